"""A checkpoint folder checked in seconds, before any step starts: no weights are read.

Owns saying what is wrong with `model.path` while the user is still watching, instead of
after tokenize: the folder and its config.json, an architecture we run (engine/llama.py's
`LlamaConfig.from_hf` decides), tokenizer files, safetensors files (one, several, or listed
by `model.safetensors.index.json`), each file's header (8-byte little-endian length + JSON,
offsets inside the file), and every tensor the loader needs with the shape config.json
implies and a dtype it reads. It reads only config.json, the index and each header.

Refuses: pickle-based weights (`*.bin`, `*.pt`, ...: loading them can run code; only
safetensors and JSON are ever read), index entries that point outside the folder, and
remote code (nothing here imports transformers).

Exit codes, through the errors raised: a folder that is not a checkpoint we can run (missing,
no config.json, another architecture, no tokenizer, pickle weights only) is a ConfigError
naming `model.path` (exit 2); a file that is there but broken (bad JSON, corrupt or
truncated header, missing tensor, wrong shape) is StepFailed naming that file (exit 1).

    summary = check_checkpoint("gs://bucket/llama-3-8b")   # raises, or {"model_type": ..., ...}
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from engine.llama import LlamaConfig, UnsupportedModelError, checkpoint_mapping
from pipeline import storage
from pipeline.errors import ConfigError, StepFailed

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""At least one must exist: what `pipeline/hf.py` loads a fast tokenizer from."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weights in Python's pickle format: loading them can execute code, so they are never read."""
WEIGHT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
"""Bytes per element of the dtypes engine/llama.py's loader reads (its `_SAFETENSORS_DTYPES`)."""
HEADER_DTYPES = {**WEIGHT_DTYPES, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "U16": 2,
                 "I32": 4, "U32": 4, "I64": 8, "U64": 8}
"""Every dtype the safetensors format defines: other tensors may have them; required ones may not."""
MAX_HEADER_BYTES = 100 << 20
"""The safetensors format's own limit on a header: a larger length field means a corrupt file."""
HINT = "expected a Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer files"


def check_checkpoint(model_url: str) -> dict[str, Any]:
    """Raise ConfigError/StepFailed naming the problem, or return what was found."""
    fs, root = storage.filesystem(model_url)
    root = root.rstrip("/")
    if not fs.isdir(root):
        what = "is a file, not a folder" if fs.exists(root) else "does not exist"
        raise ConfigError(f"model.path {model_url} {what} ({HINT})")
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    config = _config(fs, root, model_url, names)
    if not any(name in names for name in TOKENIZER_FILES):
        raise ConfigError(f"model.path {model_url} has no tokenizer ({' or '.join(TOKENIZER_FILES)} missing; {HINT})")
    index, files = _weight_files(fs, root, model_url, names)
    headers = {name: _header(fs, f"{root}/{name}", storage.join(model_url, name)) for name in files}
    for tensor, file in index.items():
        if tensor not in headers[file]:
            raise StepFailed(f"{storage.join(model_url, INDEX_FILE)}: tensor {tensor} is listed in {file}, "
                             f"but {file} does not hold it (the index and the shards disagree)")
    # Which file the loader reads a tensor from: the index's, else the last file (sorted) holding it.
    where = dict(index) or {tensor: file for file in files for tensor in headers[file]}
    expected = _expected_shapes(config)
    missing = [name for name in expected if name not in where]
    if missing:
        raise StepFailed(f"model.path {model_url}: the checkpoint lacks {len(missing)} tensor(s) a "
                         f"{config.model_type} with this config.json needs, e.g. {', '.join(missing[:3])}")
    for name, shape in expected.items():
        info, url = headers[where[name]][name], storage.join(model_url, where[name])
        if info["dtype"] not in WEIGHT_DTYPES:
            raise StepFailed(f"{url}: tensor {name} has dtype {info['dtype']} "
                             f"(only {', '.join(WEIGHT_DTYPES)} weights are read; quantized checkpoints are not)")
        if list(info["shape"]) != list(shape):
            raise StepFailed(f"{url}: tensor {name} has shape {info['shape']}, config.json implies {list(shape)}")
    return {"model_type": config.model_type, "files": sorted(headers), "tensors": len(where),
            "layers": config.num_hidden_layers}


