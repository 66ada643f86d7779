"""Config loading: YAML + --set into frozen dataclasses; every error names the key path (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.config import EngineConfig, InvalidConfig, MeshConfig, SamplingParams

from pipeline.cli import app
from pipeline.run.config import apply_override, build_config, load_config
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
MINIMAL = {"run": {"root": "/tmp/r", "name": "x"}, "model": {"path": "/m"}, "prompts": {"path": "/p.jsonl"}}


def with_section(section: str, **values) -> dict:
    data = {k: dict(v) for k, v in MINIMAL.items()}
    data.setdefault(section, {}).update(values)
    return data


EXAMPLES = sorted((REPO / "configs").glob("*.yaml"))
"""The example configs users copy (configs/): each names a bucket or checkpoint the tests lack."""


@pytest.mark.parametrize("path", sorted(str(p) for p in [*(REPO / "demo").glob("*.yaml"), *EXAMPLES]))
def test_every_bundled_config_loads(path):
    cfg = load_config(path)
    assert cfg.run.name and cfg.model.path and cfg.prompts.path


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> str:
    """The demo's tiny checkpoint with Llama 3.1's 131,072 positions, so the examples' lengths fit."""
    from demo.checkpoint import build_checkpoint

    return str(build_checkpoint(tmp_path_factory.mktemp("model") / "long", max_positions=131072))


