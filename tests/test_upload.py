"""The upload step (issue 7): W&B for real in offline mode, read back from the run's own files."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.errors import StepFailed
from pipeline.run import status
from steps.generate import SCHEMA

pytestmark = pytest.mark.usefixtures("wandb_env")


@pytest.fixture
def merged_run(fake_run):
    """make(**wandb) -> a FakeRun whose merge is complete (3 files of at most 7 of its 20 rows)."""

    def make(root: str | None = None, **wandb):
        run = fake_run(prompts=10, n=2, root=root, **wandb)
        run.run("merge", file_rows=7)
        return run

    return make


def merged_rows(run) -> list[dict]:
    files = storage.list_files(run.url["merge"], suffix=".parquet")
    return pa.concat_tables([storage.read_parquet(f) for f in files]).to_pylist()


def generations(recorded: dict) -> dict:
    (artifact,) = [a for a in recorded["artifacts"] if a["type"] == "generations"]
    return artifact


def table_rows(artifact: dict) -> list[dict]:
    """The `generations` table's rows; token ids are JSON text there (the Parquet files hold lists)."""
    table = json.loads(open(artifact["entries"]["generations.table.json"]["local_path"]).read())
    assert table["columns"] == SCHEMA.names
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    return [{**r, "completion_token_ids": json.loads(r["completion_token_ids"])} for r in rows]


def offline_dirs(run) -> list[str]:
    return glob.glob(os.path.join(run.url["upload"], "wandb", "offline-run-*"))


def test_offline_run_holds_config_metrics_charts_and_the_artifact(merged_run, capsys, read_wandb_run):
    run = merged_run()
    result = run.run("upload")
    summary = result.summary
    assert summary.mode == "offline" and result.rows == 20
    assert [f["path"] for f in result.files] == ["wandb_run.json"]
    assert offline_dirs(run) == [summary.offline_run_dir]
    assert f"wandb sync {summary.offline_run_dir}" in capsys.readouterr().err

    recorded = read_wandb_run(summary.offline_run_dir)
    assert recorded["run_id"] == summary.run_id
    config = recorded["config"]
    assert {k: config[k] for k in run.cfg.to_dict()} == run.cfg.to_dict()
    assert config["pipeline"]["versions"]["wandb"] and config["pipeline"]["versions"]["pyarrow"]
    assert len(config["pipeline"]["git"]["commit"]) == 40
    assert config["pipeline"]["steps"]["merge"] == run.HASHES["merge"]

    logged = recorded["summary"]
    assert logged["rows"] == 20 and logged["table_rows"] == 20 and logged["table_truncated"] is False
    assert logged["generate/tokens_per_s"] == 300 and logged["generate/prompts"] == 10
    assert logged["generate/wall_s"] == 3 and logged["generate/compile_s"] == 0.5
    per_host = [(h["host"], h["host/tokens_per_s"]) for h in recorded["history"] if "host/tokens_per_s" in h]
    assert per_host == [(0, 100), (1, 200)]
    assert logged["completion_tokens"]["_type"] == "histogram"  # every fake completion is 3 tokens long
    histogram = logged["completion_tokens"]
    assert histogram["bins"] == [0, 1, 2, 3, 4] and histogram["values"] == [0, 0, 0, 20]
    bars = config["_wandb"]["visualize"]
    assert {bars[k]["panel_config"]["panelDefId"] for k in ("finish_reasons", "tokens_per_s_per_host")} == {
        "wandb/bar/v0"}

    artifact = generations(recorded)
    assert artifact["name"] == summary.artifact == f"generations-{summary.run_id}"
    assert sorted(artifact["entries"]) == ["generations.table.json"] + [f"merged-{i:05d}.parquet" for i in range(3)]
    assert artifact["digest"] == summary.artifact_digest
    assert table_rows(artifact) == merged_rows(run)


