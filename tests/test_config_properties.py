"""Property tests for the config parser: any YAML a user can write gives a Config or one ConfigError.

Covers the reliability issue's "bad input" rule for configs: random values in every field,
random sections and keys, random `--set` strings and random YAML text never raise anything
but ConfigError, and the message names the key path that is wrong; valid values round-trip
through the dataclasses, `to_dict()`, a YAML file and `--set` unchanged.
"""

from __future__ import annotations

import math
import re

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeline.run.config import apply_override, build_config, load_config
from pipeline.errors import ConfigError

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

words = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).filter(lambda s: s.strip())
big = st.integers(min_value=1, max_value=2**63 - 1)
paths = words.filter(lambda s: "://" not in s)  # a scheme must name a storage fsspec has
VALID: dict[str, st.SearchStrategy] = {
    "run.root": paths,
    "run.name": words,
    "model.path": paths,
    "model.dtype": st.sampled_from(["float32", "bfloat16"]),
    "prompts.path": paths,
    "prompts.text_field": words,
    "prompts.id_field": st.none() | words,
    "prompts.max_prompt_tokens": big,
    "prompts.chat_template": st.booleans(),
    "prompts.system_prompt": st.none() | st.text(max_size=20),
    "prompts.on_invalid": st.sampled_from(["fail", "skip"]),
    "prompts.num_shards": st.just("auto") | big,
    "sampling.max_new_tokens": big,
    "sampling.temperature": st.floats(min_value=0, max_value=1e300) | st.integers(0, 100),
    "sampling.top_p": st.floats(min_value=0, max_value=1, exclude_min=True),
    "sampling.top_k": st.integers(0, 2**63 - 1),
    "sampling.n": big,
    "sampling.seed": st.integers(0, 2**32 - 1),
    "sampling.stop": st.lists(words, max_size=3),
    "engine.batch_size": st.just("auto") | big,
    "engine.memory_fraction": st.floats(min_value=0, max_value=1, exclude_min=True),
    "engine.part_rows": big,
    "wandb.project": words.filter(lambda s: len(s) <= 128 and not set(s) & set("/\\#?%:")),  # W&B's rule
    "wandb.entity": st.none() | words,
    "wandb.mode": st.sampled_from(["offline", "online", "disabled"]),
    "wandb.table_max_rows": st.integers(0, 2**63 - 1),
}
"""A valid value for every key (sections not listed here keep their defaults)."""
REQUIRED = ("run.root", "run.name", "model.path", "prompts.path")

yaml_scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80) | st.floats()
                | st.text(max_size=10) | st.sampled_from(["auto", "fail", "skip", "float32", "offline", "", " "]))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
"""Anything `yaml.safe_load` can produce (no dates: they only arise from YAML text, tested below)."""


def nest(flat: dict[str, object]) -> dict:
    data: dict = {}
    for path, value in flat.items():
        section, key = path.split(".")
        data.setdefault(section, {})[key] = value
    return data


@st.composite
def valid_flat(draw) -> dict[str, object]:
    keys = draw(st.sets(st.sampled_from(sorted(set(VALID) - set(REQUIRED)))))
    flat = {k: draw(VALID[k]) for k in sorted(set(REQUIRED) | keys)}
    assume(flat.get("prompts.id_field") is None or flat["prompts.id_field"] != flat.get("prompts.text_field", "prompt"))
    assume(flat.get("prompts.system_prompt") is None or flat.get("prompts.chat_template"))  # a turn of the template
    return flat


def same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=0)
    if isinstance(a, (list, tuple)):
        return list(a) == list(b)
    return a == b


@FAST
@given(valid_flat())
def test_valid_values_round_trip(flat):
    cfg = build_config(nest(flat))
    for path, value in flat.items():
        assert same(cfg.get(path), value), path
    assert build_config(cfg.to_dict()) == cfg
    assert build_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


@FAST
@given(valid_flat(), st.data())
def test_valid_values_round_trip_through_set(flat, data):
    path = data.draw(st.sampled_from(sorted(VALID)))
    value = data.draw(VALID[path])
    assume(not (path == "prompts.text_field" and value == flat.get("prompts.id_field")))
    assume(not (path == "prompts.id_field" and value == flat.get("prompts.text_field", "prompt")))
    assume(not (path == "prompts.system_prompt" and value is not None and not flat.get("prompts.chat_template")))
    assume(not (path == "prompts.chat_template" and not value and flat.get("prompts.system_prompt") is not None))
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").rstrip("\n")
    cfg = build_config(apply_override(nest(flat), f"{path}={text}"))
    assert same(cfg.get(path), value)


@FAST
@given(valid_flat(), st.data())
def test_any_value_anywhere_gives_a_config_or_an_error_naming_its_key(flat, data):
    paths = data.draw(st.sets(st.sampled_from(sorted(VALID) + ["run", "sampling", "engine", "wandb", "prompts"]),
                              min_size=1, max_size=3))
    tree = nest(flat)
    for path in paths:
        section, _, key = path.partition(".")
        value = data.draw(yaml_values)
        if key:
            if not isinstance(tree.get(section), dict):
                tree[section] = {}
            tree[section][key] = value
        else:
            tree[section] = value
    try:
        build_config(tree)
    except ConfigError as err:
        named = set(paths) | ({"prompts.id_field"} if "prompts.text_field" in paths else set())
        message = str(err)
        assert any(re.search(rf"(^|[\s:(]){re.escape(p)}([\s.\[]|$)", message) for p in named) \
            or ("unknown key" in message and any(p.split(".")[0] in message for p in named)), message
        assert "\n" not in message


@FAST
@given(valid_flat(), st.text(max_size=12), yaml_values)
def test_unknown_keys_are_refused_naming_their_path(flat, key, value):
    assume(key and key not in {p.split(".")[1] for p in VALID} and "=" not in key and "." not in key)
    tree = nest(flat)
    tree.setdefault("wandb", {})[key] = value
    shown = key if key.isprintable() else repr(key)  # a key with a newline is named on one line
    with pytest.raises(ConfigError, match=re.escape(f"unknown key wandb.{shown}")):
        build_config(tree)


@FAST
@given(st.text(max_size=40), valid_flat())
def test_any_set_string_gives_a_config_or_a_config_error(override, flat):
    try:
        build_config(apply_override(nest(flat), override))
    except ConfigError as err:
        assert "\n" not in str(err)


@FAST
@given(st.text(max_size=200))
def test_any_yaml_text_gives_a_config_or_a_config_error_naming_the_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "config.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(str(path))
    except ConfigError as err:
        assert str(path) in str(err) and "\n" not in str(err)


def test_secret_looking_keys_are_refused_not_saved():
    """The reliability issue: `--set wandb.api_key=...` must fail as an unknown key, never reach a marker."""
    base = nest({p: "x" for p in REQUIRED})
    for key in ("wandb.api_key", "wandb.key", "run.credentials"):
        with pytest.raises(ConfigError) as err:
            build_config(apply_override(base, f"{key}=sentinel-secret-0xC0FFEE"))
        assert f"unknown key {key}" in str(err.value) and "sentinel" not in str(err.value)
