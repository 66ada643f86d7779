"""`pipeline tpu run`: run the pipeline on every worker of a Cloud TPU and babysit it.

Owns the gcloud command lines (`compute tpus tpu-vm` and `compute tpus queued-resources`:
create, describe, delete, ssh), reading `describe --format=json`, and the babysitter: make
sure the TPU is READY (recreating a preempted spot or queued one), run `pipeline preflight
--expect-hosts N` on every worker, then the user's `pipeline run ...` on every worker, and
on a preemption do it all again (the run resumes) up to a retry budget, one JSON line per
attempt in the attempt log. It refuses to recreate an on-demand TPU, to retry a pipeline
that failed (exit 1) or was misconfigured (exit 2), and to babysit `--force`, which would
redo finished work on every retry. gcloud is found on PATH at each call, so tests put a
fake one first; every command is an argv list, the remote command is quoted with shlex.

    tpu = Tpu("my-tpu", zone="us-east5-a", accelerator_type="v5p-16", runtime_version="v2-alpha-tpuv5", spot=True)
    babysit(tpu, Remote(["run", "all", "--config", "configs/x.yaml"]), Policy(retries=5), log="attempts.jsonl")
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.pod import preemption
from pipeline.errors import ConfigError, Interrupted, StepFailed

READY = "READY"
ACTIVE = "ACTIVE"
"""A queued resource holding its node."""
MISSING = "MISSING"
"""Our name for `describe` answering NOT_FOUND."""
GONE = frozenset({MISSING, "PREEMPTED", "TERMINATED", "STOPPED", "FAILED", "SUSPENDED", "SUSPENDING", "STOPPING"})
"""States a TPU does not come back from by itself: recreate it (spot or queued only)."""
SSH_FAILED = 255
"""ssh's own exit code: the worker could not be reached or the connection dropped."""


@dataclass(frozen=True)
class Tpu:
    """One TPU VM (or the queued resource of the same name that holds it) and how to recreate it."""

    name: str
    zone: str
    project: str | None = None
    accelerator_type: str | None = None
    """e.g. v5p-16; read from `describe` when not given."""
    runtime_version: str | None = None
    """e.g. v2-alpha-tpuv5; read from `describe` when not given."""
    spot: bool = False
    """A spot TPU: recreated when preempted."""
    queued: bool = False
    """Created through a queued resource named like the TPU (always recreated when gone)."""

    def _where(self) -> list[str]:
        return [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])

    def describe_argv(self) -> list[str]:
        return ["gcloud", "compute", "tpus", "tpu-vm", "describe", self.name, *self._where(), "--format=json"]

    def queued_describe_argv(self) -> list[str]:
        return ["gcloud", "compute", "tpus", "queued-resources", "describe", self.name, *self._where(), "--format=json"]

    def create_argv(self) -> list[str]:
        if not (self.accelerator_type and self.runtime_version):
            raise ConfigError(f"TPU {self.name} does not exist in {self.zone}: give --accelerator-type and "
                              f"--runtime-version to create it")
        spot = ["--spot"] if self.spot else []
        if self.queued:
            return ["gcloud", "compute", "tpus", "queued-resources", "create", self.name, f"--node-id={self.name}",
                    *self._where(), f"--accelerator-type={self.accelerator_type}",
                    f"--runtime-version={self.runtime_version}", *spot]
        return ["gcloud", "compute", "tpus", "tpu-vm", "create", self.name, *self._where(),
                f"--accelerator-type={self.accelerator_type}", f"--version={self.runtime_version}", *spot]

    def delete_argv(self) -> list[str]:
        if self.queued:  # --force deletes the node with its queued resource
            return ["gcloud", "compute", "tpus", "queued-resources", "delete", self.name, *self._where(),
                    "--force", "--quiet"]
        return ["gcloud", "compute", "tpus", "tpu-vm", "delete", self.name, *self._where(), "--quiet"]

    def ssh_argv(self, worker: int, command: str) -> list[str]:
        return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", self.name, *self._where(), f"--worker={worker}",
                "--quiet", f"--command={command}"]


