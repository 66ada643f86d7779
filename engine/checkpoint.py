"""A Hugging Face checkpoint folder at any fsspec URL: the one module that knows its files.

Owns: listing the folder; reading config.json and generation_config.json; the tokenizer files
and loading a fast tokenizer from them (on gs:// or memory:// the small files are copied to a
local temp folder first: transformers reads only local paths); safetensors files (one, several,
or listed by `model.safetensors.index.json`): each header (8-byte little-endian length + JSON,
offsets inside the file) and rows of a tensor; which files hold weights; and the pre-flight
check that says what is wrong with `model.path` in seconds, before any step starts (it reads
config.json, the index and each header, no weights).

Refuses: pickle-based weights (`*.bin`, `*.pt`, ...: loading them can run code; only
safetensors and JSON are ever read), index entries that point outside the folder, and remote
code (`trust_remote_code` is never set). It imports neither JAX nor `pipeline`: placing tensors
in the model is engine/llama.py's mapping, exit codes are the pipeline's.

Two errors, both ValueErrors naming `model.path` or the file: NotACheckpoint, a folder that is
not a checkpoint we can run (missing, no config.json, another architecture, no tokenizer, pickle
weights only; the pipeline exits 2), and BrokenCheckpoint, a file that is there but broken (bad
JSON, corrupt or truncated header, missing tensor, wrong shape; exit 1).

    summary = check_checkpoint("gs://bucket/llama-3-8b")   # raises, or {"model_type": ..., ...}
    tokenizer = load_tokenizer("gs://bucket/llama-3-8b")
    tensors = read_tensors("gs://bucket/llama-3-8b")        # name -> Tensor (file, dtype, shape, offset)
    rows = read_rows(tensors["model.norm.weight"], (64,), 0, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import struct
import tempfile
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import get_protocol

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_REQUIRED = ("tokenizer.json", "tokenizer_config.json")
"""At least one must exist: what a fast tokenizer is built from."""
TOKENIZER_FILES = TOKENIZER_REQUIRED + (
    "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json", CONFIG_FILE,
    GENERATION_CONFIG_FILE, "vocab.json", "merges.txt", "added_tokens.json")
"""Every file transformers may read to build the tokenizer: copied when the folder is remote."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weights in Python's pickle format: loading them can execute code, so they are never read."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
"""Files holding weights in any format: the tokenizer's fingerprint leaves them out."""
WEIGHT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
"""The safetensors dtypes a weight may have, and the numpy dtype it is read as (no quantized ones)."""
HEADER_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
                      "BOOL": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8}
"""Bytes per element of every dtype the safetensors format defines: other tensors may have any."""
MAX_HEADER_BYTES = 100 << 20
"""The safetensors format's own limit on a header: a larger length field means a corrupt file."""
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")
"""A Hugging Face Hub repo id (organization/name), as model.path when it names no folder."""
HINT = "expected a Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer files"


class NotACheckpoint(ValueError):
    """model.path is not a checkpoint folder we can run (the pipeline exits 2)."""


class BrokenCheckpoint(ValueError):
    """A file of the checkpoint is there but broken; the message names it (the pipeline exits 1)."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one tensor of a safetensors file lies, from its header."""

    name: str
    url: str
    """The file holding it, for messages."""
    fs: Any
    path: str
    """The file's path inside `fs`."""
    dtype: str
    """The safetensors dtype code, e.g. BF16."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset of its data from the start of the file."""


# ------------------------------------------------------------------------------ the folder


def relative_hint(path: str) -> str:
    """`; a relative path is read from the current directory, CWD` for a relative local path (a
    config run from another folder than its paths assume), else nothing: for "does not exist"."""
    if "://" in path or os.path.isabs(os.path.expanduser(path)):
        return ""
    return f"; a relative path is read from the current directory, {os.getcwd()}"