def test_a_resumed_generates_runs_of_one_host_are_logged_as_that_host(merged_run, read_wandb_run):
    """generate's marker holds one entry per host and run; W&B got one bar and one history point per
    entry ("host 0" three times) and the last run's figures as the host's."""
    run = merged_run()
    record = status.read_marker(run.url["generate"])
    runs = [{"host": 0, "prompts": 6, "samples": 12, "generated_tokens": 1200, "wall_s": 2.0, "tokens_per_s": 600.0},
            {"host": 1, "prompts": 5, "samples": 10, "generated_tokens": 800, "wall_s": 1.0, "tokens_per_s": 800.0},
            {"host": 0, "prompts": 2, "samples": 4, "generated_tokens": 600, "wall_s": 1.0, "tokens_per_s": 600.0}]
    status.write_marker(run.url["generate"], dataclasses.replace(record, summary={**record.summary, "hosts": runs}))
    recorded = read_wandb_run(run.run("upload").summary.offline_run_dir)
    per_host = [(h["host"], h["host/samples"], h["host/tokens_per_s"]) for h in recorded["history"] if "host/samples" in h]
    assert per_host == [(0, 16, 600.0), (1, 10, 800.0)]
    assert recorded["summary"]["generate/hosts/host-0/samples"] == 16 and recorded["summary"]["generate/hosts/host-0/runs"] == 2


def test_rerun_with_force_resumes_the_same_run_with_the_same_artifact(merged_run, read_wandb_run):
    run = merged_run()
    first = run.run("upload")
    second = run.run("upload")  # what `pipeline run upload --force` does after the runner drops the marker
    assert second.summary.run_id == first.summary.run_id
    assert offline_dirs(run) == [second.summary.offline_run_dir]  # one offline folder per run id
    assert second.summary.artifact_digest == first.summary.artifact_digest  # W&B makes no new version
    assert read_wandb_run(second.summary.offline_run_dir)["run_id"] == first.summary.run_id


def test_deleting_the_upload_output_and_rerunning_resumes_the_same_run(merged_run):
    run = merged_run()
    first = run.run("upload")
    shutil.rmtree(run.url["upload"])
    second = run.run("upload")
    assert second.summary.run_id == first.summary.run_id
    assert second.summary.run_id.startswith("test-run-")  # run.name as a slug, then merge's hash
    saved = storage.read_json(storage.join(run.url["upload"], "wandb_run.json"))
    assert saved["run_id"] == first.summary.run_id


def test_a_damaged_run_record_resumes_the_same_run_and_is_written_again(merged_run):
    run = merged_run()
    first = run.run("upload")
    record = storage.join(run.url["upload"], "wandb_run.json")
    storage.write_bytes(record, storage.read_bytes(record)[:10])
    second = run.run("upload")
    assert second.summary.run_id == first.summary.run_id
    assert storage.read_json(record)["run_id"] == first.summary.run_id


@pytest.mark.parametrize("heard", ["reading", "logging"])
def test_a_stop_during_upload_is_heard_and_the_rerun_resumes_the_same_run(merged_run, read_wandb_run, monkeypatch,
                                                                          stop_when_called, heard):
    """A Ctrl-C during upload was never looked at: the upload ran to its end and exited 0. Now it is
    heard once the merged files are read (before W&B starts) or before the artifact is logged (the
    W&B run ended as interrupted); the rerun resumes the same W&B run and logs the artifact once."""
    from pipeline.errors import Interrupted
    from pipeline.pod import preemption
    from steps import upload

    run = merged_run()
    first = run.run("upload")  # what `--force` reruns
    stop_when_called(upload, "_table_data" if heard == "reading" else "_log_metrics")
    preemption.reset()
    try:
        with pytest.raises(Interrupted, match="stopped by SIGINT"):
            run.run("upload")
    finally:
        preemption.reset()
    if heard == "reading":  # nothing changed yet: the complete run's offline folder is still there
        assert offline_dirs(run) == [first.summary.offline_run_dir]
    else:
        assert len(offline_dirs(run)) == 1
    monkeypatch.undo()
    again = run.run("upload")
    assert offline_dirs(run) == [again.summary.offline_run_dir]  # the interrupted run's folder made again
    recorded = read_wandb_run(again.summary.offline_run_dir)
    assert recorded["run_id"] == again.summary.run_id and generations(recorded)["metadata"]["rows"] == 20


