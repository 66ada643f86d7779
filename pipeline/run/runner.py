"""The step runner: plan, skip what is complete, run the rest in order, mark success last.

Owns the order of steps (any graph of `step.Step`; the pipeline's is `steps.PIPELINE`), their
hashes and output URLs (through identity.py and storage), the decision to skip, resume or
redo, `--dry-run`, and the success marker. It refuses to run a step whose upstream is not
complete, naming the command that makes it. Steps themselves own their data: a partial output
is handed to the step, which resumes or redoes.

    plan = make_plan(cfg, PIPELINE)                          # hashes, URLs, states, reasons
    run_steps(cfg, PIPELINE, ("tokenize", ...), force=False)  # what `pipeline run all` does
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from pipeline import storage
from pipeline.errors import ConfigError, StepFailed, message_of
from pipeline.pod import hosts, preemption
from pipeline.run import identity, status, steplog
from pipeline.run.checks import check_inputs
from pipeline.run.config import Config
from pipeline.run.step import Step, StepInput, StepOutput, StepResult, ancestors, in_order
from pipeline.storage.lease import Lease


@dataclass(frozen=True)
class PlannedStep:
    step: Step
    hash: str
    url: str
    state: status.State
    rows: int | None
    action: Literal["skip", "run", "blocked"]
    reason: str
    damaged: str | None = None
    """Why the output's marker cannot be read, where one is there and does not parse (`partial`)."""
    record: status.StepRecord | None = None
    """The output's record, as the plan found it (complete)."""
    content: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The input files' fingerprints the hash covers, as the plan read them."""
    since: str | None = None
    """Where there is no output for the hash: what changed since the step's output made last."""
    running: str | None = None
    """Who holds the lease on the step's output now (`Holder.describe`), where it is not complete."""
    made_from: str | None = None
    """Where the output is complete but an input it was made from is gone now (`_made_from_gone`):
    that input, in words."""

    @property
    def name(self) -> str:
        return self.step.name

    def as_input(self) -> StepInput:
        return StepInput(self.step.name, self.hash, self.url)


def make_plan(cfg: Config, graph: tuple[Step, ...], targets: tuple[str, ...] | None = None,
              force: bool = False, again: str = "--config FILE") -> list[PlannedStep]:
    """Hashes, URLs and states of every step of `graph`, and what a run of `targets` (default:
    every step) would do. `again`: the command's config arguments (`--config` and every `--set`),
    for the commands a reason names."""
    targets = tuple(s.name for s in graph) if targets is None else targets
    plan: list[PlannedStep] = []
    by_name: dict[str, PlannedStep] = {}
    for step in in_order(graph):
        content = identity.content_fingerprints(step.name, cfg)
        semantic = identity.semantic_values(step.name, cfg)
        upstream = {s.name: by_name[s.name].hash for s in step.inputs}
        gone = [kind for kind, fingerprints in content.items() if not fingerprints]
        made_from_gone = _made_from_gone(cfg, step, content, gone, semantic, upstream) if gone else None
        if made_from_gone is not None:
            content = made_from_gone.content
        step_hash = identity.step_hash(step.name, step.version, semantic, content, upstream)
        url = storage.step_url(cfg.run.root, step.name, step_hash)
        state, record, damaged = status.inspect(url)
        if state == "missing" and (earlier := identity.earlier_semantic_values(step.name, cfg)) != semantic:
            # An output hashed by the rule before UNREAD_WHEN_GREEDY, complete or partial, is this one.
            earlier_hash = identity.step_hash(step.name, step.version, earlier, content, upstream)
            earlier_url = storage.step_url(cfg.run.root, step.name, earlier_hash)
            if (found := status.inspect(earlier_url))[0] != "missing":
                step_hash, url, (state, record, damaged) = earlier_hash, earlier_url, found
        rows = record.rows if record else None
        since = _since_last(cfg, step, content, upstream) if state == "missing" else None
        action, reason = _decide(step, state, rows, step.name in targets, force, by_name, again, since)
        made_from = f"made from {identity.describe_gone(cfg, gone)} now" if made_from_gone and state == "complete" else None
        if made_from:
            reason += f"; {made_from}"
        redo = step.redo(cfg, record, url) if action == "skip" and state == "complete" and step.redo else None
        if redo:
            action, reason = "run", redo
        if damaged and action == "run":
            reason = f"its {status.MARKER} cannot be read ({damaged}): run it again"
        holder = Lease.for_step(cfg.run.root, step.name, step_hash).current_holder() if state != "complete" else None
        running = holder.describe() if holder is not None else None
        if running and action == "run":  # the run waits for it (or, with --no-wait, exits 75)
            reason = f"being run by {running}: wait for it ({reason})"
        planned = PlannedStep(step, step_hash, url, state, rows, action, reason, damaged, record, content, since, running,
                              made_from)
        plan.append(planned)
        by_name[step.name] = planned
    return plan


