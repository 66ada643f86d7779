"""What goes into a step's hash, and nothing else.

A step's hash is sha256 over canonical JSON of: its name and code version, the config
values listed for it in SEMANTIC_KEYS (and in ADDED_KEYS, when not at their defaults; a greedy
run's UNREAD_WHEN_GREEDY at their defaults), content fingerprints of its inputs (prompt files,
tokenizer and model files: checksums, never paths or mtimes), and its upstream hashes.
Runtime knobs (engine.*, prompts.num_shards, run.root, host count, device kind) are in no
list, so they can never change a hash. tests/test_identity.py holds the table of which
edits change which hashes.

    h = step_hash("generate", "1", semantic={...}, content={...}, upstream={"tokenize": "ab12..."})
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, TypeVar

from engine.checkpoint import WEIGHT_SUFFIXES
from engine.config import SamplingParams
from pipeline import storage
from pipeline.run import checks
from pipeline.run.config import Config
from pipeline.errors import ConfigError, Interrupted, StepFailed
from pipeline.storage.retrying import StorageError

T = TypeVar("T")

SEMANTIC_KEYS: dict[str, tuple[str, ...]] = {
    "tokenize": (
        "prompts.text_field",
        "prompts.id_field",
        "prompts.max_prompt_tokens",
        "prompts.chat_template",
        "prompts.system_prompt",
        "prompts.on_invalid",
    ),
    "generate": (
        "model.dtype",
        "sampling.max_new_tokens",
        "sampling.temperature",
        "sampling.top_p",
        "sampling.top_k",
        "sampling.n",
        "sampling.seed",
        "sampling.stop",
        "sampling.stop_token_ids",
    ),
    "merge": (),
    "upload": ("run.name", "wandb.project", "wandb.entity", "wandb.table_max_rows"),
}
"""Config keys whose values change each step's output."""

ADDED_KEYS: dict[str, dict[str, Any]] = {
    "generate": {"sampling.logprobs": False, "sampling.min_p": 0.0, "sampling.min_new_tokens": 0, "sampling.repetition_penalty": 1.0,
                 "sampling.presence_penalty": 0.0, "sampling.frequency_penalty": 0.0, "sampling.prompt_logprobs": False,
                 "sampling.top_logprobs": 0},
}
"""Config keys added after results were made, with their defaults: each enters its step's hash
only when set to another value, so that a result made before the key existed keeps its hash
(and is not generated again) while the key is left at its default."""

UNREAD_WHEN_GREEDY: dict[str, Any] = {f"sampling.{name}": getattr(SamplingParams(), name)
                                      for name in ("seed", "top_p", "top_k", "min_p")}
"""Sampling keys a greedy run (sampling.temperature 0) never reads, with their defaults: there they
are hashed at their defaults, so a greedy result is found again whatever they say (a template's
leftover top_p, a sweep over seeds). Results made before this rule hashed what they said:
`earlier_semantic_values` finds them."""

CONTENT_INPUTS: dict[str, tuple[str, ...]] = {
    "tokenize": ("prompts", "tokenizer"),
    "generate": ("model",),
    "merge": (),
    "upload": (),
}
"""Input files whose content (not location) changes each step's output."""

INPUT_KEYS = {"prompts": "prompts.path", "tokenizer": "model.path", "model": "model.path"}
"""The config key naming each CONTENT_INPUTS kind's files."""

RECHECKED = ("prompts", "tokenizer")
"""Inputs read again before a step is marked complete (`changed_input`): prompt files are edited
and appended to while runs go on; a model's weights are gigabytes to read again, and are not."""


def changed_input(step: str, cfg: Config, planned: dict[str, Any]) -> str | None:
    """What of the step's RECHECKED inputs no longer holds what the plan hashed (`planned`), as
    'prompts file URL changed', or None."""
    kinds = [kind for kind in CONTENT_INPUTS[step] if kind in RECHECKED and kind in planned]
    if "prompts" in kinds:
        urls = _read(cfg, "prompts.path", lambda: storage.expand(cfg.prompts.path))
        now = [_read(cfg, "prompts.path", lambda: _prompt_fingerprint(url)) for url in urls]
        if change := _changed_files(cfg, "prompts", planned["prompts"], now, urls, "when the run began"):
            return change
    if "tokenizer" in kinds:
        now_files = _read(cfg, "model.path", lambda: _FINGERPRINTERS["tokenizer"](cfg))
        return _changed_files(cfg, "tokenizer", planned["tokenizer"], now_files)
    return None


