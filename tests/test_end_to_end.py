"""The whole pipeline through the CLI on a temp folder, as a user runs it.

First run completes all four steps; the second skips every step and touches no file;
--dry-run writes nothing; changing a sampling value reruns generate and everything after it,
and nothing before.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import time

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.cli import app

COLUMNS = ["prompt_index", "prompt_id", "sample_index", "prompt", "completion", "completion_token_ids",
           "num_prompt_tokens", "num_completion_tokens", "finish_reason"]


@pytest.fixture(autouse=True)
def hermetic_wandb(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def invoke(*args: str):
    from pipeline.pod import preemption

    preemption.reset()
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def snapshot(root) -> dict[str, int]:
    """Every output file and its mtime; the runner's own `.leases` bookkeeping is left out."""
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(root) for f in fs
            if ".leases" not in d}


def status(config: str) -> dict[str, dict]:
    result = invoke("status", "--config", config, "--json")
    assert result.exit_code == 0, result.output
    return {s["name"]: s for s in json.loads(result.output)["steps"]}


def test_first_run_then_skip_then_dry_run_then_sampling_change(make_config, tmp_path):
    config = make_config(sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "n": 2, "max_new_tokens": 6})
    runs = tmp_path / "runs"

    first = invoke("run", "all", "--config", config)
    assert first.exit_code == 0, first.output
    # Quiet by default (issue 14): the plan, a summary line per step, where the result is; no config dump.
    lines = first.output.strip().splitlines()
    assert "resolved config" not in first.output and "batch_size:" not in first.output
    assert lines[0] == f"plan (1 host, run root {runs}):"
    assert [line.split()[0] for line in lines[1:5]] == ["tokenize", "generate", "merge", "upload"]
    assert [line.split(":")[0] for line in lines if line.endswith(")") and "] complete: " in line] == [
        "[tokenize] complete", "[generate] complete", "[merge] complete", "[upload] complete"]
    assert not any(line.startswith("wandb:") for line in lines)  # no W&B banner or run history
    steps = status(config)
    assert lines[-1] == f"result: {steps['merge']['output']}/merged-00000.parquet (24 rows in 1 file)"
    for step in steps.values():  # each step's log of this host, as the terminal showed it
        log = open(os.path.join(step["output"], "logs", "host-00000.log")).read()
        assert log and "\r" not in log
    assert "24/24 samples" in open(os.path.join(steps["generate"]["output"], "logs", "host-00000.log")).read()
    # A forced generate with every row made prints nothing: its attempt is in the log all the same.
    assert invoke("run", "generate", "--force", "--config", config).exit_code == 0
    log = open(os.path.join(steps["generate"]["output"], "logs", "host-00000.log")).read()
    assert log.count(" began on host 0 ") == 2 and log.count(": ended after ") == 2, log
    assert [s["state"] for s in steps.values()] == ["complete"] * 4
    assert steps["tokenize"]["rows"] == 12 and steps["merge"]["rows"] == 24
    assert not list((runs / ".leases").glob("*.json")), "every lease is released at the end"

    merged = pq.read_table([p for p in snapshot(runs) if "/merge-" in p and p.endswith(".parquet")][0])
    assert merged.column_names == COLUMNS and merged.num_rows == 24
    keys = list(zip(merged["prompt_index"].to_pylist(), merged["sample_index"].to_pylist()))
    assert keys == [(p, s) for p in range(12) for s in range(2)]
    assert merged["prompt_id"].to_pylist()[:2] == ["p0", "p0"]
    assert all(n == len(ids) for n, ids in zip(merged["num_completion_tokens"].to_pylist(),
                                                merged["completion_token_ids"].to_pylist()))

    text = invoke("status", "--config", config).output.splitlines()
    merge_url = steps["merge"]["output"]
    assert text[-1] == f"result: {merge_url}/merged-00000.parquet (24 rows in 1 file)"
    shown = invoke("show", "--config", config, "-n", "3")
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines()[0] == f"{merge_url}/merged-00000.parquet (24 rows in 1 file)"
    assert "(p0, 0)" in shown.output and "(p0, 1)" in shown.output and "(p1, 0)" in shown.output
    assert "(p1, 1)" not in shown.output and "3 of 24 rows" in shown.output

    before = snapshot(runs)
    second = invoke("run", "all", "--config", config)
    assert second.exit_code == 0 and second.output.count("skip") >= 4
    assert snapshot(runs) == before

    dry = invoke("run", "all", "--config", config, "--set", "sampling.temperature=0.3", "--dry-run", "--verbose")
    assert dry.exit_code == 0 and "generate" in dry.output
    assert "resolved config:" in dry.output and "  temperature: 0.3" in dry.output  # --verbose shows it
    assert snapshot(runs) == before

    # Another temperature, and each token's log-probability and its 2 likeliest alternatives asked
    # for: a new result, three more columns.
    changes = ("--set", "sampling.temperature=0.3", "--set", "sampling.logprobs=true", "--set", "sampling.top_logprobs=2")
    changed = invoke("run", "all", "--config", config, *changes)
    assert changed.exit_code == 0, changed.output
    after = snapshot(runs)
    assert {p: t for p, t in after.items() if "/tokenize-" in p} == {p: t for p, t in before.items() if "/tokenize-" in p}
    new_dirs = {os.path.relpath(p, runs).split(os.sep)[0] for p in set(after) - set(before)}
    assert sorted(d.split("-")[0] for d in new_dirs) == ["generate", "merge", "upload"]
    # Two results under one run root now: status names the one of this config (issue 14).
    result = json.loads(invoke("status", "--config", config, *changes, "--json").output)["result"]
    assert result["rows"] == 24 and len(result["files"]) == 1 and merge_url not in result["files"][0]
    assert os.path.relpath(result["files"][0], runs).split(os.sep)[0] in new_dirs
    merged = pq.read_table(result["files"][0])
    assert merged.column_names == COLUMNS + ["completion_logprobs", "completion_top_token_ids", "completion_top_logprobs"]
    ids, logprobs = merged["completion_token_ids"].to_pylist(), merged["completion_logprobs"].to_pylist()
    assert [len(x) for x in logprobs] == [len(x) for x in ids] and all(v < 0 for x in logprobs for v in x)
    top_ids, top_logprobs = merged["completion_top_token_ids"].to_pylist(), merged["completion_top_logprobs"].to_pylist()
    assert [len(x) for x in top_ids] == [len(x) for x in top_logprobs] == [len(x) for x in ids]
    chosen_in_top = 0
    for row in zip(ids, logprobs, top_ids, top_logprobs):
        for token, logprob, alternatives, scores in zip(*row):  # the likeliest first; the chosen token scores no higher
            assert len(alternatives) == len(set(alternatives)) == 2 and scores[0] >= scores[1] and logprob <= scores[0] + 1e-6
            if token in alternatives:
                chosen_in_top += 1
                assert logprob == pytest.approx(scores[alternatives.index(token)], abs=1e-6)
    assert chosen_in_top > 0
    upload = next(os.path.join(runs, d) for d in new_dirs if d.startswith("upload-"))
    (table,) = glob.glob(f"{upload}/wandb/offline-run-*/files/media/table/generations_*.table.json")
    # The log-probabilities to 4 decimals, and each row's sum and mean to sort by; the alternatives
    # are in the artifact's Parquet files only.
    table = json.load(open(table))
    assert table["columns"] == [*COLUMNS, "completion_logprobs", "completion_logprob_sum", "completion_logprob_mean"]
    assert [json.loads(row[-3]) for row in table["data"]] == [pytest.approx(x, abs=5e-5) for x in logprobs]
    assert [row[-2:] for row in table["data"]] == [pytest.approx([sum(x), sum(x) / len(x)]) for x in logprobs]
    shown = invoke("show", "--config", config, *changes, "-n", "2").output  # the mean per token, a column of its own
    assert "logprob / token" in shown and f"{sum(logprobs[0]) / len(logprobs[0]):.3f}" in shown


