"""Leases: one runner per step output, on local disk (file locks) and on GCS (the emulator).

Runners are real processes where it matters (a holder killed with SIGKILL, `pipeline run`
refusing or waiting); the GCS takeover rules are driven in-process with a short timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import textwrap
import time
from dataclasses import asdict

import pytest

from pipeline import storage
from pipeline.storage.lease import Holder, Lease, LeaseBusy, LeaseLost
from tests.conftest import Process, pipeline


def step_hash(config: str, step: str) -> str:
    result = pipeline("status", "--config", config, "--json")
    assert result.returncode == 0, result.stderr
    return next(s["hash"] for s in json.loads(result.stdout)["steps"] if s["name"] == step)


def hold_lease(start_process, root: str, step: str, step_hash_: str) -> Process:
    """Another runner: a process that takes the lease and then hangs (until killed)."""
    code = textwrap.dedent(f"""
        import time
        from pipeline.storage.lease import Lease
        lease = Lease.for_step({root!r}, {step!r}, {step_hash_!r})
        lease.acquire(wait=False, say=print)
        print("held", flush=True)
        time.sleep(600)
    """)
    holder = start_process([sys.executable, "-c", code])
    assert holder.wait_for("held"), holder.output
    return holder


def test_local_second_runner_refuses_or_waits_and_takes_over_when_the_holder_dies(make_config, tmp_path, start_process,
                                                                                  start_pipeline):
    config = make_config()
    root = str(tmp_path / "runs")
    holder = hold_lease(start_process, root, "tokenize", step_hash(config, "tokenize"))
    try:
        refused = pipeline("run", "all", "--config", config, "--no-wait")
        assert refused.returncode == 75, refused.stderr
        assert f"pid {holder.pid}" in refused.stderr and "--no-wait" in refused.stderr
        (planned,) = [line for line in refused.stderr.splitlines() if line.lstrip().startswith("tokenize ")]
        assert f"being run by {socket.gethostname()} pid {holder.pid} (since " in planned, planned  # not "resume"
        steps = json.loads(pipeline("status", "--config", config, "--json").stdout)["steps"]
        assert all(s["state"] != "complete" for s in steps)
        assert f"pid {holder.pid}" in steps[0]["running"] and "running" not in steps[1]

        waiting = start_pipeline("run", "all", "--config", config)
        assert waiting.wait_for("waiting:"), f"runner ended without waiting: {waiting.output}"
        seen = waiting.output
        assert f"pid {holder.pid}" in seen and "as soon as its holder exits" in seen
        holder.send_signal(signal.SIGKILL)  # the holder dies without releasing anything
        waiting.finish(timeout_s=300)
        assert waiting.returncode == 0, waiting.output
    finally:
        holder.kill()
    states = json.loads(pipeline("status", "--config", config, "--json").stdout)["steps"]
    assert [s["state"] for s in states] == ["complete"] * 4
    assert not list((tmp_path / "runs" / ".leases").glob("*.json"))


def test_local_lease_busy_names_the_holder_and_frees_on_release(tmp_path):
    first = Lease.for_step(str(tmp_path), "merge", "ab" * 32)
    second = Lease.for_step(str(tmp_path), "merge", "ab" * 32)
    first.acquire(wait=False, say=print)
    with pytest.raises(LeaseBusy, match=f"merge-abababababab is being run by .* pid {os.getpid()}"):
        second.acquire(wait=False, say=print)
    first.check()
    first.release()
    second.acquire(wait=False, say=print)
    second.check()
    second.release()


def test_a_lease_taken_after_a_wait_says_since_when_it_is_held(tmp_path):
    """A runner's record said `since` the moment it began to wait, so `status` overstated how long
    the step had been run by it (by the whole wait)."""
    import datetime as dt
    import threading

    first = Lease.for_step(str(tmp_path), "merge", "ef" * 32)
    second = Lease.for_step(str(tmp_path), "merge", "ef" * 32)
    first.acquire(wait=False, say=print)
    waiter = threading.Thread(target=second.acquire, kwargs={"wait": True, "say": print})
    waiter.start()
    time.sleep(3)
    released = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    first.release()
    waiter.join(timeout=30)
    assert dt.datetime.fromisoformat(second.holder.since) >= released
    assert second.current_holder().since == second.holder.since  # as its record says
    second.release()


def test_a_look_at_a_free_local_lease_leaves_its_lock_alone(tmp_path, monkeypatch):
    """Every plan looks at the leases of the steps it would run (`current_holder`): a look that
    took the lock for a moment made a runner starting with --no-wait at that moment exit 75, as if
    the step were being run (19 of 300 tries in a loop). A free lease has no record to look at."""
    from filelock import FileLock

    lease, look = (Lease.for_step(str(tmp_path), "merge", "cd" * 32) for _ in range(2))  # two runners
    lease.acquire(wait=False, say=print)
    assert f"pid {os.getpid()}" in look.current_holder().describe()  # held: the record names the holder
    lease.release()
    taken = []
    real = FileLock.acquire
    monkeypatch.setattr(FileLock, "acquire", lambda self, *a, **k: (taken.append(self.lock_file), real(self, *a, **k))[1])
    assert look.current_holder() is None and taken == []


@pytest.fixture
def short_gcs_lease(monkeypatch):
    monkeypatch.setenv("PIPELINE_LEASE_TIMEOUT_S", "1.5")


def test_gcs_lease_is_exclusive_renewed_while_alive_and_taken_over_when_dead(gcs_bucket, short_gcs_lease):
    root = f"{gcs_bucket}/runs"
    holder = Lease.for_step(root, "generate", "cd" * 32)
    holder.acquire(wait=False, say=print)
    follower = Lease.follow(holder.url, holder.what, holder.token)  # another host of the holder's pod
    rival = Lease.for_step(root, "generate", "cd" * 32)

    with pytest.raises(LeaseBusy, match="generate-cdcdcdcdcdcd is being run by"):
        rival.acquire(wait=False, say=print)
    # The holder renews every timeout/4: for three timeouts nobody may take it over.
    deadline = time.monotonic() + 4.5
    while time.monotonic() < deadline:
        assert rival._backend.try_acquire(rival.holder or Holder.new()) is not None
        time.sleep(0.2)
    holder.check()
    follower.check()

    holder._backend._stop.set()  # the holder dies: no release, no more renewals
    rival = Lease.for_step(root, "generate", "cd" * 32)  # a runner started after the death
    said: list[str] = []
    started = time.monotonic()
    rival.acquire(wait=True, say=said.append)
    assert 1.5 <= time.monotonic() - started < 10
    assert any("taken over if not renewed for 2s" in s for s in said), said
    rival.check()
    with pytest.raises(LeaseLost, match="lost the lease on generate-cdcdcdcdcdcd"):
        holder.check()
    with pytest.raises(LeaseLost):
        follower.check()
    rival.release()
    assert not storage.exists(rival.url)


def test_gcs_lease_of_a_holder_that_exited_on_this_machine_is_taken_over_at_once(gcs_bucket, start_process):
    # The default timeout (120 s): a rerun after a crash here must not wait it out.
    root = f"{gcs_bucket}/runs"
    holder = hold_lease(start_process, root, "generate", "12" * 32)
    rival = Lease.for_step(root, "generate", "12" * 32)
    with pytest.raises(LeaseBusy, match=f"pid {holder.pid}"):
        rival.acquire(wait=False, say=print)  # alive on this machine: not taken
    assert rival.current_holder().pid == holder.pid

    holder.send_signal(signal.SIGKILL)  # dies holding the lease, nothing released
    holder.finish(timeout_s=30)
    assert rival.current_holder() is None, "pipeline status must not call a dead process running"
    said: list[str] = []
    started = time.monotonic()
    rival.acquire(wait=True, say=said.append)
    assert time.monotonic() - started < 10, said
    rival.check()
    assert rival.current_holder().pid == os.getpid()
    rival.release()


def test_gcs_lease_of_an_exited_pid_is_taken_early_only_when_recorded_on_this_machine(gcs_bucket):
    dead = Process([sys.executable, "-c", "pass"])
    dead.finish(timeout_s=30)
    here = Holder.new()
    lease = Lease.for_step(f"{gcs_bucket}/runs", "merge", "34" * 32)
    # Another host, another boot (or PID namespace), or an older record without one: the pid
    # means nothing here, so the lease waits for its timeout.
    for host, machine in (("elsewhere", here.machine), (here.host, "another-boot pid:[1]"), (here.host, "")):
        record = Holder("t0", host, dead.pid, "2026-01-01T00:00:00+00:00", machine)
        assert not record.is_gone()
        storage.write_json(lease.url, asdict(record))
        with pytest.raises(LeaseBusy, match=f"pid {dead.pid}"):
            lease.acquire(wait=False, say=print)
    storage.write_json(lease.url, asdict(Holder("t0", here.host, dead.pid, "2026-01-01T00:00:00+00:00", here.machine)))
    lease.acquire(wait=False, say=print)
    lease.check()
    lease.release()


def test_gcs_runners_racing_for_a_free_lease_exactly_one_wins(gcs_bucket):
    import threading

    leases = [Lease.for_step(f"{gcs_bucket}/runs", "tokenize", "ef" * 32) for _ in range(4)]
    outcomes: list[str] = []
    go = threading.Barrier(len(leases))

    def race(lease: Lease) -> None:
        go.wait()
        try:
            lease.acquire(wait=False, say=print)
            outcomes.append("won")
        except LeaseBusy:
            outcomes.append("busy")

    threads = [threading.Thread(target=race, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["busy"] * 3 + ["won"]
    winner = next(lease for lease in leases if lease.holder is not None)
    winner.check()
    winner.release()


def test_gcs_lease_record_that_cannot_be_read_says_so_and_is_taken_over_after_the_timeout(gcs_bucket, short_gcs_lease):
    """A record cut short or written by something else: a waiting runner names it as such (not
    a 'pid 0'), then takes the lease over once it has gone unrenewed for the timeout."""
    lease = Lease.for_step(f"{gcs_bucket}/runs", "upload", "56" * 32)
    storage.write_bytes(lease.url, b'{"token": "t0", "host')
    with pytest.raises(LeaseBusy, match=r"upload-565656565656 is being run by another runner \(its lease record "
                                        r"cannot be read\); lease: gs://"):
        lease.acquire(wait=False, say=print)
    said: list[str] = []
    started = time.monotonic()
    lease.acquire(wait=True, say=said.append)
    assert 1.5 <= time.monotonic() - started < 10
    assert "pid 0" not in " ".join(said), said
    lease.check()
    assert json.loads(storage.read_bytes(lease.url))["token"] == lease.token
    lease.release()


@pytest.mark.parametrize("scheme", ["file://", "memory://"])
def test_a_file_or_memory_root_runs_a_step_under_its_lease(make_config, tmp_path, monkeypatch, scheme):
    """`run.root` may be a file:// or memory:// URL (docs/contract.md). A step's lease there is
    the runner's until it finishes; before, each failed at its commit with "lost the lease ... its
    record is gone" (memory:// kept no record; file:// wrote one under ./file:/... and read it at
    the absolute path), and file:// left a stray `file:` folder in the working directory."""
    monkeypatch.chdir(tmp_path)
    root = f"{scheme}{tmp_path}/runs" if scheme == "file://" else f"memory://lease-test-{tmp_path.name}/runs"
    config = make_config(run={"root": root, "name": "t"})
    result = pipeline("run", "tokenize", "--config", config)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[tokenize] complete: 12 rows" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "file:").exists()
    if scheme == "file://":
        status = json.loads(pipeline("status", "--config", config, "--json").stdout)
        (tokenize,) = [s for s in status["steps"] if s["name"] == "tokenize"]
        assert tokenize["state"] == "complete" and tokenize["output"].startswith(f"{tmp_path}/runs/tokenize-")
        assert not os.listdir(tmp_path / "runs" / ".leases") or all(
            name.endswith(".lock") for name in os.listdir(tmp_path / "runs" / ".leases"))


