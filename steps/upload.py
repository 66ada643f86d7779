"""upload: log the merged result to W&B as a `generations` artifact, in one W&B run per result.

Owns the W&B run of a result: created here only (on the leader, where the runner calls this step;
`wandb` is imported nowhere else), with the resolved config, package versions, git commit and every
step's hash; the summary metrics of every step (`tokenize/...`, `generate/...`, `merge/...`,
`upload/...`) and three charts; the `generations` table logged to the run; every host's log of every
earlier step attached as run files (`logs/{step}/host-NNNNN.log`; upload's own is still being written); and one artifact of type `generations`
holding the merged Parquet files (every row) and a `wandb.Table` named `generations` (the first
`wandb.table_max_rows` rows). Refuses to touch the merged files, and never writes the API key
anywhere: wandb reads WANDB_API_KEY itself; error messages are scrubbed of it.

Before a W&B run begins, every merged file is checked against the sha256 merge recorded (on any
root), and read for the charts and the table: a file changed since merge fails the step naming it
and `pipeline run merge --config FILE --force`, and W&B gets nothing.

Run identity (docs/contract.md, "W&B"): one W&B run per result. The id is `{run.name as a
slug}-{merge hash12}` and the group is `run.name`: a rerun, `--force`, a resume or a rerun after
deleting the upload folder continues the same run (`resume="allow"`); a changed sampling, model or
prompt set changes merge's hash, so it is a new run in the same group.

Modes (`wandb.mode`): online (W&B down or refusing fails the step, exit 1; the merged files stay, and
`pipeline run upload` retries only this step); offline (default without an API key: the run is
written to `{upload folder}/wandb/` for a local root, else to a local cache folder, and the `wandb
sync` command that pushes it is printed; an earlier offline folder of the same id there is replaced,
because syncing two folders of one id misbehaves upstream); disabled (logs nothing, says so in the
marker). An unchanged result re-uploaded has the same artifact digest, so W&B makes no new version.
W&B's own terminal output is silenced: the pipeline prints where the run is.

    result = upload(cfg, out)   # out.upstream["merge"] complete
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.run import status, steplog
from pipeline.run.config import Config
from pipeline.run.result import MERGED_FIX, logprob_sum_and_mean
from pipeline.errors import Interrupted, StepFailed
from pipeline.pod import preemption
from pipeline.run.step import StepOutput, StepResult
from steps.generate import LOGPROBS, PROMPT_LOGPROBS, TOP_LOGPROBS, TOP_TOKEN_IDS, per_host
from steps.merge import MergeSummary

RUN_FILE = "wandb_run.json"
"""In the upload folder: the W&B run id (and where its offline copy is), written at init."""
ARTIFACT_TYPE = "generations"
TABLE_NAME = "generations"


@dataclass(frozen=True)
class UploadSummary:
    mode: str
    """online, offline or disabled (then nothing was logged)."""
    rows: int
    """Rows logged in the artifact's Parquet files (0 when disabled)."""
    merged_rows: int
    run_id: str | None = None
    project: str | None = None
    entity: str | None = None
    artifact: str | None = None
    artifact_version: str | None = None
    """The artifact's version (online only: offline runs get theirs when synced)."""
    artifact_digest: str | None = None
    table_rows: int = 0
    """Rows in the browsable table (at most wandb.table_max_rows)."""
    table_truncated: bool = False
    run_table_rows: int = 0
    """Rows of the same table logged to the run itself: W&B keeps at most wandb.Table.MAX_ROWS
    (10,000) in a run's table, where the artifact's holds up to MAX_ARTIFACT_ROWS (200,000)."""
    logs: int = 0
    """Step logs attached to the run (every host's log of every step)."""
    offline_run_dir: str | None = None
    sync_command: str | None = None
    """The `wandb sync` command that pushes an offline run."""
    note: str | None = None