def test_prompt_logprobs_score_each_prompt_token_in_the_result_and_the_table(make_config, tmp_path, demo_model,
                                                                              read_wandb_run):
    """`sampling.prompt_logprobs`: two more columns, the prompt's token ids and each one's
    log-probability given those before it (null for the first; transformers' teacher-forced
    log-softmax of the same checkpoint), the same for each sample of a prompt, after
    `completion_logprobs`; the W&B table sums and averages them, and the run's summary holds the
    prompt set's and the completions' mean log-probability per token and perplexity."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.engine_testlib import hf_logprobs

    config = make_config(sampling={"n": 2, "max_new_tokens": 3, "logprobs": True, "prompt_logprobs": True})
    assert invoke("run", "all", "--config", config).exit_code == 0
    merged = pq.read_table(glob.glob(str(tmp_path / "runs" / "merge-*" / "merged-00000.parquet"))[0])
    assert merged.column_names == COLUMNS + ["completion_logprobs", "prompt_token_ids", "prompt_logprobs"]
    rows = merged.to_pylist()
    assert len(rows) == 24
    hf = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    for i, row in enumerate(rows):  # ordered by (prompt, sample): a second sample follows its first
        ids, scores = row["prompt_token_ids"], row["prompt_logprobs"]
        assert len(ids) == len(scores) == row["num_prompt_tokens"] > 2 and scores[0] is None
        if row["sample_index"] == 0:
            assert scores[1:] == pytest.approx(hf_logprobs(hf, ids).tolist(), abs=1e-4)
        else:
            assert (ids, scores) == (rows[i - 1]["prompt_token_ids"], rows[i - 1]["prompt_logprobs"])

    (table,) = glob.glob(str(tmp_path / "runs" / "upload-*" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "generations_*.table.json"))
    table = json.load(open(table))
    assert table["columns"] == [*merged.column_names, "completion_logprob_sum", "completion_logprob_mean",
                                "prompt_logprob_sum", "prompt_logprob_mean"]
    for row, shown in zip(rows, table["data"]):
        scores = row["prompt_logprobs"][1:]
        text = json.loads(shown[-5])
        assert text[0] is None and text[1:] == pytest.approx(scores, abs=5e-5)
        assert shown[-2:] == pytest.approx([sum(scores), sum(scores) / len(scores)])
    prompt_scores = [x for row in rows if row["sample_index"] == 0 for x in row["prompt_logprobs"][1:]]
    completion_scores = [x for row in rows for x in row["completion_logprobs"]]
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "upload-*" / "wandb" / "offline-run-*"))
    logged = read_wandb_run(run_dir)["summary"]
    for name, scores in (("prompt", prompt_scores), ("completion", completion_scores)):
        mean = sum(scores) / len(scores)
        assert logged[f"merge/{name}_logprob_mean"] == pytest.approx(mean, rel=1e-6), name
        assert logged[f"merge/{name}_perplexity"] == pytest.approx(math.exp(-mean), rel=1e-6), name
    shown = invoke("show", "--config", config, "-n", "1").output  # each mean per token, a column of its own
    scores = rows[0]["prompt_logprobs"][1:]
    assert "prompt logprob / token" in shown and f"{sum(scores) / len(scores):.3f}" in shown


def test_a_damaged_file_names_itself_and_the_command_that_makes_it_again(make_config, tmp_path):
    """A shard, a part, a host's metrics or a merged file damaged after its step (cut short): the step
    that reads it exits 1 naming the file and what makes it again, and doing just that gives the
    same result back."""
    config = make_config(sampling={"n": 2, "max_new_tokens": 4})
    assert invoke("run", "all", "--config", config).exit_code == 0
    steps = status(config)
    merged = os.path.join(steps["merge"]["output"], "merged-00000.parquet")
    rows = pq.read_table(merged).to_pylist()

    def damage(path: str) -> None:
        with open(path, "r+b") as f:
            f.truncate(100)

    def flip(path: str) -> None:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))

    def fails(*args: str, untouched: bool = True) -> str:
        """The error line. A --force that failed before it changed a file leaves its step complete, as
        it was; one that wrote first (generate's new metrics), or after a file the marker lists was
        deleted, leaves it partial."""
        before = status(config)
        result = invoke(*args, "--config", config)
        assert result.exit_code == 1, result.output
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        if "--force" in args:
            step, kept = args[1], (f"[{args[1]}] failed before it changed any of its files: still "
                                   f"complete, as it was ({before[args[1]]['rows']} rows)")
            assert status(config)[step] == before[step] if untouched else status(config)[step]["state"] == "partial"
            assert (kept in result.stderr) == untouched
        return line

    part = sorted(glob.glob(os.path.join(steps["generate"]["output"], "shard-*", "part-*.parquet")))[0]
    fix = (f"delete it, then run `pipeline run generate --config {config} --force`: it makes that part's rows "
           "again and keeps the other parts")  # the command as typed: --config FILE is the user's own
    flip(part)  # one bit of a data page: the part still parses, as other token ids
    assert fails("run", "merge", "--force") == (f"error: generate part {part} is not the file generate wrote (other "
                                                f"bytes than its marker records: it was changed since): {fix}")
    damage(part)
    assert fails("run", "merge", "--force") == (f"error: generate part {part} is not the file generate wrote (another "
                                                f"size than its marker records: it was changed since): {fix}")
    line = fails("run", "generate", "--force")  # generate reads it to resume
    assert line.startswith(f"error: generate part {part} cannot be read (") and line.endswith(fix)
    os.remove(part)
    assert invoke("run", "generate", "--force", "--config", config).exit_code == 0
    assert invoke("run", "merge", "--force", "--config", config).exit_code == 0
    assert pq.read_table(merged).to_pylist() == rows

    shard = os.path.join(steps["tokenize"]["output"], "shard-00001.parquet")
    kept = open(shard, "rb").read()
    flip(shard)
    os.remove(sorted(glob.glob(os.path.join(steps["generate"]["output"], "shard-00001", "part-*.parquet")))[0])
    assert fails("run", "generate", "--force", untouched=False) == (  # its rows are wanted again: read from the shard
        f"error: tokenize shard {shard} is not the file tokenize wrote (its sha256 is not the one tokenize's marker "
        f"records: it was changed since): rerun `pipeline run tokenize --config {config} --force` to write the shards "
        "again (the same rows: the steps after it keep their work)")
    with open(shard, "wb") as f:
        f.write(kept)
    assert invoke("run", "generate", "--config", config).exit_code == 0  # partial (a part gone): its rows made again
    damage(shard)
    for command in (("run", "merge", "--force"), ("run", "generate", "--force")):
        line = fails(*command)
        assert line.startswith(f"error: tokenize shard {shard} cannot be read (")
        assert f"rerun `pipeline run tokenize --config {config} --force` to write the shards again" in line
    assert invoke("run", "tokenize", "--force", "--config", config).exit_code == 0
    assert invoke("run", "all", "--config", config).exit_code == 0  # generate resumes: nothing left to make
    assert pq.read_table(merged).to_pylist() == rows

    metrics = sorted(glob.glob(os.path.join(steps["generate"]["output"], "metrics", "host-*.json")))[0]
    damage(metrics)
    line = fails("run", "generate", "--force", untouched=False)
    assert line.startswith(f"error: generate metrics {metrics} cannot be read (")
    assert line.endswith(f"delete it (it holds only a host's figures), then run `pipeline run generate --config {config}`")
    os.remove(metrics)
    assert invoke("run", "generate", "--config", config).exit_code == 0

    damage(merged)
    for command in (("run", "upload", "--force"), ("show",)):
        line = fails(*command)
        assert line.startswith(f"error: merged file {merged} cannot be read (")
        assert f"rerun `pipeline run merge --config {config} --force` to write" in line
    assert invoke("run", "merge", "--force", "--config", config).exit_code == 0
    assert invoke("run", "upload", "--force", "--config", config).exit_code == 0
    assert pq.read_table(merged).to_pylist() == rows


def test_the_error_line_is_one_line_naming_the_users_own_config_and_overrides(make_config, monkeypatch):
    """A library's error text can hold newlines (Arrow's page errors do), and a step's fix names
    `--config FILE`: the last line still starts `error:` and holds the whole message, and the
    command it names is this one's config with its --set, which make the same result."""
    from pipeline.errors import StepFailed
    from pipeline.run import result

    def damaged(*args, **kwargs):
        raise StepFailed("merged file m.parquet cannot be read (Couldn't deserialize thrift.\nDeserializing page header "
                         "failed.\n): rerun `pipeline run merge --config FILE --force` to write the merged files again")

    monkeypatch.setattr(result, "show_text", damaged)
    config = make_config()
    got = invoke("show", "--config", config, "--set", "sampling.seed=3")
    assert got.exit_code == 1
    assert got.stderr.splitlines()[-1] == (
        "error: merged file m.parquet cannot be read (Couldn't deserialize thrift. Deserializing page header failed. ): "
        f"rerun `pipeline run merge --config {config} --set sampling.seed=3 --force` to write the merged files again")


