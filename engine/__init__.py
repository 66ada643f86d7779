"""Batch generation for the Llama family on JAX: `Engine.load(path, ...)`, then `engine.generate(requests)`.

Modules: config.py (SamplingParams, EngineConfig: the settings, no JAX), llama.py (the model),
sampler.py (per-row randomness and token choice), decode.py (compiled prefill and decode loop),
memory.py (batch planning), mesh.py (device layouts: host data parallel or one global mesh),
engine.py (scheduler), compile_cache.py (JAX's persistent compilation cache), checkpoint.py
(a Hugging Face checkpoint folder: config, tokenizer, safetensors reads, the pre-flight check;
no JAX), jax_compat.py (haliax's patch for newer JAX). Private JAX is reached in two places only:
jax_compat.py, and compile_cache.py for the cache's reset and its writes on every host.

The names below are imported on first use, so `import engine.config` (the pipeline's config
loader does) does not import JAX.
"""

import importlib

_EXPORTS = {
    "Completion": "engine.engine",
    "Engine": "engine.engine",
    "EngineStats": "engine.engine",
    "GenerationRequest": "engine.engine",
    "LoadStopped": "engine.llama",
    "UnsupportedModelError": "engine.llama",
    "EngineConfig": "engine.config",
    "MeshConfig": "engine.config",
    "SamplingParams": "engine.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
