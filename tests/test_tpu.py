"""`pipeline tpu run`: gcloud command lines, the babysitter's state machine and retry budget.

GCP cannot be reached from the tests: a fake `gcloud` (tests/fake_gcloud.py) first on PATH
plays READY / PREEMPTED / recreated sequences and ssh outcomes, and logs every call.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.ops.tpu import Remote, Tpu, parse_node, parse_queued_state

HERE = Path(__file__).resolve().parent
TPU = ["--tpu", "my-tpu", "--zone", "us-east5-a", "--project", "my-proj"]
FAST = ["--backoff-s", "0", "--poll-s", "0"]
WHERE = ["--zone=us-east5-a", "--project=my-proj"]
PREFLIGHT = "cd jax-batch-pipeline && .venv/bin/pipeline preflight --config configs/x.yaml --expect-hosts 2"
RUN = "cd jax-batch-pipeline && .venv/bin/pipeline run all --config configs/x.yaml"


class FakeGcloud:
    def __init__(self, home: Path):
        self.home = home

    def play(self, **scenario) -> None:
        (self.home / "scenario.json").write_text(json.dumps({"hosts": 2, **scenario}))

    def calls(self) -> list[list[str]]:
        path = self.home / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def story(self) -> list[str]:
        """Each call in short (`tpu-vm describe`, `ssh 1 run`), ssh calls of one round sorted by worker."""
        story: list[str] = []
        for argv in self.calls():
            if argv[3] == "ssh":
                worker = next(a for a in argv if a.startswith("--worker=")).split("=")[1]
                command = next(a for a in argv if a.startswith("--command="))
                story.append(f"ssh {worker} {'preflight' if ' preflight ' in command else 'run'}")
            else:
                story.append(f"{argv[2]} {argv[3]}")
        # The workers of one round run at once: order each round by worker.
        rounds = itertools.groupby(story, key=lambda call: call.split()[::2] if call.startswith("ssh ") else call)
        story = [call for _, calls in rounds for call in sorted(calls)]
        return story


@pytest.fixture
def gcloud(tmp_path, monkeypatch) -> FakeGcloud:
    home = tmp_path / "fake-gcloud"
    (home / "bin").mkdir(parents=True)
    exe = home / "bin" / "gcloud"
    exe.write_text(f"#!{sys.executable}\n" + (HERE / "fake_gcloud.py").read_text())
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GCLOUD_DIR", str(home))
    monkeypatch.chdir(tmp_path)
    return FakeGcloud(home)


def tpu_run(*options: str, args: tuple[str, ...] = ("run", "all", "--config", "configs/x.yaml")):
    from pipeline.pod import preemption

    preemption.reset()
    return CliRunner().invoke(app, ["tpu", "run", *TPU, *FAST, *options, "--", *args], catch_exceptions=False)


def attempts(path: str = "tpu-my-tpu-attempts.jsonl") -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def last_line(result) -> str:
    return result.output.strip().splitlines()[-1]


# --- command construction ------------------------------------------------------------------


def test_gcloud_command_lines_for_tpu_vm_and_queued_resources():
    spot = Tpu("my-tpu", "us-east5-a", "my-proj", "v5p-16", "v2-alpha-tpuv5", spot=True)
    assert spot.describe_argv() == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "my-tpu", *WHERE,
                                    "--format=json"]
    assert spot.create_argv() == ["gcloud", "compute", "tpus", "tpu-vm", "create", "my-tpu", *WHERE,
                                  "--accelerator-type=v5p-16", "--version=v2-alpha-tpuv5", "--spot"]
    assert spot.delete_argv() == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "my-tpu", *WHERE, "--quiet"]
    assert spot.ssh_argv(3, "cd x && ls") == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", *WHERE,
                                              "--worker=3", "--quiet", "--command=cd x && ls"]
    queued = Tpu("my-tpu", "us-east5-a", None, "v5p-16", "v2-alpha-tpuv5", queued=True)
    assert queued.create_argv() == ["gcloud", "compute", "tpus", "queued-resources", "create", "my-tpu",
                                    "--node-id=my-tpu", "--zone=us-east5-a", "--accelerator-type=v5p-16",
                                    "--runtime-version=v2-alpha-tpuv5"]
    assert queued.delete_argv() == ["gcloud", "compute", "tpus", "queued-resources", "delete", "my-tpu",
                                    "--zone=us-east5-a", "--force", "--quiet"]
    assert queued.queued_describe_argv()[3:6] == ["queued-resources", "describe", "my-tpu"]


def test_remote_commands_are_shell_quoted_and_preflight_takes_the_runs_config():
    remote = Remote(["run", "all", "--config", "my configs/x.yaml", "--set", "sampling.stop=['; rm -rf ~']",
                     "--no-wait"], workdir="src/pipe line", setup="git pull && bash scripts/setup.sh")
    assert remote.run_command() == ("cd 'src/pipe line' && git pull && bash scripts/setup.sh && .venv/bin/pipeline "
                                    "run all --config 'my configs/x.yaml' --set 'sampling.stop=['\"'\"'; rm -rf "
                                    "~'\"'\"']' --no-wait")
    assert remote.preflight_command(4).endswith(
        ".venv/bin/pipeline preflight --config 'my configs/x.yaml' --set 'sampling.stop=['\"'\"'; rm -rf ~'\"'\"']' "
        "--expect-hosts 4")


def test_describe_output_is_read_for_state_workers_and_how_to_recreate():
    node = parse_node(json.dumps({
        "name": "projects/p/locations/us-east5-a/nodes/my-tpu", "state": "READY", "acceleratorType": "v5p-16",
        "runtimeVersion": "v2-alpha-tpuv5", "schedulingConfig": {"spot": True},
        "networkEndpoints": [{"ipAddress": f"10.0.0.{i}", "port": 8470} for i in range(4)]}))
    assert (node.state, node.hosts, node.accelerator_type, node.runtime_version, node.spot) == \
        ("READY", 4, "v5p-16", "v2-alpha-tpuv5", True)
    assert parse_node('{"state": "CREATING"}').hosts == 0
    assert parse_queued_state('{"state": {"state": "WAITING_FOR_RESOURCES"}}') == "WAITING_FOR_RESOURCES"


# --- the babysitter against the fake gcloud ------------------------------------------------


def test_happy_path_preflight_then_run_on_every_worker(gcloud):
    gcloud.play(node=["READY"])
    result = tpu_run()
    assert result.exit_code == 0, result.output
    assert gcloud.story() == ["tpu-vm describe", "ssh 0 preflight", "ssh 1 preflight", "ssh 0 run", "ssh 1 run"]
    ssh = [argv for argv in gcloud.calls() if argv[3] == "ssh"]
    assert ["compute", "tpus", "tpu-vm", "ssh", "my-tpu", *WHERE, "--worker=1", "--quiet",
            f"--command={PREFLIGHT}"] in ssh
    assert ["compute", "tpus", "tpu-vm", "ssh", "my-tpu", *WHERE, "--worker=0", "--quiet", f"--command={RUN}"] in ssh
    [log] = attempts()
    assert log["outcome"] == "done" and log["hosts"] == 2 and log["stage"] == "run"
    assert log["exit_codes"] == {"0": 0, "1": 0} and log["actions"] == []
    assert last_line(result) == "my-tpu: done after 1 attempt(s); attempt log: tpu-my-tpu-attempts.jsonl"


def test_an_unreachable_worker_fails_preflight_fast_naming_it(gcloud):
    """The classic pod mistake, seen from the babysitter: one worker never starts, the others cannot join."""
    gcloud.play(node=["READY"], ssh={
        "0": [{"exit": 1, "say": "error: multi-host: could not join the pod at TPU auto-detect within 120s"}],
        "1": [{"exit": 255, "say": "ssh: connect to host 10.0.0.3 port 22: Connection timed out"}]})
    result = tpu_run("--spot")
    assert result.exit_code == 1, result.output
    assert gcloud.story() == ["tpu-vm describe", "ssh 0 preflight", "ssh 1 preflight", "tpu-vm describe"]
    line = last_line(result)
    assert line.startswith("error: preflight failed on my-tpu before any work, not retried: ")
    assert "worker 1 unreachable (ssh exit 255: ssh: connect to host 10.0.0.3 port 22: Connection timed out)" in line
    assert "worker 0 exit 1 (error: multi-host: could not join" in line
    [log] = attempts()
    assert (log["outcome"], log["stage"], log["exit_codes"]) == ("stop", "preflight", {"0": 1, "1": 255})


def test_no_worker_answering_ssh_yet_is_retried(gcloud):
    """Right after READY, sshd may not answer yet: when no worker does, that is worth another attempt."""
    gcloud.play(node=["READY"], ssh={w: [{"exit": 255, "say": "Connection refused"}] for w in ("0", "1")})
    result = tpu_run("--spot")
    assert result.exit_code == 0, result.output
    assert [a["outcome"] for a in attempts()] == ["retry", "done"]
    assert attempts()[0]["reason"].startswith("no worker of my-tpu answered ssh (worker 0 unreachable")
    assert "tpu-vm delete" not in gcloud.story()


def test_preflight_names_the_hosts_that_did_not_join(make_config):
    """A worker that joins alone (say, started by hand on worker 0 only) is refused before any work."""
    from pipeline.pod import preemption

    preemption.reset()
    result = CliRunner().invoke(app, ["preflight", "--config", make_config(), "--expect-hosts", "4"])
    assert result.exit_code == 2, result.output
    assert last_line(result).startswith("error: host 0/1: the pod has 1 host(s), expected 4 (--expect-hosts): "
                                        "hosts 1-3 did not join")


def test_preempted_mid_run_is_recreated_and_rerun_to_success(gcloud):
    gcloud.play(node=["READY"], after_create=["CREATING", "READY"], ssh={
        "0": [0, {"exit": 255, "say": "Connection to 10.0.0.2 closed by remote host.", "then": "PREEMPTED"}],
        "1": [0, {"exit": 1, "say": "error: host 1/2: stopped waiting for every host to finish: host 0 stopped "
                                    "responding"}]})
    result = tpu_run("--spot", "--accelerator-type", "v5p-16", "--runtime-version", "v2-alpha-tpuv5")
    assert result.exit_code == 0, result.output
    assert gcloud.story() == [
        "tpu-vm describe", "ssh 0 preflight", "ssh 1 preflight", "ssh 0 run", "ssh 1 run", "tpu-vm describe",
        "tpu-vm describe", "tpu-vm delete", "tpu-vm create", "tpu-vm describe", "tpu-vm describe",
        "ssh 0 preflight", "ssh 1 preflight", "ssh 0 run", "ssh 1 run"]
    create = next(argv for argv in gcloud.calls() if argv[3] == "create")
    assert create == ["compute", "tpus", "tpu-vm", "create", "my-tpu", *WHERE, "--accelerator-type=v5p-16",
                      "--version=v2-alpha-tpuv5", "--spot"]
    first, second = attempts()
    assert (first["outcome"], first["stage"], first["state_after"]) == ("retry", "run", "PREEMPTED")
    assert first["exit_codes"] == {"0": 255, "1": 1}
    assert "my-tpu is PREEMPTED after run (worker 0 unreachable" in first["reason"]
    assert (second["outcome"], second["actions"], second["attempt"]) == ("done", ["delete", "create"], 2)


def test_an_existing_spot_tpu_is_recreated_alike_from_what_describe_says(gcloud):
    """No --spot, type or version given: describe's schedulingConfig and type are used to recreate it."""
    gcloud.play(node=["READY", "PREEMPTED"], scheduling={"spot": True},
                ssh={"0": [0, {"exit": 75, "then": "PREEMPTED"}]})
    result = tpu_run()
    assert result.exit_code == 0, result.output
    create = next(argv for argv in gcloud.calls() if argv[3] == "create")
    assert create[-3:] == ["--accelerator-type=v5p-16", "--version=v2-alpha-tpuv5", "--spot"]


