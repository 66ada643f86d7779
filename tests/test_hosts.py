"""The multi-host frame with the real jax.distributed: local processes started by
`pipeline launch`, joined on 127.0.0.1."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.pod.launch import free_port
from tests.conftest import pipeline


def test_launch_two_hosts_meet_at_a_barrier_and_agree_on_the_plan(make_config):
    result = pipeline("launch", "--hosts", "2", "--", "preflight", "--config", make_config())
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()  # preflight's answer, on the standard output of each host and of the launch
    assert not any("joined" in line for line in result.stderr.splitlines()), result.stderr
    for host in (0, 1):
        assert any(line.startswith(f"[host {host}] host {host}/2: joined, same code and plan") for line in lines)


@pytest.mark.parametrize("command", [("preflight",), ("run", "all")])
@pytest.mark.parametrize("override, key", [("sampling.temperature=0.9", "generate"), ("run.root=ROOT2", "run.root")])
def test_hosts_with_different_configs_fail_fast_naming_the_difference(make_config, tmp_path, command, override, key):
    """Both hosts exit 2 naming the step whose hash differs, or the run root (in no hash: each host
    made its own folders, and the run failed at generate naming a tokenize that fixed nothing),
    before any step folder: the leader went on before (it made tokenize's and generate's folders
    and read the weights, then exited 1)."""
    port = str(free_port())
    env = {"PIPELINE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "PIPELINE_NUM_PROCESSES": "2"}
    config = make_config()
    override = override.replace("ROOT2", str(tmp_path / "runs-of-host-1"))

    def host(i: int):
        return pipeline(*command, "--config", config, *(["--set", override] if i else []),
                        env={**env, "PIPELINE_PROCESS_ID": str(i)}, timeout=120)

    with ThreadPoolExecutor(2) as pool:  # both hosts at once: they meet in jax.distributed
        procs = list(pool.map(host, range(2)))
    what = "code version and plan" if command == ("preflight",) else "the plan (run root and step hashes)"
    where = f"plan.{key}" if command == ("preflight",) and key != "run.root" else key
    assert [p.returncode for p in procs] == [2, 2], [p.stderr[-2000:] for p in procs]
    last = [p.stderr.strip().splitlines()[-1] for p in procs]
    assert last[1].startswith(f"error: host 1/2: {what} differs from the leader's"), last[1]
    assert last[0].startswith(f"error: host 0/2: {what} differs between host 1 and the leader"), last[0]
    for line in last:
        assert f": {where}: the leader has '" in line and "', host 1 has '" in line, line
    assert not glob.glob(str(tmp_path / "runs" / "*")) and not glob.glob(str(tmp_path / "runs-of-host-1" / "*"))


def test_a_run_root_the_hosts_do_not_share_stops_the_pod_before_any_step(make_config, tmp_path):
    """memory:// is each process's own (as a local folder is each VM's own on a real pod): the
    leader's probe file is not there for host 1, and both hosts exit 2 saying what run.root needs."""
    config = make_config(run={"root": "memory://pod-root"})
    result = pipeline("launch", "--hosts", "2", "--", "run", "all", "--config", config, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = sorted(line for line in result.stderr.splitlines() if " error: " in line)
    fix = "run.root memory://pod-root must be storage every host of the pod shares (gs://BUCKET/PREFIX, or a shared file system)"
    assert errors[0] == f"[host 0] error: host 0/2: host(s) 1 do not see the leader's files under run.root: {fix}"
    assert errors[1].startswith("[host 1] error: host 1/2: this host does not see the leader's files under run.root "
                                "(memory://pod-root/.leases/shared-by-the-pod-") and errors[1].endswith(fix)
    assert "[tokenize]" not in result.stderr  # no step began


def test_launch_on_a_port_in_use_is_a_usage_error_before_any_host_starts(make_config):
    """Host 0 failed at once on a busy --port, and host 1 waited to join it until the launcher killed
    it 90 s later (exit 1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = pipeline("launch", "--hosts", "2", "--port", str(port), "--", "preflight", "--config", make_config(),
                          timeout=240)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: launch: --port {port} is not free on 127.0.0.1")
    assert "[host " not in result.stdout + result.stderr


def test_a_missing_host_fails_in_bounded_time_with_a_clear_message(make_config):
    env = {"PIPELINE_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "PIPELINE_NUM_PROCESSES": "2",
           "PIPELINE_PROCESS_ID": "0", "PIPELINE_INIT_TIMEOUT_S": "3"}
    result = pipeline("preflight", "--config", make_config(), env=env, timeout=60)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: multi-host: could not join the pod at 127.0.0.1:"), result.stderr[-2000:]
    assert "as process 0 of 2" in last and "is every host started?" in last


@pytest.mark.parametrize("env, message", [
    ({"PIPELINE_PROCESS_ID": "5"}, "PIPELINE_PROCESS_ID=5 must be in [0, PIPELINE_NUM_PROCESSES=2)"),
    # Before, a traceback and exit 1 (int() of the value), or "could not join ...: list index out of range":
    ({"PIPELINE_INIT_TIMEOUT_S": "abc"}, "PIPELINE_INIT_TIMEOUT_S must be a whole number of seconds > 0, got 'abc'"),
    ({"PIPELINE_HEARTBEAT_TIMEOUT_S": "0"}, "PIPELINE_HEARTBEAT_TIMEOUT_S must be a whole number of seconds > 0"),
    ({"PIPELINE_COORDINATOR_ADDRESS": "nohostport"}, "PIPELINE_COORDINATOR_ADDRESS must be HOST:PORT"),
])
def test_bad_pod_variables_are_a_usage_error(make_config, env, message):
    env = {"PIPELINE_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "PIPELINE_NUM_PROCESSES": "2",
           "PIPELINE_PROCESS_ID": "1", **env}
    result = pipeline("preflight", "--config", make_config(), env=env, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr.strip().splitlines()[-1]


def test_a_stop_signal_while_joining_the_pod_exits_75_at_once(make_config, start_pipeline):
    """The main thread waits in jax's native join, where our signal handler cannot run: a
    preemption notice or Ctrl-C went unheard until the join timed out, then exit 1 (two minutes
    by default). Now it ends the host at once, with exit 75."""
    env = {"PIPELINE_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "PIPELINE_NUM_PROCESSES": "2",
           "PIPELINE_PROCESS_ID": "0", "PIPELINE_INIT_TIMEOUT_S": "120"}
    host = start_pipeline("run", "all", "--config", make_config(), "--dry-run", env=env)
    # The leader's coordination service logs as it starts, inside the join; a jax that does not
    # gets the signal just before the join or inside it, and each must end the host the same way.
    try:
        host.wait_for("coordination_service", timeout_s=30)
    except AssertionError:
        pass
    host.send_signal(signal.SIGTERM)
    assert host.finish(timeout_s=20) == 75, host.output[-2000:]
    last = host.output.strip().splitlines()[-1]
    assert last.startswith("error: stopped by SIGTERM while joining the pod at 127.0.0.1:"), host.output[-2000:]


def test_a_host_that_fails_makes_the_others_exit_1_naming_it_and_its_error(make_config, tmp_path):
    """A real failure on host 1 (its shard's committed part damaged since the last run): host 1
    exits 1 with its error, and the leader exits 1 naming host 1 and that error, not a type name."""
    config = make_config(sampling={"n": 1, "max_new_tokens": 2})
    first = pipeline("launch", "--hosts", "2", "--", "run", "all", "--config", config)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (part, *_) = sorted(glob.glob(f"{tmp_path}/runs/generate-*/shard-00001/part-*.parquet"))  # host 1's shard
    with open(part, "r+b") as f:
        f.truncate(100)
    result = pipeline("launch", "--hosts", "2", "--", "run", "generate", "--force", "--config", config)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    error = f"generate part {part} cannot be read (Parquet magic bytes not found in footer."
    assert f"[host 1] error: {error}" in output, output[-3000:]
    assert f"[host 0] error: host 0/2: host 1 failed generate: {error}" in output, output[-3000:]


LEAVING_AFTER_A_FAILURE = """
import sys, time
from pipeline.pod import hosts
hosts.initialize()
if hosts.is_leader():
    hosts.abort("the leader's own error", 1)
elif sys.argv[1] == "failing":
    time.sleep(3)  # still failing (committing its rows, printing its error) when the leader leaves
    print("error: host 1's own error", file=sys.stderr, flush=True)
else:  # stuck in a collective that waits for the leader: only the watchdog can end it
    with hosts.watchdog("generating on the global mesh"):
        time.sleep(120)
hosts.leave(1)
"""


def leave_after_the_leader_failed(host_1: str) -> subprocess.CompletedProcess:
    """Host 1's process, once the leader has failed first (exit 1) and both have left."""
    env = {"PIPELINE_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "PIPELINE_NUM_PROCESSES": "2"}

    def host(i: int):
        return subprocess.run([sys.executable, "-c", LEAVING_AFTER_A_FAILURE, host_1], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env, "PIPELINE_PROCESS_ID": str(i)})

    with ThreadPoolExecutor(2) as pool:
        leader, other = pool.map(host, range(2))
    assert leader.returncode == 1, leader.stderr[-3000:]
    return other


def test_the_leader_failing_first_lets_the_other_hosts_print_their_errors_before_it_leaves():
    """The leader serves the coordinator: had it left at once after a failure, jax would end a
    host still failing natively (SIGABRT) before its `error:` line, as CI once saw."""
    other = leave_after_the_leader_failed("failing")
    assert other.returncode == 1, other.stderr[-3000:]
    assert "error: host 1's own error" in other.stderr


def test_a_host_stuck_in_a_collective_when_the_leader_fails_exits_1_naming_the_leaders_error():
    """Its watchdog ends it (after WATCHDOG_GRACE_S) with the leader's error and exit code, before
    the leader leaves, rather than jax's native abort when the coordinator goes."""
    other = leave_after_the_leader_failed("stuck")
    assert other.returncode == 1, other.stderr[-3000:]
    last = other.stderr.strip().splitlines()[-1]
    assert last == ("error: host 1/2: stopped generating on the global mesh: host 0 failed: the leader's own error"), \
        other.stderr[-3000:]


@pytest.mark.parametrize("signals, outcome", [
    (("SIGTERM", "SIGUSR1"), "alive: stopping on SIGTERM"),  # a VM's shutdown reaches a host and its parent
    (("SIGUSR2", "SIGINT"), "alive: stopping on SIGINT"),  # Ctrl-C to the terminal's process group
    (("SIGUSR1", "SIGUSR1"), 75),  # `kill` twice to a host's parent: the second exits at once
    (("SIGINT", "SIGINT"), 75),
])
def test_a_supervisors_copy_of_a_signal_never_makes_a_second_signal(signals, outcome):
    """A pod host's parent (pipeline/pod/supervise.py) passes a stop signal on as a copy (SIGUSR1
    for SIGTERM, SIGUSR2 for SIGINT); where the signal reached the host too, the two must not add
    up to the 'second signal' that exits at once, losing the rows being committed."""
    script = f"""
import os, signal, time
from pipeline.pod import preemption
preemption.install()
for name in {list(signals)!r}:
    os.kill(os.getpid(), getattr(signal, name))
    time.sleep(0.05)
print("alive: stopping on " + preemption.stop_reason())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    if outcome == 75:
        assert done.returncode == 75 and "alive" not in done.stdout, done.stdout + done.stderr
        second = {"SIGUSR1": "SIGTERM", "SIGINT": "SIGINT"}[signals[1]]  # a copy is named as what it copies
        assert done.stderr.splitlines()[-1] == (f"error: stopped at once by a second {second}: rows not yet committed "
                                                "are lost; rerun the same command to resume"), done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip() == outcome, done.stdout + done.stderr


def test_what_a_hosts_parent_says_of_a_child_ended_by_a_signal():
    """An abort is the coordinator gone only where it refuses connections and this host is not
    its leader; else the child's own (an XLA check, a kernel): exit 1, which a retry loop stops on."""
    from pipeline.pod.supervise import _ended_by

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        alive = f"127.0.0.1:{listening.getsockname()[1]}"
        gone = f"127.0.0.1:{free_port()}"
        pod = {"PIPELINE_PROCESS_ID": "1", "PIPELINE_NUM_PROCESSES": "2"}
        assert _ended_by(signal.SIGABRT, {**pod, "PIPELINE_COORDINATOR_ADDRESS": gone}) == (
            "host 1: JAX's distributed runtime ended it (SIGABRT): the pod's coordinator, on the leader (host 0), is "
            "gone (killed or preempted)", 75)
        assert _ended_by(signal.SIGABRT, {**pod, "PIPELINE_COORDINATOR_ADDRESS": alive}) == (
            "host 1: it aborted natively (SIGABRT): see the native error above", 1)
        assert _ended_by(signal.SIGABRT, {**pod, "PIPELINE_PROCESS_ID": "0", "PIPELINE_COORDINATOR_ADDRESS": gone})[1] == 1
    assert _ended_by(signal.SIGUSR1, pod) == ("host 1: stopped by SIGTERM as it started", 75)
    assert _ended_by(signal.SIGKILL, pod) == ("host 1: it was ended by SIGKILL", 75)
    assert _ended_by(40, {}) == ("this host: it was ended by signal 40", 75)  # a real-time signal: no name


BLIND_LEADER = """
import os

if os.environ.get("PIPELINE_PROCESS_ID") == "0":  # its listing of the steps' markers finds none
    import pipeline.run.status as status

    status.complete_outputs = lambda root, step: iter(())
"""


def test_a_host_whose_look_at_the_storage_differs_does_what_the_leaders_plan_does(make_config, tmp_path):
    """The leader's listing of the upload markers failed (here: found none), so its plan skipped
    the upload that host 1's plan ran again (`Step.redo`): host 1 waited for the leader in the
    step while the leader waited for it at the end, and the pod hung. Every host now does what
    the leader's plan does."""
    from tests.conftest import _sitecustomize

    config = make_config(sampling={"max_new_tokens": 4})
    assert pipeline("run", "all", "--config", config).returncode == 0
    assert pipeline("run", "upload", "--config", config, "--set", "wandb.table_max_rows=5").returncode == 0
    hook = _sitecustomize(tmp_path / "blind-hook", BLIND_LEADER)
    result = pipeline("launch", "--hosts", "2", "--", "run", "all", "--config", config, env={"PYTHONPATH": hook},
                      timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[upload]" not in result.stderr and "[host 0] result: " in result.stderr  # as the leader planned
    # Without the hook both hosts see the later upload: the default's is logged again.
    result = pipeline("launch", "--hosts", "2", "--", "run", "all", "--config", config, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[host 0] [upload] complete: 24 rows" in result.stderr and "table_rows=24" in result.stderr
