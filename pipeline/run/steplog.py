"""Each host's log of each step: `{step folder}/logs/host-NNNNN.log`, written as the step runs.

Owns the log files' names and the tee that fills them: while a step runs, every line this
process prints (stdout and stderr: the runner's lines, progress, warnings)
also goes to the step's log of this host, with progress bars' carriage-return redraws reduced
to their last state and colour codes removed. Each run of the step on a host that does its
work (and on any other that prints) begins its part of the log with a line saying when (UTC) and
where (host, machine, pid) it began, and ends it
with when it ended and after how long (a host killed, as a preemption does, leaves no end line: the
next attempt's begin line follows its last output). On local storage the file is appended line by
line as the step runs; on remote storage (gs://) it is uploaded every SAVE_EVERY_S while the step
runs (a host killed, as a preemption does, leaves its log up to then) and when the step ends, also
when it fails (unless storage itself failed). A failed step's log ends with its `error:` line. A log
that cannot be written or saved is a warning, never a step failure. It refuses to capture what bypasses Python's streams (C libraries writing to fd 2).

    with step_log(out.url, host=hosts.process_index()):
        run(cfg, out)
    log_urls(out.url)   # every host's log of that step (upload attaches them to the W&B run)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import Iterator, TextIO

from pipeline import storage
from pipeline.errors import message_of, one_line
from pipeline.run.status import LOG_FOLDER
from pipeline.storage.retrying import StorageError

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")

SAVE_EVERY_S = 60.0
"""How often a remote step log is uploaded while its step runs."""


def log_name(host: int) -> str:
    return f"host-{host:05d}.log"


def log_urls(step_url: str) -> list[str]:
    """Every host's log of a step, in host order (none before the step has run)."""
    folder = storage.join(step_url, LOG_FOLDER)
    return storage.list_files(folder, suffix=".log") if storage.exists(folder) else []


def last_error(step_url: str) -> str | None:
    """How the last run of a step failed, where it did: the message of the `error:` line the
    leader's log ends with (the command's own, which names a failed host's error too); None where
    there is no such log or it ends otherwise (a run still going, or killed before it could say).
    Never raises: it only explains."""
    url = storage.join(step_url, LOG_FOLDER, log_name(0))
    try:
        lines = storage.read_bytes(url).decode("utf-8", errors="replace").rstrip("\n").rsplit("\n", 1)
    except Exception:  # noqa: BLE001 - no log (the run never began), or unreadable: nothing to say
        return None
    return lines[-1].removeprefix("error: ") if lines[-1].startswith("error: ") else None


ATTEMPT_MARK = "==="
"""Begins the lines the log's own (an attempt's begin and end), not the step's output."""


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


class _LazyFile:
    """A log file opened (appending) on its first line, which it follows the attempt's begin line
    with: a host that prints nothing during a step (a non-leader waiting through tokenize) leaves no
    empty log behind.

    A log that cannot be written (disk full, read-only) must not fail the step, whose own writes
    report the problem with the file they were writing: the log stops, saying so once."""

    def __init__(self, path: str, terminal: TextIO, begin: str):
        self.path, self.terminal, self.begin, self.file, self.broken = path, terminal, begin, None, False

    def write_lines(self, lines: list[str]) -> None:
        if self.broken:
            return
        try:
            if self.file is None:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.file = open(self.path, "a", encoding="utf-8", errors="replace")
                lines = [self.begin, *lines]
            self.file.write("".join(line + "\n" for line in lines))
            self.file.flush()
        except OSError as err:
            self.broken = True
            self.terminal.write(f"warning: the step log {self.path} cannot be written ({err.strerror or err}); "
                                f"it stops here\n")

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass  # what could not be flushed was reported when it was written


class _Tee:
    """A text stream that writes through to `stream` and keeps clean whole lines in `log`."""

    def __init__(self, stream: TextIO, log: _LazyFile):
        self.stream, self.log, self.pending = stream, log, ""

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        if lines:
            self.log.write_lines([_clean(line) for line in lines])
        # A bar redrawn in place (a carriage return, no newline until it closes) keeps only its last
        # state: holding every redraw made each write split hours of them again (77 ms at 10 h).
        self.pending = self.pending.rsplit("\r", 1)[-1]
        return written

    def flush(self) -> None:
        self.stream.flush()

    def close_line(self) -> None:
        """Keep a last line that never got its newline (an interrupted progress bar)."""
        if _clean(self.pending).strip():
            self.log.write_lines([_clean(self.pending)])
        self.pending = ""

    def __getattr__(self, name: str):  # isatty, fileno, encoding...: the real stream's
        return getattr(self.stream, name)


