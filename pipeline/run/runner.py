"""The step runner: plan, skip what is complete, run the rest in order, mark success last.

Owns the order of steps, their hashes and output URLs (through identity.py and storage.py),
the decision to skip, resume or redo, `--dry-run`, and the success marker. It refuses to
run a step whose upstream is not complete, naming the command that makes it. Steps
themselves own their data: a partial output is handed to the step, which resumes or redoes.

    plan = make_plan(cfg)                     # hashes, URLs, states, reasons
    run_steps(cfg, ["all"], force=False)      # what `pipeline run all` does
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import importlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from engine.checkpoint import check_checkpoint
from pipeline import storage
from pipeline.pod import hosts, preemption
from pipeline.run import identity, status
from pipeline.run.config import Config
from pipeline.errors import ConfigError, Interrupted, StepFailed, checkpoint_errors
from pipeline.storage.lease import Lease, LeaseLost


@dataclass(frozen=True)
class StepSpec:
    """A step, declared once."""

    name: str
    version: str
    """Bump when the step's output for the same inputs changes: it changes the hash."""
    upstream: tuple[str, ...]
    where: Literal["leader", "every host"]
    entry: str
    """`module:function` run as fn(cfg, out) -> StepResult (on every host for 'every host')."""
    finish: str | None = None
    """For 'every host' steps: `module:function` the leader runs after all hosts are done."""
    about: str = ""


STEPS: tuple[StepSpec, ...] = (
    StepSpec("tokenize", "1", (), "leader", "steps.tokenize:tokenize",
             about="read prompts, tokenize, write balanced Parquet shards"),
    StepSpec("generate", "1", ("tokenize",), "every host", "steps.generate:generate",
             finish="steps.generate:finish",
             about="every host generates completions for its shards"),
    StepSpec("merge", "1", ("generate",), "leader", "steps.merge:merge",
             about="verify every (prompt, sample) once, order, write the result"),
    StepSpec("upload", "1", ("merge",), "leader", "steps.upload:upload",
             about="log a W&B table artifact, resuming the same W&B run"),
)
STEP_NAMES = tuple(s.name for s in STEPS)


@dataclass(frozen=True)
class StepOutput:
    """Where a step writes and what it reads: handed to the step by the runner."""

    step: str
    hash: str
    url: str
    upstream: dict[str, "PlannedStep"] = field(default_factory=dict)
    lease: Lease | None = None
    """This runner's lease on the output; None when nobody else can write there."""

    def path(self, *names: str) -> str:
        return storage.join(self.url, *names)

    def check_lease(self) -> None:
        """Raise LeaseLost if another runner took this step over: call before each commit."""
        if self.lease is None:
            return
        try:
            self.lease.check()
        except LeaseLost:
            hosts.raise_if_aborted("stopped")  # our own leader failed and let go: that is the error
            raise


@dataclass(frozen=True)
class StepResult:
    """What a step returns; the runner writes it into the success marker."""

    rows: int
    files: list[dict[str, Any]]
    summary: dict[str, Any]


@dataclass(frozen=True)
class PlannedStep:
    spec: StepSpec
    hash: str
    url: str
    state: status.State
    rows: int | None
    action: Literal["skip", "run", "blocked"]
    reason: str


def make_plan(cfg: Config, targets: tuple[str, ...] = STEP_NAMES, force: bool = False) -> list[PlannedStep]:
    """Hashes, URLs and states of every step, and what a run of `targets` would do."""
    plan: list[PlannedStep] = []
    by_name: dict[str, PlannedStep] = {}
    for spec in STEPS:
        upstream = {name: by_name[name].hash for name in spec.upstream}
        step_hash = identity.step_hash(
            spec.name, spec.version,
            semantic=identity.semantic_values(spec.name, cfg),
            content=identity.content_fingerprints(spec.name, cfg),
            upstream=upstream,
        )
        url = storage.step_url(cfg.run.root, spec.name, step_hash)
        state = status.output_state(url)
        record = status.read_marker(url) if state == "complete" else None
        rows = record.rows if record else None
        action, reason = _decide(spec, state, rows, spec.name in targets, force, by_name)
        planned = PlannedStep(spec, step_hash, url, state, rows, action, reason)
        plan.append(planned)
        by_name[spec.name] = planned
    return plan