@dataclass(frozen=True)
class Node:
    """What `describe` says: the state and, when READY, the workers."""

    state: str
    hosts: int = 0
    """Workers (network endpoints): the expected `jax.process_count()`."""
    accelerator_type: str | None = None
    runtime_version: str | None = None
    spot: bool = False
    error: str = ""
    """gcloud's last line when describe failed for another reason than NOT_FOUND."""


def parse_node(text: str) -> Node:
    """A Node from `gcloud compute tpus tpu-vm describe --format=json`."""
    data = json.loads(text)
    scheduling = data.get("schedulingConfig") or {}
    return Node(state=data.get("state", "UNKNOWN"), hosts=len(data.get("networkEndpoints") or []),
                accelerator_type=data.get("acceleratorType"), runtime_version=data.get("runtimeVersion"),
                spot=bool(scheduling.get("spot") or scheduling.get("preemptible")))


def parse_queued_state(text: str) -> str:
    """The state of `gcloud compute tpus queued-resources describe --format=json` (e.g. ACTIVE)."""
    state = json.loads(text).get("state") or {}
    return state.get("state", "UNKNOWN") if isinstance(state, dict) else str(state)


@dataclass(frozen=True)
class Remote:
    """What runs on each worker: `cd WORKDIR && SETUP && PIPELINE ARGS...`."""

    run_args: list[str]
    """The pipeline command after `pipeline`, e.g. ["run", "all", "--config", "configs/x.yaml"]."""
    workdir: str = "jax-batch-pipeline"
    """The checkout on each worker, relative to the home folder (or absolute)."""
    setup: str | None = None
    """Shell run in `workdir` before each attempt, e.g. `git pull && bash scripts/setup.sh`."""
    pipeline: str = ".venv/bin/pipeline"

    def __post_init__(self) -> None:
        if self.run_args[:1] != ["run"] or len(self.run_args) < 2:
            raise ConfigError(f"tpu run: expected `-- run STEP --config FILE ...` after the options, "
                              f"got {shlex.join(self.run_args) or 'nothing'}")
        if "--force" in self.run_args or "--dry-run" in self.run_args:
            raise ConfigError("tpu run: --force and --dry-run do not belong in a babysat run (--force would redo "
                              "finished work on every retry): run them by hand once")

    def preflight_command(self, hosts: int) -> str:
        """`pipeline preflight` with the run's --config and --set values (its other options are the run's own)."""
        kept, args = [], self.run_args[2:]
        for i, arg in enumerate(args):
            if arg.split("=", 1)[0] in ("--config", "-c", "--set"):
                kept += [arg] if "=" in arg and arg.startswith("--") else [arg, *args[i + 1:i + 2]]
        return self._command(["preflight", *kept, "--expect-hosts", str(hosts)])

    def run_command(self) -> str:
        return self._command(self.run_args)

    def _command(self, args: list[str]) -> str:
        parts = [f"cd {shlex.quote(self.workdir)}"] + ([self.setup] if self.setup else [])
        return " && ".join(parts + [shlex.join([self.pipeline, *args])])


@dataclass(frozen=True)
class Policy:
    retries: int = 5
    """Reruns after the first attempt."""
    backoff_s: float = 60.0
    """Wait before the first rerun; doubles each time up to max_backoff_s."""
    max_backoff_s: float = 900.0
    poll_s: float = 30.0
    """How often `describe` is asked while waiting for READY."""
    ready_timeout_s: float = 86400.0
    """Longest wait for READY (a queued resource may wait for capacity for hours)."""


