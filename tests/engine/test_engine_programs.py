"""Issue 13: a run compiles a small fixed set of programs whatever its prompt lengths, and a
second engine with the same model and shapes loads them all from JAX's persistent compilation
cache instead of compiling (before: one program per prompt bucket and decode window, 24 for 240
mixed prompts, all compiled again on every rerun or resume)."""

from __future__ import annotations

import jax
import numpy as np

import engine.engine as engine_module
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, compile_cache
from engine_testlib import VOCAB, hf_greedy


def _requests(lengths):
    rng = np.random.RandomState(5)
    return [GenerationRequest(i, rng.randint(0, VOCAB, n).tolist(), [0]) for i, n in enumerate(lengths)]


def _load(path):
    return Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=5),
                       engine=EngineConfig(batch_size=4, prefill_chunk_tokens=8, prefill_tokens=16), max_prompt_tokens=40)


def test_every_prompt_length_runs_on_the_same_same_few_programs(llama, tmp_path):
    """Prompts of every length from 1 to max_prompt_tokens (several prefill chunks for most),
    then a second generate with other lengths: four programs (init, decode, prefill of first
    chunks, of later chunks), obtained once. Rows and chunks that fit the cache's first page
    (16 of 45 positions) read only it, the others both pages, in the same programs."""
    path, hf = llama
    previous = jax.config.jax_compilation_cache_dir
    try:
        compile_cache.enable(str(tmp_path / "jax-compile"))
        engine_module._COMPILED.clear()
        engine = _load(path)
        first = {c.prompt_index: c.token_ids for c in engine.generate(_requests(range(1, 41)))}
        assert sorted(first) == list(range(40)) and all(len(t) == 5 for t in first.values())
        for i in (7, 8, 22, 39):  # one chunk, exactly one, three, five
            assert first[i] == hf_greedy(hf, _requests(range(1, 41))[i].input_ids, 5), i
        assert sorted(engine.stats.programs) == ["decode", "init", "prefill", "prefill_fresh"]
        assert engine.stats.compilations == 4 and engine.stats.cache_loads == 0, engine.stats.programs
        list(engine.generate(_requests([3, 40, 17])))
        assert engine.stats.compilations == 4, engine.stats.programs

        # A new process would find the same programs on disk: forget them in memory, load again.
        engine_module._COMPILED.clear()
        jax.clear_caches()
        again = _load(path)
        second = {c.prompt_index: c.token_ids for c in again.generate(_requests(range(1, 41)))}
        assert second == first
        assert again.stats.compilations == 0 and again.stats.cache_loads == 4, again.stats.programs
        assert any((tmp_path / "jax-compile").iterdir())
    finally:
        compile_cache.enable(previous)