def _made_from_gone(cfg: Config, step: Step, content: dict[str, Any], gone: list[str], semantic: dict[str, Any],
                    upstream: dict[str, str]) -> status.StepRecord | None:
    """Where an input of `step` is gone (prompt files deleted, a model folder moved), the record of
    its complete output made from that input while it was there, with everything else as now, or
    None. Its hash stands in, so a finished result stays reachable (`show`, `run upload`) after its
    inputs are cleaned up; a step that must read the input still fails. Only where one output
    matches: of two made from other files at that path, which one the config means is unknown."""
    # Named by the same path then, or a typo in model.path would find another model's rows.
    paths = {identity.INPUT_KEYS[kind] for kind in gone}
    matching = {record.hash: record for _, record in status.complete_outputs(cfg.run.root, step.name)
                if all(identity.at(record.config, key, None) == cfg.get(key) for key in paths)
                and all(record.content.get(kind) == value for kind, value in content.items() if value)
                and identity.step_hash(step.name, step.version, semantic, record.content, upstream) == record.hash}
    return next(iter(matching.values())) if len(matching) == 1 else None


def _since_last(cfg: Config, step: Step, content: dict[str, Any], upstream: dict[str, str]) -> str | None:
    """For a step with no output for its hash: what differs from its output made last (another
    hash), as 'prompts file X changed since tokenize-1a2b3c4d5e6f', or None where there is none."""
    last = status.latest_complete(cfg.run.root, step.name)
    if last is None:
        return None
    url, record = last
    change = identity.what_changed(step.name, step.version, cfg, content, upstream, record)
    return f"{change} since {url.rstrip('/').split('/')[-1]}" if change else None


def _decide(step: Step, state: str, rows: int | None, targeted: bool, force: bool,
            earlier: dict[str, PlannedStep], again: str, since: str | None = None) -> tuple[str, str]:
    if not targeted:
        return "skip", f"{state}; not selected"
    upstream = [s.name for s in step.inputs]
    missing = [n for n in upstream if earlier[n].state != "complete" and earlier[n].action != "run"]
    if missing:
        why = earlier[missing[0]].since
        return "blocked", (f"needs {missing[0]}, which is {earlier[missing[0]].state}{f' ({why})' if why else ''}: "
                           f"run `pipeline run {missing[0]} {again}` (or `pipeline run all {again}`) first")
    if state == "complete" and not force:
        return "skip", f"complete ({rows} rows); --force reruns it"
    if state == "complete":
        return "run", "complete, but --force: run again"
    changed = [n for n in upstream if earlier[n].action == "run"]
    if state == "partial":
        return "run", "partial output from an earlier attempt: resume"
    if changed:
        return "run", f"no output for this hash ({changed[0]} runs first)"
    return "run", f"no output for this hash ({since}): run" if since else "no output for this hash: run"


def format_plan(plan: list[PlannedStep], with_urls: bool = False) -> str:
    """One line per step: its hash, what a run does and why (`with_urls`: a second line, its output)."""
    lines = []
    for p in plan:
        lines.append(f"  {p.name:<9} {p.hash[:12]}  {p.action:<7} {p.reason}")
        if with_urls:
            lines.append(f"  {'':<9} {'':<12}  -> {p.url}")
    return "\n".join(lines)


def preflight(cfg: Config, graph: tuple[Step, ...], expect_hosts: int | None = None) -> str:
    """Join the pod, check its size and that every host agrees on code and plan, meet at a barrier."""
    hosts.initialize()
    count = hosts.process_count()
    if expect_hosts is not None and count != expect_hosts:
        missing = ("too many joined" if count > expect_hosts else f"host {count} did not join"
                   if count == expect_hosts - 1 else f"hosts {count}-{expect_hosts - 1} did not join")
        raise ConfigError(f"{hosts.describe()}: the pod has {count} host(s), expected {expect_hosts} "
                          f"(--expect-hosts): {missing}; start the same command on every worker "
                          f"(gcloud ... ssh --worker=all), not on worker 0 only")
    plan = make_plan(cfg, graph)
    check_inputs(cfg, {p.name for p in plan}, is_leader=hosts.is_leader())  # what `run all` will need
    hosts.agree("preflight", {"versions": status.package_versions(), "code": code_digest(),
                              "run.root": storage.normalize(cfg.run.root), "plan": {p.name: p.hash for p in plan}},
                "code version and plan")
    check_shared_root(cfg)
    hosts.barrier("preflight")
    return f"{hosts.describe()}: joined, same code and plan as the leader ({', '.join(p.hash[:12] for p in plan)})"