def test_the_retry_budget_runs_out_with_exit_75_and_what_to_run(gcloud):
    """An on-demand TPU that stays READY (say, a maintenance SIGTERM): rerun, never recreate."""
    gcloud.play(node=["READY"], ssh={w: [0, 75, 0, 75] for w in ("0", "1")})
    result = tpu_run("--retries", "1")
    assert result.exit_code == 75, result.output
    assert "delete" not in " ".join(gcloud.story()) and "create" not in " ".join(gcloud.story())
    assert gcloud.story().count("ssh 0 run") == 2
    line = last_line(result)
    assert line.startswith("error: gave up on my-tpu after 2 attempts (last: run interrupted (worker 0 exit 75; ")
    assert "rerun the same `pipeline tpu run` command to resume" in line
    assert [a["outcome"] for a in attempts()] == ["retry", "retry"]


def test_a_config_error_is_not_retried(gcloud):
    say = "error: sampling.top_p must be in (0, 1], got 1.5"
    gcloud.play(node=["READY"], ssh={w: [{"exit": 2, "say": say}] for w in ("0", "1")})
    result = tpu_run("--spot")
    assert result.exit_code == 2, result.output
    assert last_line(result) == (f"error: preflight failed with a usage or config error, not retried: "
                                 f"worker 0 exit 2 ({say}); worker 1 exit 2 ({say})")
    assert gcloud.story().count("ssh 0 preflight") == 1 and len(attempts()) == 1