def what_changed(step: str, version: str, cfg: Config, content: dict[str, Any], upstream: dict[str, str],
                 record: Any) -> str | None:
    """What of a step's hash differs from an earlier output's `record` (a status.StepRecord):
    its code version, config values, input files or upstream outputs, in words ('sampling.seed
    changed from 0 to 1', 'prompts file X changed'), or None where nothing named differs."""
    changes = []
    if record.version != version:
        changes.append(f"the {step} step's code changed (version {record.version}, now {version})")
    added = ADDED_KEYS.get(step, {})
    hashed_then = _hashed(step, lambda key: at(record.config, key, added.get(key)), greedy_rule=True)
    hashed_now = semantic_values(step, cfg)
    for key in (*SEMANTIC_KEYS[step], *added):
        then, now = canonical_json(at(record.config, key, added.get(key))), canonical_json(cfg.get(key))
        # Named where it changed and its hashed value with it (a greedy run's seed is hashed at 0).
        if then != now and canonical_json(hashed_then.get(key)) != canonical_json(hashed_now.get(key)):
            changes.append(f"{key} changed from {then} to {now}")
    for kind in CONTENT_INPUTS[step]:
        if kind in record.content and canonical_json(record.content[kind]) != canonical_json(content.get(kind)):
            urls = _listed(cfg.prompts.path) if kind == "prompts" else []
            changes.append(_changed_files(cfg, kind, record.content[kind], content.get(kind), urls)
                           or "the prompt files changed")  # named where they can be listed
    changes += [f"{name}'s output changed" for name, h in upstream.items() if record.upstream.get(name) != h]
    return "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else "") if changes else None


def describe_gone(cfg: Config, kinds: list[str]) -> str:
    """Inputs whose files are gone (`content_fingerprints` found none), in words."""
    said = {"prompts": f"prompts.path {cfg.prompts.path}, which matches no files",
            "tokenizer": f"the tokenizer files of model.path {cfg.model.path}, which holds none",
            "model": f"model.path {cfg.model.path}, which holds no files"}
    return " and ".join(said[kind] for kind in kinds)


def at(tree: dict[str, Any], key: str, default: Any) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


def _changed_files(cfg: Config, kind: str, then: Any, now: Any, urls: list[str] | None = None,
                   when: str = "then") -> str | None:
    """Which file of an input changed between two of its fingerprints (`content_fingerprints`):
    prompt files by their place in `urls` (the listing `now` was read from), the model's by name;
    None where none is named (e.g. prompt files that could not be listed)."""
    if kind == "prompts":
        if len(then) != len(now):
            return f"prompts.path {cfg.prompts.path} matched {len(then)} file(s) {when} and {len(now)} now"
        if sorted(then) == sorted(now) and then != now:
            return (f"the files prompts.path {cfg.prompts.path} matches are the same but in another order (by "
                    f"name: it numbers the prompts)")
        changed = [url for url, a, b in zip(urls or [], now, then) if a != b]
        if len(changed) > 1:  # one replaced by another of another name: the files after it shifted
            if new := [url for url, a in zip(urls or [], now) if a not in then]:
                return f"prompts file {new[0]} is new or changed"
        return f"prompts file {changed[0]} changed" if changed else None
    if not now:
        return f"model.path {cfg.model.path} holds no {'tokenizer ' if kind == 'tokenizer' else ''}files now"
    names = sorted(name for name in set(then) | set(now) if then.get(name) != now.get(name))
    what = "the tokenizer file" if kind == "tokenizer" else "model file"
    if not names:
        return None
    return f"{what} {storage.join(cfg.model.path, names[0])} changed" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def _listed(pattern: str) -> list[str]:
    """The files a pattern names, or none where they cannot be listed (a hint is lost, not a run)."""
    try:
        return storage.expand(pattern)
    except Interrupted:
        raise
    except Exception:  # noqa: BLE001
        return []


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def step_hash(name: str, version: str, semantic: dict[str, Any], content: dict[str, Any],
              upstream: dict[str, str]) -> str:
    payload = {"step": name, "version": version, "semantic": semantic, "content": content,
               "upstream": upstream}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def semantic_values(step: str, cfg: Config) -> dict[str, Any]:
    """The config values that enter a step's hash: its SEMANTIC_KEYS, its ADDED_KEYS not at their
    defaults, and in a greedy run the keys it never reads at their defaults (UNREAD_WHEN_GREEDY)."""
    return _hashed(step, cfg.get, greedy_rule=True)


