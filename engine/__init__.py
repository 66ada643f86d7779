"""Batch generation for the Llama family on JAX: `Engine.load(path, ...)`, then `engine.generate(requests)`.

Modules: llama.py (model, config, checkpoint), sampler.py (sampling params and randomness),
decode.py (compiled prefill and decode loop), memory.py (batch planning), mesh.py (device layouts:
host data parallel or one global mesh), engine.py (scheduler).
"""

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
