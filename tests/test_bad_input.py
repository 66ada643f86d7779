"""Bad input everywhere a user can type something, through `pipeline run all` as users run it.

The reliability issue's rule: each case gets one `error:` line naming the input and what is
wrong, exit 2 for config (config files, `--set`, a model.path that is not a checkpoint we
run) or 1 for data (a broken file inside the checkpoint, prompt files), and no step is
marked complete. Model folders are checked by engine/checkpoint.py before tokenize starts.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.pod import preemption
from pipeline.cli import app


def run_all(config: str, *extra: str):
    preemption.reset()
    return CliRunner().invoke(app, ["run", "all", "--config", config, *extra])


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def markers(root: Path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f == "_SUCCESS.json"]


# --- config files and --set: exit 2 naming the key path ----------------------------------------


@pytest.mark.parametrize("extra, expected", [
    (["--set", "sampling.temperature=-0.5"], "sampling.temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
    (["--set", "sampling.top_p=0"], "sampling.top_p must be a number in (0, 1], got 0"),
    (["--set", "sampling.top_p=1.5"], "sampling.top_p must be a number in (0, 1], got 1.5"),
    (["--set", "sampling.n=two"], "sampling.n must be an integer, got 'two'"),
    (["--set", "sampling.max_new_tokens=0"], "sampling.max_new_tokens must be an integer > 0, got 0"),
    (["--set", "engine.batch_size=-4"], "engine.batch_size must be an integer > 0 or auto, got -4"),
    (["--set", "engine.part_rows=0"], "engine.part_rows must be an integer > 0, got 0"),
    (["--set", "prompts.num_shards=0"], "prompts.num_shards must be an integer > 0 or auto, got 0"),
    (["--set", "prompts.max_prompt_tokens=-1"], "prompts.max_prompt_tokens must be an integer > 0, got -1"),
    (["--set", "sampling.temperature=.nan"], "sampling.temperature must be a finite number"),
    (["--set", "sampling.tempreature=0.7"], "unknown key sampling.tempreature"),
    (["--set", "sampling.n"], "expected KEY=VALUE"),
    (["--set", "sampling.stop=[unclosed"], "value is not valid YAML"),
])
def test_bad_config_values_exit_2_naming_the_key(config_for, tmp_path, extra, expected):
    result = run_all(config_for(), *extra)
    assert result.exit_code == 2, result.output
    assert expected in error_line(result)
    assert not (tmp_path / "runs").exists()


def test_a_usage_error_is_one_error_line_and_exit_2(config_for, tmp_path):
    """A missing or unknown option, or a value its type refuses, printed click's boxed panel, which
    a script reading the last line for `error:` missed; the bare command still prints its help."""
    from tests.conftest import pipeline

    config = config_for()
    for args, first, last in [  # click's own words in between
        (["run", "all"], "error: Missing option '--config'", "(see `pipeline run all --help`)"),
        (["run", "all", "--config", config, "--sett", "x=1"], "error: No such option: --sett",
         "(see `pipeline run all --help`)"),
        (["show", "--config", config, "-n", "0"], "error: Invalid value for '--rows'", "(see `pipeline show --help`)"),
        (["status", "-c"], "error: Option '-c' requires an argument.", "(see `pipeline status --help`)"),  # no click context
    ]:
        done = pipeline(*args)
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith(first) and line.endswith(last), line
    bare = pipeline()
    assert bare.returncode == 2 and "Usage: pipeline [OPTIONS] COMMAND [ARGS]..." in bare.stdout + bare.stderr
    assert not (tmp_path / "runs").exists()


def test_yaml_syntax_error_exits_2_naming_file_line_and_column(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("run:\n  root: /tmp/x\n  name: [oops\nmodel: {path: /m}\n")
    result = run_all(str(path))
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: config file {path}:4:")


def test_unknown_key_and_wrong_type_in_the_file_exit_2(config_for, tmp_path):
    result = run_all(config_for(sampling={"max_new_tokens": "lots"}))
    assert result.exit_code == 2 and "sampling.max_new_tokens must be an integer, got 'lots'" in error_line(result)
    result = run_all(config_for(wandb={"mode": "disabled", "api_key": "x"}))
    assert result.exit_code == 2 and "unknown key wandb.api_key" in error_line(result)
    assert markers(tmp_path) == []


# --- model folders: not a checkpoint we run -> 2; a broken file -> 1 ----------------------------


def copy_model(demo_model: str, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(demo_model, folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))


def rewrite_header(path: Path, edit) -> None:
    """Apply `edit` to a safetensors file's parsed header, keeping the data bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:])