def test_a_step_failure_on_a_ready_tpu_is_not_retried(gcloud):
    gcloud.play(node=["READY"], ssh={"0": [0, {"exit": 1, "say": "error: merge: 3 rows missing"}], "1": [0, 0]})
    result = tpu_run("--spot")
    assert result.exit_code == 1, result.output
    assert last_line(result) == ("error: run failed on my-tpu, not retried: "
                                 "worker 0 exit 1 (error: merge: 3 rows missing)")


def test_a_preempted_on_demand_tpu_is_not_recreated(gcloud):
    gcloud.play(node=["TERMINATED"])
    result = tpu_run()
    assert result.exit_code == 1, result.output
    assert "my-tpu is TERMINATED and is an on-demand TPU, which the babysitter does not recreate" in last_line(result)
    assert gcloud.story() == ["tpu-vm describe"]


def test_capacity_errors_on_create_use_the_budget(gcloud):
    gcloud.play(node=["MISSING"], create_fails=True)
    result = tpu_run("--spot", "--accelerator-type", "v5p-16", "--runtime-version", "v2-alpha-tpuv5",
                     "--retries", "2")
    assert result.exit_code == 75, result.output
    assert gcloud.story() == ["tpu-vm describe", "tpu-vm create"] * 3
    assert "RESOURCE_EXHAUSTED: no capacity" in attempts()[0]["reason"]