def test_table_is_capped_at_table_max_rows_and_parquet_keeps_every_row(merged_run, read_wandb_run, capsys):
    run = merged_run(table_max_rows=5)
    result = run.run("upload")
    assert result.rows == 20 and result.summary.table_rows == 5 and result.summary.table_truncated is True
    # Said before W&B's work, which prints nothing of its own (a large result's took minutes, silent):
    (said,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("upload: logging")]
    assert said.startswith("upload: logging 20 rows (3 merged files, ") and said.endswith(
        f" KiB, and a table of 5 rows) to the offline W&B run {result.summary.run_id} of project {run.cfg.wandb.project}")
    recorded = read_wandb_run(result.summary.offline_run_dir)
    assert recorded["summary"]["table_truncated"] is True
    artifact = generations(recorded)
    assert artifact["metadata"]["table_truncated"] is True and artifact["metadata"]["rows"] == 20
    assert table_rows(artifact) == merged_rows(run)[:5]
    parquet = [e["local_path"] for name, e in sorted(artifact["entries"].items()) if name.endswith(".parquet")]
    assert pa.concat_tables([pq.read_table(p) for p in parquet]).to_pylist() == merged_rows(run)


def test_a_table_longer_than_a_run_table_may_be_is_cut_for_the_run_alone_and_said(merged_run, read_wandb_run,
                                                                                  monkeypatch, capsys):
    """W&B keeps at most `Table.MAX_ROWS` (10,000) rows in a run's table, cutting it with only a
    log line: `table_max_rows: 100000` reported `table_rows=100000` while the run held 10,000."""
    import wandb

    monkeypatch.setattr(wandb.Table, "MAX_ROWS", 3)  # W&B's own cut reads the same attribute
    run = merged_run()
    result = run.run("upload")
    assert (result.summary.table_rows, result.summary.run_table_rows) == (20, 3)
    assert ("upload: the run's own `generations` table holds the first 3 rows (W&B's most for a run's table); "
            "the artifact's holds 20 (wandb.table_max_rows)") in capsys.readouterr().err
    recorded = read_wandb_run(result.summary.offline_run_dir)
    (logged,) = [h["generations"] for h in recorded["history"] if "generations" in h]
    assert logged["nrows"] == 3 and recorded["summary"]["run_table_rows"] == 3
    assert table_rows(generations(recorded)) == merged_rows(run)  # the artifact's, whole


def test_api_key_is_written_to_no_file(merged_run, monkeypatch, tmp_path):
    key = "fakekey0" * 5
    monkeypatch.setenv("WANDB_API_KEY", key)
    run = merged_run(mode="offline")
    result = run.run("upload")
    assert result.summary.mode == "offline"
    files = [p for p in glob.glob(str(tmp_path / "**"), recursive=True) if os.path.isfile(p)]
    assert any(".wandb" in p for p in files) and len(files) > 10
    assert [p for p in files if key.encode() in open(p, "rb").read()] == []


def test_disabled_logs_nothing_and_says_so(merged_run):
    run = merged_run(mode="disabled")
    result = run.run("upload")
    assert result.rows == 0 and result.summary.mode == "disabled" and result.summary.merged_rows == 20
    assert "disabled" in result.summary.note
    assert not os.path.exists(os.path.join(run.url["upload"], "wandb"))


def test_unreachable_w_and_b_fails_clearly_and_keeps_the_merged_files(merged_run, monkeypatch):
    with socket.socket() as s:  # a local port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "fakekey1" * 5
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    run = merged_run(mode="online")
    before = merged_rows(run)
    with pytest.raises(StepFailed) as err:
        run.run("upload")
    message = str(err.value)
    assert message.startswith("upload: could not start the W&B run (online run test-run-")
    assert run.url["merge"] in message and "`pipeline run upload --config FILE`" in message
    assert key not in message
    assert merged_rows(run) == before


