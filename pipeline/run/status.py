"""Success markers and what `pipeline status` reports.

A step's output folder is complete only when `_SUCCESS.json` is there; it is written last,
after every data file, and holds the `StepRecord`: the manifest (files, rows, bytes,
sha256), the step's summary, timings, package versions and the resolved config. Readers
trust the marker, never the presence of files. This module refuses to guess: a folder with
files but no marker, or a marker that does not parse, is `partial`, whatever it holds.

    record = read_marker(out_url)          # None when the step is not complete
    state = output_state(out_url)          # "complete" | "partial" | "missing"
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

from pipeline import storage

MARKER = "_SUCCESS.json"
CONFIG_FILE = "config.yaml"
"""The resolved config, written beside each step's output when the step starts."""
LOG_FOLDER = "logs"
"""Each host's log of the step (pipeline/run/steplog.py)."""

State = Literal["complete", "partial", "missing"]

_VERSIONED = ("jax-batch-pipeline", "jax", "jaxlib", "haliax", "equinox", "transformers",
              "tokenizers", "pyarrow", "fsspec", "gcsfs", "wandb")


@dataclass(frozen=True)
class StepRecord:
    """What a complete step leaves in its marker."""

    step: str
    hash: str
    version: str
    files: list[dict[str, Any]]
    """One entry per data file: path (relative to the step folder), rows, bytes, sha256."""
    summary: dict[str, Any]
    """The step's own figures (rows in/out, rejected, tokens, ...)."""
    rows: int
    """Rows of the step's main output."""
    started_at: str
    finished_at: str
    wall_s: float
    config: dict[str, Any]
    upstream: dict[str, str]
    versions: dict[str, str] = field(default_factory=lambda: package_versions())
    content: dict[str, Any] = field(default_factory=dict)
    """The fingerprints of the input files its hash covers (`identity.content_fingerprints`), so
    that a later plan with another hash can say which file changed (empty in older markers)."""


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def write_marker(out_url: str, record: StepRecord) -> None:
    """Mark a step complete. Call only after every data file is written."""
    storage.write_json(storage.join(out_url, MARKER), dataclasses.asdict(record))


def read_marker(out_url: str) -> StepRecord | None:
    """The step's record; None while the step is not complete, and where its marker does not
    parse (`inspect` says why): a marker is written whole, so that one was damaged after its
    step, which then counts as partial and runs again (nothing is lost: a step's rerun keeps or
    remakes its files, and writes a new marker last)."""
    return _marker(out_url)[0]


def _marker(out_url: str) -> tuple[StepRecord | None, str | None]:
    url = storage.join(out_url, MARKER)
    if not storage.exists(url):
        return None, None
    try:
        return StepRecord(**storage.read_json(url)), None
    except (ValueError, TypeError) as err:  # not JSON (cut short, overwritten), or not a record
        return None, f"{type(err).__name__}: {err}"


def remove_marker(out_url: str) -> None:
    storage.remove(storage.join(out_url, MARKER))


def data_files(out_url: str) -> dict[str, tuple[str, ...]]:
    """A step folder's files but its marker, its config and its logs (and hidden temp files), each
    with what changes when it is written again (`storage.files_under`): two looks are equal only
    if the step's output was not touched between them."""
    return {name: version for name, version in storage.files_under(out_url).items()
            if name not in (MARKER, CONFIG_FILE) and not name.startswith(f"{LOG_FOLDER}/")
            and not name.rsplit("/", 1)[-1].startswith(".")}


def inspect(out_url: str) -> tuple[State, StepRecord | None, str | None]:
    """One look at a step's output: its state, its record when complete, and why its marker cannot
    be read where there is one that does not parse (the step is then partial)."""
    record, damaged = _marker(out_url)
    if record is not None:
        return "complete", record, None
    return ("partial" if storage.exists(out_url) else "missing"), None, damaged


def latest_complete(root: str, step: str) -> tuple[str, StepRecord] | None:
    """The output of `step` under `root` that was finished last, with its record, whatever its hash;
    None where there is none (or the root cannot be listed: this only explains, never decides)."""
    return next(complete_outputs(root, step), None)


def complete_outputs(root: str, step: str) -> Iterator[tuple[str, StepRecord]]:
    """The complete outputs of `step` under `root`, whatever their hash, with their records, the
    one finished last first; none where the root cannot be listed."""
    try:
        fs, path = storage.filesystem(root)
        markers = fs.glob(f"{path.rstrip('/')}/{step}-*/{MARKER}", detail=True)
        # Newest first by the listing's time (local mtime, GCS updated: an ISO string), compared as
        # text so that an entry with neither sorts last, not raises; a marker is read only when asked for.
        newest = sorted(markers, key=lambda m: str(markers[m].get("mtime") or markers[m].get("updated") or ""),
                        reverse=True)
    except Exception:  # noqa: BLE001 - a hint lost, not a run
        return
    for marker in newest:
        out_url = storage.join(root, marker.rstrip("/").split("/")[-2])
        try:
            record = read_marker(out_url)
        except Exception:  # noqa: BLE001 - as above
            continue
        if record is not None:
            yield out_url, record


def output_state(out_url: str) -> State:
    return inspect(out_url)[0]