def redo(cfg: Config, record: status.StepRecord, url: str) -> str | None:
    """A result uploaded with `wandb.mode: disabled` logged nothing: with W&B on, it is uploaded
    (the mode is in no hash: online and offline make the same run). One logged to its W&B run
    before another upload of the same result did (other `wandb.table_max_rows`, the same run) is
    logged again, or the run's latest table and artifact would stay that other upload's."""
    if record.summary.get("mode") == "disabled" and cfg.wandb.mode != "disabled":
        return f"complete, but with wandb.mode disabled (nothing was logged): log it, {cfg.wandb.mode}"
    run = {key: record.summary.get(key) for key in ("run_id", "project", "entity")}
    if run["run_id"] is None:
        return None
    folder = url.rstrip("/").rsplit("/", 1)[-1]
    for other_url, other in status.complete_outputs(cfg.run.root, "upload"):  # the one finished last first
        other_folder = other_url.rstrip("/").rsplit("/", 1)[-1]
        if other_folder == folder:
            return None
        if {key: other.summary.get(key) for key in run} == run:
            return (f"complete, but {other_folder} logged to the same W&B run ({run['run_id']}) since: log this "
                    f"result again, so that the run's latest table and artifact are this config's")
    return None


def upload(cfg: Config, out: StepOutput) -> StepResult:
    """Log the merged Parquet files, a browsable table, metrics and charts to one W&B run."""
    merge_url = out.upstream["merge"].url
    merged = status.read_marker(merge_url)
    if merged is None:
        raise StepFailed(f"merge output {merge_url} is not complete: run `pipeline run merge --config FILE`")
    mode = cfg.wandb.mode
    if mode == "disabled":
        return StepResult(rows=0, files=[], summary=UploadSummary(
            mode="disabled", rows=0, merged_rows=merged.rows,
            note=f"wandb.mode is disabled: nothing was logged; the merged files are in {merge_url}"))

    import wandb  # only here: no other step or host pays for it, or starts its service

    started = time.monotonic()
    run_id = _run_id(cfg, out)
    local = _local_folder(out, run_id)
    parquet = [f for f in merged.files if f["path"].endswith(".parquet")]
    table_cap = min(cfg.wandb.table_max_rows, wandb.Table.MAX_ARTIFACT_ROWS)
    # Nothing of W&B's own is printed: a large result's logging (online: its upload) said nothing for minutes.
    size = sum(f.get("bytes", 0) for f in parquet)
    size_text = f"{size / 2**20:,.1f} MiB" if size >= 2**20 else f"{size / 2**10:,.1f} KiB"
    print(f"upload: logging {merged.rows:,} rows ({len(parquet)} merged file{'s' if len(parquet) != 1 else ''}, "
          f"{size_text}, and a table of {min(merged.rows, table_cap):,} rows) to the "
          f"{mode} W&B run {run_id} of project {cfg.wandb.project}", file=sys.stderr, flush=True)
    # Every read of the merged files comes before the W&B run begins, so a damaged one fails naming
    # itself and merge's fix, and is never logged (nor blamed on W&B).
    copies = _local_copies(merge_url, merged.files, local)
    lengths = _completion_lengths(copies)
    columns, data = _table_data(copies, table_cap)
    paths = list(copies.values())
    wandb_dir = os.path.join(local, "wandb")
    preemption.check()  # the merged files are read: a stop asked meanwhile is heard before anything changes
    if mode == "offline":
        for earlier in glob.glob(os.path.join(wandb_dir, f"offline-run-*-{run_id}")):
            shutil.rmtree(earlier)
    steps = _upstream_steps(out)
    generate = steps["generate"][1] if "generate" in steps else None
    config = {**cfg.to_dict(), "pipeline": {
        "versions": status.package_versions(), "git": _git_commit(),
        "steps": {**{name: record.hash for name, (_, record) in steps.items()}, "upload": out.hash}}}
    try:
        run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, id=run_id, name=run_id,
                         group=cfg.run.name, resume="allow", mode=mode, dir=local, config=config,
                         job_type="upload", settings=wandb.Settings(console="off", silent=True))
    except Exception as err:  # wandb raises CommError, UsageError, AuthenticationError, timeouts...
        raise StepFailed(_failed("could not start the W&B run", run_id, mode, merge_url, err)) from err
    run_dir = str(Path(run.dir).parent)
    storage.write_json(out.path(RUN_FILE), {"run_id": run_id, "project": cfg.wandb.project,
                                            "entity": cfg.wandb.entity, "mode": mode, "run_dir": run_dir})
    try:
        _log_metrics(wandb, run, generate.summary if generate else {}, MergeSummary(**merged.summary).finish_reasons,
                     lengths)
        run.summary.update(_step_metrics({name: record for name, (_, record) in steps.items()}))
        table_rows = len(data)
        truncated = table_rows < merged.rows
        # Two Table objects: an artifact given a Table already logged to the run stores a reference only.
        # W&B cuts a run's table to its MAX_ROWS with only a log line: cut here, and say so.
        run_table_rows = min(table_rows, wandb.Table.MAX_ROWS)
        run.log({TABLE_NAME: wandb.Table(columns=columns, data=data[:run_table_rows])})
        preemption.check()  # the last place to stop: from the artifact on, W&B's calls run to their end
        artifact = _artifact(wandb, cfg, run_id, merged, out.upstream["merge"].hash, paths,
                             wandb.Table(columns=columns, data=data), table_rows)
        run.summary.update({"rows": merged.rows, "table_rows": table_rows, "table_truncated": truncated,
                            "run_table_rows": run_table_rows, "merged_files": len(paths)})
        logged = run.log_artifact(artifact)
        version = None
        if mode == "online":
            logged.wait()  # raises if W&B refuses it; gives the version number
            version = logged.version
        digest = artifact.digest
        run.summary.update({"upload/wall_s": round(time.monotonic() - started, 3), "upload/table_rows": table_rows})
        logs = _attach_logs(run, {name: url for name, (url, _) in steps.items()})  # upload's own is still open
        run.finish()
        # finish() can return before W&B's service has flushed the offline run's record log; the
        # marker is written after every file of the step, so wait for the service to close it.
        wandb.teardown()
    except Interrupted:
        try:
            run.finish(exit_code=preemption.EXIT_INTERRUPTED)  # the rerun resumes this W&B run (resume="allow")
        except Exception:  # noqa: BLE001 - W&B unreachable as well: the stop is still what ended the step
            pass
        raise
    except Exception as err:
        try:
            run.finish(exit_code=1)
        finally:
            raise StepFailed(_failed("could not log the result", run_id, mode, merge_url, err)) from err
    summary = UploadSummary(
        mode=mode, rows=merged.rows, merged_rows=merged.rows, run_id=run_id, project=cfg.wandb.project,
        entity=cfg.wandb.entity, artifact=f"{ARTIFACT_TYPE}-{run_id}", artifact_version=version,
        artifact_digest=digest, table_rows=table_rows, table_truncated=truncated, run_table_rows=run_table_rows,
        logs=logs,
        offline_run_dir=run_dir if mode == "offline" else None,
        sync_command=f"wandb sync {run_dir}" if mode == "offline" else None,
    )
    if run_table_rows < table_rows:
        print(f"upload: the run's own `{TABLE_NAME}` table holds the first {run_table_rows:,} rows (W&B's most for a "
              f"run's table); the artifact's holds {table_rows:,} (wandb.table_max_rows)", file=sys.stderr, flush=True)
    if mode == "offline":
        print(f"upload: offline W&B run {run_id} written to {run_dir}; push it with: wandb sync {run_dir}",
              file=sys.stderr, flush=True)
    record = out.path(RUN_FILE)
    entry = {"path": RUN_FILE, "bytes": storage.size(record), "sha256": storage.sha256(record)}
    return StepResult(rows=merged.rows, files=[entry], summary=summary)