def check_shared_root(cfg: Config) -> None:
    """On a pod, every host sees what the leader writes under run.root: the leader writes a probe,
    each host looks for it (a local or memory:// root on hosts of their own disks gave each host
    its own step folders, and a run that failed at generate naming a `pipeline run tokenize` that
    fixed nothing). A ConfigError on every host, naming the hosts that do not see it."""
    if not hosts.joined():
        return
    root = storage.normalize(cfg.run.root)
    fix = (f"run.root {cfg.run.root} must be storage every host of the pod shares (gs://BUCKET/PREFIX, or a "
           f"shared file system)")
    if hosts.is_leader():
        probe = storage.join(root, ".leases", f"shared-by-the-pod-{secrets.token_hex(6)}")
        storage.write_text(probe, "")
        hosts.publish("shared-root/probe", probe)
        try:
            blind = [host for host in range(1, hosts.process_count())
                     if not hosts.wait_for(f"shared-root/{host}", f"host {host} to look under run.root")]
        finally:
            storage.remove(probe)
        if blind:
            raise ConfigError(f"{hosts.describe()}: host(s) {', '.join(map(str, blind))} do not see the leader's files "
                              f"under run.root: {fix}")
        return
    probe = hosts.wait_for("shared-root/probe", "the leader's file under run.root")
    seen = storage.exists(probe)
    hosts.publish(f"shared-root/{hosts.process_index()}", seen)
    if not seen:
        raise ConfigError(f"{hosts.describe()}: this host does not see the leader's files under run.root ({probe} "
                          f"is not there): {fix}")


def code_digest() -> str:
    """sha256 of the pipeline's own source (pipeline/, steps/, engine/): hosts on different checkouts differ."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in ("pipeline", "steps", "engine"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(f"{path.relative_to(root)}\n".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def run_steps(cfg: Config, graph: tuple[Step, ...], targets: tuple[str, ...], force: bool = False,
              dry_run: bool = False, echo: Callable[[str], None] | None = None,
              wait: bool = True, verbose: bool = False, again: str = "--config FILE") -> list[PlannedStep]:
    """Run `targets` of `graph` in order on this host (every host calls this); return the plan used.

    Each step runs under a lease on its output (pipeline/storage/lease.py): while another runner
    holds it, wait (or with wait=False raise LeaseBusy, exit 75). The leader prints the plan, one
    summary line per step and where the result is; `verbose` adds the resolved config (it is in
    every step folder as config.yaml anyway) and output URLs. Each host's lines during a step also
    go to the step's log (pipeline/run/steplog.py).
    """
    say = echo or _say
    hosts.initialize()
    plan = make_plan(cfg, graph, targets, force, again)
    hosts.agree("plan", {"run.root": storage.normalize(cfg.run.root), **{p.name: p.hash for p in plan}},
                "the plan (run root and step hashes)")
    plan = _leaders_actions(plan)
    if hosts.is_leader():
        everything = set(targets) == {p.name for p in plan}
        command = f"pipeline run {'all' if everything else ' '.join(targets)}"
        if verbose:
            say(f"{command}, resolved config:\n{_indent(yaml.safe_dump(cfg.to_dict(), sort_keys=False))}")
        say(f"plan ({hosts.process_count()} host{'s' if hosts.process_count() != 1 else ''}, run root "
            f"{cfg.run.root}):\n" + format_plan(plan, with_urls=verbose))
        if any(p.name == "generate" and p.action == "run" for p in plan):
            for note in _greedy_notes(cfg):
                say(f"note: {note}")
    blocked = [p for p in plan if p.action == "blocked"]
    if blocked:
        raise StepFailed(f"cannot run {blocked[0].name}: {blocked[0].reason}")
    # Every input of the steps about to run (model headers, prompt files, run.root, W&B key): in
    # seconds, before any step folder or lease exists, so a bad input leaves nothing behind.
    check_inputs(cfg, {p.name for p in plan if p.action == "run"}, is_leader=hosts.is_leader(), dry_run=dry_run)
    if dry_run:
        return plan
    check_shared_root(cfg)  # on every host, whatever its plan does: hosts that see other roots plan apart
    by_name = {p.name: p for p in plan}
    for planned in plan:
        if planned.action != "run":
            continue
        preemption.check()
        upstream = {s.name: by_name[s.name].as_input() for s in ancestors(planned.step)}
        out = StepOutput(planned.name, planned.hash, planned.url, upstream)
        started = time.time()
        if hosts.is_leader() and verbose:
            say(f"[{planned.name}] {planned.reason} -> {planned.url}")
        result = _execute(cfg, planned, out, wait, say)
        if hosts.is_leader() and result is not None:
            say(f"[{planned.name}] complete: {result.rows:,} rows in {time.time() - started:.1f}s "
                f"{_summary_line(result.summary_dict())}")
        by_name[planned.name] = dataclasses.replace(planned, state="complete", rows=result.rows if result else None)
    hosts.barrier("end", "every host to finish")  # nobody leaves while the leader still works
    if hosts.is_leader():
        if preemption.stop_requested():  # heard after the last place a step could stop: its work stands
            say(f"{preemption.stop_reason()} came as the last step was finishing: every step is complete, "
                f"nothing was stopped")
        _say_result(by_name, say)
    return plan


def _greedy_notes(cfg: Config) -> list[str]:
    """What a greedy generate (sampling.temperature 0) makes of sampling settings meant for
    sampling, as transformers' generate warns of them (a temperature left out of the config?)."""
    if cfg.sampling.temperature != 0:
        return []
    notes = []
    unread = [f"{key} {identity.canonical_json(cfg.get(key))}" for key, default in identity.UNREAD_WHEN_GREEDY.items()
              if cfg.get(key) != default]
    if unread:
        notes.append(f"{', '.join(unread)} {'is' if len(unread) == 1 else 'are'} not read: sampling.temperature is 0 "
                     f"(greedy decoding)")
    if (n := cfg.sampling.n) > 1:
        notes.append(f"sampling.n is {n} with greedy decoding: each prompt's {n} samples get the same tokens")
    return notes


