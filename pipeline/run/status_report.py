"""What `pipeline status` shows: one row per step, as data and as text.

Owns the report's fields (the contract's name/hash/output/state/rows, plus why a run would
or would not run the step, rejected prompt rows, how far a partial step got (`Step.progress`),
who is running it now, and the input the next run would stop on before its first step) and the
line saying where the merged result is. Changes nothing.

    rows = report(cfg, steps.PIPELINE)
    print(report_text(rows, result_of(rows)))
"""

from __future__ import annotations

from typing import Any

from pipeline.run import status, steplog
from pipeline.run.checks import input_problem
from pipeline.run.config import Config
from pipeline.run.result import MergedResult, merged_result, missing_files
from pipeline.run.runner import make_plan
from pipeline.run.step import Step


def report(cfg: Config, graph: tuple[Step, ...]) -> list[dict[str, Any]]:
    plan = make_plan(cfg, graph)
    problem = input_problem(cfg, {p.name for p in plan if p.action == "run"})
    urls = {p.name: p.url for p in plan}
    rows = []
    for p in plan:
        row: dict[str, Any] = {"name": p.name, "hash": p.hash, "output": p.url, "state": p.state,
                               "rows": p.rows}
        if p.record is not None and "rejected" in p.record.summary:
            row["rejected"] = p.record.summary["rejected"]
        if p.state == "partial" and p.step.progress is not None:
            done = p.step.progress(cfg, p.url, {s.name: urls[s.name] for s in p.step.inputs})
            if done is not None:
                row["progress"] = str(done)
                row["committed_rows"], row["total_rows"] = done.rows, done.of
        if p.state == "partial" and not p.damaged and p.running is None and (failed := steplog.last_error(p.url)):
            row["last_error"] = failed
        row["why"] = _why(p, row.get("progress"), row.get("last_error"))
        if p.running is not None:
            row["running"] = p.running
            row["why"] = f"being run by {p.running}" + (f": {row['progress']} so far" if "progress" in row else "")
        if problem is not None and p.action == "run":  # the first step the next run would start
            row["problem"], problem = problem, None
            row["why"] = f"{p.state}, but the next run stops before it: {row['problem']}"
        rows.append(row)
    return rows


def _why(p: Any, progress: str | None = None, failed: str | None = None) -> str:
    if p.state == "complete" and p.action == "run":  # the step asks for it again (`Step.redo`)
        return f"{p.reason}: the next `run all` runs it"
    if p.state == "complete":
        return "complete: `run all` skips it (--force reruns it)" + (f"; {p.made_from}" if p.made_from else "")
    if p.action == "blocked":
        return p.reason
    if p.state == "partial":
        if p.damaged:
            return f"partial: its {status.MARKER} cannot be read ({p.damaged}): the next run runs it again"
        state = f"partial ({progress})" if progress else "partial"
        if failed is not None:  # a resume would meet the same error unless its cause is fixed
            again = "resumes it" if p.step.progress is not None else "runs it again"
            return f"{state}; its last run ended: {failed}; the next run {again}"
        return f"{state}: the next run resumes it"
    return f"missing ({p.since}): the next `run all` runs it" if p.since else "missing: the next `run all` runs it"


def result_of(rows: list[dict[str, Any]]) -> MergedResult | None:
    """The merged files, when the report's merge step is complete."""
    merge = next(r for r in rows if r["name"] == "merge")
    result = merged_result(merge["output"]) if merge["state"] == "complete" else None
    # Only files that are there: a merged file deleted by hand is made again by the next run (merge's redo).
    if result is not None and missing_files(result.folder, [url.rsplit("/", 1)[-1] for url in result.files]):
        return None
    return result


def report_json(rows: list[dict[str, Any]], result: MergedResult | None) -> dict[str, Any]:
    return {"steps": rows, "result": None if result is None else {"rows": result.rows, "files": result.files}}


def report_text(rows: list[dict[str, Any]], result: MergedResult | None = None) -> str:
    lines = [f"{'step':<9} {'hash':<12} {'state':<9} {'rows':>9}  output / why"]
    for r in rows:
        count = "-" if r["rows"] is None else str(r["rows"])
        extra = f" ({r['rejected']} rejected)" if r.get("rejected") else ""
        lines.append(f"{r['name']:<9} {r['hash'][:12]:<12} {r['state']:<9} {count:>9}  {r['output']}{extra}")
        lines.append(f"{'':<9} {'':<12} {'':<9} {'':>9}  {r['why']}")
    merge_complete = any(r["name"] == "merge" and r["state"] == "complete" for r in rows)
    lines.append(f"result: {result.describe()}" if result else
                 "result: none now (a merged file is gone: the next `run all` writes it again)" if merge_complete else
                 "result: none yet (merge is not complete)")
    return "\n".join(lines)