# --- identity and places -----------------------------------------------------------------------


def _run_id(cfg: Config, out: StepOutput) -> str:
    """`{run.name as a slug}-{merge hash12}`: one W&B run per result (an earlier attempt's id if recorded).
    A name the slug changes gets 6 characters of its own hash after the slug."""
    earlier = out.path(RUN_FILE)
    if storage.exists(earlier):
        try:
            return storage.read_json(earlier)["run_id"]
        except (ValueError, KeyError, TypeError):  # damaged since: the id below, which is rewritten there
            pass
    slug = re.sub(r"[^a-z0-9_-]+", "-", cfg.run.name.lower()).strip("-")[:40] or "run"
    if slug != cfg.run.name:  # lossy ("My Run", "ééé", a long name): names that slug alike keep runs apart
        slug += "-" + hashlib.sha256(cfg.run.name.encode()).hexdigest()[:6]
    return f"{slug}-{out.upstream['merge'].hash[:storage.HASH_CHARS]}"


def _local_folder(out: StepOutput, run_id: str) -> str:
    """Where W&B writes: the upload folder itself when local, else a local cache folder for the run."""
    if storage.is_local(out.url):
        return storage.filesystem(out.url)[1]
    return storage.local_cache("upload", run_id)


def _local_copies(merge_url: str, files: list[dict[str, Any]], local: str) -> dict[str, str]:
    """The local path of each merged file, by its URL: the file itself when local, else a copy in the
    cache folder. Each is checked against merge's record by `_check_merged`, on every root."""
    folder = os.path.join(local, "merged-" + merge_url.rstrip("/").rsplit("-", 1)[-1])
    copies = {}
    for f in files:
        url = storage.join(merge_url, f["path"])
        if storage.is_local(url):
            path = storage.filesystem(url)[1]
        else:
            path = os.path.join(folder, f["path"])
            if os.path.exists(path) and storage.sha256(path) == f["sha256"]:
                copies[url] = path  # copied by an earlier attempt, and still merge's file
                continue
            storage.write_bytes(path, storage.read_bytes(url))
        _check_merged(url, path, f)
        copies[url] = path
    return copies