def _leaders_actions(plan: list[PlannedStep]) -> list[PlannedStep]:
    """On a pod, what the leader's plan does with each step, on every host. A host's own look at the
    storage, a moment apart from the leader's, can differ (a step another runner finished meanwhile,
    a listing that failed for a `Step.redo`): a host that ran a step the leader skipped waited for
    the leader in it while the leader waited at the end (one that skipped a generate the leader ran
    would leave the leader waiting for its report), and the pod hung."""
    leaders = hosts.on_leader("plan/actions", lambda: {p.name: [p.action, p.reason] for p in plan},
                              "the leader's plan")
    return [dataclasses.replace(p, action=leaders[p.name][0], reason=leaders[p.name][1]) for p in plan]


def _say_result(by_name: dict[str, PlannedStep], say: Callable[[str], None]) -> None:
    """The last line: where the merged result of this config is (two samplings: two results)."""
    from pipeline.run.result import merged_result

    merge = by_name.get("merge")
    merged = merged_result(merge.url) if merge is not None and merge.state == "complete" else None
    if merged is not None:
        say(f"result: {merged.describe()}")


def _execute(cfg: Config, planned: PlannedStep, out: StepOutput, wait: bool,
             say: Callable[[str], None]) -> StepResult | None:
    """Run one step under its lease; the leader marks it complete. None on non-leaders, and when
    another runner completed the step while this one waited for the lease."""
    step, tag = planned.step, f"{planned.name}-{planned.hash[:12]}"
    started = _now()
    lease = Lease.for_step(cfg.run.root, step.name, planned.hash)
    forced: list[_Forced] = []  # the leader's, when --force runs a complete step again
    try:
        token = hosts.on_leader(f"{tag}/start", lambda: _begin(cfg, planned, out, lease, wait, say, forced),
                                f"the lease on step {step.name}")
        if token is None:
            if hosts.is_leader():
                say(f"[{step.name}] completed by another runner while this one waited: skipped")
            return None
        out = dataclasses.replace(out, lease=lease if hosts.is_leader() else Lease.follow(lease.url, lease.what, token))
        with steplog.step_log(out.url, hosts.process_index(),  # under the lease: one writer per log
                              works=step.on == "every host" or hosts.is_leader()):
            if step.on == "leader":
                return hosts.on_leader(tag, lambda: _mark(cfg, planned, out, started, step.run(cfg, out)),
                                       f"step {step.name}")
            hosts.run_and_report(f"{tag}/host-{hosts.process_index()}", lambda: step.run(cfg, out))
            return hosts.on_leader(f"{tag}/finish",
                                   lambda: _mark(cfg, planned, out, started, _finish(cfg, step, out, tag)),
                                   f"step {step.name} to be checked")
    except BaseException as err:
        if hosts.is_leader():  # tell the pod before letting go, so no host takes it for a takeover
            hosts.abort(message_of(err), getattr(err, "exit_code", 1))
            settled = step.on != "every host" or hosts.wait_briefly(  # and let hosts that are stopping
                [f"{tag}/host-{i}" for i in range(1, hosts.process_count())])  # too commit their rows
            if forced and settled:
                forced[0].put_back_if_untouched(out.url, lease, say)
        raise
    finally:
        if hosts.is_leader():
            lease.release()