@dataclass
class Attempt:
    """One line of the attempt log."""

    attempt: int
    started_at: str
    tpu: str
    actions: list[str] = field(default_factory=list)
    """gcloud actions taken to get a READY TPU: create, delete."""
    hosts: int = 0
    stage: str = "ready"
    """How far it got: ready (waiting for the TPU), preflight, run."""
    exit_codes: dict[str, int] = field(default_factory=dict)
    """Per worker index, the exit code of its ssh (255: unreachable)."""
    state_after: str | None = None
    outcome: str = ""
    """done, retry or stop."""
    reason: str = ""
    finished_at: str = ""


class _Retry(Exception):
    """This attempt failed in a way a fresh attempt can fix (preemption, a lost host, capacity)."""


def babysit(tpu: Tpu, remote: Remote, policy: Policy, log: str | Path,
            echo: Callable[[str], None] | None = None, sleep: Callable[[float], None] = time.sleep) -> str:
    """Run `remote` on every worker until it succeeds; return a one-line summary.

    Raises StepFailed / ConfigError when the pipeline fails for a reason a rerun cannot fix
    (its exit 1 / 2 on a READY TPU), Interrupted (exit 75) when the retry budget is spent.
    """
    say = echo or _say
    attempts = policy.retries + 1
    for number in range(1, attempts + 1):
        record = Attempt(number, _now(), tpu.name)
        say(f"[tpu] attempt {number}/{attempts} on {tpu.name}")
        try:
            tpu = _attempt(tpu, remote, policy, record, say, sleep)
            record.outcome, record.reason = "done", f"{shlex.join(remote.run_args[:2])} finished on every worker"
        except _Retry as err:
            record.outcome, record.reason = "retry", str(err)
        except (StepFailed, ConfigError, Interrupted) as err:
            record.outcome, record.reason = "stop", str(err)
            _log(log, record, say)
            raise
        _log(log, record, say)
        if record.outcome == "done":
            return f"{tpu.name}: done after {number} attempt(s); attempt log: {log}"
        if number < attempts:
            wait_s = min(policy.backoff_s * 2 ** (number - 1), policy.max_backoff_s)
            say(f"[tpu] rerunning in {wait_s:.0f}s (the run resumes where it stopped)")
            _sleep(sleep, wait_s)
    raise Interrupted(f"gave up on {tpu.name} after {attempts} attempts (last: {record.reason}); finished work is "
                      f"kept: rerun the same `pipeline tpu run` command to resume (attempt log: {log})")


def _attempt(tpu: Tpu, remote: Remote, policy: Policy, record: Attempt, say: Callable[[str], None],
             sleep: Callable[[float], None]) -> Tpu:
    tpu, node = _ensure_ready(tpu, policy, record, say, sleep)
    record.hosts = node.hosts
    for stage, command in (("preflight", remote.preflight_command(node.hosts)), ("run", remote.run_command())):
        record.stage = stage
        say(f"[tpu] {stage} on {node.hosts} worker(s): {command}")
        results = run_on_workers(tpu, node.hosts, command, say)
        preemption.check()
        record.exit_codes = {str(w): code for w, (code, _) in results.items()}
        if any(code for code, _ in results.values()):
            record.state_after = describe(tpu).state
            _judge(stage, results, record.state_after, tpu.name)
    record.state_after = READY
    return tpu


def _judge(stage: str, results: dict[int, tuple[int, str]], state: str, name: str) -> None:
    """Raise _Retry or a stopping error for a round in which some worker failed."""
    failed = {w: r for w, r in results.items() if r[0]}
    detail = "; ".join(_worker_line(w, code, line) for w, (code, line) in failed.items())
    if state != READY:
        raise _Retry(f"{name} is {state} after {stage} ({detail})")
    codes = [code for code, _ in failed.values()]
    if 2 in codes:
        raise ConfigError(f"{stage} failed with a usage or config error, not retried: {detail}")
    if stage == "preflight":
        if codes.count(SSH_FAILED) == len(results):
            raise _Retry(f"no worker of {name} answered ssh ({detail})")
        if any(code != preemption.EXIT_INTERRUPTED for code in codes):
            raise StepFailed(f"preflight failed on {name} before any work, not retried: {detail}")
    # A preempted or lost host (75, killed, ssh dropped) makes its peers fail with exit 1
    # ("host N stopped responding"): those follow from the first and are retried with it.
    if any(code == preemption.EXIT_INTERRUPTED or code >= 128 for code in codes):
        raise _Retry(f"{stage} interrupted ({detail})")
    raise StepFailed(f"{stage} failed on {name}, not retried: {detail}")


