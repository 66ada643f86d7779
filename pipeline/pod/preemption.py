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

from pipeline.errors import Interrupted, exit_now

EXIT_INTERRUPTED = 75

_stop = threading.Event()
_reason: list[str] = []


def install() -> None:
    """Handle SIGTERM (preemption notice) and SIGINT (Ctrl-C) in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


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


def reset() -> None:
    """Forget a stop request (tests run several commands in one process)."""
    _stop.clear()
    _reason.clear()


def _on_signal(signum: int, frame: object) -> None:
    del frame
    name = signal.Signals(signum).name
    if _stop.is_set():  # a second signal: the user does not want to wait for the commit
        exit_now(EXIT_INTERRUPTED)
    request_stop(name)
