"""The three kinds of failure the CLI turns into exit codes.

Code raises these (or plain exceptions, which count as step failures) where a problem is
detected; only `cli.py` maps them to exit codes (`exit_now` is the one way around it, for a
process that must end where no exception can reach):

    ConfigError  -> 2   a config file, --set value or command line is wrong
    StepFailed   -> 1   a step could not finish (bad data, missing upstream, storage)
    Interrupted  -> 75  SIGTERM/SIGINT or a preemption notice: rerun the same command

The engine imports nothing from the pipeline, so its checkpoint errors are plain ValueErrors;
`checkpoint_errors(model_path)` gives them their kind here:

    with checkpoint_errors(cfg.model.path):
        check_checkpoint(cfg.model.path)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, NoReturn


class PipelineError(Exception):
    """Base class: the message is the one line the user sees."""

    exit_code = 1


class ConfigError(PipelineError):
    """The config, a --set override or a command-line value is invalid (exit 2)."""

    exit_code = 2


class StepFailed(PipelineError):
    """A step failed; the message names the step and where to look (exit 1)."""

    exit_code = 1


class Interrupted(PipelineError):
    """Stopped by a signal after committing finished work; rerun to resume (exit 75)."""

    exit_code = 75


def failure(code: int, message: str) -> PipelineError:
    """The error another host's exit `code` means here: 75 stays an interruption, anything else
    is a step failure. The one place a published exit code turns back into an exception."""
    return Interrupted(message) if code == Interrupted.exit_code else StepFailed(message)


def one_line(message: str) -> str:
    """A message on one line, as every `error:` line is (a library's error text can hold newlines:
    Arrow's do), its lines joined by spaces."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def message_of(err: BaseException) -> str:
    """What another host is told of `err`: our own errors are their message, as `cli.py` prints
    them; anything else keeps its type's name (`KeyError: 'x'`)."""
    return str(err) if isinstance(err, PipelineError) else f"{type(err).__name__}: {err}"


_ended = threading.Event()


def end_output() -> None:
    """The command's `error:` line is printed: what threads would still say after it (a program
    being got, on a pod while the leader waits for the others' goodbyes) is left out, so that it
    stays the last line. `say_unless_ended` is how such threads print."""
    _ended.set()


def begin_output() -> None:
    """A command begins (several run in one process under tests): its threads may print again."""
    _ended.clear()


def say_unless_ended(line: str) -> None:
    if not _ended.is_set():
        print(line, file=sys.stderr, flush=True)


def exit_now(code: int, message: str | None = None) -> NoReturn:
    """End this process at once with `code`, after printing `error: message` (if given).

    For the few places where raising cannot work: a watchdog thread ending a host stuck in a
    collective, a second Ctrl-C, leaving a pod (jax.distributed's shutdown must not run after
    a failure). Everything else raises and lets `cli.py` decide the exit code.
    """
    if message is not None:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def checkpoint_errors(url: str) -> Iterator[None]:
    """engine/checkpoint.py's errors as ours: NotACheckpoint -> ConfigError, BrokenCheckpoint -> StepFailed,
    and a storage fault that outlasted the client's own retries (a 5xx, a
    refused connection) -> one StorageError line naming model.path (a traceback and `HttpError: {}, 503`
    before: engine/checkpoint.py reads through fsspec, not pipeline/storage)."""
    from engine.checkpoint import BrokenCheckpoint, NotACheckpoint
    from pipeline.storage.retrying import StorageError, is_transient, short_error

    try:
        yield
    except NotACheckpoint as err:
        raise ConfigError(str(err)) from err
    except BrokenCheckpoint as err:
        raise StepFailed(str(err)) from err
    except Exception as err:
        if not is_transient(err):
            raise
        raise StorageError(f"storage: could not read the checkpoint at model.path {url} ({short_error(err)}); "
                           f"nothing is marked complete: rerun the same command once the storage answers") from err
