"""Turning SIGTERM/SIGINT into a clean stop: finish the current unit, commit it, exit 75.

Owns the process-wide stop flag. Long loops call `check()` between units of work (a
generate part, a tokenize batch); it raises `Interrupted` once a signal has arrived, so the
work in flight is either committed before the check or simply redone on the next run.
A second signal while stopping exits at once (the work in flight is lost, nothing else).

    preemption.install()
    for part in parts:
        preemption.check()
        commit(part)
"""

from __future__ import annotations

import signal
import threading
import time

from pipeline.errors import Interrupted, exit_now

EXIT_INTERRUPTED = 75

COPIES = {signal.SIGUSR1: "SIGTERM", signal.SIGUSR2: "SIGINT"}
"""What a pod host's supervisor (supervise.py) sends on for the SIGTERM or SIGINT it got: a copy.
The same signal often reaches both processes (Ctrl-C to the terminal's process group, a VM's
shutdown to every process), so a copy and a signal never add up to a 'second signal'."""

_stop = threading.Event()
_reason: list[str] = []
_seen = {"signal": 0, "copy": 0}


def install() -> None:
    """Handle SIGTERM (preemption notice) and SIGINT (Ctrl-C), and a supervisor's copies of them,
    in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT, *COPIES):
        signal.signal(signum, _on_signal)


def ignore_from_now() -> None:
    """The command has ended and its exit code is decided: a stop signal from now on is ignored.
    Python's shutdown (tens of milliseconds with JAX loaded) puts back the default handlers, and
    a SIGTERM there ended a command that had printed its `result:` line by the signal (exit 143),
    which a scheduler takes for a failure; ignored signals stay ignored through it."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT, *COPIES):
        signal.signal(signum, signal.SIG_IGN)


def signal_name(signum: int) -> str | None:
    """'SIGTERM' or 'SIGINT' for a stop signal or a supervisor's copy of one, else None."""
    if signum in COPIES:
        return COPIES[signum]
    return signal.Signals(signum).name if signum in (signal.SIGTERM, signal.SIGINT) else None


def request_stop(reason: str) -> None:
    _reason.append(reason)
    _stop.set()


def stop_requested() -> bool:
    return _stop.is_set()


def stop_reason() -> str | None:
    """What asked to stop first (e.g. SIGTERM), or None."""
    return _reason[0] if _reason else None


def check() -> None:
    """Raise Interrupted if a stop was requested."""
    if _stop.is_set():
        raise Interrupted(f"stopped by {_reason[0]}: finished work is committed; rerun the same command to resume")


PAUSE_SLICE_S = 0.1


def pause(seconds: float) -> None:
    """Sleep `seconds` between two tries, but raise Interrupted within PAUSE_SLICE_S of a stop
    being asked: a SIGTERM while storage retries waited out a 30 s back-off before it was heard.
    Short sleeps, not `_stop.wait`: the signal handler sets `_stop`, and Event.set from a handler
    that interrupted Event.wait in the same thread can block on the event's own lock for good."""
    end = time.monotonic() + seconds
    while True:
        check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, PAUSE_SLICE_S))


def reset() -> None:
    """Forget a stop request (tests run several commands in one process)."""
    _stop.clear()
    _reason.clear()
    _seen.update(signal=0, copy=0)


def _on_signal(signum: int, frame: object) -> None:
    del frame
    route = "copy" if signum in COPIES else "signal"
    # A second signal (or copy), or a signal after a stop asked for otherwise: the user does not
    # want to wait for the commit.
    again = _seen[route] > 0 or (_stop.is_set() and not any(_seen.values()))
    _seen[route] += 1
    if again:  # the error line all the same: a script, and `status`'s last error, read it
        exit_now(EXIT_INTERRUPTED, f"stopped at once by a second {signal_name(signum) or signal.Signals(signum).name}: "
                                   f"rows not yet committed are lost; rerun the same command to resume")
    request_stop(signal_name(signum) or signal.Signals(signum).name)