def test_status_of_a_generate_being_run_says_how_far_it_got(make_config, tmp_path, start_process, monkeypatch):
    """While a runner held generate, `status` said only `being run by HOST pid N (since ...)`:
    the rows committed so far were in `--json` alone, when an operator asks most."""
    import glob

    import pyarrow.parquet as pq

    config = make_config(engine={"batch_size": 4, "part_rows": 4})
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    assert pipeline("run", "generate", "--config", config).returncode == 0
    (folder,) = glob.glob(f"{tmp_path}/runs/generate-*")
    os.remove(f"{folder}/_SUCCESS.json")  # as a run still going leaves it
    parts = sorted(glob.glob(f"{folder}/shard-*/part-*.parquet"))
    gone = pq.read_metadata(parts[0]).num_rows
    os.remove(parts[0])
    # A part named as before names said their rows: status reads its footer.
    os.rename(parts[1], re.sub(r"-\d+rows-of\d+\.parquet$", ".parquet", parts[1]))
    holder = hold_lease(start_process, str(tmp_path / "runs"), "generate", step_hash(config, "generate"))
    try:
        text = pipeline("status", "--config", config).stdout
    finally:
        holder.kill()
    (why,) = [line.strip() for line in text.splitlines() if "being run by" in line]
    assert why.startswith(f"being run by {socket.gethostname()} pid {holder.pid} (since ")
    assert why.endswith(f": {24 - gone} of 24 rows committed in {len(parts) - 1} part(s) so far"), why

    # The others' rows are read from their names: on a bucket a footer read per part took minutes for 40,000.
    from pipeline.run.config import load_config
    from steps import generate

    read, footer = [], pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda f: read.append(f) or footer(f))
    (tokenize,) = glob.glob(f"{tmp_path}/runs/tokenize-*")
    committed = generate.progress(load_config(config), folder, {"tokenize": tokenize})
    assert (committed.rows, committed.parts, len(read)) == (24 - gone, len(parts) - 1, 1)
