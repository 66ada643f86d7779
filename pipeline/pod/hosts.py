"""Which host am I, who leads, and how hosts agree: a thin layer over `jax.distributed`.

Owns joining the pod (TPU auto-detection or the PIPELINE_* variables), the leader test,
barriers, and `on_leader`, which runs leader-only work and tells the other hosts how it
ended, so a leader failure makes them raise instead of waiting forever. Uses only the
coordination service's key-value store and barriers: no device collectives, so hosts never
wait on each other inside compiled code. A single machine with no pod never imports jax
here.

    hosts.initialize()
    if hosts.is_leader(): ...
    result = hosts.on_leader("tokenize-1a2b", lambda: run_tokenize())   # others: its JSON value or None
    hosts.barrier("generate-done")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, TypeVar

from pipeline.errors import ConfigError, Interrupted, PipelineError, StepFailed, exit_now, failure, message_of
from pipeline.pod import preemption

T = TypeVar("T")

ENV_ADDRESS = "PIPELINE_COORDINATOR_ADDRESS"
ENV_COUNT = "PIPELINE_NUM_PROCESSES"
ENV_INDEX = "PIPELINE_PROCESS_ID"
ENV_INIT_TIMEOUT = "PIPELINE_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "PIPELINE_HEARTBEAT_TIMEOUT_S"

POLL_S = 2.0
"""How often a waiting host wakes to check for a stop signal while it waits."""

WATCHDOG_GRACE_S = 15.0
"""How long `watchdog` lets a host leave a collective by itself after a peer failed."""

LEAVE_GRACE_S = 1.0
"""How long the leader (which serves the coordinator) outlives the other hosts' goodbyes."""

LEAVE_INTERRUPTED_WAIT_S = 10.0
"""After a stop signal, how long the leader waits for the other hosts to leave first."""

LEAVE_FAILED_WAIT_S = WATCHDOG_GRACE_S + 3 * POLL_S
"""After a failure, how long the leader waits for the other hosts to leave first: long enough for
a host stuck in a collective to be ended by its `watchdog`."""

LIVE_ANSWER_S = 1.0
"""How long a peer check waits for the coordination service's list of live hosts (`_dead_hosts`)."""

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
    elif on_multihost_tpu(env):
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


def barrier(name: str, what: str = "") -> None:
    """Wait until every host reaches `name` (no-op on one host).

    Built on the key-value store rather than `wait_at_barrier` so a waiting host notices
    when another host failed (see `abort`) and stops waiting at once.
    """
    if _state["client"] is None:
        return
    publish(f"barrier/{name}/{process_index()}", True)
    for index in range(process_count()):
        wait_for(f"barrier/{name}/{index}", what or f"every host to reach {name}")


def joined() -> bool:
    """This process is a host of a pod of several (jax.distributed joined)."""
    return _state["client"] is not None


def publish(key: str, value: Any) -> None:
    """Make a JSON value visible to every host under `key` (set once per run)."""
    if _state["client"] is not None:
        _state["client"].key_value_set(f"pipeline/{key}", json.dumps(value))


def wait_for(key: str, what: str) -> Any:
    """Block until some host publishes `key`.

    Wakes every POLL_S to check for a stop signal and for another host's `abort`, so no
    host waits forever on work that will never come.
    """
    client = _state["client"]
    while True:
        preemption.check()
        try:
            return json.loads(client.blocking_key_value_get(f"pipeline/{key}", int(POLL_S * 1000)))
        except Exception as err:  # noqa: BLE001 - jaxlib raises its own XlaRuntimeError
            text = str(err)
            if "DEADLINE_EXCEEDED" not in text and "deadline" not in text.lower():
                raise Interrupted(
                    f"{describe()}: lost contact with the pod while waiting for {what} "
                    f"(the leader or coordinator is gone): {text.splitlines()[0]}; rerun the same command to resume"
                ) from err
        check_peers(f"stopped waiting for {what}")


