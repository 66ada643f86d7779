"""The runner's contract on stand-in steps: skip what is complete, --force, --dry-run writes
nothing, the marker is written last, missing upstream names the command that makes it.

The steps here are stubs that write one file each: they isolate the runner. The real steps
run end to end in tests/test_end_to_end.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from typer.testing import CliRunner

from pipeline import storage
import steps
from pipeline.run import runner, status, status_report
from pipeline.run.step import Step, StepResult, in_order
from steps import PIPELINE
from pipeline.cli import app
from pipeline.run.config import load_config

CALLS: list[str] = []
FAIL_IN: set[str] = set()
FAIL_FIRST: set[str] = set()
"""Steps that fail before they write anything (a check of their input that fails)."""


@dataclasses.dataclass(frozen=True)
class StubSummary:
    rows: int = 3
    mode: str | None = None
    """upload's: the wandb.mode it ran with (`steps.upload.redo` reads it)."""


def _stub(name: str):
    def step(cfg, out):
        CALLS.append(name)
        if name in FAIL_FIRST:
            raise RuntimeError(f"{name} broke before writing anything")
        storage.write_text(out.path("data.txt"), f"{name} output")
        if name in FAIL_IN:
            raise RuntimeError(f"{name} broke after writing its data")
        return StepResult(rows=3, files=[{"path": "data.txt"}],
                          summary=StubSummary(mode=cfg.wandb.mode if name == "upload" else None))
    return step


def _finish(cfg, out):
    return StepResult(rows=3, files=[{"path": "data.txt"}], summary=StubSummary())


def _stub_graph() -> tuple[Step, ...]:
    """The real graph's shape (names, inputs, where each runs) with stub functions."""
    stubs: dict[str, Step] = {}
    for step in in_order(PIPELINE):
        stubs[step.name] = dataclasses.replace(step, run=_stub(step.name), finish=_finish if step.finish else None,
                                               inputs=tuple(stubs[s.name] for s in step.inputs))
    return tuple(stubs.values())


GRAPH = _stub_graph()
NAMES = tuple(s.name for s in GRAPH)


@pytest.fixture(autouse=True)
def stub_steps(monkeypatch):
    monkeypatch.setattr(steps, "PIPELINE", GRAPH)  # what the CLI hands the runner
    CALLS.clear()
    FAIL_IN.clear()
    FAIL_FIRST.clear()


def files_under(root) -> dict[str, float]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, fs in os.walk(root) for f in fs}


def test_first_run_runs_all_then_second_run_skips_all(make_config, tmp_path):
    cfg = load_config(make_config())
    runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == list(NAMES)
    assert [p.state for p in runner.make_plan(cfg, GRAPH)] == ["complete"] * 4
    before = files_under(tmp_path / "runs")
    CALLS.clear()
    plan = runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == [] and [p.action for p in plan] == ["skip"] * 4
    assert files_under(tmp_path / "runs") == before


def test_marker_holds_manifest_config_and_versions(make_config):
    cfg = load_config(make_config())
    runner.run_steps(cfg, GRAPH, ("tokenize",), echo=lambda _: None)
    (planned,) = [p for p in runner.make_plan(cfg, GRAPH) if p.name == "tokenize"]
    record = status.read_marker(planned.url)
    assert record.rows == 3 and record.files == [{"path": "data.txt"}] and record.hash == planned.hash
    assert record.config["sampling"]["n"] == 2 and "jax" in record.versions and record.wall_s >= 0
    assert storage.exists(storage.join(planned.url, status.CONFIG_FILE))


def test_failure_after_data_leaves_step_partial_not_complete(make_config):
    cfg = load_config(make_config())
    FAIL_IN.add("generate")
    with pytest.raises(RuntimeError, match="generate broke"):
        runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    states = {p.name: p.state for p in runner.make_plan(cfg, GRAPH)}
    assert states == {"tokenize": "complete", "generate": "partial", "merge": "missing", "upload": "missing"}
    generate = status_report.report(cfg, GRAPH)[1]  # the step's log ends with the error: status tells it
    assert generate["last_error"] == "RuntimeError: generate broke after writing its data"
    assert generate["why"].endswith("; its last run ended: RuntimeError: generate broke after writing its data; "
                                    "the next run resumes it"), generate["why"]
    FAIL_IN.clear()
    CALLS.clear()
    plan = runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == ["generate", "merge", "upload"]
    assert plan[1].reason.startswith("partial output from an earlier attempt")


