"""Hugging Face checkpoint folders at any URL: the tokenizer and the config files.

Owns getting a transformers fast tokenizer out of a checkpoint folder that may live on
gs:// or memory:// (small files are copied to a local temp folder first: transformers only
reads local paths). Refuses remote code: `trust_remote_code` is never set.

    tokenizer = load_tokenizer("gs://bucket/models/llama-3-8b")
"""

from __future__ import annotations

import functools
import tempfile

from pipeline import storage
from pipeline.errors import StepFailed

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json", "config.json",
                   "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json")


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_url: str):
    """The checkpoint's fast tokenizer (cached per URL within a process)."""
    from transformers import AutoTokenizer

    def load(local: str):
        try:
            return AutoTokenizer.from_pretrained(local, use_fast=True, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise StepFailed(f"model.path {model_url}: could not load a tokenizer "
                             f"(tokenizer.json / tokenizer_config.json missing or invalid): {err}") from err

    if storage.is_local(model_url):
        return load(model_url)
    # The loaded tokenizer keeps everything in memory: the copies can go once it is built.
    with tempfile.TemporaryDirectory(prefix="pipeline-tokenizer-") as local:
        for name in TOKENIZER_FILES:
            url = storage.join(model_url, name)
            if storage.exists(url):
                with open(f"{local}/{name}", "wb") as f:
                    f.write(storage.read_bytes(url))
        return load(local)