def test_there_are_examples_to_copy():
    assert len(EXAMPLES) >= 3, EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_plans_a_whole_run_with_real_inputs_in_place_of_its_paths(path, tmp_path, long_context_model):
    # Only the three paths are replaced: prompts in the example's own fields, a checkpoint that
    # has its chat template, every other value (lengths, sampling, engine, W&B) the file's own,
    # and every check a run makes before its first step passes.
    cfg = load_config(str(path))
    prompts = tmp_path / "prompts.jsonl"
    rows = [{cfg.prompts.text_field: f"question {i}", **({cfg.prompts.id_field: f"q{i}"} if cfg.prompts.id_field else {})}
            for i in range(3)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(app, ["run", "all", "--dry-run", "--config", str(path),
                                      "--set", f"model.path={long_context_model}", "--set", f"prompts.path={prompts}",
                                      "--set", f"run.root={tmp_path / 'runs'}"], env={"WANDB_API_KEY": ""})
    assert result.exit_code == 0, result.output
    planned = [line.split()[0] for line in result.output.splitlines() if line.endswith("runs first)") or ": run" in line]
    assert planned == ["tokenize", "generate", "merge", "upload"], result.output
    assert not (tmp_path / "runs").exists(), "a dry run writes nothing"


def test_defaults_fill_optional_sections():
    cfg = build_config(MINIMAL)
    assert cfg.sampling.temperature == 0.0 and cfg.sampling.n == 1 and cfg.engine.batch_size == "auto"
    assert cfg.prompts.on_invalid == "fail" and cfg.wandb.table_max_rows == 10_000


@pytest.mark.parametrize("data, message", [
    (with_section("sampling", top_p=1.5), "sampling.top_p must be a number in (0, 1], got 1.5"),
    (with_section("sampling", temperature=-0.1), "sampling.temperature must be a finite number >= 0"),
    (with_section("sampling", n=0), "sampling.n must be an integer > 0, got 0"),
    (with_section("sampling", max_new_tokens="many"), "sampling.max_new_tokens must be an integer, got 'many'"),
    (with_section("sampling", temperature=True), "sampling.temperature must be a number, got True"),
    (with_section("sampling", stop="###"), "sampling.stop must be a list of strings"),
    (with_section("sampling", stop=[""]), "sampling.stop must be non-empty strings"),
    (with_section("sampling", tempreature=0.7), "unknown key sampling.tempreature"),
    (with_section("engine", batch_size=0), "engine.batch_size must be an integer > 0 or auto, got 0"),
    (with_section("engine", batch_size="big"), "engine.batch_size must be an integer or auto, got 'big'"),
    (with_section("model", dtype="float16"), "model.dtype must be float32 or bfloat16, got 'float16'"),
    (with_section("prompts", on_invalid="ignore"), "prompts.on_invalid must be fail or skip"),
    (with_section("prompts", max_prompt_tokens=-1), "prompts.max_prompt_tokens must be an integer > 0, got -1"),
    (with_section("wandb", mode="cloud"), "wandb.mode must be offline or online or disabled"),
    ({"run": {"root": "/r", "name": "x"}, "model": {"path": "/m"}}, "missing required key prompts"),
    (with_section("run", name=None), "run.name must be a string, got null"),
    ({**MINIMAL, "extra": {}}, "unknown key extra"),
    (with_section("sampling", **{"seed": 1.5}), "sampling.seed must be an integer, got 1.5"),
    (with_section("sampling", seed=-1), "sampling.seed must be an integer in [0, 2**32), got -1"),
    (with_section("sampling", seed=2**32), "sampling.seed must be an integer in [0, 2**32)"),
    (with_section("sampling", temperature=float("inf")), "sampling.temperature must be a finite number, got inf"),
    (with_section("sampling", top_p=0), "sampling.top_p must be a number in (0, 1], got 0.0"),
    (with_section("sampling", top_k=-1), "sampling.top_k must be an integer >= 0"),
    (with_section("sampling", min_p=1.5), "sampling.min_p must be a number in [0, 1] (0 = off), got 1.5"),
    (with_section("sampling", max_new_tokens=8, min_new_tokens=9), "sampling.min_new_tokens must be an integer in [0, max_new_tokens = 8], got 9"),
    (with_section("sampling", repetition_penalty=0), "sampling.repetition_penalty must be a finite number > 0 (1 = off), got 0"),
    (with_section("sampling", frequency_penalty=2.5), "sampling.frequency_penalty must be a number in [-2, 2] (0 = off), got 2.5"),
    (with_section("sampling", presence_penalty="high"), "sampling.presence_penalty must be a number, got 'high' (str)"),
    (with_section("sampling", max_new_tokens=0), "sampling.max_new_tokens must be an integer > 0, got 0"),
    (with_section("sampling", max_new_tokens=2**70), "sampling.max_new_tokens must be an integer between"),
    (with_section("prompts", num_shards=0), "prompts.num_shards must be an integer > 0 or auto, got 0"),
    (with_section("prompts", max_prompt_tokens=0), "prompts.max_prompt_tokens must be an integer > 0, got 0"),
    (with_section("prompts", id_field=""), "prompts.id_field must be a field name or null"),
    (with_section("prompts", id_field="prompt"), "prompts.id_field must be a field other than prompts.text_field"),
    (with_section("prompts", path=""), "prompts.path must be a file, folder or glob"),
    (with_section("model", path=" "), "model.path must be a checkpoint folder"),
    (with_section("engine", part_rows=0), "engine.part_rows must be an integer > 0, got 0"),
    (with_section("engine", memory_fraction=0), "engine.memory_fraction must be a number in (0, 1], got 0.0"),
    (with_section("wandb", table_max_rows=-1), "wandb.table_max_rows must be an integer >= 0, got -1"),
    (with_section("wandb", project=""), "wandb.project must be a non-empty project name"),
    # W&B refuses these when the run starts, i.e. at upload, after the other steps (exit 1 there):
    (with_section("wandb", project="team/project"), "wandb.project must be a W&B project name: at most 128 "
     "characters, none of / \\ # ? % :, got 'team/project'"),
    (with_section("wandb", project="p" * 129), "wandb.project must be a W&B project name"),
    # An unknown storage: a traceback (run.root) or exit 1 (the paths) once the plan read them.
    (with_section("run", root="htps://bucket/runs"), "run.root must be a local path or a URL of a storage fsspec "
     "can open (gs://, file://, memory://, ...): Protocol not known: htps, got 'htps://bucket/runs'"),
    (with_section("model", path="s3://bucket/model"), "model.path must be a local path or a URL of a storage "
     "fsspec can open (gs://, file://, memory://, ...): Install s3fs"),
    (with_section("run", root="gs://"), "run.root must be gs://BUCKET or gs://BUCKET/PREFIX, got 'gs://'"),
    (with_section("prompts", path="gs:///p.jsonl"), "prompts.path must be gs://BUCKET or gs://BUCKET/PREFIX"),
    (with_section("prompts", system_prompt="Be brief \ud800."), "prompts.system_prompt must be null while"),
    (with_section("prompts", system_prompt="Be brief \ud800.", chat_template=True),
     "prompts.system_prompt must be text without lone surrogates"),
    (with_section("wandb", api_key="sentinel"), "unknown key wandb.api_key"),
    ({**MINIMAL, 1: {}}, "unknown key 1 (valid keys in the top level"),
    (with_section("run", **{"na\nme": 1}), "unknown key run.'na\\nme' (valid keys in run"),
])
def test_bad_values_name_the_key_path(data, message):
    with pytest.raises(ConfigError) as err:
        build_config(data)
    assert message in str(err.value)


@pytest.mark.parametrize("make, message", [
    (lambda: EngineConfig(batch_size=(16, 64)), "engine.batch_size must be an integer > 0 or auto, got (16, 64)"),
    (lambda: EngineConfig(prefill_tokens="512"), "engine.prefill_tokens must be auto or an integer >= engine.prefill_chunk_tokens"),
    (lambda: EngineConfig(memory_fraction=None), "engine.memory_fraction must be a number in (0, 1], got None"),
    (lambda: MeshConfig(model="2"), "engine.mesh.model must be an integer > 0 or auto, got '2'"),
    (lambda: SamplingParams(max_new_tokens=True), "sampling.max_new_tokens must be an integer > 0, got True"),
    (lambda: SamplingParams(top_p="0.9"), "sampling.top_p must be a number in (0, 1], got '0.9'"),
    # A bare string iterated as one-character stops: "\n\n" stopped at every "\n".
    (lambda: SamplingParams(stop="\n\n"), "sampling.stop must be a list of strings (one stop string: ['\\n\\n']), got '\\n\\n'"),
    (lambda: SamplingParams(stop=None), "sampling.stop must be a list of strings"),
    (lambda: SamplingParams(stop_token_ids=5), "sampling.stop_token_ids must be a list of integer token ids, got 5"),
    (lambda: SamplingParams(stop_token_ids=[1.5]), "sampling.stop_token_ids must be a list of integer token ids, got [1.5]"),
])
def test_the_engine_api_names_the_key_of_a_wrong_type(make, message):
    """Engine.load takes these classes from Python too, where no YAML reader checked the types:
    a wrong one is named like a wrong value, not a TypeError from comparing it."""
    with pytest.raises(InvalidConfig) as err:
        make()
    assert message in str(err.value)


def test_the_engine_api_takes_numpy_integers():
    assert EngineConfig(batch_size=np.int64(16)).batch_size == 16
    assert SamplingParams(max_new_tokens=np.int32(8), top_p=np.float32(0.5)).max_new_tokens == 8
    assert SamplingParams(stop_token_ids=np.array([7, 9]), stop=["a", "b"]).stop_token_ids == (7, 9)


def test_set_overrides_are_yaml_typed_and_dotted():
    data = apply_override(apply_override(MINIMAL, "sampling.temperature=0.7"), 'sampling.stop=["\\n\\n"]')
    cfg = build_config(apply_override(data, "engine.batch_size=auto"))
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.stop == ("\n\n",) and cfg.engine.batch_size == "auto"
    assert MINIMAL.get("sampling") is None  # the input is not mutated


@pytest.mark.parametrize("override, message", [
    ("sampling.temperature", "expected KEY=VALUE"),
    ("run.root.deeper=1", "run.root is not a section"),
    ("sampling.n=[1", "value is not valid YAML"),
    (".prompts=1", "the key '.prompts' has an empty part"),
    ("sampling..n=1", "the key 'sampling..n' has an empty part"),
])
def test_bad_set_syntax(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        apply_override(MINIMAL, override)


def test_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run: {root: /tmp\n  name: [\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).startswith(f"config file {path}:2:7 is not valid YAML: expected ',' or '}}'")
    assert "\n" not in str(err.value)
    path.write_text("run:\n\troot: /tmp\n")
    with pytest.raises(ConfigError, match=f"config file {path}:2:1 is not valid YAML: found character"):
        load_config(str(path))


def test_a_config_file_that_is_not_utf8_is_named_in_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run: {root: /tmp/x, name: a}\n# caf\xe9\n")
    with pytest.raises(ConfigError) as err:  # a UnicodeDecodeError's traceback before
        load_config(str(path))
    assert str(err.value) == f"config file {path} is not UTF-8 text: byte 0xe9 at offset 34; save it as UTF-8"


def test_yaml_merge_keys_fill_a_section_and_the_keys_beside_them_win(tmp_path):
    """`<<: *defaults` is plain YAML; the duplicate-key check refused it as "not valid YAML"."""
    inline = tmp_path / "inline.yaml"
    inline.write_text("run: {root: /tmp/x, name: a}\nmodel: {path: /m}\nprompts: {path: /p}\n"
                      "sampling:\n  <<: {max_new_tokens: 16, n: 2, temperature: 0.9}\n  temperature: 0.5\n")
    cfg = load_config(str(inline))
    assert (cfg.sampling.max_new_tokens, cfg.sampling.n, cfg.sampling.temperature) == (16, 2, 0.5)
    twice = tmp_path / "twice.yaml"
    twice.write_text(inline.read_text() + "  temperature: 0.7\n")
    with pytest.raises(ConfigError, match="key 'temperature' appears twice"):
        load_config(str(twice))


def test_a_key_given_twice_is_refused_not_silently_overwritten(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("run: {root: /tmp/x, name: a}\nsampling:\n  temperature: 0.5\n  n: 2\n  temperature: 0.9\n")
    with pytest.raises(ConfigError, match=f"config file {path}:5:3 is not valid YAML: key 'temperature' appears twice"):
        load_config(str(path))


def test_cli_config_errors_exit_2_with_one_line(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["run", "all", "--config", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2
    assert missing.output.strip().splitlines()[-1] == f"error: config file {tmp_path / 'nope.yaml'} not found"
    bad = runner.invoke(app, ["status", "--config", str(REPO / "demo" / "config.yaml"), "--set", "sampling.top_p=2"])
    assert bad.exit_code == 2
    assert bad.output.strip().splitlines()[-1].startswith("error: ") and "sampling.top_p" in bad.output


@pytest.mark.parametrize("override, line", [
    ("sampling.temprature=0.2", "error: --set sampling.temprature=...: unknown key sampling.temprature "
     "(valid keys in sampling: max_new_tokens, min_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, n, seed, stop, stop_token_ids, logprobs, prompt_logprobs, top_logprobs)"),
    ("sampling.n=two", "error: --set sampling.n=two: sampling.n must be an integer, got 'two' (str)"),
    ("sampling.top_p=2", "error: --set sampling.top_p=2: sampling.top_p must be a number in (0, 1], got 2.0"),
    ("engine.mesh={data: x}", "error: --set engine.mesh={data: x}: engine.mesh.data must be an integer or auto, "
     "got 'x' (str)"),
    ("sampling=3", "error: --set sampling=3: sampling must be a mapping, got 3 (int)"),
    # An error about the section the --set set a key in: the file was named (it has no engine.mesh).
    ("engine.mesh.data=2", "error: --set engine.mesh.data=2: engine.mesh applies only with engine.mode: "
     "global_mesh (engine.mode is host_dp); remove it or set engine.mode=global_mesh"),
    ("foo.bar=3", "error: --set foo.bar=...: unknown key foo (valid keys in the top level: run, model, prompts, "
     "sampling, engine, wandb)"),
])
def test_a_set_mistake_names_the_set_argument_not_the_file(override, line):
    """Issue 14: `--set sampling.temprature=0.2` was reported as `demo/config.yaml: unknown key ...`.
    An unknown key's value is not repeated: it may be a secret (`--set wandb.api_key=...`)."""
    result = CliRunner().invoke(app, ["run", "all", "--dry-run", "--config", str(REPO / "demo" / "config.yaml"),
                                      "--set", override])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == line


def test_a_mistake_in_the_file_still_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {root: /tmp/x, name: a}\nmodel: {path: /m}\nprompts: {path: /p}\nsampling: {temprature: 1}\n")
    with pytest.raises(ConfigError, match=f"^{path}: unknown key sampling.temprature "):
        load_config(str(path), ["sampling.n=2"])