@dataclass(frozen=True)
class _Forced:
    """A complete step run again (--force, or its `redo`), as it was: its record and its files."""

    name: str
    record: status.StepRecord
    files: dict[str, tuple[str, ...]]

    def put_back_if_untouched(self, out_url: str, lease: Lease, say: Callable[[str], None]) -> None:
        """After the run failed: where it changed none of the step's files (a check that failed
        first, a preemption before the first write), the step is complete as it was, not partial.
        Never raises: the run's own error is what the user must see."""
        try:
            lease.check()  # a runner that took the step over may be writing it
            if status.data_files(out_url) == self.files:
                status.write_marker(out_url, self.record)
                say(f"[{self.name}] failed before it changed any of its files: still complete, as it was "
                    f"({self.record.rows} rows)")
        except Exception:  # noqa: BLE001 - left partial: the next run makes it again
            pass


def _begin(cfg: Config, planned: PlannedStep, out: StepOutput, lease: Lease, wait: bool,
           say: Callable[[str], None], forced: list[_Forced]) -> str | None:
    """Leader: take the lease and prepare the output folder; returns the lease token for the other
    hosts, or None if another runner completed the step meanwhile. Running a complete step again
    (--force) keeps its record and its files' listing in `forced`."""
    lease.acquire(wait, say)
    if planned.state != "complete" and status.output_state(out.url) == "complete":
        lease.release()
        return None
    if planned.state == "complete" and (record := status.read_marker(out.url)) is not None:
        files = status.data_files(out.url)
        if all(f["path"] in files for f in record.files):  # not one deleted by hand, to be made again
            forced.append(_Forced(planned.name, record, files))
    if planned.state == "complete":
        status.remove_marker(out.url)  # --force: not complete until it finishes again (or fails untouched)
    stale = storage.remove_temp_files(out.url)  # from a writer killed mid-write
    if stale:
        say(f"[{planned.name}] removed {len(stale)} temp file(s) a killed writer left behind")
    storage.write_text(out.path(status.CONFIG_FILE), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return lease.token


def _finish(cfg: Config, step: Step, out: StepOutput, tag: str) -> StepResult:
    """Leader, for an every-host step: wait for every host's report, then the step's finish."""
    for index in range(1, hosts.process_count()):
        hosts.await_report(f"{tag}/host-{index}", step.name, index)
    return step.finish(cfg, out)


def _mark(cfg: Config, planned: PlannedStep, out: StepOutput, started: str, result: Any) -> StepResult:
    """Leader: check the step's result and write its success marker (last)."""
    _check_result(planned.step, result)
    changed = identity.changed_input(planned.name, cfg, planned.content)
    if changed:
        raise StepFailed(f"{changed} while {planned.name} ran: its output is not what its hash says, so it is not "
                         f"marked complete; rerun the same command to {planned.name} the files as they are now")
    out.check_lease()
    status.write_marker(out.url, status.StepRecord(
        step=planned.name, hash=planned.hash, version=planned.step.version, files=result.files,
        summary=result.summary_dict(), rows=result.rows, started_at=started, finished_at=_now(),
        wall_s=round(_elapsed(started), 3), config=cfg.to_dict(),
        upstream={s.name: out.upstream[s.name].hash for s in planned.step.inputs}, content=planned.content,
    ))
    return result


def _check_result(step: Step, result: Any) -> None:
    if not isinstance(result, StepResult) or not dataclasses.is_dataclass(result.summary):
        raise StepFailed(f"step {step.name} returned {type(result).__name__}, not a StepResult with a summary "
                         f"dataclass (a bug)")


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