def test_a_merged_file_deleted_by_hand_is_not_named_as_the_result_and_the_next_run_writes_it_again(make_config):
    config = make_config(sampling={"n": 2, "max_new_tokens": 4})
    assert invoke("run", "all", "--config", config).exit_code == 0
    steps = status(config)
    merged = os.path.join(steps["merge"]["output"], "merged-00000.parquet")
    rows = pq.read_table(merged).to_pylist()
    os.remove(merged)

    shown = invoke("status", "--config", config, "--json")
    assert json.loads(shown.output)["result"] is None  # it named the missing file, for scripts to fail on later
    assert invoke("status", "--config", config).output.strip().splitlines()[-1] == (
        "result: none now (a merged file is gone: the next `run all` writes it again)")  # not "merge is not complete"
    assert status(config)["merge"]["why"] == ("complete, but its file merged-00000.parquet is gone: write the merged "
                                              "files again: the next `run all` runs it")
    again = invoke("run", "all", "--config", config)
    assert again.exit_code == 0
    assert "merge     " in again.output and "[merge] complete: " in again.output and "[upload] complete" not in again.output
    assert again.output.strip().splitlines()[-1] == f"result: {merged} ({len(rows)} rows in 1 file)"
    assert pq.read_table(merged).to_pylist() == rows