def wait_briefly(keys: list[str], seconds: float = LEAVE_INTERRUPTED_WAIT_S) -> bool:
    """Wait up to `seconds` in all for every key to be published: True if all were. Never
    raises (used while failing or leaving)."""
    if _state["client"] is None:
        return True
    deadline = time.monotonic() + seconds
    for key in keys:
        try:
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
            _state["client"].blocking_key_value_get(f"pipeline/{key}", wait_ms)
        except Exception:  # noqa: BLE001 - not published in time, or the coordinator is gone
            return False
    return True


def aborted() -> dict[str, Any] | None:
    """Another host's `abort` (its host, error and exit code), or None: one non-blocking look-up."""
    if _state["client"] is None:
        return None
    return _try_get("abort")


def raise_if_aborted(doing: str) -> None:
    """Raise (with the failed host's exit code: 75 stays 75) if another host has aborted. A host
    that stopped because it found a peer dead is not the news: the dead peer is named."""
    record = aborted()
    if record is None:
        return
    code = record.get("code", 1)
    what = "was stopped" if code == Interrupted.exit_code else "failed"
    raise _relayed(code, record["host"], doing,
                   f"{describe()}: {doing}: host {record['host']} {what}: {record['error']}")


def _relayed(code: int, host: int, doing: str, message: str) -> PipelineError:
    """The error this host raises for `host`'s (exit `code`, its `message` here); a host that
    stopped because it found a peer dead is not the news: that peer is named."""
    lost = _try_get("lost") if code == Interrupted.exit_code else None
    if lost is not None and lost["by"] == host and lost["host"] != process_index():
        return Interrupted(_lost_message(doing, lost["host"], f"host {host} noticed first"))
    return failure(code, message)


def check_peers(doing: str, cause: str = "") -> None:
    """The one peer check: raise if another host aborted (its exit code), or Interrupted if a host
    stopped responding (killed or lost: the coordinator no longer hears its heartbeat)."""
    raise_if_aborted(doing)
    dead = _dead_hosts()
    if dead:
        with contextlib.suppress(Exception):  # the first host to notice a death is recorded
            _state["client"].key_value_set("pipeline/lost", json.dumps({"host": dead[0], "by": process_index()}))
        raise Interrupted(_lost_message(doing, dead[0], cause))


def _lost_message(doing: str, host: int, detail: str) -> str:
    return (f"{describe()}: {doing}: host {host} stopped responding (killed or lost"
            f"{'; ' + detail if detail else ''}); rerun the same command to resume")


def abort(error: str, code: int = 1) -> None:
    """Tell every other host that this one failed with exit `code` (first failure wins); safe on one host."""
    if _state["client"] is None:
        return
    try:
        _state["client"].key_value_set("pipeline/abort", json.dumps({"host": process_index(), "error": error, "code": code}))
    except Exception:  # noqa: BLE001 - another host aborted first, or the coordinator is gone
        pass


def leave(code: int) -> None:
    """Leave the pod with exit `code`; returns only when there is no pod.

    jax's own shutdown needs the coordinator (on the leader) to outlive every other host's
    shutdown call, and aborts the process natively otherwise. So after a successful
    command the other hosts say goodbye and leave, and the leader, which serves the
    coordinator, leaves last. After a failure or a stop signal (exit 75) hosts often fail or stop
    together (the others learn of a failure through `abort`; global_mesh agrees on a stop): they
    leave the same way, but the leader waits at most LEAVE_FAILED_WAIT_S (a stop:
    LEAVE_INTERRUPTED_WAIT_S) for the others' goodbyes. Without that wait another host still
    failing would lose its own `error:` line and exit code: the leader's exit takes the
    coordinator down, and jax then ends that host natively (SIGABRT).
    """
    if _state["client"] is None:
        return
    if code == 0:
        if is_leader():
            for index in range(1, process_count()):
                wait_for(f"leaving/{index}", f"host {index} to finish")
            # A host exits right after saying goodbye; the coordinator must outlive that
            # exit or the host's error poller sees it vanish and aborts natively.
            time.sleep(LEAVE_GRACE_S)
        else:
            publish(f"leaving/{process_index()}", True)
    else:
        try:
            if is_leader():
                wait_s = LEAVE_INTERRUPTED_WAIT_S if code == preemption.EXIT_INTERRUPTED else LEAVE_FAILED_WAIT_S
                if wait_briefly([f"leaving/{index}" for index in range(1, process_count())], wait_s):
                    time.sleep(LEAVE_GRACE_S)
            else:
                publish(f"leaving/{process_index()}", True)
        except Exception:  # noqa: BLE001 - a host still working, or the coordinator gone: leave anyway
            pass
    exit_now(code)  # jax.distributed's own shutdown would abort natively after a failure