def _decide(spec: StepSpec, state: str, rows: int | None, targeted: bool, force: bool,
            earlier: dict[str, PlannedStep]) -> tuple[str, str]:
    if not targeted:
        return "skip", f"{state}; not selected"
    missing = [n for n in spec.upstream if earlier[n].state != "complete" and earlier[n].action != "run"]
    if missing:
        return "blocked", (f"needs {missing[0]}, which is {earlier[missing[0]].state}: "
                           f"run `pipeline run {missing[0]}` (or `pipeline run all`) first")
    if state == "complete" and not force:
        return "skip", f"complete ({rows} rows); --force reruns it"
    if state == "complete":
        return "run", "complete, but --force: run again"
    changed = [n for n in spec.upstream if earlier[n].action == "run"]
    if state == "partial":
        return "run", "partial output from an earlier attempt: resume"
    if changed:
        return "run", f"no output for this hash ({changed[0]} runs first)"
    return "run", "no output for this hash: run"


def format_plan(plan: list[PlannedStep]) -> str:
    lines = []
    for p in plan:
        lines.append(f"  {p.spec.name:<9} {p.hash[:12]}  {p.action:<7} {p.reason}")
        lines.append(f"  {'':<9} {'':<12}  -> {p.url}")
    return "\n".join(lines)


def preflight(cfg: Config, expect_hosts: int | None = None) -> str:
    """Join the pod, check its size and that every host agrees on code and plan, meet at a barrier."""
    hosts.initialize()
    count = hosts.process_count()
    if expect_hosts is not None and count != expect_hosts:
        missing = ("too many joined" if count > expect_hosts else f"host {count} did not join"
                   if count == expect_hosts - 1 else f"hosts {count}-{expect_hosts - 1} did not join")
        raise ConfigError(f"{hosts.describe()}: the pod has {count} host(s), expected {expect_hosts} "
                          f"(--expect-hosts): {missing}; start the same command on every worker "
                          f"(gcloud ... ssh --worker=all), not on worker 0 only")
    plan = make_plan(cfg)
    with checkpoint_errors():
        check_checkpoint(cfg.model.path)
    hosts.agree("preflight", {"versions": status.package_versions(), "code": code_digest(),
                              "plan": [[p.spec.name, p.hash] for p in plan]}, "code version and plan")
    hosts.barrier("preflight")
    return f"{hosts.describe()}: joined, same code and plan as the leader ({', '.join(p.hash[:12] for p in plan)})"