def break_model(case: str, folder: Path) -> str:
    """Break the copy as `case` says; return the file (or model.path) the message must name."""
    weights = folder / "model.safetensors"
    if case == "no config.json":
        (folder / "config.json").unlink()
        return f"model.path {folder} has no config.json"
    if case == "wrong architecture":
        edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
        return f"model.path {folder}: architectures ['GPT2LMHeadModel'] in config.json is not a supported architecture"
    if case == "unsupported model_type":
        edit_config(folder, model_type="gemma", architectures=["GemmaForCausalLM"])
        return f"model.path {folder}/config.json: model_type 'gemma' is not supported"
    if case == "pickle weights only":
        weights.rename(folder / "pytorch_model.bin")
        return f"model.path {folder} holds only pickle weights (pytorch_model.bin)"
    if case == "no weights":
        weights.unlink()
        return f"model.path {folder} has no *.safetensors files"
    if case == "no tokenizer":
        (folder / "tokenizer.json").unlink()
        (folder / "tokenizer_config.json").unlink()
        return f"model.path {folder} has no tokenizer"
    if case in ("no tokenizer.json", "tokenizer.json of no known model"):  # no fast tokenizer to build
        if case == "no tokenizer.json":
            (folder / "tokenizer.json").unlink()
        else:  # the tokenizers library raises a bare Exception for it
            (folder / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "Nope"}}')
        return f"model.path {folder}: could not load a tokenizer (tokenizer.json / tokenizer_config.json missing or invalid)"
    if case == "config.json not JSON":
        (folder / "config.json").write_text('{"model_type": "llama",')
        return f"{folder}/config.json is not valid JSON"
    if case == "corrupt header length":
        weights.write_bytes(struct.pack("<Q", 1 << 40) + weights.read_bytes()[8:])
        return f"{weights} is not a valid safetensors file: the header length field says {1 << 40} bytes"
    if case == "corrupt header JSON":
        data = weights.read_bytes()
        weights.write_bytes(data[:8] + b"\xff" * 16 + data[24:])
        return f"{weights} is not a valid safetensors file: its header is not valid JSON"
    if case == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
        return f"{weights} is not a valid safetensors file: tensor"
    if case == "too short":
        weights.write_bytes(b"\x00\x01")
        return f"{weights} is not a valid safetensors file: 2 bytes"
    if case == "missing tensor":
        rewrite_header(weights, lambda h: h.pop("model.norm.weight"))
        return f"model.path {folder}: the checkpoint lacks 1 tensor(s) a llama with this config.json needs, e.g. model.norm.weight"
    if case == "shape disagrees with config.json":
        edit_config(folder, intermediate_size=128)
        return f"{weights}: tensor model.layers.0.mlp.gate_proj.weight has shape [256, 64], config.json implies [128, 64]"
    if case == "index names a missing shard":
        index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return f"{folder}/model.safetensors.index.json: tensor model.embed_tokens.weight is in model-00002-of-00002.safetensors, which is not in"
    if case == "index escapes the folder":
        index = {"weight_map": {"model.embed_tokens.weight": "../model/model.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return f"{folder}/model.safetensors.index.json: tensor model.embed_tokens.weight maps to '../model/model.safetensors'"
    raise AssertionError(case)


CONFIG_CASES = ["no config.json", "wrong architecture", "unsupported model_type", "pickle weights only", "no weights",
                "no tokenizer", "no tokenizer.json", "tokenizer.json of no known model"]
DATA_CASES = ["config.json not JSON", "corrupt header length", "corrupt header JSON", "truncated", "too short",
              "missing tensor", "shape disagrees with config.json", "index names a missing shard",
              "index escapes the folder"]


@pytest.mark.parametrize("case", CONFIG_CASES + DATA_CASES)
def test_a_bad_model_folder_fails_before_tokenize(config_for, demo_model, tmp_path, case):
    folder = copy_model(demo_model, tmp_path)
    expected = break_model(case, folder)
    result = run_all(config_for(model=str(folder)))
    assert result.exit_code == (2 if case in CONFIG_CASES else 1), result.output
    assert error_line(result).startswith(f"error: {expected}"), error_line(result)
    assert not (tmp_path / "runs").exists()  # nothing started: no step folder, no marker
    if "tokenizer.json" in case:  # status does not load the tokenizer: it reports, as before the check
        shown = CliRunner().invoke(app, ["status", "--config", config_for(model=str(folder))])
        assert shown.exit_code == 0 and "tokenize" in shown.stdout, shown.output


def test_a_missing_model_path_is_a_config_error(config_for, tmp_path):
    result = run_all(config_for(model=str(tmp_path / "no-such-model")))
    assert result.exit_code == 2
    assert error_line(result) == (f"error: model.path {tmp_path / 'no-such-model'} does not exist (expected a Hugging "
                                  f"Face checkpoint folder: config.json, *.safetensors, tokenizer files)")
    assert not (tmp_path / "runs").exists()


def test_a_hub_id_as_model_path_says_to_download_it_first(config_for, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where no folder of that name is
    result = run_all(config_for(model="some-org/Some-Model-1B"))
    assert result.exit_code == 2
    assert error_line(result) == (
        f"error: model.path some-org/Some-Model-1B does not exist; a relative path is read from the current directory, "
        f"{tmp_path}; if it is a Hugging Face Hub id, the pipeline downloads nothing: fetch it first (`hf download "
        f"some-org/Some-Model-1B --local-dir models/Some-Model-1B`) and set model.path to that folder (or to a gs:// "
        f"copy of it)")
    assert not (tmp_path / "runs").exists()
    (tmp_path / "checkpoints").mkdir()  # a folder of ours, its model not there: no Hub advice
    result = run_all(config_for(model="checkpoints/Qwen2.5-7B-Instruct"))
    assert result.exit_code == 2 and error_line(result) == (
        f"error: model.path checkpoints/Qwen2.5-7B-Instruct does not exist (expected a Hugging Face checkpoint folder: "
        f"config.json, *.safetensors, tokenizer files; a relative path is read from the current directory, {tmp_path})")


def test_relative_paths_run_from_another_folder_name_it_in_run_and_status(demo_model, tmp_path, monkeypatch):
    """The demo's config run from outside the repository: its relative paths name nothing there.
    run says which folder they were read from; status names the input on the step it stops."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copytree(demo_model, project / "model")
    (project / "data" / "prompts.jsonl").write_text('{"id": "a", "prompt": "Say a."}\n')
    config = project / "config.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"root": "runs", "name": "test"}, "model": {"path": "model"},
        "prompts": {"path": "data/prompts.jsonl", "max_prompt_tokens": 16},
        "sampling": {"max_new_tokens": 2}, "wandb": {"mode": "disabled"}}))
    monkeypatch.chdir(elsewhere)
    hint = f"a relative path is read from the current directory, {elsewhere}"
    result = run_all(str(config))
    assert result.exit_code == 2
    assert error_line(result) == f"error: prompts.path data/prompts.jsonl matched no files (no such file, or an empty folder; {hint})"
    assert error_line(run_all(str(config), "--set", f"prompts.path={project / 'data/prompts.jsonl'}")) == (
        f"error: model.path model does not exist (expected a Hugging Face checkpoint folder: config.json, "
        f"*.safetensors, tokenizer files; {hint})")
    assert os.listdir(elsewhere) == []

    status = CliRunner().invoke(app, ["status", "--config", str(config)])
    assert status.exit_code == 0, status.output
    lines = status.output.splitlines()
    assert lines[2].strip() == ("missing, but the next run stops before it: prompts.path data/prompts.jsonl matched "
                                f"no files (no such file, or an empty folder; {hint})")
    assert lines[4].strip() == "missing: the next `run all` runs it"  # generate: the run stops before it
    steps = json.loads(CliRunner().invoke(app, ["status", "--config", str(config), "--json"]).output)["steps"]
    assert [s.get("problem") for s in steps] == [error_line(result)[len("error: "):], None, None, None]

    monkeypatch.chdir(project)  # where the config's paths are: nothing stops a run
    steps = json.loads(CliRunner().invoke(app, ["status", "--config", str(config), "--json"]).output)["steps"]
    assert [s.get("problem") for s in steps] == [None] * 4
    assert [s["why"] for s in steps] == ["missing: the next `run all` runs it"] * 4


def test_the_demo_checkpoint_passes_and_a_sharded_one_too(demo_model, tmp_path):
    from engine.checkpoint import check_checkpoint
    from safetensors.numpy import load_file, save_file

    assert check_checkpoint(demo_model)["tensors"] == 21
    folder = copy_model(demo_model, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    (folder / "model.safetensors").unlink()
    weight_map = {}
    for part, chunk in enumerate((names[:10], names[10:]), 1):
        file = f"model-{part:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(folder / file))
        weight_map.update({n: file for n in chunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert check_checkpoint(str(folder))["files"] == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"]


# --- prompt files: exit 1 naming file and line ----------------------------------------------


def test_missing_prompt_file_exits_2_and_a_bad_prompt_line_exits_1(config_for, tmp_path):
    missing = config_for(prompts={"path": str(tmp_path / "nope.jsonl")})
    result = run_all(missing)  # checked before any step starts (issue 14): a config error, nothing written
    assert result.exit_code == 2 and error_line(result).startswith(f"error: prompts.path {tmp_path / 'nope.jsonl'} matched no files")
    assert not (tmp_path / "runs").exists()
    bad = config_for(prompts_text='{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": \n')
    result = run_all(bad)
    assert result.exit_code == 1
    assert error_line(result).startswith(f"error: prompts file {tmp_path / 'prompts.jsonl'} line 2: invalid JSON")
    assert markers(tmp_path) == []
    # status says why the step is partial: it had said "the next run resumes it", which would fail the same way
    shown = CliRunner().invoke(app, ["status", "--config", bad, "--json"])
    tokenize = json.loads(shown.stdout)["steps"][0]
    assert tokenize["state"] == "partial" and tokenize["last_error"] == error_line(result).removeprefix("error: ")
    assert tokenize["why"] == f"partial; its last run ended: {tokenize['last_error']}; the next run runs it again"


@pytest.mark.parametrize("engine, message", [
    ({"batch_size": 3, "lanes": 2}, "error: engine.batch_size=3 must be a multiple of engine.lanes=2 times the 1 "
                                    "data-parallel devices (2): each lane takes an equal share of the rows"),
    ({"batch_size": 100_000_000}, "error: engine.batch_size=100000000 needs ~"),
    ({"memory_fraction": 0.000001}, "error: one row needs "),  # it said "0.00 GiB", not naming the setting
    ({"mode": "global_mesh", "mesh": {"data": 2, "model": 1}}, "error: engine.mesh {data: 2, model: 1} needs 2 devices, but the pod has 1"),
])
def test_an_engine_setting_that_does_not_fit_the_devices_stops_the_run_before_any_step(config_for, tmp_path, engine,
                                                                                       message):
    """The engine plans for this host's devices before tokenize (`Engine.check`): one line naming
    the setting, exit 2, nothing written; a dry run says the same (it found nothing before)."""
    for extra in ((), ("--dry-run",)):
        result = run_all(config_for(engine=engine), *extra)
        assert result.exit_code == 2, result.output
        assert error_line(result).startswith(message), error_line(result)
        if "memory_fraction" in engine:
            assert re.search(r"\(weights 0\.7 MiB, .* but engine\.memory_fraction 1e-06 of cpu device memory \(.* GiB\) is "
                             r"\d+\.\d KiB \(raise engine\.memory_fraction, ", error_line(result)), error_line(result)
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "runs").exists()


def test_status_does_not_take_the_devices(config_for):
    """`status` beside a running job on a TPU VM: opening the devices there fails (the job holds
    the TPU). It names missing inputs, but leaves the engine settings to `run`: here the devices
    cannot be opened at all (JAX_PLATFORMS names a platform this machine lacks)."""
    config = config_for(engine={"batch_size": 3, "lanes": 2})
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--config", config, "--json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "tpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert [s.get("problem") for s in json.loads(done.stdout)["steps"]] == [None] * 4
    run = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "all", "--dry-run", "--config", config],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "tpu"})
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith(
        "error: generate needs this host's devices, and JAX could not open them: Unable to initialize backend 'tpu'")


def test_a_batch_that_fits_short_prompts_but_not_the_runs_fails_in_generate_in_one_line(config_for, demo_model, tmp_path):
    """The check before any step plans for one-token prompts; generate plans for its longest and
    may still not fit: one line naming the setting, exit 1, tokenize kept complete."""
    from engine import Engine, EngineConfig, SamplingParams
    from engine.config import InvalidConfig

    tiny = {"memory_fraction": 0.0002, "lanes": 1}  # a few dozen rows of the demo model's KV cache
    fits_one_token = Engine._setup(demo_model, dtype="float32", sampling=SamplingParams(max_new_tokens=4),
                                   engine=EngineConfig(batch_size="auto", **tiny), max_prompt_tokens=1).plan
    assert fits_one_token.reason.startswith("auto: largest that fits"), fits_one_token.reason
    engine = {"batch_size": fits_one_token.batch_size, **tiny}
    with pytest.raises(InvalidConfig):  # the test's prompts ("Say 0.") are longer than one token
        Engine._setup(demo_model, dtype="float32", sampling=SamplingParams(max_new_tokens=4),
                      engine=EngineConfig(**engine), max_prompt_tokens=2)
    result = run_all(config_for(engine=engine))
    assert result.exit_code == 1, result.output
    line = error_line(result)
    assert line.startswith(f"error: generate: engine.batch_size={engine['batch_size']} needs ~"), line
    assert line.endswith("change the setting and rerun the same command)"), line
    assert "Traceback" not in result.stderr
    assert [os.path.basename(os.path.dirname(m)).split("-")[0] for m in markers(tmp_path)] == ["tokenize"]