def earlier_semantic_values(step: str, cfg: Config) -> dict[str, Any]:
    """The values the step hashed before UNREAD_WHEN_GREEDY (every key as it says): where they
    differ from `semantic_values`, the plan looks for an output under that hash too, so a result
    made then is found, not generated again."""
    return _hashed(step, cfg.get, greedy_rule=False)


def _hashed(step: str, value_of: Callable[[str], Any], *, greedy_rule: bool) -> dict[str, Any]:
    """The hashed values of a step, each key's value from `value_of`."""
    unread = UNREAD_WHEN_GREEDY if greedy_rule and step == "generate" and value_of("sampling.temperature") == 0 else {}
    values = {key: unread.get(key, value_of(key)) for key in SEMANTIC_KEYS[step]}
    for key, default in ADDED_KEYS.get(step, {}).items():
        if (value := unread.get(key, value_of(key))) != default:
            values[key] = value
    return values


def content_fingerprints(step: str, cfg: Config) -> dict[str, Any]:
    """Checksums of the input files a step reads, keyed by name relative to their input."""
    return {kind: _read(cfg, INPUT_KEYS[kind], lambda: _FINGERPRINTERS[kind](cfg))
            for kind in CONTENT_INPUTS[step]}


def _read(cfg: Config, key: str, read: Callable[[], T]) -> T:
    """read(), with any filesystem's error (unknown protocol, no network, ...) as one line naming `key`."""
    try:
        return read()
    except (Interrupted, ConfigError):  # a stop signal (exit 75), an input of the wrong kind (exit 2)
        raise
    except Exception as err:  # noqa: BLE001 - classified into one StepFailed line
        cause = str(err) if isinstance(err, StorageError) else f"{type(err).__name__}: {err}"
        raise StepFailed(f"{key} {cfg.get(key)} could not be read: {cause}") from err


def _prompt_files(cfg: Config) -> list[str]:
    # Order matters (prompt_index follows the sorted file order), names do not: the same
    # files in another bucket give the same list.
    urls = storage.expand(cfg.prompts.path)
    for url in urls:  # the same bytes renamed to a type tokenize refuses are not its finished input
        checks.prompt_file_format(url, cfg.prompts)
    return [_prompt_fingerprint(url) for url in urls]


def _prompt_fingerprint(url: str) -> str:
    # A .txt file's kind enters it: its lines are the prompts, where the same bytes named .jsonl
    # are parsed (JSONL and Parquet files keep the fingerprints they had before this, so their
    # results keep their hashes).
    return storage.fingerprint(url) + (":txt" if checks.kind_of(url) == "txt" else "")


def _checkpoint_files(cfg: Config, weights: bool) -> dict[str, str]:
    files = storage.expand(cfg.model.path)
    return {
        url.rsplit("/", 1)[-1]: storage.fingerprint(url)
        for url in files
        if weights or not url.endswith(WEIGHT_SUFFIXES)
    }


_FINGERPRINTERS = {
    "prompts": _prompt_files,
    "tokenizer": lambda cfg: _checkpoint_files(cfg, weights=False),
    "model": lambda cfg: _checkpoint_files(cfg, weights=True),
}
