"""Which host am I, who leads, and how hosts agree: a thin layer over `jax.distributed`.

Owns joining the pod (TPU auto-detection or the PIPELINE_* variables), the leader test,
barriers, and `on_leader`, which runs leader-only work and tells the other hosts how it
ended, so a leader failure makes them raise instead of waiting forever. Uses only the
coordination service's key-value store and barriers: no device collectives, so hosts never
wait on each other inside compiled code. A single machine with no pod never imports jax
here.

    hosts.initialize()
    if hosts.is_leader(): ...
    result = hosts.on_leader("tokenize-1a2b", lambda: run_tokenize())   # others get None
    hosts.barrier("generate-done")
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, TypeVar

from pipeline.errors import ConfigError, StepFailed
from pipeline import preemption

T = TypeVar("T")

ENV_ADDRESS = "PIPELINE_COORDINATOR_ADDRESS"
ENV_COUNT = "PIPELINE_NUM_PROCESSES"
ENV_INDEX = "PIPELINE_PROCESS_ID"
ENV_INIT_TIMEOUT = "PIPELINE_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "PIPELINE_HEARTBEAT_TIMEOUT_S"

POLL_S = 2.0
"""How often a waiting host wakes to check for a stop signal while it waits."""

_state: dict[str, Any] = {"initialized": False, "index": 0, "count": 1, "client": None}


def initialize() -> None:
    """Join the pod if there is one; idempotent. Raises ConfigError on bad PIPELINE_* values."""
    if _state["initialized"]:
        return
    _state["initialized"] = True
    env = os.environ
    if env.get(ENV_COUNT) or env.get(ENV_ADDRESS) or env.get(ENV_INDEX):
        address, count, index = _pod_from_env(env)
        if count > 1:
            _join(coordinator_address=address, num_processes=count, process_id=index)
    elif _on_multihost_tpu(env):
        _join()


def process_index() -> int:
    return _state["index"]


def process_count() -> int:
    return _state["count"]


def is_leader() -> bool:
    """Process 0 leads: it runs tokenize, merge, upload and writes the markers."""
    return _state["index"] == 0


def describe() -> str:
    return f"host {process_index()}/{process_count()}"


def barrier(name: str, timeout_s: float = 24 * 3600) -> None:
    """Wait until every host reaches `name` (no-op on one host)."""
    client = _state["client"]
    if client is None:
        return
    client.wait_at_barrier(f"pipeline/{name}", int(timeout_s * 1000))


def publish(key: str, value: Any) -> None:
    """Make a JSON value visible to every host under `key` (set once per run)."""
    if _state["client"] is not None:
        _state["client"].key_value_set(f"pipeline/{key}", json.dumps(value))


def wait_for(key: str, what: str) -> Any:
    """Block until some host publishes `key`; checks for stop signals while waiting."""
    client = _state["client"]
    while True:
        preemption.check()
        try:
            return json.loads(client.blocking_key_value_get(f"pipeline/{key}", int(POLL_S * 1000)))
        except Exception as err:  # noqa: BLE001 - jaxlib raises its own XlaRuntimeError
            text = str(err)
            if "DEADLINE_EXCEEDED" in text or "deadline" in text.lower():
                continue
            raise StepFailed(
                f"{describe()}: lost contact with the leader while waiting for {what} "
                f"(the leader or coordinator is gone): {text.splitlines()[0]}"
            ) from err


def on_leader(tag: str, fn: Callable[[], T], what: str) -> T | None:
    """Run `fn` on the leader only; other hosts wait for its outcome.

    If the leader's `fn` raises, the others raise StepFailed naming the leader's error, so
    no host waits forever on work that will never come.
    """
    if _state["client"] is None:
        return fn()
    if is_leader():
        try:
            result = fn()
        except BaseException as err:
            publish(f"{tag}/outcome", {"ok": False, "error": f"{type(err).__name__}: {err}"})
            raise
        publish(f"{tag}/outcome", {"ok": True})
        return result
    outcome = wait_for(f"{tag}/outcome", what)
    if not outcome["ok"]:
        raise StepFailed(f"{describe()}: the leader failed {what}: {outcome['error']}")
    return None


def agree(tag: str, value: Any, what: str) -> Any:
    """The leader's `value` on every host; a host whose own value differs raises.

    Used at start so that every host runs the same plan (same code version, same hashes):
    the classic pod mistake is hosts with different configs or code.
    """
    if _state["client"] is None:
        return value
    if is_leader():
        publish(f"{tag}/value", value)
        return value
    leader_value = wait_for(f"{tag}/value", what)
    if leader_value != value:
        raise ConfigError(
            f"{describe()}: {what} differs from the leader's (same code and config on every host?): "
            f"{_first_difference(leader_value, value)}"
        )
    return leader_value


def _pod_from_env(env: os._Environ) -> tuple[str, int, int]:
    missing = [k for k in (ENV_ADDRESS, ENV_COUNT, ENV_INDEX) if not env.get(k)]
    if missing:
        raise ConfigError(f"multi-host: {', '.join(missing)} not set (set all of {ENV_ADDRESS}, {ENV_COUNT}, {ENV_INDEX})")
    try:
        count, index = int(env[ENV_COUNT]), int(env[ENV_INDEX])
    except ValueError as err:
        raise ConfigError(f"multi-host: {ENV_COUNT} and {ENV_INDEX} must be integers, got "
                          f"{env[ENV_COUNT]!r} and {env[ENV_INDEX]!r}") from err
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"multi-host: {ENV_INDEX}={index} must be in [0, {ENV_COUNT}={count})")
    return env[ENV_ADDRESS], count, index


def _on_multihost_tpu(env: os._Environ) -> bool:
    hostnames = env.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hostnames.split(",") if h]) > 1


def _join(**kwargs: Any) -> None:
    import jax
    from jax._src import distributed

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    init_timeout_s = int(os.environ.get(ENV_INIT_TIMEOUT, "120"))
    started = time.monotonic()
    try:
        jax.distributed.initialize(
            **kwargs,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=int(os.environ.get(ENV_HEARTBEAT_TIMEOUT, "30")),
            shutdown_timeout_seconds=30,
        )
    except Exception as err:  # noqa: BLE001 - jaxlib's error type is private
        raise StepFailed(
            f"multi-host: could not join the pod at {kwargs.get('coordinator_address', 'TPU auto-detect')} "
            f"as process {kwargs.get('process_id', '?')} of {kwargs.get('num_processes', '?')} within "
            f"{time.monotonic() - started:.0f}s (is every host started? {ENV_INIT_TIMEOUT} sets the wait): "
            f"{str(err).splitlines()[0]}"
        ) from err
    _state.update(index=jax.process_index(), count=jax.process_count(),
                  client=distributed.global_state.client)


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
    return f"{path or 'value'}: leader has {a!r}, this host has {b!r}"