def _check_merged(url: str, path: str, record: dict[str, Any]) -> None:
    """Fail naming `url` and merge's fix unless the file at local `path` has the sha256 merge recorded
    (streamed). Size and row count alone missed bytes changed in place: one bit flipped still read
    as other rows and was logged, exit 0."""
    with storage.unreadable("merged file", url, MERGED_FIX):
        if storage.sha256(path) == record["sha256"]:
            return
        size, rows = os.path.getsize(path), pq.ParquetFile(path).metadata.num_rows
    if (size, rows) == (record["bytes"], record["rows"]):
        change = "same size and rows, but other bytes: its sha256 is not the one merge recorded"
    else:
        change = f"{size:,} bytes and {rows:,} rows, not {record['bytes']:,} and {record['rows']:,}"
    raise StepFailed(f"merged file {url} no longer matches merge's record ({change}): {MERGED_FIX}")


def _upstream_steps(out: StepOutput) -> dict[str, tuple[str, status.StepRecord]]:
    """Every earlier step's output URL and marker, in run order (a step deleted since is left out)."""
    found = {}
    for name, given in out.upstream.items():
        record = status.read_marker(given.url)
        if record is not None:
            found[name] = (given.url, record)
    return found


def _git_commit() -> dict[str, Any] | None:
    """The pipeline code's git commit (and whether the checkout has changes), if it is a checkout."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        changes = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(changes.stdout.strip())}


# --- what is logged ----------------------------------------------------------------------------


def _completion_lengths(copies: dict[str, str]) -> np.ndarray:
    """Rows per completion length (index: num_completion_tokens), counted file by file."""
    per_length = np.zeros(1, np.int64)
    for url, path in copies.items():
        with storage.unreadable("merged file", url, MERGED_FIX):
            lengths = pq.read_table(path, columns=["num_completion_tokens"])["num_completion_tokens"].to_numpy()
        counts = np.bincount(lengths, minlength=len(per_length))
        counts[:len(per_length)] += per_length
        per_length = counts
    return per_length


def _log_metrics(wandb: Any, run: Any, generate: dict[str, Any], finish_reasons: dict[str, int],
                 per_length: np.ndarray) -> None:
    """generate's per-host and total figures, and the three charts (`per_length`: rows per completion
    length, from `_completion_lengths`)."""
    hosts = per_host(generate.get("hosts", []))  # a resumed step's runs of one host as one
    # Per-host figures on an explicit `host` axis rather than W&B's own step counter, so a resumed
    # run (whose step counter has moved on) logs them at the same x values again.
    run.define_metric("host")
    run.define_metric("host/*", step_metric="host")
    for h in hosts:
        run.log({"host": h.get("host", 0), **{f"host/{k}": v for k, v in h.items() if _is_number(v) and k != "host"}})
    totals = {k: v for k, v in generate.items() if _is_number(v)}
    if "prompts" not in totals:  # a generate marker from before its summary held them: the hosts' count
        totals["prompts"] = sum(h.get("prompts", 0) for h in hosts)
    totals["samples"] = sum(h.get("samples", 0) for h in hosts)
    run.summary.update({f"generate/{k}": v for k, v in totals.items()})

    width = -(-len(per_length) // 64)  # at most 64 bins, each a whole number of tokens wide
    binned = np.bincount(np.arange(len(per_length)) // width, weights=per_length).astype(np.int64)
    edges = np.arange(len(binned) + 1) * width
    charts: dict[str, Any] = {
        "completion_tokens": wandb.Histogram(np_histogram=(binned.tolist(), edges.tolist())),
        "finish_reasons": wandb.plot.bar(
            wandb.Table(columns=["finish_reason", "rows"], data=[[k, v] for k, v in sorted(finish_reasons.items())]),
            "finish_reason", "rows", title="finish reasons"),
    }
    if hosts:
        charts["tokens_per_s_per_host"] = wandb.plot.bar(
            wandb.Table(columns=["host", "tokens_per_s"],
                        data=[[f"host {h.get('host', 0)}", h.get("tokens_per_s", 0.0)] for h in hosts]),
            "host", "tokens_per_s", title="generated tokens/s per host")
    run.log(charts)


def _step_metrics(records: dict[str, status.StepRecord]) -> dict[str, float]:
    """`{step}/{figure}` for every number in every step's summary (nested counts flattened with `/`),
    plus each step's rows and wall time: rows read, rejected by reason, tokens, shards, duplicates..."""
    metrics: dict[str, float] = {}

    def add(prefix: str, value: Any) -> None:
        if _is_number(value):
            metrics[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                add(f"{prefix}/{key}", item)
        elif isinstance(value, list) and all(isinstance(v, dict) and "host" in v for v in value):
            for item in value:  # generate's per-host figures: generate/hosts/host-1/tokens_per_s
                add(f"{prefix}/host-{item['host']}", {k: v for k, v in item.items() if k != "host"})

    for step, record in records.items():
        summary = record.summary
        if step == "generate" and "hosts" in summary:
            summary = {**summary, "hosts": per_host(summary["hosts"])}  # a resumed step's runs of one host as one
        add(step, summary)
        metrics[f"{step}/rows"] = record.rows
        metrics.setdefault(f"{step}/wall_s", record.wall_s)  # the runner's timing, unless the step kept its own
    return metrics


def _attach_logs(run: Any, step_urls: dict[str, str]) -> int:
    """Copy every host's log of each step into the run's files (`logs/{step}/host-NNNNN.log`)."""
    count = 0
    for step, url in step_urls.items():
        for log_url in steplog.log_urls(url):
            path = os.path.join(run.dir, steplog.LOG_FOLDER, step, log_url.rsplit("/", 1)[-1])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(storage.read_bytes(log_url))
            run.save(path, base_path=run.dir, policy="end")
            count += 1
    return count


def _artifact(wandb: Any, cfg: Config, run_id: str, merged: status.StepRecord, merge_hash: str,
              paths: list[str], table: Any, table_rows: int) -> Any:
    """The `generations` artifact: every merged Parquet file and the browsable table."""
    truncated = table_rows < merged.rows
    artifact = wandb.Artifact(
        f"{ARTIFACT_TYPE}-{run_id}", type=ARTIFACT_TYPE,
        description=(f"{merged.rows} generations of run {cfg.run.name} in {len(paths)} Parquet files; the "
                     f"`{TABLE_NAME}` table shows {'the first ' if truncated else ''}{table_rows} rows"),
        # No timestamps here: an unchanged result must give the same artifact.
        metadata={"rows": merged.rows, "table_rows": table_rows, "table_truncated": truncated, "merge": merge_hash,
                  "files": [{k: f[k] for k in ("path", "rows", "bytes", "sha256")} for f in merged.files]})
    for f, path in zip(merged.files, paths):
        artifact.add_file(path, name=f["path"], policy="immutable")  # no staging copy: merge never rewrites
    artifact.add(table, TABLE_NAME)
    return artifact


def _table_data(copies: dict[str, str], max_rows: int) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a wandb.Table of the first `max_rows` merged rows (`copies`: local path by
    URL, from `_local_copies`), every column but NOT_IN_TABLE.

    List columns (completion_token_ids) go in as compact JSON text: W&B types and converts a list
    element by element, which took ~5 s for 10k rows of ~50 ids (~0.5 s as text) and grows with
    max_new_tokens. The Parquet files in the same artifact keep the lists. Log-probabilities
    (`sampling.logprobs`, `sampling.prompt_logprobs`) go in to LOGPROB_DIGITS decimals, and each
    row's sum and mean besides them, columns a table can sort by (LOGPROB_SUMMARIES).
    """
    columns: list[str] = []
    data: list[list[Any]] = []
    for url, path in copies.items():
        with storage.unreadable("merged file", url, MERGED_FIX):
            parquet = pq.ParquetFile(path)
            columns = [name for name in parquet.schema_arrow.names if name not in NOT_IN_TABLE]
            for batch in parquet.iter_batches(batch_size=min(max(max_rows, 1), 65536), columns=columns):
                if len(data) >= max_rows:
                    break
                batch = batch.slice(0, max_rows - len(data))
                values = [_as_text(c) if pa.types.is_list(c.type) else c.to_pylist() for c in batch.columns]
                for name in LOGPROB_SUMMARIES:
                    if name in columns:
                        values += _logprob_sums_and_means(batch.column(name))
                data.extend(list(row) for row in zip(*values))
        if len(data) >= max_rows:
            break
    summaries = [summary for name, summary in LOGPROB_SUMMARIES.items() if name in columns]
    return [*columns, *itertools.chain(*summaries)], data


NOT_IN_TABLE = (TOP_TOKEN_IDS.name, TOP_LOGPROBS.name)
"""Columns only the artifact's Parquet files hold (`sampling.top_logprobs`): K alternatives per
completion token, as text about 13 x K characters a token (20 alternatives of 2,048 tokens: 0.5 MB
a row, 5 GB for the default 10,000 rows), and nothing a person reads in a table."""
LOGPROB_DIGITS = 4
"""Decimals of a log-probability in the table's text: 20 characters a token in full, 7 so."""
LOGPROB_SUMMARIES = {
    LOGPROBS.name: ("completion_logprob_sum", "completion_logprob_mean"),
    PROMPT_LOGPROBS.name: ("prompt_logprob_sum", "prompt_logprob_mean"),
}
"""The table's columns after the merged ones, per log-probability column the result has: the
completion's (or the prompt's) log-likelihood, and that per token that has one (None for an
empty completion, or a prompt of one token)."""


def _as_text(lists: pa.Array) -> list[str | None]:
    digits = LOGPROB_DIGITS if pa.types.is_floating(lists.type.value_type) else None

    def rounded(v: list) -> list:
        return [None if x is None else round(x, digits) for x in v]

    return [None if v is None else json.dumps(v if digits is None else rounded(v), separators=(",", ":"))
            for v in lists.to_pylist()]


def _logprob_sums_and_means(lists: pa.Array) -> list[list[float | None]]:
    pairs = [logprob_sum_and_mean(v) for v in lists.to_pylist()]
    return [[total for total, _ in pairs], [mean for _, mean in pairs]]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _failed(what: str, run_id: str, mode: str, merge_url: str, err: Exception) -> str:
    detail = " ".join(str(err).split())
    key = os.environ.get("WANDB_API_KEY")
    if key:
        detail = detail.replace(key, "***")
    hint = ("check WANDB_API_KEY, wandb.entity/project and that W&B is reachable, or set wandb.mode=offline "
            "and `wandb sync` later" if mode == "online" else "see the W&B logs under the run folder")
    return (f"upload: {what} ({mode} run {run_id}): {type(err).__name__}: {detail}. The merged results are "
            f"untouched in {merge_url}; {hint}; then `pipeline run upload --config FILE` retries only this step")