PROJECT_NOT_SET = ("ERROR: (gcloud.compute.tpus.tpu-vm.describe) The required property [project] is not currently set.\n"
                   "It can be set on a per-command basis by re-running your command with the [--project] flag.")


def test_a_gcloud_that_is_not_set_up_is_not_retried(gcloud):
    """A project not set (or no login, no permission) was retried as a preemption: with the
    defaults about half an hour of attempts, then exit 75 saying to rerun."""
    gcloud.play(node=["READY"], describe_fails=[PROJECT_NOT_SET] * 3)
    result = tpu_run("--spot", "--retries", "2")
    assert result.exit_code == 2, result.output
    assert last_line(result) == (
        "error: gcloud could not describe my-tpu (exit 1): ERROR: (gcloud.compute.tpus.tpu-vm.describe) The required "
        "property [project] is not currently set.: set the project: --project ID, or `gcloud config set project ID`, "
        "then rerun (not retried: waiting does not fix it)")
    assert gcloud.story() == ["tpu-vm describe"] and len(attempts()) == 1


REFRESH_DROPPED = ("ERROR: (gcloud.compute.tpus.tpu-vm.describe) There was a problem refreshing your current auth tokens: "
                   "('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))\n"
                   "Please run:\n\n  $ gcloud auth login\n\nto obtain new credentials.")


@pytest.mark.parametrize("said", ["ERROR: (gcloud.compute.tpus.tpu-vm.describe) UNAVAILABLE: try again", REFRESH_DROPPED])
def test_a_gcloud_error_that_may_pass_is_retried(gcloud, said):
    """A dropped connection while gcloud refreshed its token ends with "gcloud auth login" too: retried."""
    gcloud.play(node=["READY"], describe_fails=[said])
    result = tpu_run("--spot", "--retries", "2")
    assert result.exit_code == 0, result.output
    assert [a["outcome"] for a in attempts()] == ["retry", "done"]
    assert attempts()[0]["reason"].startswith("gcloud could not describe my-tpu (exit 1: ")


def test_a_create_gcloud_refuses_for_its_setup_is_not_retried(gcloud):
    gcloud.play(node=["MISSING"], create_fails="ERROR: (gcloud.compute.tpus.tpu-vm.create) PERMISSION_DENIED: "
                                              "Permission 'tpu.nodes.create' denied on 'projects/p/locations/z'")
    result = tpu_run("--spot", "--accelerator-type", "v5p-16", "--runtime-version", "v2-alpha-tpuv5", "--retries", "2")
    assert result.exit_code == 2, result.output
    assert last_line(result).startswith("error: gcloud could not create my-tpu (exit 1): ERROR: (gcloud.compute.tpus."
                                        "tpu-vm.create) PERMISSION_DENIED: Permission 'tpu.nodes.create' denied")
    assert "give this account the Cloud TPU permission the error names" in last_line(result)
    assert gcloud.story() == ["tpu-vm describe", "tpu-vm create"] and len(attempts()) == 1


