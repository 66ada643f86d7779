"""One runner per step output at a time: leases kept beside the run's outputs.

A second `pipeline run` on the same run root waits for a step another runner is executing
(or, with `--no-wait`, exits 75 at once), naming the holder and since when. A lease whose
holder died is taken over; a holder that lost its lease stops before its next commit.

Each lease is a small JSON record, `{root}/.leases/{step}-{hash12}.json` (`storage.lease_url`),
naming its holder (host, pid, a random token, since when, which kernel and PID namespace):

- local disk: an OS file lock (`filelock`) on the `.lock` file beside the record guards it.
  The OS frees the lock the moment its holder dies, so takeover is immediate.
- gs://: the record itself is the lock. It is created with `ifGenerationMatch=0`, and its
  holder rewrites it every `timeout/4` seconds with `ifGenerationMatch=<its generation>`. A
  waiter that sees the same generation for `timeout` seconds of its own clock (no clock sync
  needed) takes it over with `ifGenerationMatch=<that generation>`: of several waiters
  exactly one wins. The old holder's next renewal fails and it counts the lease as lost.
  A waiter on the holder's own machine does not wait out the timeout when the holder's
  process is gone (`Holder.is_gone`): the rerun after a crash or a storage outage starts
  at once.
- memory:// (one process): no lease.

Before each commit (a generate part, a success marker) the writer calls `check()`, which
re-reads the record and raises `LeaseLost` unless it still names this runner's token; the
non-leader hosts of a pod check the leader's token the same way (`Lease.follow`).

    lease = Lease.for_step(root, "generate", step_hash)
    lease.acquire(wait=True, say=print)
    try: ... lease.check(); commit(...)
    finally: lease.release()
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from pipeline import storage
from pipeline.pod import preemption
from pipeline.errors import PipelineError, StepFailed
from pipeline.storage.retrying import ENV_RETRY_S, StorageError, is_transient, retry_budget_s

ENV_TIMEOUT = "PIPELINE_LEASE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
"""gs:// only: how long a lease may go unrenewed before a waiter takes it over."""

REPORT_EVERY_S = 60.0
"""How often a waiting runner repeats who it is waiting for."""


class LeaseBusy(PipelineError):
    """Another runner holds the lease and we were told not to wait (exit 75: try again later)."""

    exit_code = 75


class LeaseLost(StepFailed):
    """Another runner took this runner's lease over: stop writing (exit 1)."""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: written into the record, shown to waiting runners."""

    token: str
    host: str
    pid: int
    since: str
    machine: str = ""
    """The holder's kernel boot id and PID namespace (`this_machine()`); '' where unknown."""

    def describe(self) -> str:
        if not self.pid:  # a holder known only by its lock or its unreadable record (`unknown`)
            return self.host
        return f"{self.host} pid {self.pid} (since {self.since})"

    @classmethod
    def unknown(cls, who: str) -> "Holder":
        """A holder whose record says nothing usable: being written, or not in our format."""
        return cls("?", who, 0, "")

    @classmethod
    def new(cls) -> "Holder":
        return cls(secrets.token_hex(8), socket.gethostname(), os.getpid(), _now(), this_machine())

    def is_gone(self) -> bool:
        """True only when the holder is provably dead: it ran on this machine (same host name,
        kernel boot and PID namespace, so its pid means the same process here) and that pid no
        longer runs. Anything else (another machine, a reboot, a pid reused since) is not proof:
        the caller then waits for the lease to go unrenewed."""
        if not self.machine or self.machine != this_machine() or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)  # signal 0: only asks whether the pid exists
        except ProcessLookupError:
            return True
        except PermissionError:  # it exists, as another user's process
            pass
        return False


