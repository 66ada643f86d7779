"""Batch generation for the Llama family on JAX: `Engine.load(path, ...)`, then `engine.generate(requests)`.

Modules: llama.py (model, config, checkpoint), sampler.py (sampling params and randomness),
decode.py (compiled prefill and decode loop), memory.py (batch planning), mesh.py (device layouts:
host data parallel or one global mesh), engine.py (scheduler).
"""

import jax

if not hasattr(jax.core, "is_constant_dim"):
    # haliax 1.4.dev453 (the newest release) calls jax.core.is_constant_dim, which jax 0.11 moved
    # to jax._src.core; the GPU machines ship jax 0.11. Remove once haliax stops calling it.
    import jax._src.core

    jax.core.is_constant_dim = jax._src.core.is_constant_dim

from engine.engine import Completion, Engine, EngineConfig, EngineStats, GenerationRequest
from engine.llama import UnsupportedModelError
from engine.sampler import SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationRequest",
    "SamplingParams",
    "UnsupportedModelError",
]