def test_a_stop_in_a_forced_merge_before_it_writes_leaves_the_result_as_it_was(make_config, stop_when_called):
    """Ctrl-C while `run merge --force` checked the parts (before it wrote a file): merge had
    removed the merged files first, so the result was gone and merge partial."""
    from steps import merge

    config = make_config(sampling={"n": 2, "max_new_tokens": 4})
    assert invoke("run", "all", "--config", config).exit_code == 0
    before = status(config)
    merged = os.path.join(before["merge"]["output"], "merged-00000.parquet")
    written = os.stat(merged).st_mtime_ns
    stop_when_called(merge, "_check_duplicates")  # a Ctrl-C while it checks the parts
    result = invoke("run", "merge", "--force", "--config", config)
    assert result.exit_code == 75, result.output
    assert (f"[merge] failed before it changed any of its files: still complete, as it was "
            f"({before['merge']['rows']} rows)") in result.stderr
    assert status(config)["merge"] == before["merge"] and os.stat(merged).st_mtime_ns == written
    assert invoke("show", "--config", config).exit_code == 0  # the result is still there to read


def test_a_stop_as_the_last_step_finishes_is_said_and_the_complete_job_exits_0(make_config, stop_when_called):
    """A Ctrl-C during upload's W&B calls (past its last place to stop) went unsaid: the command
    printed its result and exited 0 as if no signal had come."""
    from steps import upload

    config = make_config(sampling={"n": 2, "max_new_tokens": 4})
    assert invoke("run", "all", "--config", config).exit_code == 0
    stop_when_called(upload, "_attach_logs")  # past upload's last place to stop
    result = invoke("run", "upload", "--force", "--config", config)
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-2] == "SIGINT came as the last step was finishing: every step is complete, nothing was stopped"
    assert lines[-1].startswith("result: ") and status(config)["upload"]["state"] == "complete"