def blame_peer(err: BaseException, doing: str) -> None:
    """After a failed cross-host collective: raise Interrupted if a peer died or aborted.

    A peer killed mid-collective makes the survivors' collective fail (gloo: connection reset,
    raised as JaxRuntimeError or, from jax's multihost checks, ValueError) before the
    coordinator notices the death, so look for up to twice the heartbeat timeout. Returns if
    every peer is alive and well: the error is then this host's own.
    """
    if _state["client"] is None:
        return
    deadline = time.monotonic() + 2 * float(os.environ.get(ENV_HEARTBEAT_TIMEOUT, "30")) + 2 * POLL_S
    while time.monotonic() < deadline:
        try:
            check_peers(f"stopped {doing}", cause=f"{type(err).__name__} in a collective")
        except PipelineError as peer_failure:
            raise peer_failure from err
        time.sleep(POLL_S / 4)


@contextlib.contextmanager
def watchdog(doing: str) -> Iterator[None]:
    """While the block runs, exit this process if another host fails or dies.

    For work inside cross-host collectives (global_mesh generation): a host whose peer is gone
    waits in a collective that never completes, where no exception can reach it, so a thread
    watches the pod and ends the process with the failed host's exit code (75 for a kill or
    an interruption), instead of the pod hanging until someone kills it.
    """
    if _state["client"] is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(POLL_S):
            try:
                check_peers(f"stopped {doing}")
            except PipelineError as err:
                # Usually the block ends on its own (the hosts agreed to stop, or its collective
                # failed): let it, so it commits its work. Only a host still stuck is ended.
                if done.wait(WATCHDOG_GRACE_S):
                    return
                print(f"error: {err}", file=sys.stderr, flush=True)
                leave(err.exit_code)  # with a goodbye, so that a leader waiting in `leave` goes at once

    thread = threading.Thread(target=watch, daemon=True, name="pod-watchdog")
    thread.start()
    try:
        yield
    finally:
        done.set()