def test_queued_resource_is_waited_for_then_recreated_after_preemption(gcloud):
    gcloud.play(queued=["MISSING"], node=["MISSING"], queued_after_create=["WAITING_FOR_RESOURCES", "ACTIVE"],
                after_create=["READY"], ssh={"0": [0, {"exit": 255, "then": "PREEMPTED"}]})
    result = tpu_run("--queued", "--spot", "--accelerator-type", "v5p-16", "--runtime-version", "v2-alpha-tpuv5")
    assert result.exit_code == 0, result.output
    assert gcloud.story() == [
        "queued-resources describe", "queued-resources create", "queued-resources describe",
        "queued-resources describe", "tpu-vm describe", "ssh 0 preflight", "ssh 1 preflight", "ssh 0 run", "ssh 1 run",
        "queued-resources describe",
        "queued-resources describe", "queued-resources delete", "queued-resources create",
        "queued-resources describe", "queued-resources describe", "tpu-vm describe",
        "ssh 0 preflight", "ssh 1 preflight", "ssh 0 run", "ssh 1 run"]
    create = next(argv for argv in gcloud.calls() if argv[3] == "create")
    assert create == ["compute", "tpus", "queued-resources", "create", "my-tpu", "--node-id=my-tpu", *WHERE,
                      "--accelerator-type=v5p-16", "--runtime-version=v2-alpha-tpuv5", "--spot"]
    first, second = attempts()
    assert first["state_after"] == "SUSPENDED" and first["actions"] == ["create"]
    assert second["actions"] == ["delete", "create"] and second["outcome"] == "done"


def test_force_and_a_missing_run_are_usage_errors(gcloud):
    gcloud.play()
    assert tpu_run(args=("run", "all", "--config", "x.yaml", "--force")).exit_code == 2
    result = tpu_run(args=("status", "--config", "x.yaml"))
    assert result.exit_code == 2 and "expected `-- run STEP --config FILE ...`" in last_line(result)
    assert gcloud.calls() == []


def test_gcloud_missing_from_path_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    result = tpu_run()
    assert result.exit_code == 2
    assert last_line(result).startswith("error: gcloud not found on PATH")


@pytest.mark.slow  # about 70 s on the 2-core development machine: four real pipeline processes
def test_a_real_run_is_preempted_recreated_and_resumed_to_the_same_w_and_b_run(gcloud, make_config, tmp_path,
                                                                                monkeypatch):
    """The fake ssh runs the remote command with bash: a real one-worker `pipeline run all`, preempted
    (SIGTERM, then the TPU is PREEMPTED) once generate has committed a part, resumes on the recreated TPU."""
    import pyarrow.parquet as pq

    pipeline = Path(sys.executable).parent / "pipeline"
    if not pipeline.exists():
        pytest.skip(f"no pipeline console script beside {sys.executable}")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = make_config(engine={"batch_size": 2, "part_rows": 2})
    runs = tmp_path / "runs"
    gcloud.play(hosts=1, node=["READY"], scheduling={"spot": True}, ssh={"0": [
        {"exec": True},
        {"exec": True, "preempt_when": str(runs / "generate-*" / "shard-*" / "part-*.parquet"), "then": "PREEMPTED"},
        {"exec": True}, {"exec": True}]})
    result = tpu_run("--workdir", str(HERE.parent), "--pipeline", str(pipeline),
                     args=("run", "all", "--config", config))
    assert result.exit_code == 0, result.output
    first, second = attempts()
    assert (first["outcome"], first["exit_codes"], first["state_after"]) == ("retry", {"0": 75}, "PREEMPTED")
    assert (second["outcome"], second["actions"]) == ("done", ["delete", "create"])
    [merged] = runs.glob("merge-*/merged-*.parquet")
    table = pq.read_table(merged)
    assert table.num_rows == 24
    assert sorted(zip(table["prompt_index"].to_pylist(), table["sample_index"].to_pylist())) == \
        [(p, s) for p in range(12) for s in range(2)]
    assert "run     partial output from an earlier attempt: resume" in result.output  # the plan's generate line
    [run_file] = runs.glob("upload-*/wandb_run.json")
    run_id = json.loads(run_file.read_text())["run_id"]
    [merge_dir] = runs.glob("merge-*")  # one W&B run per result: the id follows merge's hash (issue 14)
    assert run_id == f"test-{merge_dir.name.split('-', 1)[1]}" and f"offline W&B run {run_id} written to" in result.output