def test_a_damaged_marker_makes_its_step_partial_and_the_next_run_runs_it_again(make_config):
    """A marker cut short after its step (markers are written whole): status and the plan say so,
    nothing crashes on it, and the next run makes that step again and marks it complete."""
    cfg = load_config(make_config())
    runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    (merge,) = [p for p in runner.make_plan(cfg, GRAPH) if p.name == "merge"]
    marker = storage.join(merge.url, status.MARKER)
    storage.write_bytes(marker, storage.read_bytes(marker)[:40])
    result = CliRunner().invoke(app, ["status", "--config", make_config(), "--json"])
    assert result.exit_code == 0, result.output
    reported = {s["name"]: s for s in json.loads(result.output)["steps"]}
    assert reported["merge"]["state"] == "partial" and reported["upload"]["state"] == "complete"
    assert reported["merge"]["why"].startswith("partial: its _SUCCESS.json cannot be read (JSONDecodeError: ")
    assert reported["merge"]["why"].endswith("): the next run runs it again")
    CALLS.clear()
    plan = runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == ["merge"]
    assert plan[2].reason.startswith("its _SUCCESS.json cannot be read (JSONDecodeError: ")
    assert status.read_marker(merge.url).rows == 3


def test_dry_run_writes_nothing(make_config, tmp_path):
    cfg = load_config(make_config())
    plan = runner.run_steps(cfg, GRAPH, NAMES, dry_run=True, echo=lambda _: None)
    assert [p.action for p in plan] == ["run"] * 4 and CALLS == []
    assert not (tmp_path / "runs").exists()


def test_force_reruns_a_complete_step(make_config):
    cfg = load_config(make_config())
    runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    CALLS.clear()
    runner.run_steps(cfg, GRAPH, ("upload",), force=True, echo=lambda _: None)
    assert CALLS == ["upload"]


@pytest.mark.parametrize("step", ["merge", "generate"])  # on the leader, and on every host
def test_a_forced_step_that_fails_before_touching_its_files_stays_complete_as_it_was(make_config, step):
    """--force takes the marker away first; a run that then failed in a check of its input (a part
    missing for merge, a damaged shard for generate) left a complete step partial, its result gone
    from `show`, though not one of its files had changed. Changed files stay partial (below)."""
    cfg = load_config(make_config())
    runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    (planned,) = [p for p in runner.make_plan(cfg, GRAPH) if p.name == step]
    before = status.read_marker(planned.url)
    FAIL_FIRST.add(step)
    said: list[str] = []
    with pytest.raises(RuntimeError, match="before writing anything"):
        runner.run_steps(cfg, GRAPH, (step,), force=True, echo=said.append)
    assert status.read_marker(planned.url) == before
    assert said[-1] == f"[{step}] failed before it changed any of its files: still complete, as it was (3 rows)"
    assert [p.action for p in runner.make_plan(cfg, GRAPH)] == ["skip"] * 4

    os.remove(os.path.join(planned.url, "data.txt"))  # deleted to be made again (the fix a damaged file's error gives)
    with pytest.raises(RuntimeError, match="before writing anything"):
        runner.run_steps(cfg, GRAPH, (step,), force=True, echo=said.append)
    assert status.output_state(planned.url) == "partial"  # not complete without the file its marker lists
    assert "still complete" not in said[-1]

    FAIL_FIRST.clear()
    FAIL_IN.add(step)  # writes its file again, then fails: not what the marker recorded any more
    with pytest.raises(RuntimeError, match="after writing its data"):
        runner.run_steps(cfg, GRAPH, (step,), force=True, echo=said.append)
    assert status.output_state(planned.url) == "partial"
    assert "still complete" not in said[-1]