@pytest.mark.parametrize("root", [None, "memory://upload-test/runs"])
def test_a_merged_file_changed_since_merge_fails_before_any_w_and_b_run(merged_run, root):
    """Another file put in place of a merged one (here, its first rows only, still valid Parquet):
    upload checks the files against merge's record (size and rows here, the checksum of a
    remote one it copies) before it begins a W&B run."""
    run = merged_run(root=root)
    try:
        first = storage.list_files(run.url["merge"], suffix=".parquet")[0]
        storage.write_parquet(first, storage.read_parquet(first).slice(0, 2))
        with pytest.raises(StepFailed) as err:
            run.run("upload")
        message = str(err.value)
        assert message.startswith(f"merged file {first} no longer matches merge's record")
        assert message.endswith("rerun `pipeline run merge --config FILE --force` to write the merged files again")
        if root is None:
            assert re.search(r"\([\d,]+ bytes and 2 rows, not [\d,]+ and 7\)", message), message
        assert offline_dirs(run) == [] and not storage.exists(storage.join(run.url["upload"], "wandb_run.json"))
    finally:
        storage.remove("memory://upload-test", recursive=True)


def change_in_place(path: str, readable: bool) -> None:
    """Change a merged file's bytes but not its size or footer (so not its row count either): the
    first bit of its pages that, flipped, still reads as other rows (readable), or 40 bytes of its
    pages XORed, which pyarrow cannot decode (not readable)."""
    data = open(path, "rb").read()
    rows = pq.read_table(path).to_pylist()
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    tries = range(4, footer) if readable else [footer // 2]
    for offset in tries:
        changed = bytearray(data)
        for i in range(offset, offset + (1 if readable else 40)):
            changed[i] ^= 1 if readable else 0xFF
        with open(path, "wb") as f:
            f.write(changed)
        try:
            if pq.read_table(path).to_pylist() != rows:
                assert readable, "40 bytes XORed still read"
                return
        except (pa.ArrowException, OSError):
            if not readable:
                return
    raise AssertionError(f"no such change found in {path}")


def upload_fails_before_any_w_and_b_run(run, start: str) -> None:
    """upload raises an error that starts with `start` and tells to write the merged files again,
    and no W&B run was begun (no wandb folder, no run id kept)."""
    with pytest.raises(StepFailed) as err:
        run.run("upload")
    message = str(err.value)
    assert message.startswith(start)
    assert message.endswith("rerun `pipeline run merge --config FILE --force` to write the merged files again")
    assert not os.path.exists(os.path.join(run.url["upload"], "wandb"))
    assert not storage.exists(storage.join(run.url["upload"], "wandb_run.json"))


@pytest.mark.parametrize("readable", [True, False], ids=["one-bit-still-reads", "40-bytes-unreadable"])
def test_a_merged_file_changed_in_place_fails_before_any_w_and_b_run(merged_run, readable):
    """A local merged file changed in place, its size and row count still merge's. Upload compared
    only those: one bit flipped was logged as a new artifact (exit 0), and 40 bytes XORed failed
    inside W&B's logging telling to rerun upload, which fails forever. Now it checks the sha256 merge
    recorded before any W&B run, and names the file and `pipeline run merge --force`."""
    run = merged_run()
    first = storage.list_files(run.url["merge"], suffix=".parquet")[0]
    size = os.path.getsize(first)
    change_in_place(first, readable)
    assert os.path.getsize(first) == size and pq.ParquetFile(first).metadata.num_rows == 7
    upload_fails_before_any_w_and_b_run(run, f"merged file {first} no longer matches merge's record (same size and rows, ")


def test_a_recorded_merged_file_that_does_not_decode_is_named_before_any_w_and_b_run(merged_run):
    """A merged file whose pages do not decode, though merge's record holds its checksum (the
    checksum check cannot catch it): reading it for the charts and the table failed as `could not
    log the result` and told to rerun upload, which fails forever. It must name the file and
    `pipeline run merge --force`, before any W&B run."""
    import dataclasses

    from pipeline.run import status

    run = merged_run()
    first = storage.list_files(run.url["merge"], suffix=".parquet")[0]
    change_in_place(first, readable=False)
    record = status.read_marker(run.url["merge"])
    files = [{**f, "sha256": storage.sha256(first)} if f["path"] == os.path.basename(first) else f
             for f in record.files]
    status.write_marker(run.url["merge"], dataclasses.replace(record, files=files))
    upload_fails_before_any_w_and_b_run(run, f"merged file {first} cannot be read (")


def test_remote_root_writes_the_offline_run_to_the_local_cache(merged_run, wandb_env, read_wandb_run):
    run = merged_run(root="memory://upload-test/runs")
    try:
        result = run.run("upload")
        cache = str(wandb_env / "pipeline-cache")
        assert result.summary.offline_run_dir.startswith(cache)
        artifact = generations(read_wandb_run(result.summary.offline_run_dir))
        parquet = [e["local_path"] for name, e in sorted(artifact["entries"].items()) if name.endswith(".parquet")]
        assert all(p.startswith(cache) for p in parquet)
        assert pa.concat_tables([pq.read_table(p) for p in parquet]).to_pylist() == merged_rows(run)
        saved = storage.read_json(storage.join(run.url["upload"], "wandb_run.json"))
        assert saved["run_id"] == result.summary.run_id
    finally:
        storage.remove("memory://upload-test", recursive=True)


# --- issue 14: one W&B run per result, the table in the run, every step's metrics and logs ---------


def test_one_run_per_result_grouped_by_run_name(merged_run, read_wandb_run):
    """Issue 14: two samplings of one run.name landed in the same W&B run (its id came from root and name)."""
    import dataclasses

    from steps.upload import _run_id

    run = merged_run()
    result = run.run("upload")
    named = hashlib.sha256(b"test run").hexdigest()[:6]  # "test run" is not its own slug
    assert result.summary.run_id == f"test-run-{named}-{run.HASHES['merge']}"
    recorded = read_wandb_run(result.summary.offline_run_dir)
    assert recorded["group"] == "test run" and recorded["run_id"] == result.summary.run_id

    out = run.out("upload")  # another result of the same run.name: merge's hash differs
    other = dataclasses.replace(out, hash="0b1d0000000e", url=out.url + "x",
                                upstream={"merge": dataclasses.replace(out.upstream["merge"], hash="3e7e0000000f")})
    assert _run_id(run.cfg, other) == f"test-run-{named}-3e7e0000000f"

    def run_id(name: str) -> str:
        return _run_id(dataclasses.replace(run.cfg, run=dataclasses.replace(run.cfg.run, name=name)), other)

    # Names that slug alike got one id, so their uploads of one result resumed one W&B run.
    alike = ["Test Run", "test-run", "test run!", "ééé", "ààà"] + ["x" * 40 + tail for tail in ("a", "b")]
    assert len({run_id(name) for name in alike}) == len(alike)
    assert run_id("test-run") == "test-run-3e7e0000000f"  # a name that is its own slug keeps the plain id
    assert max(len(run_id(name)) for name in alike) <= 64


def test_the_table_is_logged_to_the_run_and_every_steps_metrics_and_logs_are_there(merged_run, read_wandb_run):
    run = merged_run()
    run._mark("tokenize", [], {"rows_in": 13, "rows": 10, "rejected": 3, "tokens": 50, "num_shards": 3,
                               "rejected_reasons": {"too_long": 2, "invalid_json": 1}}, {})
    for step in ("tokenize", "generate", "merge"):
        for host in range(2 if step == "generate" else 1):
            storage.write_text(storage.join(run.url[step], "logs", f"host-{host:05d}.log"),
                               f"{step} on host {host}\n")
    result = run.run("upload")
    run_dir = result.summary.offline_run_dir
    recorded = read_wandb_run(run_dir)

    (logged,) = [h["generations"] for h in recorded["history"] if "generations" in h]
    assert logged["_type"] == "table-file" and logged["nrows"] == 20
    table = json.loads(open(os.path.join(run_dir, "files", logged["path"])).read())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [(r["prompt_index"], r["sample_index"], r["completion"]) for r in rows] == [
        (r["prompt_index"], r["sample_index"], r["completion"]) for r in merged_rows(run)]

    summary = recorded["summary"]
    assert summary["tokenize/rows"] == 10 and summary["tokenize/rows_in"] == 13 and summary["tokenize/tokens"] == 50
    assert summary["tokenize/rejected"] == 3 and summary["tokenize/num_shards"] == 3
    assert summary["tokenize/rejected_reasons/too_long"] == 2 and summary["tokenize/rejected_reasons/invalid_json"] == 1
    assert summary["generate/rows"] == 20 and summary["generate/generated_tokens"] == 60
    assert summary["generate/hosts/host-1/tokens_per_s"] == 200 and summary["generate/compile_s"] == 0.5
    assert summary["merge/rows"] == 20 and summary["merge/duplicates_dropped"] == 0 and summary["merge/files"] == 3
    assert summary["merge/finish_reasons/eos"] == 10 and summary["upload/wall_s"] > 0
    assert {k for k in summary if k.endswith("/wall_s")} >= {f"{s}/wall_s" for s in ("tokenize", "generate", "merge", "upload")}
    assert recorded["config"]["pipeline"]["steps"] == {**run.HASHES}

    expected = ["logs/tokenize/host-00000.log", "logs/generate/host-00000.log", "logs/generate/host-00001.log",
                "logs/merge/host-00000.log"]
    assert sorted(f for f in recorded["files"] if f.startswith("logs/")) == sorted(expected)
    assert result.summary.logs == 4
    assert open(os.path.join(run_dir, "files", "logs", "generate", "host-00001.log")).read() == "generate on host 1\n"


def test_a_two_host_run_attaches_every_hosts_log_of_every_step(make_config, tmp_path, read_wandb_run):
    """Issue 14: the W&B run had no console log; now every host's log of every step is in it, as run files."""
    from tests.conftest import pipeline

    config = make_config()
    result = pipeline("launch", "--hosts", "2", "--", "run", "all", "--config", config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (upload_dir,) = glob.glob(str(tmp_path / "runs" / "upload-*"))
    (run_dir,) = glob.glob(os.path.join(upload_dir, "wandb", "offline-run-*"))
    recorded = read_wandb_run(run_dir)

    logs = sorted(f for f in recorded["files"] if f.startswith("logs/"))
    assert {"logs/generate/host-00000.log", "logs/generate/host-00001.log"} <= set(logs)
    assert {f"logs/{step}/host-00000.log" for step in ("tokenize", "merge")} <= set(logs)
    for name in logs:  # upload's own log is still being written while it uploads: it is left out
        step = name.split("/")[1]
        assert step != "upload"
        assert open(os.path.join(run_dir, "files", name)).read() == open(
            glob.glob(str(tmp_path / "runs" / f"{step}-*" / "logs" / name.rsplit("/", 1)[1]))[0]).read()
    generate_1 = open(os.path.join(run_dir, "files", "logs", "generate", "host-00001.log")).read()
    assert "generate host 1/2" in generate_1  # host 1's own progress, not the leader's

    assert any(h.get("generations", {}).get("nrows") == 24 for h in recorded["history"])  # the table, in the run
    summary = recorded["summary"]
    for key in ("tokenize/rows", "tokenize/rejected", "tokenize/tokens", "tokenize/wall_s", "generate/rows",
                "generate/generated_tokens", "generate/compile_s", "generate/hosts/host-1/tokens_per_s",
                "generate/wall_s", "merge/rows", "merge/duplicates_dropped", "merge/wall_s", "upload/wall_s"):
        assert key in summary, key
    assert summary["tokenize/rows"] == 12 and summary["merge/rows"] == 24
    assert recorded["group"] == "test" and recorded["run_id"] == "test-" + os.path.basename(
        glob.glob(str(tmp_path / "runs" / "merge-*"))[0]).split("-", 1)[1]
