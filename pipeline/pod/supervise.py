"""A pod host's command, run as the child of a small parent that outlives it.

JAX's distributed runtime ends a host's process natively when the pod's coordinator goes away
(the leader killed or preempted): a C++ stack trace, SIGABRT, exit 134, and no `error:` line; a
hand-run pod or a scheduler that retries on 75 saw an unexplained crash. No Python code of the
host runs after that, so its parent says it: the parent starts the same command as its child,
passes the stop signals it gets on as copies (`preemption.COPIES`: the same signal often reaches
both), and turns a child ended by a signal into one `error:` line and the contract's exit 75: a
kill, or an abort while the coordinator refuses connections (on a TPU pod, where JAX finds its
address, any abort of a host but the leader). An abort with the coordinator there is the
child's own (an XLA check, a kernel): exit 1, not a retry.
Only `run` and `preflight` in a pod (`PIPELINE_NUM_PROCESSES` > 1, or a multi-host TPU) are
supervised, and only on Linux, where the child is killed with its parent (`PR_SET_PDEATHSIG`:
a SIGKILL of the host's process, as a test or the OOM killer sends, takes both).

    if supervise.wanted(sys.argv[1:], os.environ):
        sys.exit(supervise.run(sys.argv[1:]))
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from typing import Mapping

from pipeline.pod import hosts, preemption

ENV_SUPERVISED = "PIPELINE_SUPERVISED"
"""Set in the child: it runs the command itself."""

_COPY_OF = {signal.SIGTERM: signal.SIGUSR1, signal.SIGINT: signal.SIGUSR2}
_PR_SET_PDEATHSIG = 1


def wanted(argv: list[str], env: Mapping[str, str]) -> bool:
    """This process is a pod host's command that JAX could end natively, not yet supervised."""
    if not sys.platform.startswith("linux") or env.get(ENV_SUPERVISED) == "1" or argv[:1] not in (["run"], ["preflight"]):
        return False
    try:
        pod = int(env.get(hosts.ENV_COUNT) or 1) > 1
    except ValueError:
        pod = False  # the command names the bad value itself (exit 2)
    return pod or hosts.on_multihost_tpu(env)


def run(argv: list[str]) -> int:
    """Run `pipeline ARGV` as a child and return its exit code; when a signal ended it, one
    `error:` line and 75 (a coordinator gone, a kill), or 1 (an abort of its own)."""
    child: subprocess.Popen | None = None

    def pass_on(signum: int, frame: object) -> None:
        del frame
        if child is not None and child.poll() is None:
            child.send_signal(_COPY_OF[signum])

    for signum in _COPY_OF:  # before the child exists: a Ctrl-C now is passed on once it does
        signal.signal(signum, pass_on)
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def die_with_parent() -> None:  # in the child, before it runs
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(preemption.EXIT_INTERRUPTED)

    child = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv],
                             env={**os.environ, ENV_SUPERVISED: "1"}, preexec_fn=die_with_parent)
    code = child.wait()
    if code >= 0:
        return code
    message, code = _ended_by(-code, os.environ)
    resume = ("rows it had not committed are generated again: rerun the same command to resume" if argv[:1] == ["run"]
              else "rerun the same command")
    print(f"error: {message}; {resume}", file=sys.stderr, flush=True)
    return code


def _ended_by(signum: int, env: Mapping[str, str]) -> tuple[str, int]:
    """What to say of a child ended by `signum`, and the exit code."""
    index = env.get(hosts.ENV_INDEX)
    who = f"host {index}" if index else "this host"
    if signum == signal.SIGABRT:
        if index != "0" and _coordinator_gone(env) is not False:
            return (f"{who}: JAX's distributed runtime ended it (SIGABRT): the pod's coordinator, on the leader "
                    f"(host 0), is gone (killed or preempted)", preemption.EXIT_INTERRUPTED)
        return f"{who}: it aborted natively (SIGABRT): see the native error above", 1
    if signum in preemption.COPIES:  # a stop signal before the child could hear it
        return f"{who}: stopped by {preemption.COPIES[signum]} as it started", preemption.EXIT_INTERRUPTED
    return f"{who}: it was ended by {describe_signal(signum)}", preemption.EXIT_INTERRUPTED


def _coordinator_gone(env: Mapping[str, str]) -> bool | None:
    """Whether the pod's coordinator refuses connections now; None where its address is JAX's to
    find (a TPU pod)."""
    host, _, port = (env.get(hosts.ENV_ADDRESS) or "").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def describe_signal(signum: int) -> str:
    """SIGKILL, or `signal 40` for one Python has no name for (a real-time signal)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