class _LiveHosts:
    """The coordination service's list of live hosts, asked in a thread of its own. The service
    answers once every live host has asked too (its own barrier: a host killed is dropped from it
    after the heartbeat timeout), so a host waiting on a busy peer (the leader waiting for another
    host's shards) would be stuck in the question, deaf to its own Ctrl-C, until that peer asked
    as well. A check waits for the answer at most LIVE_ANSWER_S; the question stays asked and a
    later check takes its answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._question: concurrent.futures.Future | None = None

    def live(self, everyone: list[int]) -> dict[int, Any] | None:
        """The live hosts, or None while the answer is not in (no evidence of a death)."""
        with self._lock:
            if self._question is None:
                self._question = concurrent.futures.Future()
                threading.Thread(target=self._ask, args=(everyone, self._question), daemon=True,
                                 name="pod-live-hosts").start()
            question = self._question
        try:
            answer = question.result(timeout=LIVE_ANSWER_S)
        except concurrent.futures.TimeoutError:
            return None
        with self._lock:
            if self._question is question:  # this question's answer is taken: the next check asks again
                self._question = None
        return answer

    @staticmethod
    def _ask(everyone: list[int], question: concurrent.futures.Future) -> None:
        try:
            question.set_result(_state["client"].get_live_nodes(everyone))
        except Exception:  # noqa: BLE001 - no answer is not evidence of death
            question.set_result(None)


_live_hosts = _LiveHosts()


def _dead_hosts() -> list[int]:
    """Hosts the coordinator no longer hears heartbeats from (those that left cleanly excluded)."""
    everyone = list(range(process_count()))
    live = _live_hosts.live(everyone)
    if live is None:
        return []
    return [i for i in everyone if i not in live and _try_get(f"leaving/{i}") is None]


def _try_get(key: str) -> Any:
    try:
        return json.loads(_state["client"].key_value_try_get(f"pipeline/{key}"))
    except Exception:  # noqa: BLE001 - NOT_FOUND is an exception here
        return None


def run_and_report(key: str, fn: Callable[[], T]) -> T:
    """Run `fn` on this host and publish how it ended under `key`: ok, or its error and exit code
    (75 for an interruption), for `await_report` on another host."""
    try:
        result = fn()
    except BaseException as err:
        publish(key, {"ok": False, "error": message_of(err), "code": getattr(err, "exit_code", 1)})
        raise
    publish(key, {"ok": True, "value": result if isinstance(result, (dict, list, str, int, float, bool)) else None})
    return result


def await_report(key: str, what: str, host: int) -> Any:
    """Wait for `host`'s `run_and_report(key, ...)`: its JSON value, or raise naming it failed (an
    interruption stays an interruption, exit 75)."""
    outcome = wait_for(key, what)
    if not outcome["ok"]:
        code = outcome.get("code", 1)
        ended = "was stopped in" if code == Interrupted.exit_code else "failed"
        who = "the leader" if host == 0 else f"host {host}"
        raise _relayed(code, host, f"stopped waiting for {what}",
                       f"{describe()}: {who} {ended} {what}: {outcome['error']}")
    return outcome.get("value")


def on_leader(tag: str, fn: Callable[[], T], what: str) -> T | None:
    """The leader section: run `fn` on the leader only; the other hosts wait for its outcome.

    The leader gets `fn`'s value; the others get it too when it is plain JSON (a dict, list,
    string or number), else None. If the leader's `fn` raises, the others raise too, naming
    the leader's error, so no host waits forever on work that will never come.
    """
    if _state["client"] is None:
        return fn()
    if is_leader():
        return run_and_report(f"{tag}/outcome", fn)
    return await_report(f"{tag}/outcome", what, 0)


def agree(tag: str, value: Any, what: str) -> Any:
    """The leader's `value` on every host; a host whose own value differs raises, and so does the
    leader, naming that host, once every host has compared (before, the leader went on: it
    made step folders and read weights for a run the other host had already refused).

    Used at start so that every host runs the same plan (same code version, same hashes):
    the classic pod mistake is hosts with different configs or code.
    """
    if _state["client"] is None:
        return value
    if is_leader():
        publish(f"{tag}/value", value)
        for host in range(1, process_count()):
            difference = wait_for(f"{tag}/verdict/{host}", f"host {host} to compare {what}")
            if difference is not None:
                raise ConfigError(f"{describe()}: {what} differs between host {host} and the leader (same code "
                                  f"and config on every host?): {difference}")
        return value
    leader_value = wait_for(f"{tag}/value", what)
    difference = None if leader_value == value else _first_difference(leader_value, value, f"host {process_index()}")
    publish(f"{tag}/verdict/{process_index()}", difference)
    if difference is not None:
        raise ConfigError(f"{describe()}: {what} differs from the leader's (same code and config on every host?): "
                          f"{difference}")
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
    host, _, port = env[ENV_ADDRESS].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"multi-host: {ENV_ADDRESS} must be HOST:PORT (the leader's address and a free port), "
                          f"got {env[ENV_ADDRESS]!r}")
    return env[ENV_ADDRESS], count, index


def _seconds(env: os._Environ, name: str, default: int) -> int:
    """A whole number of seconds > 0 from the variable `name`, else a ConfigError naming it."""
    value = env.get(name, "").strip() or str(default)
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"multi-host: {name} must be a whole number of seconds > 0, got {env[name]!r}")
    return int(value)


def on_multihost_tpu(env: Mapping[str, str]) -> bool:
    hostnames = env.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hostnames.split(",") if h]) > 1


def _join(**kwargs: Any) -> None:
    import jax
    # The coordination service's key-value store (publish, wait_for, _dead_hosts) has no public
    # API: jax.distributed exposes only initialize/shutdown. This is the one place we reach it.
    from jax._src import distributed

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Hosts that fail or leave must not take the others down with a native abort: we
    # detect failures ourselves (abort key, end barrier) and exit with the contract's codes.
    jax.config.update("jax_enable_recoverability", True)
    # jax's preemption service catches SIGTERM natively, so our handler (preemption.py) never
    # ran on a pod and a preempted host went on to the end instead of committing and exiting 75.
    jax.config.update("jax_enable_preemption_service", False)
    init_timeout_s = _seconds(os.environ, ENV_INIT_TIMEOUT, 120)
    heartbeat_timeout_s = _seconds(os.environ, ENV_HEARTBEAT_TIMEOUT, 30)
    where = (f"the pod at {kwargs.get('coordinator_address', 'TPU auto-detect')} as process "
             f"{kwargs.get('process_id', '?')} of {kwargs.get('num_processes', '?')}")

    def give_up() -> None:
        # jax aborts the process (SIGABRT, a native stack trace) when registration times
        # out; say what happened in one line and leave first.
        exit_now(1, f"multi-host: could not join {where} within {init_timeout_s}s (is every host started? "
                    f"{ENV_INIT_TIMEOUT} sets the wait)")

    with _stop_signals_end(f"joining {where}"):
        watchdog = threading.Timer(init_timeout_s, give_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            jax.distributed.initialize(
                **kwargs,
                initialization_timeout=init_timeout_s + 30,
                heartbeat_timeout_seconds=heartbeat_timeout_s,
                shutdown_timeout_seconds=30,
            )
        except Exception as err:  # noqa: BLE001 - jaxlib's error type is private
            raise StepFailed(f"multi-host: could not join {where}: {str(err).splitlines()[0]}") from err
        finally:
            watchdog.cancel()
    _state.update(index=jax.process_index(), count=jax.process_count(),
                  client=distributed.global_state.client)


@contextlib.contextmanager
def _stop_signals_end(doing: str) -> Iterator[None]:
    """While the main thread waits inside native code (jax.distributed.initialize), our signal
    handler cannot run: a Ctrl-C or a preemption notice went unheard until the join timed out
    (exit 1, minutes later). Python's own low-level handler still writes each signal's number to
    the wakeup fd, whichever thread the signal lands on: a thread of ours reads it, and a stop
    signal (or one that came just before) ends the process with exit 75 at once (nothing was done
    yet)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard, wakeup = socket.socketpair()
    wakeup.setblocking(False)
    heard.settimeout(0.2)
    before = signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
    done = threading.Event()

    def wait_for_a_signal() -> None:
        while not done.is_set():
            try:
                signals = heard.recv(64)
            except (TimeoutError, OSError):
                signals = b""
            for number in signals:
                if name := preemption.signal_name(number):
                    preemption.request_stop(name)
            if preemption.stop_requested():  # now, or just before (the handler ran)
                exit_now(preemption.EXIT_INTERRUPTED, f"stopped by {preemption.stop_reason()} while {doing}: "
                                                      f"nothing was done; rerun the same command")

    waiter = threading.Thread(target=wait_for_a_signal, name="join-signals", daemon=True)
    waiter.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(before)
        done.set()
        waiter.join()
        heard.close()
        wakeup.close()


def _first_difference(a: Any, b: Any, host: str, path: str = "") -> str:
    """Where the leader's value `a` and `host`'s `b` first differ, and what each has there."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), host, f"{path}.{key}" if path else key)
    return f"{path or 'value'}: the leader has {a!r}, {host} has {b!r}"