def test_a_stop_signal_after_the_result_line_leaves_the_exit_code_as_it_was(make_config, start_pipeline):
    """A scheduler's SIGTERM that lands while a finished command shuts down (Python puts the
    default handlers back there) ended it by the signal, exit 143, after it had printed its
    `result:` line: a completed job counted as failed. Signals from then on are ignored."""
    config = make_config(sampling={"max_new_tokens": 2})
    assert invoke("run", "all", "--config", config).exit_code == 0
    for delay in (0.01, 0.02, 0.04):  # the shutdown's window with JAX loaded: tens of ms here
        process = start_pipeline("run", "all", "--config", config)
        assert process.wait_for("result: ")
        time.sleep(delay)
        process.send_signal(signal.SIGTERM)
        assert process.finish() == 0, (delay, process.output[-2000:])


@pytest.mark.parametrize("named_before", [False, True])
def test_prompts_cut_into_other_shards_keep_the_rows_already_made(make_config, tmp_path, monkeypatch, stop_when_called,
                                                                   named_before):
    """generate stopped, then tokenize rerun (`--force`) into another number of shards under the
    same hash, as `run all --force` on a pod of another size does: generate read only the parts of
    its new shards' folders, so it made most rows again (duplicates merge dropped) and counted the
    folders' old rows as its rows (1,136 rows and 301 prompts for 600 and 300). named_before: the
    parts were named before they said how many shards they were made from."""
    from pipeline import storage
    from tests.conftest import generated_rows

    def config(name: str, root: str) -> str:
        return make_config(name, run={"root": str(tmp_path / root)}, prompts={"num_shards": 2},
                           engine={"batch_size": 4, "part_rows": 4})

    clean = config("clean.yaml", "clean")
    assert invoke("run", "all", "--config", clean).exit_code == 0
    config = config("config.yaml", "runs")
    assert invoke("run", "tokenize", "--config", config).exit_code == 0
    stop_when_called(storage, "write_parquet")  # a Ctrl-C as generate commits its first part
    assert invoke("run", "generate", "--config", config).exit_code == 75
    monkeypatch.undo()
    committed = generated_rows(tmp_path / "runs")
    if named_before:
        parts = glob.glob(f"{tmp_path}/runs/generate-*/shard-*/part-*rows-of2.parquet")
        assert parts
        for part in parts:  # part-<time>-<rand>.parquet, as parts were named before they said their rows and cut
            os.rename(part, re.sub(r"-\d+rows-of2\.parquet$", ".parquet", part))
    assert 0 < len(committed) < 24
    assert invoke("run", "tokenize", "--force", "--config", config, "--set", "prompts.num_shards=3").exit_code == 0
    result = invoke("run", "all", "--config", config, "--set", "prompts.num_shards=3")
    assert result.exit_code == 0, result.output
    assert f": 24/24 samples ({len(committed)} resumed), " in result.stderr
    assert len(generated_rows(tmp_path / "runs")) == 24  # and none twice
    steps = status(config)
    summary = json.load(open(os.path.join(steps["generate"]["output"], "_SUCCESS.json")))["summary"]
    assert (summary["rows"], summary["prompts"]) == (24, 12)
    merged = json.load(open(os.path.join(steps["merge"]["output"], "_SUCCESS.json")))["summary"]
    assert merged["duplicates_dropped"] == 0
    (expected,) = glob.glob(f"{tmp_path}/clean/merge-*/merged-00000.parquet")
    assert (pq.read_table(os.path.join(steps["merge"]["output"], "merged-00000.parquet")).to_pylist()
            == pq.read_table(expected).to_pylist())


