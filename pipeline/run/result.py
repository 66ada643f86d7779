"""Where a config's result is, and its first rows as a table a person can read.

Owns finding the merged files of a config (merge's output for the config's hash, through its
success marker's manifest) and `pipeline show`'s table: prompt, completion, finish reason (and,
with `sampling.logprobs`, each completion's mean log-probability per token, and with
`sampling.prompt_logprobs` the prompt's).
Reads only, and refuses to look into a merge output without its marker: a reader trusts the
marker, not the files.

    merged = merged_result(merge_url)         # None until merge is complete
    print(show_text(cfg, steps.PIPELINE, "--config demo/config.yaml", rows=5))
"""

from __future__ import annotations

import io
import math
import shutil
import sys
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from pipeline import storage
from pipeline.errors import StepFailed
from pipeline.run import status
from pipeline.run.config import Config
from pipeline.run.step import Step

SHOWN_COLUMNS = ["prompt_index", "prompt_id", "sample_index", "prompt", "completion", "finish_reason"]
MEAN_COLUMNS = {"completion_logprobs": "logprob / token", "prompt_logprobs": "prompt logprob / token"}
"""Shown as their means per token, under these headings, where the result has them
(`sampling.logprobs`, `sampling.prompt_logprobs`)."""
TEXT_CHARS = 500
"""Longer prompts and completions are cut in the table (the Parquet files hold them whole)."""
MERGED_FIX = "rerun `pipeline run merge --config FILE --force` to write the merged files again"
"""What to do about a merged file that cannot be read or no longer matches merge's record (show, upload)."""


def logprob_sum_and_mean(values: list[float | None]) -> tuple[float, float | None]:
    """A row's log-probabilities' sum (its log-likelihood) and mean per token that has one (None
    when none has: an empty completion, a one-token prompt); a prompt's first token has None."""
    scored = [v for v in values if v is not None]
    total = math.fsum(scored)
    return total, total / len(scored) if scored else None


@dataclass(frozen=True)
class MergedResult:
    folder: str
    rows: int
    files: list[str]
    """URLs of the merged Parquet files, in order."""

    def describe(self) -> str:
        where = self.files[0] if len(self.files) == 1 else f"{self.folder}/merged-*.parquet" if self.files else self.folder
        # N as a plain integer: scripts read the `result:` line (the contract's `N rows in K files`)
        return f"{where} ({self.rows} rows in {len(self.files)} file{'s' if len(self.files) != 1 else ''})"


def merged_result(merge_url: str) -> MergedResult | None:
    """The merged files of a complete merge output; None while it is not complete."""
    record = status.read_marker(merge_url)
    if record is None:
        return None
    files = [storage.join(merge_url, f["path"]) for f in record.files if f["path"].endswith(".parquet")]
    return MergedResult(folder=merge_url, rows=record.rows, files=files)


def missing_files(folder: str, names: list[str]) -> list[str]:
    """Of `names`, files of `folder` that a marker records, those the folder no longer holds (a
    merged file deleted by hand), in their order."""
    there = {url.rsplit("/", 1)[-1] for url in storage.list_files(folder)}
    return [name for name in names if name not in there]


def first_rows(result: MergedResult, count: int) -> list[dict[str, Any]]:
    """The first `count` rows of the result (reading no more than needed), the shown columns only."""
    rows: list[dict[str, Any]] = []
    for url in result.files:
        if len(rows) >= count:
            break
        fs, path = storage.filesystem(url)
        with storage.unreadable("merged file", url, MERGED_FIX), fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            columns = SHOWN_COLUMNS + [name for name in MEAN_COLUMNS if name in parquet.schema_arrow.names]
            for batch in parquet.iter_batches(batch_size=max(count, 1), columns=columns):
                rows.extend(batch.slice(0, count - len(rows)).to_pylist())
                if len(rows) >= count:
                    break
    return rows


def show_text(cfg: Config, graph: tuple[Step, ...], again: str, rows: int) -> str:
    """`pipeline show`: where the result is, and its first rows as a table. `again`: the command's
    config arguments (`--config` and every `--set`), for the command that makes a missing result."""
    from pipeline.run.checks import input_problem
    from pipeline.run.runner import make_plan

    plan = make_plan(cfg, graph)
    (merge,) = [p for p in plan if p.name == "merge"]
    result = merged_result(merge.url)
    if result is None:
        problem = input_problem(cfg, {p.name for p in plan if p.state != "complete"})
        if problem:  # the result's hash needs its inputs: moved prompt files name no result
            raise StepFailed(f"no result for this config: {problem}")
        raise StepFailed(f"no result for this config yet: {merge.url} is {merge.state}; "
                         f"run `pipeline run all {again}` first")
    return f"{result.describe()}\n{_table(first_rows(result, rows), result.rows)}"


def _table(rows: list[dict[str, Any]], total: int) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=True, caption=f"{len(rows)} of {total:,} rows")
    table.add_column("prompt (id, sample)", overflow="fold", ratio=2)
    table.add_column("completion", overflow="fold", ratio=3)
    table.add_column("finish", no_wrap=True)
    means = [name for name in MEAN_COLUMNS if rows and name in rows[0]]
    for name in means:
        table.add_column(MEAN_COLUMNS[name], no_wrap=True, justify="right")
    for r in rows:
        cells = [f"{_cut(r['prompt'])}\n[dim]({_cut(r['prompt_id'])}, {r['sample_index']})[/dim]", _cut(r["completion"]),
                 r["finish_reason"]]
        for name in means:
            _, mean = logprob_sum_and_mean(r[name])
            cells.append("-" if mean is None else f"{mean:.3f}")
        table.add_row(*cells)
    buffer = io.StringIO()
    # The terminal's width when there is one; 120 columns in a pipe or a log.
    width = shutil.get_terminal_size((120, 24)).columns if sys.stdout.isatty() else 120
    Console(file=buffer, width=width, highlight=False, emoji=False).print(table)
    return buffer.getvalue().rstrip()


def _cut(text: str) -> str:
    """The user's text as a cell shows it: at most TEXT_CHARS, with rich's markup escaped (an id or
    prompt holding `[bold]` or `[/1]` is data: read as markup it was dropped, or ended `show`)."""
    from rich.markup import escape

    text = text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + "..."
    return escape(text)