def this_machine() -> str:
    """This kernel's boot id and this process's PID namespace: two processes with the same value
    see the same pids. '' where the system does not say (not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def timeout_s() -> float:
    return float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))


class Lease:
    """The lease on one step output; `acquire` on the runner's leader, `follow` on the others."""

    def __init__(self, url: str, what: str):
        self.url = url
        self.what = what
        self.holder: Holder | None = None
        self._backend = _backend_for(url)

    @classmethod
    def for_step(cls, root: str, step: str, step_hash: str) -> "Lease":
        return cls(storage.lease_url(root, step, step_hash), f"{step}-{step_hash[:storage.HASH_CHARS]}")

    @classmethod
    def follow(cls, url: str, what: str, token: str) -> "Lease":
        """The lease another host of this pod acquired: `check` compares against its token."""
        lease = cls(url, what)
        lease.holder = Holder(token, "", 0, "")
        return lease

    @property
    def token(self) -> str | None:
        return self.holder.token if self.holder else None

    def acquire(self, wait: bool, say: Callable[[str], None]) -> None:
        """Take the lease, waiting while another live runner holds it (or raise LeaseBusy)."""
        me = Holder.new()
        waited_since = time.monotonic()
        reported = -REPORT_EVERY_S
        while True:
            me = replace(me, since=_now())  # since it holds the lease, not since it began to wait
            with self._storage_errors("take"):
                other = self._backend.try_acquire(me)
            if other is None:
                self.holder = me
                if time.monotonic() - waited_since > 1:
                    say(f"lease on {self.what} acquired after {time.monotonic() - waited_since:.0f}s")
                return
            message = (f"{self.what} is being run by {other.describe()}; "
                       f"lease: {self.url}")
            if not wait:
                raise LeaseBusy(f"{message}. Rerun later, or without --no-wait to wait for it")
            if time.monotonic() - reported >= REPORT_EVERY_S:
                say(f"waiting: {message} ({self._backend.takeover_rule})")
                reported = time.monotonic()
            preemption.pause(self._backend.poll_s)

    def check(self) -> None:
        """Raise LeaseLost unless the record still names this runner (call before each commit)."""
        if self.holder is None:
            return
        with self._storage_errors("read"):
            current = self._backend.read()
        if self._backend.lost or current is None or current.token != self.holder.token:
            by = f"by {current.describe()}" if current else "(its record is gone)"
            raise LeaseLost(f"lost the lease on {self.what}: it was taken over {by}, so this runner "
                            f"stops writing; the other runner finishes the step. Lease: {self.url}")

    def current_holder(self) -> Holder | None:
        """Who holds the lease now, as far as can be told without waiting (for `pipeline status`)."""
        return self._backend.peek()

    @contextlib.contextmanager
    def _storage_errors(self, op: str) -> Iterator[None]:
        """The storage stayed unreachable through the client's retries: one clear line."""
        try:
            yield
        except Exception as err:
            if not is_transient(err):
                raise
            raise StorageError(f"storage: could not {op} the lease {self.url} ({type(err).__name__}) within "
                               f"the retry budget ({ENV_RETRY_S}); nothing more was written: rerun the same "
                               f"command once the storage answers") from err

    def release(self) -> None:
        """Give the lease up; never raises (it runs while another error may be on its way out)."""
        if self.holder is not None and self.holder.host:
            try:
                self._backend.release(self.holder)
            except Exception as err:  # noqa: BLE001 - the lease then expires on its own
                print(f"lease: could not release {self.url} ({type(err).__name__}); another runner may take "
                      f"it over once it expires ({self._backend.takeover_rule})", file=sys.stderr, flush=True)
        self.holder = None


class _NoLease:
    """memory:// lives in one process: nobody else can run there, so the lease is this runner's
    from `try_acquire` to `release`, and nothing is written."""

    poll_s = 1.0
    takeover_rule = ""
    lost = False

    def __init__(self) -> None:
        self._holder: Holder | None = None

    def try_acquire(self, me: Holder) -> Holder | None:
        self._holder = me
        return None

    def read(self) -> Holder | None:
        return self._holder

    def peek(self) -> Holder | None:
        return None  # another runner's lease object: nobody else runs here

    def release(self, me: Holder) -> None:
        self._holder = None