def _config(fs: Any, root: str, model_url: str, names: set[str]) -> LlamaConfig:
    url = storage.join(model_url, "config.json")
    if "config.json" not in names:
        raise ConfigError(f"model.path {model_url} has no config.json ({HINT})")
    try:
        with fs.open(f"{root}/config.json", "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise StepFailed(f"{url} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise StepFailed(f"{url} must hold a JSON object, got {type(data).__name__}")
    architectures = data.get("architectures") or []
    if not isinstance(architectures, list) or any(not str(a).endswith("ForCausalLM") for a in architectures):
        raise ConfigError(f"model.path {model_url}: architectures {architectures!r} in config.json is not a causal "
                          f"LM (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")
    try:
        config = LlamaConfig.from_hf(data, source=url)
    except UnsupportedModelError as err:
        raise ConfigError(str(err)) from err
    except KeyError as err:
        raise StepFailed(f"{url} lacks {err.args[0]!r}, which a {data.get('model_type')} config needs") from err
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise StepFailed(f"{url} has an invalid value: {type(err).__name__}: {err}") from err
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim")
    for key in sizes:
        if getattr(config, key) <= 0:
            raise StepFailed(f"{url}: {key} must be > 0, got {getattr(config, key)}")
    return config


def _weight_files(fs: Any, root: str, model_url: str, names: set[str]) -> tuple[dict[str, str], list[str]]:
    """(tensor name -> file name from the index, or {} without one; the safetensors files to read)."""
    safetensors = sorted(n for n in names if n.endswith(".safetensors") and not n.startswith("consolidated"))
    if INDEX_FILE not in names:
        if not safetensors:
            pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
            if pickles:
                raise ConfigError(
                    f"model.path {model_url} holds only pickle weights ({', '.join(pickles[:3])}): they can run "
                    f"code when loaded, so only *.safetensors are read (convert the checkpoint, e.g. load it in "
                    f"transformers and save_pretrained(..., safe_serialization=True))")
            raise ConfigError(f"model.path {model_url} has no *.safetensors files ({HINT})")
        return {}, safetensors
    url = storage.join(model_url, INDEX_FILE)
    try:
        with fs.open(f"{root}/{INDEX_FILE}", "rb") as f:
            weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise StepFailed(f"{url} is not a valid safetensors index (a JSON object with a weight_map): "
                         f"{type(err).__name__}: {err}") from err
    if not isinstance(weight_map, dict) or not weight_map:
        raise StepFailed(f"{url}: weight_map must be a non-empty object of tensor name -> file name")
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or "/" in file or "\\" in file or file in ("", ".", ".."):
            raise StepFailed(f"{url}: tensor {tensor} maps to {file!r}; entries must be file names in the folder")
        if file not in names:
            raise StepFailed(f"{url}: tensor {tensor} is in {file}, which is not in model.path {model_url}")
    return dict(weight_map), sorted(set(weight_map.values()))


def _header(fs: Any, path: str, url: str) -> dict[str, dict[str, Any]]:
    """A safetensors header, checked: every tensor's dtype, shape and offsets fit the file."""
    size = fs.size(path)
    corrupt = f"{url} is not a valid safetensors file"
    if size < 8:
        raise StepFailed(f"{corrupt}: {size} bytes, shorter than the 8-byte header length")
    with fs.open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise StepFailed(f"{corrupt}: the header length field says {length} bytes, the file has {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise StepFailed(f"{corrupt}: its header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise StepFailed(f"{corrupt}: its header must be a JSON object, got {type(header).__name__}")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for name, info in header.items():
        problem = _tensor_problem(info, data_bytes)
        if problem:
            raise StepFailed(f"{corrupt}: tensor {name} {problem}")
    return header


def _tensor_problem(info: Any, data_bytes: int) -> str | None:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        return "needs dtype, shape and data_offsets"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in HEADER_DTYPES:
        return f"has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"has an invalid shape {shape!r}"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"has invalid data_offsets {offsets!r}"
    if offsets[1] > data_bytes:
        return f"ends at byte {offsets[1]} of the data, but the file holds {data_bytes} (truncated?)"
    if offsets[1] - offsets[0] != math.prod(shape) * HEADER_DTYPES[dtype]:
        return f"has {offsets[1] - offsets[0]} bytes, but {dtype} {shape} needs {math.prod(shape) * HEADER_DTYPES[dtype]}"
    return None


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the loader reads (engine/llama.py's mapping) and its shape as transformers saves it."""
    hidden, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    by_suffix = {
        "embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
        "layernorm.weight": (hidden,), "norm.weight": (hidden,),
        "gate_proj.weight": (config.intermediate_size, hidden), "up_proj.weight": (config.intermediate_size, hidden),
        "down_proj.weight": (hidden, config.intermediate_size),
        "q_proj.weight": (q, hidden), "k_proj.weight": (kv, hidden), "v_proj.weight": (kv, hidden),
        "o_proj.weight": (hidden, q), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "o_proj.bias": (hidden,),
    }
    shapes = {}
    for name, _ in checkpoint_mapping(config):
        suffix = next(s for s in by_suffix if name.endswith(s))  # a new tensor kind needs its shape here
        shapes[name] = by_suffix[suffix]
    return shapes