def _worker_line(worker: int, code: int, line: str) -> str:
    if code == SSH_FAILED:
        return f"worker {worker} unreachable (ssh exit {code}" + (f": {line})" if line else ")")
    return f"worker {worker} exit {code}" + (f" ({line})" if line else "")


def _ensure_ready(tpu: Tpu, policy: Policy, record: Attempt, say: Callable[[str], None],
                  sleep: Callable[[float], None]) -> tuple[Tpu, Node]:
    """Wait until the TPU is READY, creating it or recreating a gone spot/queued one (once per attempt)."""
    deadline = time.monotonic() + policy.ready_timeout_s
    while True:
        preemption.check()
        node = describe(tpu)
        tpu = _learn(tpu, node)
        if node.state == READY and node.hosts:
            say(f"[tpu] {tpu.name} is READY with {node.hosts} worker(s)")
            return tpu, node
        if node.error:
            raise _Retry(f"gcloud could not describe {tpu.name} ({node.error})")
        if node.state in GONE:
            if record.actions:
                raise _Retry(f"{tpu.name} went {node.state} right after it was recreated")
            if node.state != MISSING:
                if not (tpu.spot or tpu.queued):
                    raise StepFailed(f"{tpu.name} is {node.state} and is an on-demand TPU, which the babysitter "
                                     f"does not recreate: start or recreate it, then rerun")
                _gcloud(tpu.delete_argv(), f"delete {tpu.name}", say)
                record.actions.append("delete")
            _gcloud(tpu.create_argv(), f"create {tpu.name}", say)
            record.actions.append("create")
            continue
        if time.monotonic() > deadline:
            raise _Retry(f"{tpu.name} not READY after {policy.ready_timeout_s:.0f}s (state {node.state})")
        say(f"[tpu] {tpu.name} is {node.state}; waiting for READY")
        _sleep(sleep, policy.poll_s)


def _learn(tpu: Tpu, node: Node) -> Tpu:
    """Fill what the user left out (type, version, spot) from what describe says, to recreate alike."""
    return Tpu(tpu.name, tpu.zone, tpu.project, tpu.accelerator_type or node.accelerator_type,
               tpu.runtime_version or node.runtime_version, tpu.spot or node.spot, tpu.queued)


def describe(tpu: Tpu) -> Node:
    """The node's state (for a queued resource that is not ACTIVE yet: the queued resource's)."""
    if tpu.queued:
        done = _run(tpu.queued_describe_argv())
        if done.returncode:
            return _failed(done, tpu.name)
        state = parse_queued_state(done.stdout)
        if state != ACTIVE:
            return Node(state)
    done = _run(tpu.describe_argv())
    return _failed(done, tpu.name) if done.returncode else parse_node(done.stdout)


_SETUP_PROBLEMS = (
    (("property [project] is not currently set", "core/project"),
     "set the project: --project ID, or `gcloud config set project ID`"),
    (("do not currently have an active account", "Reauthentication", "invalid_grant"),
     "log in: `gcloud auth login`, or activate a service account"),
    (("PERMISSION_DENIED",), "give this account the Cloud TPU permission the error names"),
    (("SERVICE_DISABLED", "has not been used in project"), "enable the Cloud TPU API in the project"),
    (("INVALID_ARGUMENT", "unrecognized arguments", "Invalid value for"),
     "check --zone, --accelerator-type and --runtime-version"),
)
"""gcloud's answers that no wait fixes, each with what does: retried as a preemption, a project not
set ran through the whole retry budget (half an hour) to an exit 75. Not "gcloud auth login" alone:
gcloud adds it to every failed token refresh, a dropped connection's too."""

