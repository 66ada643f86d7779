"""What a step is, what it is handed, and what it returns: the step graph's three types.

A `Step` refers to its function and to the steps it reads, as plain Python (the graph itself
is `steps.PIPELINE`); the runner (runner.py) walks any such graph. The runner hands each step a
`StepOutput`: where to write, and the output of every step before it (its inputs and their
inputs), so no step rebuilds a URL from `run.root`. A step returns a `StepResult`, which the
runner writes into the success marker.

    TOKENIZE = Step("tokenize", tokenize, about="read prompts, tokenize, write shards")
    GENERATE = Step("generate", generate, inputs=(TOKENIZE,), on="every host", finish=finish)
    def generate(cfg: Config, out: StepOutput) -> None:
        shards = out.upstream["tokenize"].url
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from pipeline import storage
from pipeline.pod import hosts
from pipeline.storage.lease import Lease, LeaseLost

if TYPE_CHECKING:
    from pipeline.run.config import Config
    from pipeline.run.status import StepRecord


@dataclass(frozen=True, eq=False)
class Step:
    """A step of the graph, declared once, next to the others (steps/__init__.py)."""

    name: str
    """Names the output folder (`{run.root}/{name}-{hash}`) and the `pipeline run NAME` command."""
    run: Callable[["Config", "StepOutput"], "StepResult | None"]
    """fn(cfg, out): on the leader it returns the StepResult; on every host for `on="every host"`."""
    inputs: tuple["Step", ...] = ()
    """Steps whose complete output this one reads; their hashes enter this step's hash."""
    on: Literal["leader", "every host"] = "leader"
    finish: Callable[["Config", "StepOutput"], "StepResult"] | None = None
    """For `on="every host"`: run by the leader once every host's `run` is done; returns the StepResult."""
    version: str = "1"
    """Bump when the step's output for the same inputs changes: it changes the hash."""
    redo: Callable[["Config", "StepRecord", str], str | None] | None = None
    """fn(cfg, record, output url) of a complete output: why this config wants it made again though
    its hash is the same (the plan's reason), or None to skip it. For a runtime knob that decided
    whether the step did its work at all (upload with `wandb.mode: disabled`), or an output file
    of the result that is gone (merge's)."""
    progress: Callable[["Config", str, dict[str, str]], "Committed | None"] | None = None
    """fn(cfg, output url, {upstream step: its url}) of a partial output: how far it got, for
    `status`, or None."""
    about: str = ""

    def __post_init__(self):
        if (self.on == "every host") != (self.finish is not None):
            raise TypeError(f"step {self.name}: a finish function goes with on='every host', and only with it")


@dataclass(frozen=True)
class Committed:
    """How far a partial step got (`Step.progress`): rows committed so far, of how many, in how
    many files. `status` prints it ('1,234 of 5,000 rows committed in 7 part(s)'), and `status
    --json` gives the numbers too."""

    rows: int
    of: int
    parts: int

    def __str__(self) -> str:
        return f"{self.rows:,} of {self.of:,} rows committed in {self.parts} part(s)"


def in_order(graph: tuple[Step, ...]) -> tuple[Step, ...]:
    """The graph's steps with every step after its inputs (the order they run in)."""
    ordered: list[Step] = []

    def visit(step: Step, path: tuple[str, ...]) -> None:
        if step.name in path:
            raise TypeError(f"the step graph has a cycle: {' -> '.join(path + (step.name,))}")
        for earlier in step.inputs:
            visit(earlier, path + (step.name,))
        if step not in ordered:
            ordered.append(step)

    for step in graph:
        visit(step, ())
    names = [s.name for s in ordered]
    if len(set(names)) != len(names):
        raise TypeError(f"two steps share a name in the step graph: {names}")
    return tuple(ordered)


def ancestors(step: Step) -> tuple[Step, ...]:
    """Every step `step` reads from, directly or through its inputs, in run order."""
    return in_order(step.inputs)


@dataclass(frozen=True)
class StepInput:
    """A complete output of an earlier step, as handed to a later one."""

    name: str
    hash: str
    url: str


@dataclass(frozen=True)
class StepOutput:
    """Where a step writes and what it reads: handed to the step by the runner."""

    step: str
    hash: str
    url: str
    upstream: dict[str, StepInput] = field(default_factory=dict)
    """Every earlier step's output this step depends on (inputs and their inputs), by step name."""
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
    summary: Any
    """The step's own summary dataclass (e.g. steps.merge.MergeSummary), stored as JSON in the marker."""

    def summary_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.summary)