def code_digest() -> str:
    """sha256 of the pipeline's own source (pipeline/, steps/, engine/): hosts on different checkouts differ."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in ("pipeline", "steps", "engine"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(f"{path.relative_to(root)}\n".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def run_steps(cfg: Config, targets: tuple[str, ...], force: bool = False, dry_run: bool = False,
              echo: Callable[[str], None] | None = None, wait: bool = True) -> list[PlannedStep]:
    """Run `targets` in order on this host (every host calls this); return the plan used.

    Each step runs under a lease on its output (pipeline/storage/lease.py): while another runner
    holds it, wait (or with wait=False raise LeaseBusy, exit 75).
    """
    say = echo or _say
    hosts.initialize()
    plan = make_plan(cfg, targets, force)
    hosts.agree("plan", [[p.spec.name, p.hash] for p in plan], "the plan (step hashes)")
    if hosts.is_leader():
        say(f"pipeline run {'all' if targets == STEP_NAMES else ' '.join(targets)} ({hosts.process_count()} host(s)), resolved config:")
        say(_indent(yaml.safe_dump(cfg.to_dict(), sort_keys=False)))
        say("plan:\n" + format_plan(plan))
    blocked = [p for p in plan if p.action == "blocked"]
    if blocked:
        raise StepFailed(f"cannot run {blocked[0].spec.name}: {blocked[0].reason}")
    if any(p.action == "run" and p.spec.name in ("tokenize", "generate") for p in plan):
        with checkpoint_errors():  # config.json and headers only: seconds
            check_checkpoint(cfg.model.path)  # a bad model.path fails now, not after tokenize
    if dry_run:
        return plan
    by_name = {p.spec.name: p for p in plan}
    for planned in plan:
        if planned.action != "run":
            continue
        preemption.check()
        upstream = {n: by_name[n] for n in planned.spec.upstream}
        out = StepOutput(planned.spec.name, planned.hash, planned.url, upstream)
        started = time.time()
        if hosts.is_leader():
            say(f"[{planned.spec.name}] {planned.reason} -> {planned.url}")
        result = _execute(cfg, planned, out, wait, say)
        if hosts.is_leader() and result is not None:
            say(f"[{planned.spec.name}] complete: {result.rows} rows in {time.time() - started:.1f}s "
                f"{_summary_line(result.summary)}")
        by_name[planned.spec.name] = dataclasses.replace(planned, state="complete",
                                                         rows=result.rows if result else None)
    hosts.barrier("end", "every host to finish")  # nobody leaves while the leader still works
    return plan


def _execute(cfg: Config, planned: PlannedStep, out: StepOutput, wait: bool,
             say: Callable[[str], None]) -> StepResult | None:
    """Run one step under its lease; the leader marks it complete. None on non-leaders."""
    spec = planned.spec
    tag = f"{spec.name}-{planned.hash[:12]}"
    started = _now()
    lease = Lease.for_step(cfg.run.root, spec.name, planned.hash)

    def start() -> dict[str, Any]:
        """Leader: take the lease; skip if another runner completed the step meanwhile."""
        lease.acquire(wait, say)
        if planned.state != "complete" and status.output_state(out.url) == "complete":
            lease.release()
            return {"done_by_other": True, "token": None}
        if planned.state == "complete":
            status.remove_marker(out.url)  # --force: not complete until it finishes again
        stale = storage.remove_temp_files(out.url)  # from a writer killed mid-write
        if stale:
            say(f"[{spec.name}] removed {len(stale)} temp file(s) a killed writer left behind")
        storage.write_text(out.path(status.CONFIG_FILE), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return {"done_by_other": False, "token": lease.token}

    def mark(result: StepResult) -> StepResult:
        _check_result(spec, result)
        out.check_lease()
        status.write_marker(out.url, status.StepRecord(
            step=spec.name, hash=planned.hash, version=spec.version, files=result.files,
            summary=result.summary, rows=result.rows, started_at=started, finished_at=_now(),
            wall_s=round(_elapsed(started), 3), config=cfg.to_dict(),
            upstream={n: p.hash for n, p in out.upstream.items()},
        ))
        return result

    try:
        begun = hosts.from_leader(f"{tag}/start", start, f"the lease on step {spec.name}")
        if begun["done_by_other"]:
            if hosts.is_leader():
                say(f"[{spec.name}] completed by another runner while this one waited: skipped")
            return None
        if not hosts.is_leader():
            lease = Lease.follow(lease.url, lease.what, begun["token"])
        out = dataclasses.replace(out, lease=lease)
        run = _load(spec.entry)
        if spec.where == "leader":
            return hosts.on_leader(tag, lambda: mark(run(cfg, out)), f"step {spec.name}")
        _run_on_every_host(tag, run, cfg, out)

        def finish() -> StepResult:
            for index in range(1, hosts.process_count()):
                outcome = hosts.wait_for(f"{tag}/host-{index}", f"host {index} to finish {spec.name}")
                if not outcome["ok"]:
                    stop = Interrupted if outcome.get("code") == Interrupted.exit_code else StepFailed
                    raise stop(f"{spec.name} failed on host {index}: {outcome['error']}")
            return mark(_load(spec.finish)(cfg, out))

        return hosts.on_leader(f"{tag}/finish", finish, f"step {spec.name} to be checked")
    except BaseException as err:
        if hosts.is_leader():  # tell the pod before letting go, so no host takes it for a takeover
            hosts.abort(f"{type(err).__name__}: {err}", getattr(err, "exit_code", 1))
            if spec.where == "every host":  # and let hosts that are stopping too commit their rows
                hosts.wait_briefly([f"{tag}/host-{i}" for i in range(1, hosts.process_count())])
        raise
    finally:
        if hosts.is_leader():
            lease.release()


def _run_on_every_host(tag: str, run: Callable[..., Any], cfg: Config, out: StepOutput) -> None:
    """Every host runs the step and publishes how it ended (the leader's finish waits for it)."""
    try:
        run(cfg, out)
    except BaseException as err:
        hosts.publish(f"{tag}/host-{hosts.process_index()}", {"ok": False, "error": f"{type(err).__name__}: {err}",
                                                              "code": getattr(err, "exit_code", 1)})
        raise
    hosts.publish(f"{tag}/host-{hosts.process_index()}", {"ok": True})


def _check_result(spec: StepSpec, result: Any) -> None:
    if not isinstance(result, StepResult):
        raise StepFailed(f"step {spec.name} returned {type(result).__name__}, not a StepResult (a bug)")


def _load(entry: str) -> Callable[..., Any]:
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def _summary_line(summary: dict[str, Any]) -> str:
    items = [f"{k}={v}" for k, v in summary.items() if isinstance(v, (int, float, str)) and k != "rows"]
    return f"({', '.join(items[:8])})" if items else ""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def _elapsed(started_iso: str) -> float:
    return (dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(started_iso)).total_seconds()


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.rstrip().splitlines())


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
