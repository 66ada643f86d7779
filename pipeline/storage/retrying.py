"""Storage calls that survive transient faults, and storage errors a user can act on.

`storage.py` wraps each of its whole-file operations in `@storage_call("read")` etc. Every
one of them is idempotent (whole-object reads, one-shot uploads that replace the object,
listings), so retrying is safe. A transient fault (connection refused or reset, timeouts,
HTTP 408/429/5xx: a restarted emulator, a GCS hiccup) is retried with exponential backoff
until PIPELINE_STORAGE_RETRY_S seconds (default 300) have passed; gcsfs already retries each
request a few times underneath. Anything else, or a fault that outlasts the budget, becomes
one `StorageError` line naming the operation, the URL and the cause: exit 1, and the step
stays unmarked, so a rerun resumes.

    @storage_call("read")
    def read_bytes(url): ...
"""

from __future__ import annotations

import errno
import functools
import os
import sys
import time
from typing import Callable, TypeVar

from pipeline.pod import preemption
from pipeline.errors import StepFailed

ENV_RETRY_S = "PIPELINE_STORAGE_RETRY_S"
DEFAULT_RETRY_S = 300.0
MAX_DELAY_S = 30.0

F = TypeVar("F", bound=Callable)

_TRANSIENT_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                     errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN}
_HINTS = {
    errno.ENOSPC: "the disk is full: free space, then rerun the same command",
    errno.EDQUOT: "the disk quota is exceeded: free space, then rerun the same command",
    errno.EACCES: "permission denied: check run.root (or the input path) is writable by this user",
    errno.EPERM: "permission denied: check run.root (or the input path) is writable by this user",
    errno.EROFS: "the file system is read-only: point run.root at writable storage",
}


class StorageError(StepFailed):
    """A storage operation failed for good (exit 1); nothing was marked complete."""


def retry_budget_s() -> float:
    return float(os.environ.get(ENV_RETRY_S, DEFAULT_RETRY_S))


def storage_call(op: str, url_arg: int = 0) -> Callable[[F], F]:
    """Retry `fn` on transient faults; turn final failures into a StorageError naming the URL."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            url = args[url_arg] if len(args) > url_arg else kwargs.get("url", "?")
            started = time.monotonic()
            delay, tries = 1.0, 0
            while True:
                tries += 1
                try:
                    return fn(*args, **kwargs)
                except Exception as err:  # noqa: BLE001 - classified right below
                    if not is_transient(err):
                        mapped = explain(err, op, url)
                        if mapped is err:
                            raise
                        raise mapped from err
                    spent = time.monotonic() - started
                    if spent + delay > retry_budget_s():
                        raise StorageError(
                            f"storage: could not {op} {url} ({short_error(err)}) after {tries} tries over "
                            f"{spent:.0f}s ({ENV_RETRY_S}); nothing is marked complete: rerun the same "
                            f"command once the storage answers") from err
                    print(f"storage: {op} {url} failed ({short_error(err)}); retry {tries} in {delay:.0f}s",
                          file=sys.stderr, flush=True)
                    preemption.pause(delay)
                    delay = min(delay * 2, MAX_DELAY_S)

        return call  # type: ignore[return-value]

    return wrap


def is_transient(err: BaseException) -> bool:
    """Worth retrying: the same request may well succeed in a moment."""
    if isinstance(err, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    code = getattr(err, "code", None) or getattr(err, "status", None)
    if isinstance(code, int) and (code in (408, 429) or 500 <= code < 600):
        return True
    if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
        return True
    module = type(err).__module__
    if module.startswith("aiohttp") or module.startswith("requests"):
        return True  # client-side connection and timeout errors of the HTTP stacks gcsfs uses
    return isinstance(err.__cause__, BaseException) and err.__cause__ is not err and is_transient(err.__cause__)


def explain(err: Exception, op: str, url: str) -> Exception:
    """A StorageError with a hint for disk full / permission / read-only; other errors as they are."""
    if isinstance(err, OSError) and err.errno in _HINTS:
        return StorageError(f"storage: could not {op} {url}: {err.strerror}: {_HINTS[err.errno]}")
    return err


def short_error(err: BaseException) -> str:
    """`Type: the first line of its message` (at most 200 characters), for one-line errors."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__
