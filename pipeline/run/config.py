"""The pipeline's configuration: YAML -> `--set` overrides -> frozen, validated dataclasses.

Owns the schema of every section (docs/contract.md) and the rules for reading it; the
`sampling` and `engine` sections are the engine's own dataclasses (engine/config.py).
Refuses unknown keys, wrong types and impossible values before any work starts, with a
message that names the key path (`ConfigError`, exit 2). It does not decide what enters a
hash: that list lives in `identity.py`.

    cfg = load_config("demo/config.yaml", overrides=["sampling.temperature=0.7"])
    cfg.sampling.temperature  # 0.7
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import fsspec
import yaml

from engine.config import EngineConfig, SamplingParams, require
from pipeline.errors import ConfigError


@dataclass(frozen=True)
class RunConfig:
    root: str
    """Where every step writes: a local path, file://, gs://bucket/prefix or memory://."""
    name: str
    """A name for this run; the W&B run is named after it."""

    def __post_init__(self):
        require(bool(self.root.strip()), "run.root", self.root, "a non-empty URL")
        require(bool(self.name.strip()), "run.name", self.name, "a non-empty name")
        _require_storage("run.root", self.root)


@dataclass(frozen=True)
class ModelConfig:
    path: str
    """A Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files), local or gs://."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Weights' dtype on device; activations of the KV cache stay float32."""

    def __post_init__(self):
        require(bool(self.path.strip()), "model.path", self.path, "a checkpoint folder (path or URL)")
        _require_storage("model.path", self.path)


@dataclass(frozen=True)
class PromptsConfig:
    path: str
    """A prompt file, folder or glob (JSONL, Parquet or .txt), on any fsspec filesystem."""
    text_field: str = "prompt"
    """The JSONL/Parquet field holding the prompt text (ignored for .txt)."""
    id_field: str | None = None
    """Field holding a unique prompt id; null uses the prompt's position."""
    max_prompt_tokens: int = 1024
    """Longer prompts are rejected (never truncated), per `on_invalid`."""
    chat_template: bool = False
    """Format each prompt as a user turn with the tokenizer's own chat template."""
    system_prompt: str | None = None
    """With chat_template: a system turn put before every prompt."""
    on_invalid: Literal["fail", "skip"] = "fail"
    """fail: stop before writing anything; skip: record each bad row with its reason and go on."""
    num_shards: int | Literal["auto"] = "auto"
    """Shards written by tokenize; auto = 8 per host. A runtime knob: never part of a hash."""

    def __post_init__(self):
        require(self.max_prompt_tokens > 0, "prompts.max_prompt_tokens", self.max_prompt_tokens, "an integer > 0")
        require(self.num_shards == "auto" or self.num_shards > 0, "prompts.num_shards", self.num_shards, "an integer > 0 or auto")
        require(bool(self.path.strip()), "prompts.path", self.path, "a file, folder or glob")
        _require_storage("prompts.path", self.path)
        require(self.system_prompt is None or self.chat_template, "prompts.system_prompt", self.system_prompt,
                "null while prompts.chat_template is false (a system prompt is a turn of the chat template: "
                "set prompts.chat_template=true)")
        require(self.system_prompt is None or is_text(self.system_prompt), "prompts.system_prompt",
                self.system_prompt, "text without lone surrogates")
        require(bool(self.text_field), "prompts.text_field", self.text_field, "a field name")
        require(self.id_field is None or bool(self.id_field), "prompts.id_field", self.id_field, "a field name or null")
        require(self.id_field is None or self.id_field != self.text_field, "prompts.id_field", self.id_field,
                 f"a field other than prompts.text_field ({self.text_field!r}) or null")


@dataclass(frozen=True)
class EngineSection(EngineConfig):
    """The `engine:` section: the engine's own settings (engine/config.py) plus the generate
    step's commit size. Runtime knobs only: none of it enters a hash."""

    part_rows: int = 256
    """Rows per committed generate part: a hard kill loses at most the parts in flight."""

    def __post_init__(self):
        super().__post_init__()
        require(self.part_rows > 0, "engine.part_rows", self.part_rows, "an integer > 0")


WANDB_PROJECT_FORBIDS = "/\\#?%:"
"""Characters W&B refuses in a project name (when the run starts, i.e. at upload)."""