def _clean(line: str) -> str:
    """What a terminal shows last on the line: the text after the last carriage return, no colours."""
    return _ANSI.sub("", line.rsplit("\r", 1)[-1])


def _said(err: BaseException) -> str:
    """The error line's message, on one line as the terminal's."""
    return one_line("interrupted; rerun the same command to resume" if isinstance(err, KeyboardInterrupt)
                    else message_of(err))


@contextlib.contextmanager
def step_log(step_url: str, host: int, works: bool = False) -> Iterator[None]:
    """Tee this process's stdout and stderr into the step's log of `host` while the body runs.
    works: this host does the step's work, so its attempt is logged at once, whether or not it
    prints (a generate with nothing left, a host killed while the weights load); a host that only
    waits (a non-leader in a leader's step) gets a log once it prints something."""
    url = storage.join(step_url, LOG_FOLDER, log_name(host))
    local = storage.is_local(url)
    if local:
        path = storage.filesystem(url)[1]
    else:
        folder = tempfile.mkdtemp(prefix="pipeline-steplog-")
        path = os.path.join(folder, log_name(host))
        if storage.exists(url):  # an earlier attempt's log: keep it, this attempt appends
            with open(path, "wb") as f:
                f.write(storage.read_bytes(url))
    saved = sys.stdout, sys.stderr
    began = time.time()
    step = step_url.rstrip("/").rsplit("/", 1)[-1]
    log = _LazyFile(path, saved[1], f"{ATTEMPT_MARK} {_utc(began)}: {step} began on host {host} "
                                    f"({socket.gethostname()}, pid {os.getpid()}) {ATTEMPT_MARK}")
    if works:
        log.write_lines([])  # the begin line alone
    tees = _Tee(saved[0], log), _Tee(saved[1], log)
    sys.stdout, sys.stderr = tees
    failed: BaseException | None = None
    uploading = threading.Lock()  # one upload at a time: an older copy never lands after the last
    done = threading.Event()
    if not local:
        threading.Thread(target=_save_while_running, args=(path, url, uploading, done), daemon=True,
                         name="step-log-saver").start()
    try:
        yield
    except BaseException as err:
        failed = err
        raise
    finally:
        sys.stdout, sys.stderr = saved
        for tee in tees:
            tee.close_line()
        if log.file is not None or failed is not None:  # say when it ended, before the error line it ends with
            # (an attempt that failed before printing anything too: no end line reads as a host killed)
            ended = time.time()
            how = "ended" if failed is None else "stopped"
            log.write_lines([f"{ATTEMPT_MARK} {_utc(ended)}: {how} after {ended - began:.1f} s {ATTEMPT_MARK}"])
        if failed is not None:
            # The command's last line (`cli.py` prints it after the step): on a pod the logs are where
            # a host's reason is read, and a log ending at a progress bar said nothing of why.
            log.write_lines([f"error: {_said(failed)}"])
        log.close()
        done.set()
        if not local:
            try:  # not after a storage failure: no retrying the log's upload against that storage
                if os.path.exists(path) and not isinstance(failed, StorageError):
                    with uploading:
                        _upload(path, url)
            except Exception as err:  # noqa: BLE001 - a lost log must not fail (or hide the error of) the step
                saved[1].write(f"warning: the step log could not be saved to {url}: {err}\n")
            finally:
                shutil.rmtree(folder, ignore_errors=True)


def _save_while_running(path: str, url: str, uploading: threading.Lock, done: threading.Event) -> None:
    """Upload the log at once and then every SAVE_EVERY_S while it grows, until the step ends (its
    end uploads it last): a host killed in its first minute leaves its begin line."""
    size, wait = 0, 0.0
    while not done.wait(wait):
        wait = SAVE_EVERY_S
        try:
            with uploading:
                if done.is_set() or not os.path.exists(path) or os.path.getsize(path) == size:
                    continue
                size = os.path.getsize(path)
                _upload(path, url)
        except Exception:  # noqa: BLE001 - the upload at the step's end says what is wrong, once
            pass


def _upload(path: str, url: str) -> None:
    """A copy of the log as it is now: the file stays and grows (`storage.put_file` consumed it, so
    the first upload while the step ran was also the last: the log stopped there)."""
    with open(path, "rb") as f:
        storage.write_bytes(url, f.read())
