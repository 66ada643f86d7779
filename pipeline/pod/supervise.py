"""A pod host's command, run as the child of a small parent that outlives it.

JAX's distributed runtime ends a host's process natively when the pod's coordinator goes away
(the leader killed or preempted): a C++ stack trace, SIGABRT, exit 134, and no `error:` line; a
hand-run pod or a scheduler that retries on 75 saw an unexplained crash. No Python code of the
host runs after that, so its parent says it: the parent starts the same command as its child,
passes the stop signals it gets on as copies (`preemption.COPIES`: the same signal often reaches
both), and turns a child ended by a signal into the contract's exit 75 with one `error:` line.
Only `run` and `preflight` in a pod (`PIPELINE_NUM_PROCESSES` > 1, or a multi-host TPU) are
supervised, and only on Linux, where the child is killed with its parent (`PR_SET_PDEATHSIG`:
a SIGKILL of the host's process, as a test or the OOM killer sends, takes both).

    if supervise.wanted(sys.argv[1:], os.environ):
        sys.exit(supervise.run(sys.argv[1:]))
"""

from __future__ import annotations

import os
import signal
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
    """Run `pipeline ARGV` as a child and return its exit code; 75 with an `error:` line when a
    signal ended it."""
    child = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv],
                             env={**os.environ, ENV_SUPERVISED: "1"}, preexec_fn=_die_with_parent)

    def pass_on(signum: int, frame: object) -> None:
        del frame
        if child.poll() is None:
            child.send_signal(_COPY_OF[signum])

    for signum in _COPY_OF:
        signal.signal(signum, pass_on)
    code = child.wait()
    if code >= 0:
        return code
    host = os.environ.get(hosts.ENV_INDEX)
    who = f"host {host}" if host else "this host"
    if -code == signal.SIGABRT:
        why = ("JAX's distributed runtime ended it (SIGABRT): the pod's coordinator, on the leader (host 0), is "
               "gone (killed or preempted)")
    else:
        why = f"it was ended by {signal.Signals(-code).name}"
    print(f"error: {who}: {why}; rows it had not committed are generated again: rerun the same command to resume",
          file=sys.stderr, flush=True)
    return preemption.EXIT_INTERRUPTED


def _die_with_parent() -> None:
    """In the child, before it runs: the kernel sends it SIGKILL when its parent dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