@dataclass(frozen=True)
class WandbConfig:
    project: str = "pipeline"
    """W&B project the run is logged to."""
    entity: str | None = None
    """W&B entity (user or team); null = the API key's default."""
    mode: Literal["offline", "online", "disabled"] = field(
        default_factory=lambda: "online" if os.environ.get("WANDB_API_KEY") else "offline"
    )
    """online needs WANDB_API_KEY; offline writes a run `wandb sync` pushes later (default without a key)."""
    table_max_rows: int = 10_000
    """Rows put in the browsable wandb.Table; the Parquet files in the artifact hold every row."""

    def __post_init__(self):
        require(bool(self.project.strip()), "wandb.project", self.project, "a non-empty project name")
        require(len(self.project) <= 128 and not any(c in self.project for c in WANDB_PROJECT_FORBIDS), "wandb.project",
                self.project, f"a W&B project name: at most 128 characters, none of {' '.join(WANDB_PROJECT_FORBIDS)}")
        require(self.table_max_rows >= 0, "wandb.table_max_rows", self.table_max_rows, "an integer >= 0")


@dataclass(frozen=True)
class Config:
    run: RunConfig
    model: ModelConfig
    prompts: PromptsConfig
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine: EngineSection = field(default_factory=EngineSection)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved config as plain YAML/JSON-able data."""
        return _plain(dataclasses.asdict(self))

    def get(self, key_path: str) -> Any:
        """The value at a dotted key path, e.g. `sampling.temperature`."""
        value: Any = self
        for part in key_path.split("."):
            value = getattr(value, part)
        return _plain(value)


def _require_storage(key: str, url: str) -> None:
    """A URL's scheme names a filesystem fsspec has (`htps://` is a typo, `s3://` needs s3fs)."""
    if "://" not in url:
        return
    scheme, rest = url.split("://", 1)
    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as err:
        require(False, key, url, f"a local path or a URL of a storage fsspec can open (gs://, file://, memory://, "
                                 f"...): {_one_line(err)}")
    # `gs://` alone was joined into `gs:/name`: a local folder named `gs:`.
    require(scheme not in ("gs", "gcs") or bool(rest.split("/", 1)[0]), key, url, "gs://BUCKET or gs://BUCKET/PREFIX")


def is_text(value: str) -> bool:
    """Text UTF-8 can hold: no lone surrogates (a YAML or JSON "\\ud800" escape makes one), which
    no Parquet string column, tokenizer or W&B table takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it would keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: keys given next to it override its keys, as intended
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys are refused later, as unknown keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (any fsspec URL), apply `KEY=VALUE` overrides, validate."""
    try:
        with fsspec.open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as err:
        raise ConfigError(f"config file {path} not found") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text: byte {err.object[err.start]:#04x} at offset "
                          f"{err.start}; save it as UTF-8") from err
    except OSError as err:
        raise ConfigError(f"config file {path} could not be read: {err}") from err
    try:
        loader = _UniqueKeyLoader(text)  # what yaml.safe_load does, with the duplicate-key check
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {_yaml_where(path, err)} is not valid YAML: {_yaml_problem(err)}") from err
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections, got {type(data).__name__}")
    by_key: dict[str, str] = {}
    for override in overrides:
        data = apply_override(data, override)
        by_key[override.partition("=")[0].strip()] = override
    return build_config(data, source=path, overrides=by_key)


def apply_override(data: dict, override: str) -> dict:
    """Return a copy of `data` with one `dotted.key=yaml-value` override applied."""
    key_path, sep, raw = override.partition("=")
    if not sep or not key_path.strip():
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE, e.g. --set sampling.temperature=0.7")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {override!r}: value is not valid YAML: {_one_line(err)}") from err
    parts = key_path.strip().split(".")
    if not all(part.strip() for part in parts):
        raise ConfigError(f"--set {override!r}: the key {key_path.strip()!r} has an empty part; "
                          f"expected dotted keys, e.g. --set sampling.temperature=0.7")
    result = dict(data)
    node = result
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = value
    return result


def build_config(data: dict, source: str = "config", overrides: dict[str, str] | None = None) -> Config:
    """Validate plain data into a `Config`; every error names its key path.

    An error about a key that an override set (`overrides`: key path -> the `--set` argument)
    is blamed on that `--set` argument, not on `source`, the file the rest came from.
    """
    return _build(Config, data, prefix="", blame=_Blame(source, overrides or {}))