def test_an_upload_made_with_wandb_disabled_runs_again_once_wandb_is_on(make_config):
    """wandb.mode is in no hash (online and offline make the same run), but a disabled upload logged
    nothing: with W&B on, the plan runs it again, saying why (it was skipped as complete, and
    nothing reached W&B without --force). A result logged once stays: turning W&B off skips it."""
    config = make_config(wandb={"mode": "disabled"})
    runner.run_steps(load_config(config), GRAPH, NAMES, echo=lambda _: None)
    CALLS.clear()
    offline = load_config(config, ["wandb.mode=offline"])
    planned = {p.name: p for p in runner.make_plan(offline, GRAPH)}
    assert planned["upload"].action == "run" and "wandb.mode disabled (nothing was logged)" in planned["upload"].reason
    (upload,) = [r for r in status_report.report(offline, GRAPH) if r["name"] == "upload"]  # `status` says so too
    assert upload["state"] == "complete" and upload["why"] == (
        "complete, but with wandb.mode disabled (nothing was logged): log it, offline: the next `run all` runs it")
    runner.run_steps(offline, GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == ["upload"]
    CALLS.clear()
    for mode in ("offline", "disabled"):
        runner.run_steps(load_config(config, [f"wandb.mode={mode}"]), GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == []


def test_changing_sampling_reruns_generate_and_after_only(make_config):
    runner.run_steps(load_config(make_config()), GRAPH, NAMES, echo=lambda _: None)
    CALLS.clear()
    runner.run_steps(load_config(make_config(), ["sampling.temperature=0.5"]), GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == ["generate", "merge", "upload"]


def test_a_greedy_run_reruns_nothing_for_sampling_keys_it_never_reads(make_config):
    """seed, top_p, top_k and min_p choose nothing where sampling.temperature is 0: a greedy job
    whose config changes them finds its result; the same edit to a sampled job reruns generate."""
    config, said = make_config(), []  # greedy, n = 2
    runner.run_steps(load_config(config, ["sampling.top_p=0.9"]), GRAPH, NAMES, echo=said.append)
    assert said[1:3] == ["note: sampling.top_p 0.9 is not read: sampling.temperature is 0 (greedy decoding)",
                         "note: sampling.n is 2 with greedy decoding: each prompt's 2 samples get the same tokens"]
    CALLS.clear()
    said.clear()
    unread = ["sampling.seed=3", "sampling.top_p=0.95", "sampling.top_k=40", "sampling.min_p=0.1"]
    runner.run_steps(load_config(config, unread), GRAPH, NAMES, echo=said.append)
    assert CALLS == []
    assert not [line for line in said if line.startswith("note:")]  # nothing to generate: no note
    said.clear()
    runner.run_steps(load_config(config, [*unread, "sampling.max_new_tokens=5"]), GRAPH, ("generate",), echo=said.append)
    assert said[1] == ("note: sampling.seed 3, sampling.top_p 0.95, sampling.top_k 40, sampling.min_p 0.1 are not read: "
                       "sampling.temperature is 0 (greedy decoding)")  # under the plan
    said.clear()
    runner.run_steps(load_config(config, ["sampling.n=1", "sampling.max_new_tokens=6"]), GRAPH, NAMES, echo=said.append)
    assert not [line for line in said if line.startswith("note:")]  # greedy, n = 1, nothing set for sampling
    runner.run_steps(load_config(config, ["sampling.temperature=0.5"]), GRAPH, NAMES, echo=lambda _: None)
    CALLS.clear()
    said.clear()
    runner.run_steps(load_config(config, ["sampling.temperature=0.5", "sampling.seed=3"]), GRAPH, NAMES, echo=said.append)
    assert CALLS == ["generate", "merge", "upload"]
    assert not [line for line in said if line.startswith("note:")]  # a sampled run reads them all


@pytest.mark.parametrize("generate_was", ["complete", "partial"])
def test_a_greedy_result_hashed_by_the_earlier_rule_is_taken(make_config, monkeypatch, generate_was):
    """Until a greedy run hashed its unread keys at their defaults (identity.UNREAD_WHEN_GREEDY),
    they entered its hash as they said: such an output, complete or partial, is the one the plan
    takes, so the new rule generates nothing again."""
    from pipeline.run import identity

    cfg = load_config(make_config(), ["sampling.seed=7", "sampling.top_k=5"])
    with monkeypatch.context() as earlier_rule:
        earlier_rule.setattr(identity, "UNREAD_WHEN_GREEDY", {})
        if generate_was == "partial":
            FAIL_IN.add("generate")
            with pytest.raises(Exception, match="generate broke after writing its data"):
                runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
            FAIL_IN.clear()
        else:
            runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
        earlier = runner.make_plan(cfg, GRAPH)
    after_generate = "missing" if generate_was == "partial" else "complete"
    assert [p.state for p in earlier] == ["complete", generate_was, after_generate, after_generate]
    CALLS.clear()
    plan = runner.make_plan(cfg, GRAPH)
    assert [(p.hash, p.state) for p in plan] == [(p.hash, p.state) for p in earlier]
    assert plan[1].hash != identity.step_hash("generate", plan[1].step.version, identity.semantic_values("generate", cfg),
                                              plan[1].content, {"tokenize": plan[0].hash})
    runner.run_steps(cfg, GRAPH, NAMES, echo=lambda _: None)
    assert CALLS == ([] if generate_was == "complete" else ["generate", "merge", "upload"])
    assert [p.url for p in runner.make_plan(cfg, GRAPH)] == [p.url for p in earlier]


def test_single_step_with_missing_upstream_exits_1_naming_the_command(make_config):
    config = make_config()
    result = CliRunner().invoke(app, ["run", "merge", "--config", config, "--set", "sampling.seed=3"])
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: cannot run merge: needs generate, which is missing")
    assert f"run `pipeline run generate --config {config} --set sampling.seed=3` (or `pipeline run all " in last
    assert CALLS == []


def test_a_step_with_a_new_hash_says_what_changed_since_its_last_output(make_config, tmp_path):
    """A prompt file appended to after tokenize: `run generate` names the file, not just that
    tokenize is missing; a changed sampling value and status say the same of their steps."""
    config = make_config()
    runner.run_steps(load_config(config), GRAPH, NAMES, echo=lambda _: None)
    last_tokenize = runner.make_plan(load_config(config), GRAPH)[0].url.rstrip("/").split("/")[-1]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(prompts.read_text() + '{"id": 99, "prompt": "one more"}\n')
    CALLS.clear()

    result = CliRunner().invoke(app, ["run", "generate", "--config", config])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith(
        f"error: cannot run generate: needs tokenize, which is missing (prompts file {prompts} changed since {last_tokenize}): run ")
    report = status_report.report(load_config(config), GRAPH)
    assert report[0]["why"] == f"missing (prompts file {prompts} changed since {last_tokenize}): the next `run all` runs it"

    runner.run_steps(load_config(config), GRAPH, NAMES, echo=lambda _: None)
    plan = runner.make_plan(load_config(config, ["sampling.seed=3", "sampling.temperature=0.5"]), GRAPH, ("generate",))
    last_generate = runner.make_plan(load_config(config), GRAPH)[1].url.rstrip("/").split("/")[-1]
    assert plan[1].reason == (f"no output for this hash (sampling.temperature changed from 0.0 to 0.5; sampling.seed changed "
                              f"from 0 to 3 since {last_generate}): run")
    assert CALLS == list(NAMES)


def test_a_step_never_run_under_the_root_gives_no_since(make_config):
    plan = runner.make_plan(load_config(make_config()), GRAPH)
    assert [p.since for p in plan] == [None] * 4
    assert plan[0].reason == "no output for this hash: run"


def test_status_json_lists_four_steps(make_config):
    config = make_config()
    CliRunner().invoke(app, ["run", "all", "--config", config], catch_exceptions=False)
    result = CliRunner().invoke(app, ["status", "--config", config, "--json"])
    assert result.exit_code == 0
    steps = json.loads(result.output)["steps"]
    assert [s["name"] for s in steps] == list(NAMES)
    assert all(s["state"] == "complete" and s["rows"] == 3 and len(s["hash"]) == 64 for s in steps)
    assert all(s["output"].endswith(f"{s['name']}-{s['hash'][:12]}") for s in steps)
