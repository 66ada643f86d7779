"""engine.mode: global_mesh: the model sharded over every device of a pod, hosts in lockstep.

A 2-host pod (`pipeline launch --hosts 2`, one CPU device per process, collectives through
gloo) must give the same rows as one host in host-data-parallel mode, each row written once,
and resume after lost parts or a SIGTERM. Plus the mesh-shape rules and config checks.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time

import pytest

from engine.config import MeshConfig
from engine.mesh import MeshShape, mesh_shape
from tests.conftest import generated_rows, pipeline
from pipeline.run.config import build_config
from pipeline.errors import ConfigError

SETTINGS = {"sampling": {"max_new_tokens": 8, "temperature": 0.0, "n": 2},
            "engine": {"batch_size": 4, "part_rows": 4}, "prompts": {"num_shards": 4}}
GLOBAL = ("--set", "engine.mode=global_mesh")


# --- mesh shapes and config -----------------------------------------------------------------


@pytest.mark.parametrize("requested, devices, kv_heads, expected", [
    ("auto", 1, 2, MeshShape(1, 1)),
    ("auto", 2, 2, MeshShape(1, 2)),         # tensor parallel over both: the KV heads split evenly
    ("auto", 8, 2, MeshShape(4, 2)),         # the rest of the devices split the batch
    ("auto", 8, 8, MeshShape(1, 8)),
    ("auto", 6, 4, MeshShape(3, 2)),         # gcd
    ("auto", 4, 1, MeshShape(4, 1)),         # one KV head: no tensor parallelism
    (MeshConfig(model=1), 4, 2, MeshShape(4, 1)),
    (MeshConfig(data=2), 4, 4, MeshShape(2, 2)),
    (MeshConfig(data=2, model=4), 8, 8, MeshShape(2, 4)),
])
def test_mesh_shapes(requested, devices, kv_heads, expected):
    assert mesh_shape(requested, num_devices=devices, kv_heads=kv_heads) == expected


@pytest.mark.parametrize("requested, devices, message", [
    (MeshConfig(model=3), 3, "engine.mesh.model must divide the number of KV heads (2), got 3"),
    (MeshConfig(model=4), 2, "engine.mesh.model must divide the pod's 2 devices, got 4"),
    (MeshConfig(data=3), 4, "engine.mesh.data must divide the pod's 4 devices, got 3"),
    (MeshConfig(data=2, model=2), 8, "engine.mesh {data: 2, model: 2} needs 4 devices, but the pod has 8"),
])
def test_impossible_mesh_shapes_name_the_key(requested, devices, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mesh_shape(requested, num_devices=devices, kv_heads=2)


def _engine(**engine):
    return build_config({"run": {"root": "/tmp/unused", "name": "n"}, "model": {"path": "m"},
                         "prompts": {"path": "p"}, "engine": engine}).engine


def test_engine_mode_and_mesh_config():
    assert (_engine().mode, _engine().mesh) == ("host_dp", "auto")
    mesh = _engine(mode="global_mesh", mesh={"model": 2}).mesh
    assert (mesh.data, mesh.model) == ("auto", 2)
    for engine, message in [
        ({"mode": "tensor"}, "engine.mode must be host_dp or global_mesh"),
        ({"mode": "global_mesh", "mesh": {"model": 0}}, "engine.mesh.model must be an integer > 0 or auto, got 0"),
        ({"mode": "global_mesh", "mesh": {"modle": 2}}, "unknown key engine.mesh.modle"),
        ({"mode": "global_mesh", "mesh": "big"}, "engine.mesh must be auto or a mapping {data, model}"),
        ({"mesh": {"model": 2}}, "engine.mesh applies only with engine.mode: global_mesh"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
            _engine(**engine)


# --- a 2-host pod on CPU ------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Prompt {i}: tell me about {i * 7} birds."}) + "\n"
                            for i in range(24)))
    return str(path)


@pytest.fixture
def reference(make_config, tmp_path, prompts):
    """One host, host data parallel (the default mode)."""
    config = make_config("reference.yaml", run={"root": str(tmp_path / "reference")}, **{
        **SETTINGS, "prompts": {**SETTINGS["prompts"], "path": prompts}})
    for step in ("tokenize", "generate"):
        result = pipeline("run", step, "--config", config)
        assert result.returncode == 0, result.stderr[-3000:]
    found = generated_rows(tmp_path / "reference")
    assert len(found) == 24 * 2
    return found


def _pod_config(make_config, tmp_path, prompts, name: str) -> str:
    config = make_config(f"{name}.yaml", run={"root": str(tmp_path / name)}, **{
        **SETTINGS, "prompts": {**SETTINGS["prompts"], "path": prompts}})
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    return config


def test_two_host_global_mesh_equals_one_host_and_resumes_lost_parts(make_config, tmp_path, prompts, reference):
    config = _pod_config(make_config, tmp_path, prompts, "pod")
    result = pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, *GLOBAL)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "global mesh data 1 x model 2 over 2 cpu devices of 2 host(s)" in result.stderr
    assert generated_rows(tmp_path / "pod") == reference
    # Shard i is written by host i % 2 only; both hosts report what they wrote.
    metrics = [json.loads(open(p).read()) for p in glob.glob(f"{tmp_path}/pod/generate-*/metrics/host-*.json")]
    assert sorted((m["host"], m["mode"], m["shards"], m["samples"] > 0) for m in metrics) == [
        (0, "global_mesh", 2, True), (1, "global_mesh", 2, True)]
    assert sum(m["samples"] for m in metrics) == 48

    # Lose the marker and some parts (a kill before the end): the rerun makes only those rows.
    (step,) = glob.glob(f"{tmp_path}/pod/generate-*")
    os.remove(f"{step}/_SUCCESS.json")
    parts = sorted(glob.glob(f"{step}/shard-*/part-*.parquet"))
    lost = parts[::3]
    for path in lost:
        os.remove(path)
    kept = set(parts) - set(lost)
    result = pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, *GLOBAL)
    assert result.returncode == 0, result.stderr[-4000:]
    assert kept <= set(glob.glob(f"{step}/shard-*/part-*.parquet"))
    assert generated_rows(tmp_path / "pod") == reference


def test_sigterm_stops_every_host_together_then_resumes(make_config, tmp_path, prompts, reference, start_pipeline):
    root = tmp_path / "termed"
    config = _pod_config(make_config, tmp_path, prompts, "termed")
    pod = start_pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, *GLOBAL,
                         "--set", "engine.batch_size=2")
    pod.wait_for_files(f"{root}/generate-*/shard-*/part-*.parquet", timeout_s=300)
    os.kill(pod.hosts()[0], signal.SIGTERM)  # the leader only: the other host must stop too
    pod.finish(timeout_s=180)
    output = pod.output
    assert pod.returncode == 75, output[-4000:]
    assert "stopped by a stop signal on another host" in output, output[-3000:]
    committed = generated_rows(root)
    assert 0 < len(committed) < 48
    assert committed.items() <= reference.items()

    result = pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, *GLOBAL)
    assert result.returncode == 0, result.stderr[-4000:]
    assert generated_rows(root) == reference


def test_a_host_killed_mid_collective_does_not_hang_the_pod(make_config, tmp_path, prompts, start_pipeline):
    """The survivor waits inside a collective no exception reaches: its watchdog ends it (exit 75)."""
    root = tmp_path / "killed"
    config = _pod_config(make_config, tmp_path, prompts, "killed")
    pod = start_pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, *GLOBAL,
                         "--set", "engine.batch_size=2")
    pod.wait_for_files(f"{root}/generate-*/shard-*/part-*.parquet", timeout_s=300)
    os.kill(pod.hosts()[1], signal.SIGKILL)
    killed_at = time.monotonic()
    pod.finish(timeout_s=180)
    output = pod.output
    assert pod.returncode == 75, output[-4000:]
    assert time.monotonic() - killed_at < 60, "the survivor hung until launch killed it"
    assert "still running" not in output and "host 1 stopped responding" in output, output[-3000:]


def test_a_host_stopped_while_the_weights_are_read_stops_the_others_reading(make_config, tmp_path, prompts, slow_read):
    """SIGTERM to one host while every host reads the weights (minutes for an 8B model from a
    bucket): that host stops before its next tensor, and the others stop reading at their next
    tensor once it has left, instead of reading the whole model first; the pod exits 75."""
    config = _pod_config(make_config, tmp_path, prompts, "reading")
    result = pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, *GLOBAL,
                      env=slow_read(hosts=[0, 1], sigterm=0), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 75, output[-4000:]
    read = {host: re.findall(rf"host {host} reading tensor \d+", output) for host in (0, 1)}
    assert len(read[0]) == 1, output[-4000:]
    assert 1 <= len(read[1]) <= 4, output[-4000:]  # the model has 21 tensors
    assert re.search(r"\[host 1\] error: host 1/2: stopped reading the model's weights: host 0 was stopped: stopped by SIGTERM: finished work",
                     output), output[-4000:]
    assert not glob.glob(f"{tmp_path}/reading/generate-*/_SUCCESS.json")
