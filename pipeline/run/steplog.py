"""Each host's log of each step: `{step folder}/logs/host-NNNNN.log`, written as the step runs.

Owns the log files' names and the tee that fills them: while a step runs, every line this
process prints (stdout and stderr: the runner's lines, progress, warnings, W&B's own output)
also goes to the step's log of this host, with progress bars' carriage-return redraws reduced
to their last state and colour codes removed. On local storage the file is appended line by
line as the step runs; on remote storage (gs://) it is uploaded when the step ends, also when
it fails. It refuses to capture what bypasses Python's streams (C libraries writing to fd 2).

    with step_log(out.url, host=hosts.process_index()):
        run(cfg, out)
    log_urls(out.url)   # every host's log of that step (upload attaches them to the W&B run)
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator, TextIO

from pipeline import storage

LOG_FOLDER = "logs"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def log_name(host: int) -> str:
    return f"host-{host:05d}.log"


def log_urls(step_url: str) -> list[str]:
    """Every host's log of a step, in host order (none before the step has run)."""
    folder = storage.join(step_url, LOG_FOLDER)
    return storage.list_files(folder, suffix=".log") if storage.exists(folder) else []


class _Tee:
    """A text stream that writes through to `stream` and keeps clean whole lines in `log`."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream, self.log, self.pending = stream, log, ""

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.log.write(_ANSI.sub("", line.rsplit("\r", 1)[-1]) + "\n")
        if lines:
            self.log.flush()
        return written

    def flush(self) -> None:
        self.stream.flush()

    def close_line(self) -> None:
        """Keep a last line that never got its newline (an interrupted progress bar)."""
        tail = _ANSI.sub("", self.pending.rsplit("\r", 1)[-1])
        if tail.strip():
            self.log.write(tail + "\n")
        self.pending = ""

    def __getattr__(self, name: str):  # isatty, fileno, encoding...: the real stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def step_log(step_url: str, host: int) -> Iterator[None]:
    """Tee this process's stdout and stderr into the step's log of `host` while the body runs."""
    url = storage.join(step_url, LOG_FOLDER, log_name(host))
    local = storage.is_local(url)
    if local:
        path = storage.filesystem(url)[1]
        os.makedirs(os.path.dirname(path), exist_ok=True)
    else:
        handle, path = tempfile.mkstemp(prefix="pipeline-steplog-", suffix=".log")
        os.close(handle)
        if storage.exists(url):  # an earlier attempt's log: keep it, this attempt appends
            with open(path, "wb") as f:
                f.write(storage.read_bytes(url))
    saved = sys.stdout, sys.stderr
    with open(path, "a", encoding="utf-8", errors="replace") as log:
        tees = _Tee(saved[0], log), _Tee(saved[1], log)
        sys.stdout, sys.stderr = tees
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved
            for tee in tees:
                tee.close_line()
    if not local:
        try:
            storage.put_file(path, url)
        finally:
            os.remove(path)