@dataclasses.dataclass(frozen=True)
class _Folder:
    url: str
    fs: Any
    root: str
    names: frozenset[str]

    @staticmethod
    def open(url: str) -> "_Folder":
        fs, root = fsspec.core.url_to_fs(url)
        root = root.rstrip("/")
        if not fs.isdir(root):
            if fs.exists(root):
                raise NotACheckpoint(f"model.path {url} is a file, not a folder ({HINT})")
            if HUB_ID.fullmatch(url) and not os.path.isdir(url.split("/")[0]):  # its first folder is not here either
                raise NotACheckpoint(
                    f"model.path {url} does not exist{relative_hint(url)}; if it is a Hugging Face Hub id, the "
                    f"pipeline downloads nothing: fetch it first (`hf download {url} --local-dir "
                    f"models/{url.split('/')[1]}`) and set model.path to that folder (or to a gs:// copy of it)")
            raise NotACheckpoint(f"model.path {url} does not exist ({HINT}{relative_hint(url)})")
        names = frozenset(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
        return _Folder(url.rstrip("/"), fs, root, names)

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read_json(self, name: str) -> dict[str, Any]:
        try:
            with self.fs.open(f"{self.root}/{name}", "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise BrokenCheckpoint(f"{self.url_of(name)} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise BrokenCheckpoint(f"{self.url_of(name)} must hold a JSON object, got {type(data).__name__}")
        return data


def is_local(url: str) -> bool:
    """The checkpoint is on this host's file system (a path or file://), not in remote storage."""
    return get_protocol(url) in ("file", "local")


def read_config(url: str) -> dict[str, Any]:
    """config.json of the checkpoint at url, as a dict."""
    folder = _Folder.open(url)
    if CONFIG_FILE not in folder.names:
        raise NotACheckpoint(f"model.path {url} has no config.json ({HINT})")
    return folder.read_json(CONFIG_FILE)


def eos_token_ids(url: str, config: dict[str, Any]) -> list[int]:
    """The ids that end a completion, as transformers' `generate` takes them: generation_config.json's
    eos_token_id where that file exists (none if it names none), else config.json's."""
    folder = _Folder.open(url)
    if GENERATION_CONFIG_FILE in folder.names:
        value = folder.read_json(GENERATION_CONFIG_FILE).get("eos_token_id")
    else:
        value = config.get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


# ------------------------------------------------------------------------------ tokenizer


def load_tokenizer(url: str):
    """The checkpoint's fast tokenizer, cached within a process by URL and by the tokenizer
    files' sizes and times: files rewritten at the same URL are loaded again."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    try:
        listing = fs.ls(root, detail=True)
    except (OSError, ValueError):
        listing = []  # the load names the folder: a missing one has no tokenizer either
    stamps = tuple(sorted(
        (entry["name"].rsplit("/", 1)[-1], entry.get("size"),
         str(entry.get("mtime") or entry.get("updated") or entry.get("created") or entry.get("md5Hash")))
        for entry in listing if entry["name"].rsplit("/", 1)[-1] in TOKENIZER_FILES))
    return _load_tokenizer(url, stamps)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(url: str, stamps: tuple):
    from transformers import AutoTokenizer

    def load(local: str):
        try:
            return AutoTokenizer.from_pretrained(local, use_fast=True, trust_remote_code=False)
        except Exception as err:  # the tokenizers library raises bare Exceptions, KeyErrors, ... on bad files
            raise BrokenCheckpoint(f"model.path {url}: could not load a tokenizer "
                                   f"(tokenizer.json / tokenizer_config.json missing or invalid): {err}") from err

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if isinstance(fs, LocalFileSystem):
        return load(root)
    # The loaded tokenizer keeps everything in memory: the copies can go once it is built.
    names = {name for name, _, _ in stamps}
    with tempfile.TemporaryDirectory(prefix="pipeline-tokenizer-") as local:
        for name in TOKENIZER_FILES:
            if name in names:
                fs.get_file(f"{root}/{name}", f"{local}/{name}")
        return load(local)


# ------------------------------------------------------------------------------ safetensors


def read_tensors(url: str) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, from the file it is read from: the index's, else the
    last file (sorted) holding it. Headers and the index are checked; no data is read."""
    return _tensors(_Folder.open(url))[0]


def read_rows(tensor: Tensor, shape: tuple[int, ...], start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of `tensor` viewed (row-major) as rows of shape[1:], in its own dtype:
    `shape` is the weight read, which may be a block of a fused tensor's rows."""
    dtype = _numpy_dtype(tensor)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    with tensor.fs.open(tensor.path, "rb") as f:
        f.seek(tensor.offset + start * row_bytes)
        data = np.frombuffer(f.read((stop - start) * row_bytes), dtype=dtype)
    return data.reshape((stop - start,) + tuple(shape[1:]))


def _numpy_dtype(tensor: Tensor) -> np.dtype:
    if tensor.dtype not in WEIGHT_DTYPES:
        raise BrokenCheckpoint(f"{tensor.url}: tensor {tensor.name} has dtype {tensor.dtype} (only "
                               f"{', '.join(WEIGHT_DTYPES)} weights are read; quantized checkpoints are not)")
    if tensor.dtype == "BF16":
        import ml_dtypes  # numpy has no bfloat16; imported here, it costs 0.1 s at import time

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(WEIGHT_DTYPES[tensor.dtype])


def _tensors(folder: _Folder) -> tuple[dict[str, Tensor], list[str]]:
    """(every tensor by name, from the file it is read from; the safetensors files read)."""
    index, files = _weight_files(folder)
    headers = {name: _header(folder, name) for name in files}
    for tensor, file in index.items():
        if tensor not in headers[file]:
            raise BrokenCheckpoint(f"{folder.url_of(INDEX_FILE)}: tensor {tensor} is listed in {file}, "
                                   f"but {file} does not hold it (the index and the shards disagree)")
    if index:
        return {tensor: headers[file][tensor] for tensor, file in index.items()}, files
    return {name: tensor for file in files for name, tensor in headers[file].items()}, files


def _weight_files(folder: _Folder) -> tuple[dict[str, str], list[str]]:
    """(tensor name -> file name from the index, or {} without one; the safetensors files to read)."""
    names = folder.names
    safetensors = sorted(n for n in names if n.endswith(".safetensors") and not n.startswith("consolidated"))
    if INDEX_FILE not in names:
        if not safetensors:
            pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
            if pickles:
                raise NotACheckpoint(
                    f"model.path {folder.url} holds only pickle weights ({', '.join(pickles[:3])}): they can run "
                    f"code when loaded, so only *.safetensors are read (convert the checkpoint, e.g. load it in "
                    f"transformers and save_pretrained(..., safe_serialization=True))")
            raise NotACheckpoint(f"model.path {folder.url} has no *.safetensors files ({HINT})")
        return {}, safetensors
    url = folder.url_of(INDEX_FILE)
    try:
        with folder.fs.open(f"{folder.root}/{INDEX_FILE}", "rb") as f:
            weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise BrokenCheckpoint(f"{url} is not a valid safetensors index (a JSON object with a weight_map): "
                               f"{type(err).__name__}: {err}") from err
    if not isinstance(weight_map, dict) or not weight_map:
        raise BrokenCheckpoint(f"{url}: weight_map must be a non-empty object of tensor name -> file name")
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or "/" in file or "\\" in file or file in ("", ".", ".."):
            raise BrokenCheckpoint(f"{url}: tensor {tensor} maps to {file!r}; entries must be file names in the folder")
        if file not in names:
            raise BrokenCheckpoint(f"{url}: tensor {tensor} is in {file}, which is not in model.path {folder.url}")
    return dict(weight_map), sorted(set(weight_map.values()))


def _header(folder: _Folder, name: str) -> dict[str, Tensor]:
    """A safetensors header, checked: every tensor's dtype, shape and offsets fit the file."""
    path, url = f"{folder.root}/{name}", folder.url_of(name)
    size = folder.fs.size(path)
    corrupt = f"{url} is not a valid safetensors file"
    if size < 8:
        raise BrokenCheckpoint(f"{corrupt}: {size} bytes, shorter than the 8-byte header length")
    with folder.fs.open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise BrokenCheckpoint(f"{corrupt}: the header length field says {length} bytes, the file has {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise BrokenCheckpoint(f"{corrupt}: its header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise BrokenCheckpoint(f"{corrupt}: its header must be a JSON object, got {type(header).__name__}")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for tensor, info in header.items():
        problem = _tensor_problem(info, data_bytes)
        if problem:
            raise BrokenCheckpoint(f"{corrupt}: tensor {tensor} {problem}")
    return {tensor: Tensor(tensor, url, folder.fs, path, info["dtype"], tuple(info["shape"]),
                           8 + length + info["data_offsets"][0]) for tensor, info in header.items()}


def _tensor_problem(info: Any, data_bytes: int) -> str | None:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        return "needs dtype, shape and data_offsets"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in HEADER_DTYPE_BYTES:
        return f"has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"has an invalid shape {shape!r}"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"has invalid data_offsets {offsets!r}"
    if offsets[1] > data_bytes:
        return f"ends at byte {offsets[1]} of the data, but the file holds {data_bytes} (truncated?)"
    need = math.prod(shape) * HEADER_DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        return f"has {offsets[1] - offsets[0]} bytes, but {dtype} {shape} needs {need}"
    return None


# ------------------------------------------------------------------------------ pre-flight check


def check_checkpoint(url: str) -> dict[str, Any]:
    """Raise NotACheckpoint/BrokenCheckpoint naming the problem, or return what was found."""
    folder = _Folder.open(url)
    config = _llama_config(folder)
    from engine.llama import saved_shapes  # as in _llama_config, which imported it already
    if not any(name in folder.names for name in TOKENIZER_REQUIRED):
        raise NotACheckpoint(f"model.path {url} has no tokenizer ({' or '.join(TOKENIZER_REQUIRED)} missing; {HINT})")
    tensors, files = _tensors(folder)
    expected = saved_shapes(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise BrokenCheckpoint(f"model.path {url}: the checkpoint lacks {len(missing)} tensor(s) a "
                               f"{config.model_type} with this config.json needs, e.g. {', '.join(missing[:3])}")
    for name, shape in expected.items():
        tensor = tensors[name]
        _numpy_dtype(tensor)
        if list(tensor.shape) != list(shape):
            raise BrokenCheckpoint(f"{tensor.url}: tensor {name} has shape {list(tensor.shape)}, "
                                   f"config.json implies {list(shape)}")
    return {"model_type": config.model_type, "files": files, "tensors": len(tensors),
            "layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "longrope_rows": config.longrope_rows,
            "attn_logit_softcapping": config.attn_logit_softcapping}


def has_chat_template(url: str) -> bool:
    """The tokenizer at `url` has a chat template where transformers looks for one (the files
    `load_tokenizer` copies): chat_template.jinja, chat_template.json, or tokenizer_config.json's
    `chat_template`. Reads at most that one small file."""
    folder = _Folder.open(url)
    if folder.names & {"chat_template.jinja", "chat_template.json"}:
        return True
    return "tokenizer_config.json" in folder.names and bool(folder.read_json("tokenizer_config.json").get("chat_template"))


def _llama_config(folder: _Folder):
    # engine/llama.py reads its tensors through this module: it is imported here, not at the top
    # (which also keeps JAX out of the pipeline's config-time imports of the constants above).
    from engine.llama import LlamaConfig, UnsupportedModelError

    url = folder.url_of(CONFIG_FILE)
    if CONFIG_FILE not in folder.names:
        raise NotACheckpoint(f"model.path {folder.url} has no config.json ({HINT})")
    data = folder.read_json(CONFIG_FILE)
    architectures = data.get("architectures") or []
    # Gemma 3's image-and-text checkpoints hold a causal LM: its text model runs alone.
    if not isinstance(architectures, list) or any(not str(a).endswith("ForCausalLM") and
                                                  a != "Gemma3ForConditionalGeneration" for a in architectures):
        raise NotACheckpoint(f"model.path {folder.url}: architectures {architectures!r} in config.json is not a "
                             f"supported architecture (supported: LlamaForCausalLM, GraniteForCausalLM, GraniteMoeForCausalLM, "
                             f"MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, "
                             f"Qwen3MoeForCausalLM, Olmo2ForCausalLM, OlmoeForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, "
                             f"Gemma3ForCausalLM, Gemma3ForConditionalGeneration's text model)")
    try:
        config = LlamaConfig.from_hf(data, source=url)
    except UnsupportedModelError as err:
        raise NotACheckpoint(str(err)) from err
    except KeyError as err:
        raise BrokenCheckpoint(f"{url} lacks {err.args[0]!r}, which a {data.get('model_type')} config needs") from err
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise BrokenCheckpoint(f"{url} has an invalid value: {type(err).__name__}: {err}") from err
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim")
    for key in sizes:
        if getattr(config, key) <= 0:
            raise BrokenCheckpoint(f"{url}: {key} must be > 0, got {getattr(config, key)}")
    return config