def test_a_finished_result_stays_reachable_after_its_prompts_and_model_are_deleted(make_config, tmp_path, demo_model):
    """Prompt files and a checkpoint cleaned up after a finished run gave every step another hash:
    `status` said `result: none yet`, `show` exited 1 and `run upload` (the README's fix for W&B
    being unreachable) could not run. The output made from them, when they were there under the
    same path, now stands in; a step that must read them still says they are gone."""
    import shutil

    from tests.conftest import write_prompts

    model = shutil.copytree(demo_model, tmp_path / "model")
    config = make_config(model={"path": str(model)})
    prompts = tmp_path / "prompts.jsonl"
    assert invoke("run", "all", "--config", config).exit_code == 0
    before = status(config)
    prompts.unlink()
    shutil.rmtree(model)

    after = status(config)
    assert {name: (s["hash"], s["state"]) for name, s in after.items()} == {
        name: (s["hash"], "complete") for name, s in before.items()}
    text = invoke("status", "--config", config).output
    assert (f"made from prompts.path {prompts}, which matches no files and the tokenizer files of model.path {model}, "
            f"which holds none now") in text  # tokenize's
    assert f"made from model.path {model}, which holds no files now" in text  # generate's
    assert "result: " + os.path.join(before["merge"]["output"], "merged-00000.parquet") in text
    assert invoke("show", "--config", config).exit_code == 0
    result = invoke("run", "upload", "--force", "--config", config)
    assert result.exit_code == 0, result.output
    assert "[upload] complete: 24 rows" in result.stderr

    # Only by the same path: a typo in model.path is not taken for the model that was deleted.
    typo = invoke("status", "--config", config, "--set", f"model.path={model}-typo", "--json")
    assert [s["state"] for s in json.loads(typo.output)["steps"]] == ["missing"] * 4
    forced = invoke("run", "tokenize", "--force", "--config", config)
    assert forced.exit_code == 2 and f"error: prompts.path {prompts} matched no files" in forced.stderr

    # Two outputs made from other files at that path: which one the config means is unknown.
    shutil.copytree(demo_model, model)
    write_prompts(prompts, ["Another prompt."])
    assert invoke("run", "tokenize", "--config", config).exit_code == 0
    prompts.unlink()
    assert status(config)["tokenize"]["state"] == "missing"


def test_an_upload_of_the_same_w_and_b_run_since_makes_a_switch_back_log_again(make_config):
    """`wandb.table_max_rows` 5, then back to the default: the same result's W&B run had the 5-row
    table logged last, yet the default's upload was complete and skipped, so the run's latest table
    and artifact stayed the other config's."""
    config = make_config()
    assert invoke("run", "all", "--config", config).exit_code == 0
    assert invoke("run", "upload", "--config", config, "--set", "wandb.table_max_rows=5").exit_code == 0
    steps = status(config)
    assert steps["upload"]["state"] == "complete" and "logged to the same W&B run" in steps["upload"]["why"]
    again = invoke("run", "all", "--config", config)
    assert again.exit_code == 0
    assert "[upload] complete: 24 rows" in again.stderr and "table_rows=24" in again.stderr
    assert "[upload]" not in invoke("run", "all", "--config", config).stderr  # now the last: skipped
