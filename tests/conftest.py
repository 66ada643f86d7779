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