@dataclass(frozen=True)
class _Blame:
    """Who gave the value at a key path: the config file, or the `--set` argument that set it."""

    source: str
    overrides: dict[str, str]

    def __call__(self, key: str, unknown: bool = False) -> str:
        """The source of `key`. For an unknown key the `--set` value is not repeated: it may be a
        secret meant for a key that does not exist (`--set wandb.api_key=...`)."""
        for set_key in sorted(self.overrides, key=len, reverse=True):  # the most specific first
            if key == set_key or key.startswith(set_key + ".") or key.startswith(set_key + "["):
                return f"--set {set_key}=..." if unknown else f"--set {self.overrides[set_key]}"
        for set_key in sorted(self.overrides, key=len):  # about a section a --set set a key in
            if key and set_key.startswith(key + "."):  # (`--set engine.mesh.data=2`, `--set foo.bar=3`)
                return f"--set {set_key}=..." if unknown else f"--set {self.overrides[set_key]}"
        return self.source


# --- typed conversion -----------------------------------------------------------------


def _build(cls: type, data: Any, prefix: str, blame: _Blame) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{blame(prefix.rstrip('.'))}: {where} must be a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted((str(k) for k in data if k not in fields))  # YAML keys may be numbers, null, ...
    if unknown:
        shown = unknown[0] if unknown[0].isprintable() else repr(unknown[0])  # a newline in a key stays on one line
        raise ConfigError(
            f"{blame(prefix + unknown[0], unknown=True)}: unknown key {prefix}{shown} (valid keys in {where}: {', '.join(fields)})"
        )
    values = {}
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{blame(key)}: missing required key {key}")
            continue
        values[name] = _convert(hints[name], data[name], key, blame)
    try:
        return cls(**values)
    except ValueError as err:  # a dataclass's own check (engine.config.InvalidConfig): names the key first
        raise ConfigError(f"{blame(str(err).split(' ', 1)[0])}: {err}") from None


def _convert(tp: Any, value: Any, key: str, blame: _Blame) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, prefix=f"{key}.", blame=blame)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key, blame)
            except ConfigError as err:
                if dataclasses.is_dataclass(option) and isinstance(value, dict):
                    raise  # a mapping meant for this section: its own error names the inner key
                errors.append(err)
        raise ConfigError(f"{blame(key)}: {key} must be {_expected(tp)}, got {_describe(value)}")
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
        raise ConfigError(f"{blame(key)}: {key} must be {_expected(tp)}, got {_describe(value)}")
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{blame(key)}: {key} must be {_expected(tp)}, got {_describe(value)}")
        (item_tp, _) = typing.get_args(tp)
        return tuple(_convert(item_tp, v, f"{key}[{i}]", blame) for i, v in enumerate(value))
    ok = {
        bool: lambda v: type(v) is bool,
        int: lambda v: type(v) is int,
        float: lambda v: type(v) in (int, float),
        str: lambda v: type(v) is str,
    }[tp]
    if not ok(value):
        raise ConfigError(f"{blame(key)}: {key} must be {_expected(tp)}, got {_describe(value)}")
    if tp is int and not -2**63 <= value < 2**63:  # numpy, Arrow and JAX hold 64 bits at most
        raise ConfigError(f"{blame(key)}: {key} must be an integer between -2**63 and 2**63, got {_describe(value)}")
    if tp is float:
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{blame(key)}: {key} must be a finite number, got {_describe(value)}")
        return number
    return value


def _expected(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_expected(t) for t in typing.get_args(tp))
    if origin is Literal:
        return " or ".join(repr(v) if not isinstance(v, str) else v for v in typing.get_args(tp))
    if origin is tuple:
        item = typing.get_args(tp)[0]
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(item, _expected(item))
    if dataclasses.is_dataclass(tp):
        return "a mapping {" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null"}[tp]


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})" if value is not None else "null"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _yaml_where(path: str, err: yaml.YAMLError) -> str:
    """`path:line:col` (1-based) of a YAML syntax error, or just `path` when PyYAML gives no mark."""
    mark = getattr(err, "problem_mark", None)
    return f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What PyYAML found wrong, without its multi-line excerpt of the file."""
    problem, context = getattr(err, "problem", None), getattr(err, "context", None)
    if not problem:
        return _one_line(err)
    return f"{problem} ({context})" if context else problem
