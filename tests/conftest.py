"""Shared fixtures: a tiny demo checkpoint, configs in temp folders, hermetic environment.

Each step's test module may add its own fixtures below its own heading.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

# Keep every test hermetic: no W&B network, no user settings, one CPU device per process.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    """A tiny random-weight Llama (2 layers, width 64, vocab 512) with a real BPE tokenizer."""
    from pipeline.demo import build_checkpoint

    out = tmp_path_factory.mktemp("model") / "llama"
    build_checkpoint(out, layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=512)
    return str(out)


def write_prompts(path: Path, texts: list[str]) -> Path:
    import json

    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture
def make_config(tmp_path, demo_model):
    """Write a config YAML in tmp_path from the demo defaults plus section overrides; return its path."""

    def make(name: str = "config.yaml", **sections: dict) -> str:
        prompts = tmp_path / "prompts.jsonl"
        if not prompts.exists():
            write_prompts(prompts, [f"Tell me about topic number {i}." for i in range(12)])
        data = {
            "run": {"root": str(tmp_path / "runs"), "name": "test"},
            "model": {"path": demo_model, "dtype": "float32"},
            "prompts": {"path": str(prompts), "text_field": "prompt", "id_field": "id", "max_prompt_tokens": 64},
            "sampling": {"max_new_tokens": 8, "temperature": 0.0, "n": 2, "seed": 0},
            "engine": {"batch_size": 8},
            "wandb": {"project": "test", "mode": "offline"},
        }
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return make


# --- merge and upload (issue 7): upstream outputs as tokenize/generate leave them ---

import importlib  # noqa: E402 - this section's own imports, kept with it

import pyarrow as pa  # noqa: E402

from pipeline import status, storage  # noqa: E402
from pipeline.config import build_config  # noqa: E402
from pipeline.runner import STEPS, PlannedStep, StepOutput  # noqa: E402
from steps.generate import SCHEMA  # noqa: E402


def _generation_row(prompt_index: int, sample_index: int, completion: str | None = None) -> dict:
    """One generate row; every row of the fake run has the same in-memory size."""
    return {
        "prompt_index": prompt_index, "prompt_id": f"p{prompt_index:05d}", "sample_index": sample_index,
        "prompt": f"prompt {prompt_index:05d}", "completion": completion or f"completion {prompt_index:05d}.{sample_index:03d}",
        "completion_token_ids": [prompt_index % 97, sample_index, 7], "num_prompt_tokens": 5,
        "num_completion_tokens": 3, "finish_reason": ("eos", "len")[(prompt_index + sample_index) % 2],
    }


class FakeRun:
    """A run root with complete tokenize and generate outputs (markers included), made by hand.

    Prompts go round-robin to shards, so shards interleave in prompt_index; each shard's rows are
    written in parts of `part_rows` rows, last prompts first, so no file is in output order.
    """

    HASHES = {"tokenize": "70ce0000000a", "generate": "9e0e0000000b", "merge": "3e7e0000000c", "upload": "0b1d0000000d"}

    def __init__(self, root: str, prompts: int, n: int, shards: int, part_rows: int, wandb: dict):
        self.root, self.prompts, self.n, self.shards = root, prompts, n, shards
        self.cfg = build_config({"run": {"root": root, "name": "test run"}, "model": {"path": "unused"},
                                 "prompts": {"path": "unused"}, "sampling": {"n": n},
                                 "wandb": {"project": "test", "mode": "offline", **wandb}})
        self.url = {step: storage.step_url(root, step, h) for step, h in self.HASHES.items()}
        self.parts: list[str] = []
        tokenize_files = []
        for shard in range(shards):
            indices = list(range(shard, prompts, shards))
            table = pa.table({"prompt_index": pa.array(indices, pa.int64()),
                              "prompt_id": [f"p{i:05d}" for i in indices],
                              "prompt": [f"prompt {i:05d}" for i in indices],
                              "input_ids": pa.array([[1, 2, 3, 4, 5]] * len(indices), pa.list_(pa.int32())),
                              "num_tokens": pa.array([5] * len(indices), pa.int32())})
            entry = storage.write_parquet(storage.join(self.url["tokenize"], f"shard-{shard:05d}.parquet"), table)
            tokenize_files.append({**entry, "tokens": 5 * len(indices)})
        self._mark("tokenize", tokenize_files, {"rows": prompts, "rejected": 0, "tokens": 5 * prompts}, {})
        self.part_rows = part_rows

    def shard_keys(self, shard: int) -> list[tuple[int, int]]:
        return [(p, s) for p in range(shard, self.prompts, self.shards) for s in range(self.n)]

    def write_part(self, shard: int, rows: list[dict], name: str | None = None) -> str:
        name = name or f"shard-{shard:05d}/part-{len(self.parts):05d}.parquet"
        storage.write_parquet(storage.join(self.url["generate"], name), pa.Table.from_pylist(rows, schema=SCHEMA))
        self.parts.append(name)
        return name

    def write_all_parts(self, skip: set[tuple[int, int]] = frozenset()) -> None:
        for shard in range(self.shards):
            keys = [k for k in reversed(self.shard_keys(shard)) if k not in skip]
            for start in range(0, len(keys), self.part_rows):
                self.write_part(shard, [_generation_row(p, s) for p, s in keys[start:start + self.part_rows]])

    def finish_generate(self) -> None:
        """Write generate's marker listing every part written, with per-host metrics."""
        files = [{"path": p, "bytes": storage.size(storage.join(self.url["generate"], p))} for p in self.parts]
        hosts = [{"host": h, "prompts": self.prompts // 2, "samples": self.prompts * self.n // 2,
                  "generated_tokens": 3 * self.prompts * self.n // 2, "wall_s": 2.0 + h, "compile_s": 0.5,
                  "tokens_per_s": 100.0 * (h + 1), "peak_memory_bytes": None} for h in range(2)]
        self._mark("generate", files, {"rows": self.prompts * self.n, "hosts": hosts,
                                       "generated_tokens": 3 * self.prompts * self.n, "tokens_per_s": 300.0,
                                       "wall_s": 3.0, "compile_s": 0.5}, {"tokenize": self.HASHES["tokenize"]})

    def out(self, step: str):
        """The StepOutput the runner would hand `step` (upstream marked complete)."""
        spec = {s.name: s for s in STEPS}
        upstream = {u: PlannedStep(spec[u], self.HASHES[u], self.url[u], "complete", None, "skip", "test")
                    for u in spec[step].upstream}
        return StepOutput(step, self.HASHES[step], self.url[step], upstream)

    def run(self, step: str, **kwargs):
        """Run `step` as the runner does: the step, then its success marker."""
        result = getattr(importlib.import_module(f"steps.{step}"), step)(self.cfg, self.out(step), **kwargs)
        self._mark(step, result.files, result.summary, {u: self.HASHES[u] for u in self.out(step).upstream},
                   rows=result.rows)
        return result

    def _mark(self, step: str, files: list, summary: dict, upstream: dict, rows: int | None = None) -> None:
        status.write_marker(self.url[step], status.StepRecord(
            step=step, hash=self.HASHES[step], version="1", files=files, summary=summary,
            rows=summary.get("rows", 0) if rows is None else rows, started_at="", finished_at="", wall_s=0.0,
            config=self.cfg.to_dict(), upstream=upstream))


@pytest.fixture
def generation_row():
    """generation_row(prompt_index, sample_index, completion=None) -> the fake run's generate row."""
    return _generation_row


@pytest.fixture
def fake_run(tmp_path):
    """make(prompts, n, shards, part_rows, complete=True, root=None, **wandb) -> FakeRun.

    complete=True writes every part and generate's marker; False leaves that to the test.
    """

    def make(prompts: int = 10, n: int = 2, shards: int = 3, part_rows: int = 4, complete: bool = True,
             root: str | None = None, **wandb) -> FakeRun:
        run = FakeRun(root or str(tmp_path / "runs"), prompts, n, shards, part_rows, wandb)
        if complete:
            run.write_all_parts()
            run.finish_generate()
        return run

    return make