class _FileLease:
    """Local disk: an OS lock on `<record>.lock`; the record says who holds it."""

    poll_s = 1.0
    takeover_rule = "taken over as soon as its holder exits"
    lost = False

    def __init__(self, url: str):
        from filelock import FileLock

        self.url = url
        self._lock_path = url[: -len(".json")] + ".lock"
        self._lock = FileLock(self._lock_path)

    def try_acquire(self, me: Holder) -> Holder | None:
        from filelock import Timeout

        os.makedirs(os.path.dirname(self.url), exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            return self.read() or Holder.unknown("another process (its lease record is being written)")
        storage.write_json(self.url, asdict(me))
        return None

    def read(self) -> Holder | None:
        try:
            with open(self.url) as f:
                return Holder(**json.load(f))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def peek(self) -> Holder | None:
        """The record's holder if its lock is held; a record left by a killed holder is stale.
        Without a record nobody holds it (a holder writes one as it takes the lock and removes it
        as it lets go): the lock is not touched then, so that a look (every plan takes one) never
        makes a runner starting with --no-wait see it held."""
        from filelock import Timeout

        if not os.path.exists(self.url) or not os.path.exists(self._lock_path):
            return None  # not held, or never leased: do not create anything
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            return self.read() or Holder.unknown("another process (its lease record cannot be read)")
        self._lock.release()
        return None

    def release(self, me: Holder) -> None:
        current = self.read()
        if current is not None and current.token == me.token:
            os.remove(self.url)
        self._lock.release()


@functools.lru_cache(maxsize=2)
def _gcs_client(endpoint: str | None):
    """One client a process (per endpoint: tests move the emulator): the plan looks at each
    unfinished step's lease, and each client looked its credentials and project up again."""
    from google.cloud import storage as gcs

    return gcs.Client()


class _GcsLease:
    """gs://: the record is the lock, guarded by generation-match preconditions."""

    def __init__(self, url: str):
        from google.cloud.storage.retry import DEFAULT_RETRY

        # Conditional writes are safe to retry; bound the client's retries by ours.
        self._calls = {"retry": DEFAULT_RETRY.with_timeout(min(retry_budget_s(), 120.0)), "timeout": 30}
        bucket, _, name = url[len("gs://"):].partition("/")
        self.blob_name = name
        self.bucket = _gcs_client(os.environ.get("STORAGE_EMULATOR_HOST")).bucket(bucket)
        self.timeout = timeout_s()
        self.poll_s = min(5.0, max(0.2, self.timeout / 10))
        self.takeover_rule = (f"taken over if not renewed for {self.timeout:.0f}s ({ENV_TIMEOUT}), at once if its "
                              f"holder ran on this machine and has exited")
        self.lost = False
        self._seen: tuple[int, float] | None = None   # (generation, when first seen), for staleness
        self._generation = 0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def try_acquire(self, me: Holder) -> Holder | None:
        from google.api_core.exceptions import PreconditionFailed

        generation, other = self._read_with_generation()
        if other is None:
            expect = 0
        else:
            now = time.monotonic()
            if self._seen is None or self._seen[0] != generation:
                self._seen = (generation, now)
            if now - self._seen[1] < self.timeout and not other.is_gone():
                return other
            expect = generation  # no renewal for `timeout`, or its process here has exited
        try:
            self._write(me, expect)
        except PreconditionFailed:
            generation, current = self._read_with_generation()
            if current is None or current.token != me.token:
                return current or other or Holder.unknown("another runner (it took the lease just now)")
            self._generation = generation  # our write landed; a retry of it met its own result
        self._start_renewing(me)
        return None

    def read(self) -> Holder | None:
        return self._read_with_generation()[1]

    def peek(self) -> Holder | None:
        """The record's holder, unless it provably died (`Holder.is_gone`); the record of a holder
        that died elsewhere stays until a runner takes it over."""
        holder = self.read()
        return None if holder is None or holder.is_gone() else holder

    def release(self, me: Holder) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        generation, current = self._read_with_generation()
        if current is not None and current.token == me.token:
            from google.api_core.exceptions import NotFound, PreconditionFailed

            try:
                self.bucket.blob(self.blob_name).delete(if_generation_match=generation, **self._calls)
            except (NotFound, PreconditionFailed):
                pass

    def _read_with_generation(self) -> tuple[int, Holder | None]:
        blob = self.bucket.get_blob(self.blob_name, **self._calls)
        if blob is None:
            return 0, None
        try:
            record = blob.download_as_bytes(if_generation_match=blob.generation, **self._calls)
            return blob.generation, Holder(**json.loads(record))
        except Exception:  # noqa: BLE001 - rewritten between the two reads, or not our format
            return blob.generation, Holder.unknown("another runner (its lease record cannot be read)")

    def _write(self, me: Holder, expect: int) -> None:
        blob = self.bucket.blob(self.blob_name)
        blob.upload_from_string(json.dumps(asdict(me)), content_type="application/json",
                                if_generation_match=expect, **self._calls)
        self._generation = blob.generation

    def _start_renewing(self, me: Holder) -> None:
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, args=(me,), daemon=True, name="lease-renewer")
        self._renewer.start()

    def _renew(self, me: Holder) -> None:
        from google.api_core.exceptions import PreconditionFailed

        while not self._stop.wait(self.timeout / 4):
            try:
                self._write(me, self._generation)
            except PreconditionFailed:
                # A retried write may have landed already: still ours if the record says so.
                generation, current = self._read_with_generation()
                if current is not None and current.token == me.token:
                    self._generation = generation
                else:
                    self.lost = True
                    return
            except Exception:  # noqa: BLE001 - transient storage error: try again next round
                continue


def _backend_for(url: str):
    if url.startswith("gs://"):
        return _GcsLease(url)
    if storage.is_local(url):
        return _FileLease(url)
    return _NoLease()