_PASSING = ("Connection", "connection", "timed out", "Timeout", "UNAVAILABLE", "DEADLINE_EXCEEDED", "metadata",
            "Internal Server Error", "Service Unavailable")
"""Words of a failure that may pass, whatever else gcloud says with them: retried."""


def _refuse_setup_problem(done: subprocess.CompletedProcess, what: str) -> None:
    """Raise a ConfigError (exit 2, not retried) where gcloud failed for its own setup."""
    text = f"{done.stderr}\n{done.stdout}"
    if any(word in text for word in _PASSING):
        return
    for needles, fix in _SETUP_PROBLEMS:
        if any(needle in text for needle in needles):
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            said = next((line for line in lines if line.startswith("ERROR:")), lines[0] if lines else "no output")
            raise ConfigError(f"gcloud could not {what} (exit {done.returncode}): {said}: {fix}, then rerun "
                              f"(not retried: waiting does not fix it)")


def _failed(done: subprocess.CompletedProcess, name: str) -> Node:
    _refuse_setup_problem(done, f"describe {name}")
    if "NOT_FOUND" in done.stderr or "not found" in done.stderr.lower():
        return Node(MISSING)
    lines = (done.stderr or done.stdout).strip().splitlines()
    return Node("UNKNOWN", error=f"exit {done.returncode}: {lines[-1] if lines else 'no output'}")


def run_on_workers(tpu: Tpu, hosts: int, command: str, say: Callable[[str], None]) -> dict[int, tuple[int, str]]:
    """`command` on every worker at once, one ssh each (so each worker's exit code is known).

    Output lines are prefixed `[worker i]`; returns, per worker, its exit code and its last
    `error:` line (or last line), which names what went wrong there.
    """
    procs = [subprocess.Popen(_resolve(tpu.ssh_argv(w, command)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1) for w in range(hosts)]
    last: dict[int, str] = {}
    pumps = [threading.Thread(target=_pump, args=(p, w, last, say), daemon=True) for w, p in enumerate(procs)]
    for t in pumps:
        t.start()
    codes = [p.wait() for p in procs]
    for t in pumps:
        t.join(timeout=5)
    return {w: (code, last.get(w, "") if code else "") for w, code in enumerate(codes)}


def _pump(proc: subprocess.Popen, worker: int, last: dict[int, str], say: Callable[[str], None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        say(f"[worker {worker}] {line}")
        if line.strip() and (line.startswith("error:") or not last.get(worker, "").startswith("error:")):
            last[worker] = line.strip()


def _gcloud(argv: list[str], what: str, say: Callable[[str], None]) -> None:
    say(f"[tpu] {shlex.join(argv)}")
    done = _run(argv)
    if done.returncode:
        _refuse_setup_problem(done, what)
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise _Retry(f"gcloud could not {what} (exit {done.returncode}): {lines[-1] if lines else 'no output'}")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_resolve(argv), capture_output=True, text=True)


def _resolve(argv: list[str]) -> list[str]:
    path = shutil.which(argv[0])
    if path is None:
        raise ConfigError(f"{argv[0]} not found on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk)")
    return [path, *argv[1:]]


def _log(log: str | Path, record: Attempt, say: Callable[[str], None]) -> None:
    record.finished_at = _now()
    with Path(log).open("a") as f:  # a local, append-only operator log: one line per attempt
        f.write(json.dumps(asdict(record)) + "\n")
    say(f"[tpu] attempt {record.attempt}: {record.outcome}: {record.reason}")


def _sleep(sleep: Callable[[float], None], seconds: float) -> None:
    sleep(seconds)
    preemption.check()


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
