"""`pipeline launch --hosts N -- ARGS...`: a pod of N hosts simulated on one machine.

Starts N processes of `pipeline ARGS...` with the PIPELINE_* variables that make them join
one `jax.distributed` pod on 127.0.0.1 (CPU collectives through gloo), prefixes each line
of their output with the host index (a host's stdout to ours, its stderr to ours), forwards
SIGTERM/SIGINT to all of them, and returns the worst exit code. It refuses nothing the hosts
would accept: every check happens in the hosts.

    code = launch(["run", "all", "--config", "demo/config.yaml"], hosts=2)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TextIO

from pipeline.errors import ConfigError
from pipeline.pod import hosts as hosts_mod
from pipeline.pod.supervise import describe_signal

GRACE_S = 90.0
"""After one host fails, how long the others get to notice and exit before being killed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """A ConfigError unless `port` is free on 127.0.0.1: host 0 failed at once on a busy one, while
    the others waited to join it until the launcher killed them (GRACE_S)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise ConfigError(f"launch: --port {port} is not free on 127.0.0.1 ({err.strerror}): choose another, "
                              f"or leave --port out to pick a free one") from err


def launch(args: list[str], hosts: int, port: int = 0, env: dict[str, str] | None = None) -> int:
    """Run `pipeline ARGS` as `hosts` processes; return the pod's exit code."""
    if port:
        check_port(port)
    port = port or free_port()
    base_env = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    for index in range(hosts):
        host_env = dict(base_env)
        host_env.update({
            hosts_mod.ENV_ADDRESS: f"127.0.0.1:{port}",
            hosts_mod.ENV_COUNT: str(hosts),
            hosts_mod.ENV_INDEX: str(index),
            "PYTHONUNBUFFERED": "1",
        })
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", *args], env=host_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True,
        ))
    pumps = [threading.Thread(target=_pump, args=(stream, i, to), daemon=True)
             for i, p in enumerate(procs) for stream, to in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
    for t in pumps:
        t.start()

    def forward(signum: int, frame: object) -> None:
        del frame
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        codes = _wait(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in pumps:
            t.join(timeout=5)
    return _pod_code(codes)


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    failed_at: float | None = None
    said: set[int] = set()
    while True:
        codes = [p.poll() for p in procs]
        for i, c in enumerate(codes):
            if c is not None and c < 0 and i not in said:  # its process printed nothing of it
                said.add(i)
                print(f"[launch] host {i} was ended by {describe_signal(-c)}", file=sys.stderr, flush=True)
        if all(c is not None for c in codes):
            return codes  # type: ignore[return-value]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    print(f"[launch] host {i} still running {GRACE_S:.0f}s after another host failed: killing it",
                          file=sys.stderr, flush=True)
                    p.kill()
        time.sleep(0.2)


def _pod_code(codes: list[int]) -> int:
    bad = [c for c in codes if c != 0]
    if not bad:
        return 0
    # A host killed by a signal (SIGKILL included: a preemption without notice) can be resumed.
    mapped = [75 if c == 75 or c < 0 else c for c in bad]
    worst = [c for c in mapped if c != 75]
    return worst[0] if worst else 75


def _pump(stream: TextIO, index: int, to: TextIO) -> None:
    for line in stream:
        to.write(f"[host {index}] {line}")
        to.flush()
