"""Security rules of the reliability issue, checked on a real run and on the source.

- Secrets (WANDB_API_KEY, the GOOGLE_APPLICATION_CREDENTIALS file) are never logged or saved:
  a whole `pipeline run all` with sentinel secrets leaves them nowhere under the run root, the
  W&B folders, stdout or stderr; `--set wandb.api_key=...` is refused, not saved.
- Output paths cannot escape the run root: prompt ids like `../../x` stay values in the rows.
- No pickle or code execution from model or data files: only safetensors and JSON are read
  and `trust_remote_code` is never true (a source check, so a new call site cannot slip in).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from pipeline.pod import preemption
from pipeline.cli import app

REPO = Path(__file__).resolve().parent.parent
API_KEY = "sentinel-wandb-key-0123456789abcdef0123456789abcdef"
CREDENTIALS = "sentinel-gcs-private-key-fedcba9876543210"
PATH_IDS = ["../../x", "/etc/passwd", "a/b", "..", "shard-00000.parquet", "../../../escape.parquet"]


def invoke(*args: str):
    preemption.reset()
    return CliRunner().invoke(app, list(args))


def files_under(folder: Path) -> dict[str, int]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(folder) for f in fs}


def test_secrets_are_written_nowhere_and_path_like_ids_stay_values(tmp_path, make_config, wandb_env, monkeypatch):
    credentials = tmp_path / "gcs-key.json"
    credentials.write_text(json.dumps({"type": "service_account", "private_key": CREDENTIALS}))
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(credentials))
    prompts = tmp_path / "prompts.jsonl"
    ids = PATH_IDS + [f"p{i}" for i in range(4)]
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"Tell me about {i}."}) + "\n" for i in ids))
    root = tmp_path / "deep" / "er" / "runs"
    config = make_config(run={"root": str(root), "name": "secrets"}, wandb={"project": "test", "mode": "offline"},
                         sampling={"max_new_tokens": 3, "n": 1})
    before = files_under(tmp_path)
    passwd = os.stat("/etc/passwd").st_mtime_ns if os.path.exists("/etc/passwd") else None

    result = invoke("run", "all", "--config", config)
    assert result.exit_code == 0, result.output

    # path-like ids are values: every row keeps its id, no file appeared outside the run root and W&B
    merged = [p for p in files_under(root) if "/merge-" in p and p.endswith(".parquet")]
    rows = pq.read_table(merged).to_pylist()
    assert [r["prompt_id"] for r in sorted(rows, key=lambda r: r["prompt_index"])] == ids
    new = set(files_under(tmp_path)) - set(before)
    outside = [p for p in new if not p.startswith(str(root) + os.sep) and not p.startswith(str(wandb_env) + os.sep)]
    assert outside == []
    assert not any(Path(p).name in ("x", "passwd", "escape.parquet", "b") for p in new)
    assert passwd is None or os.stat("/etc/passwd").st_mtime_ns == passwd

    # secrets: nowhere in any file written (run root, offline W&B run, W&B's own folders), nor in the output
    assert any(p.endswith(".wandb") for p in new) and any(p.endswith("_SUCCESS.json") for p in new)
    for secret in (API_KEY, CREDENTIALS):
        assert secret not in result.stdout and secret not in result.stderr
        leaked = [p for p in new if secret.encode() in Path(p).read_bytes()]
        assert leaked == [], f"{secret[:15]}... written to {leaked}"

    # a secret passed as a config value is refused before anything is written
    after = files_under(tmp_path)
    refused = invoke("run", "all", "--config", config, "--set", f"wandb.api_key={API_KEY}")
    assert refused.exit_code == 2 and "unknown key wandb.api_key" in refused.stderr
    assert API_KEY not in refused.stdout + refused.stderr
    assert files_under(tmp_path) == after


SOURCES = sorted(p for package in ("pipeline", "steps", "engine") for p in (REPO / package).rglob("*.py"))


def test_no_pickle_eval_or_remote_code_in_the_pipeline_source():
    """Loading model or data files never runs code: no pickle/torch.load/eval/exec, no trust_remote_code=True."""
    forbidden = re.compile(r"\bimport pickle\b|\bpickle\.loads?\(|\btorch\.load\(|\bjoblib\.load\(|(?<![\w.])eval\(|"
                           r"(?<![\w.])exec\(|trust_remote_code\s*=\s*True|yaml\.load\(|yaml\.unsafe_load|"
                           r"allow_pickle\s*=\s*True|weights_only\s*=\s*False")
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in SOURCES
            for n, line in enumerate(p.read_text().splitlines(), 1) if forbidden.search(line)]
    assert hits == []


def test_every_from_pretrained_call_refuses_remote_code():
    calls = [(p, m.group(0)) for p in SOURCES for m in re.finditer(r"from_pretrained\((?:[^()]|\([^()]*\))*\)", p.read_text())]
    assert calls, "expected engine/checkpoint.py to load the tokenizer with from_pretrained"
    assert all("trust_remote_code=False" in call for _, call in calls), calls
