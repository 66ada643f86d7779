"""Decode attention through JAX's Pallas kernel (`engine.decode_attention: pallas`,
engine/kernels.py), run here by Pallas' interpreter: the same attention as the engine's own
over ragged rows and pages the kernel cannot read, the same tokens from a whole engine on one
device and on several (per device), the decode program lowered for a GPU (Triton's lowering
runs on the CPU), and which setting each kind of host gets."""

from __future__ import annotations

import functools
import math
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, cpu_attention, kernels
from engine.config import InvalidConfig
from engine.decode import cache_ends
from engine.kernels import KernelTuning, attend_pages_kernel, kernel_blocks, resolve
from engine_testlib import VOCAB, ragged_attention_case, run_on_forced_devices


@pytest.mark.parametrize("steps, tuning, window", [(4, KernelTuning(), None), (16, KernelTuning(chunk_kernel=1), None),
                                                   (4, KernelTuning(), 12), (16, KernelTuning(chunk_kernel=1), 12),
                                                   (16, KernelTuning(chunk_kernel=1), 2)])
def test_kernel_attention_matches_the_engines_over_ragged_rows(steps, tuning, window):
    """Pages of 32 and 16 positions (the kernel's) and of 10 (attended the XLA way), rows of
    lengths 0..58 (some with nothing in a page), two query heads per KV head, and a chunk buffer
    with its first 3 steps written (4 steps: by XLA operations; 16, tuned so: by the kernel too):
    the kernel's result equals _attend_pages' to float32 rounding. With a sliding window each
    row reads from its query's position (lengths + 2) - window + 1 on: a window of 12 starts
    inside a kernel block of some rows' pages and past whole pages of others; one of 2 reads
    the chunk's last two steps alone."""
    lengths = [0, 5, 32, 40, 48, 58]
    first = None if window is None else [max(n + 2 + 1 - window, 0) for n in lengths]
    q, pages, chunk, chunk_mask, lengths, want = ragged_attention_case(
        batch=6, kv_heads=2, group=2, head_dim=16, page_lens=(32, 16, 10), steps=steps, lengths=lengths, first=first)
    scale = 1 / math.sqrt(16)
    axes = ("batch", "position", "kv_heads", "q_per_kv", "head_dim")
    begin = None if first is None else jnp.asarray(first, jnp.int32)

    def attend(q, pages, chunk):
        return attend_pages_kernel(q, pages, lengths, chunk, chunk_mask, scale, tuning=tuning,
                                   first=begin).rearrange(axes).array

    np.testing.assert_allclose(attend(q, pages, chunk), want, rtol=2e-6, atol=2e-6)
    kernel_calls = str(jax.make_jaxpr(attend)(q, pages, chunk)).count("pallas_call[")
    assert kernel_calls == (3 if tuning.chunk_kernel else 2)  # the pages of 32 and 16, and the chunk if tuned so


def test_engine_with_the_kernel_makes_the_same_tokens(llama, monkeypatch):
    """float32, sampled, three samples of five prompts, 4 slots (rows join and leave between
    chunks): every row's tokens are the same with the kernel (each step's keys and values
    written into the cache in place) as with the engine's attention, with a chunk buffer
    instead, with the decode chunk's own positions through the kernel too; and with the
    engine's CPU kernel (engine/cpu_attention.py) where it builds."""
    path, _ = llama
    prompts = [np.random.RandomState(30 + i).randint(0, VOCAB, n).tolist() for i, n in enumerate([4, 13, 7, 16, 9])]
    sampling = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, n=3, seed=3)

    def run(attention: str):
        engine = Engine.load(path, dtype="float32", sampling=sampling, max_prompt_tokens=16,
                             engine=EngineConfig(batch_size=4, decode_attention=attention))
        assert engine.attention == attention
        return {(c.prompt_index, c.sample_index): c.token_ids
                for c in engine.generate([GenerationRequest(i, p, range(3)) for i, p in enumerate(prompts)])}

    xla, pallas = run("xla"), run("pallas")
    assert sorted(pallas) == [(p, s) for p in range(5) for s in range(3)]
    assert pallas == xla
    monkeypatch.setattr(kernels, "TUNING", KernelTuning(in_place=0))  # read by Engine.load: the chunk buffer
    assert run("pallas") == xla
    monkeypatch.setattr(kernels, "TUNING", KernelTuning(in_place=0, chunk_kernel=1))  # and the kernel over it
    assert run("pallas") == xla
    if cpu_attention.unavailable() is None:
        assert run("cpu") == xla


def test_which_attention_each_host_gets():
    def auto(platform, head_dim=128, dtype="bfloat16"):
        return resolve("auto", platform=platform, head_dim=head_dim, dtype=dtype)

    assert (auto("gpu"), auto("gpu", 64, "float16")) == ("pallas", "pallas")
    assert auto("tpu") == "xla"  # a CPU's: tests/engine/test_cpu_attention.py
    assert auto("gpu", dtype="float32") == "xla"  # the engine's attention keeps float32 products
    assert auto("gpu", head_dim=80) == auto("gpu", head_dim=8) == "xla"  # Triton's blocks: powers of two >= 16
    assert resolve("xla", platform="gpu", head_dim=128, dtype="bfloat16") == "xla"
    assert resolve("pallas", platform="cpu", head_dim=8, dtype="float32") == "pallas"  # Pallas' interpreter: these tests
    with pytest.raises(InvalidConfig, match="engine.decode_attention: pallas runs JAX's Pallas GPU kernel; this host's devices are tpu"):
        resolve("pallas", platform="tpu", head_dim=128, dtype="bfloat16")
    with pytest.raises(InvalidConfig, match="pallas needs a head_dim that is a power of two >= 16 .*; this model's is 80"):
        resolve("pallas", platform="gpu", head_dim=80, dtype="bfloat16")


def test_the_kernel_runs_per_device_over_several(llama, mistral):
    """Four forced CPU devices: host data parallel (rows over 4 devices) and a global mesh (rows
    over 2, KV heads over 2, also with the chunk buffer instead of the cache written in place),
    each with the kernel, and
    host data parallel with the engine's CPU kernel, give one device's tokens (float32,
    sampled); so does Mistral's sliding window (8 positions, rows of up to 24) on the global
    mesh, each device's rows read from their own window's start."""
    prompts = [np.random.RandomState(40 + i).randint(0, VOCAB, n).tolist() for i, n in enumerate([6, 14, 3, 10])]
    sampling = dict(max_new_tokens=8, temperature=0.9, top_k=20, n=2, seed=5)
    paths = {"llama": llama[0], "mistral": mistral[0]}
    want = {}
    for name, path in paths.items():
        engine = Engine.load(path, dtype="float32", sampling=SamplingParams(**sampling), max_prompt_tokens=16,
                             engine=EngineConfig(batch_size=4, decode_attention="xla"))
        want[name] = {f"{c.prompt_index},{c.sample_index}": c.token_ids
                      for c in engine.generate(GenerationRequest(i, p, [0, 1]) for i, p in enumerate(prompts))}
    out = run_on_forced_devices(f"""
        import json, sys
        sys.path.insert(0, {os.getcwd()!r})
        import jax
        from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, cpu_attention, kernels
        assert jax.device_count() == 4
        out = {{}}
        modes = ("host_dp", "global_mesh", "global_mesh buffer") + (("host_dp cpu",) if cpu_attention.unavailable() is None else ())
        runs = [("llama", mode) for mode in modes] + [("mistral", "global_mesh")]
        for name, mode in runs:  # the global mesh: data 2 x model 2
            kernels.TUNING = kernels.KernelTuning(in_place=int(not mode.endswith("buffer")))  # read by Engine.load
            attention = "cpu" if mode.endswith("cpu") else "pallas"
            engine = Engine.load({paths!r}[name], dtype="float32", sampling=SamplingParams(**{sampling!r}),
                                 max_prompt_tokens=16,
                                 engine=EngineConfig(batch_size=4, mode=mode.split()[0], decode_attention=attention))
            assert engine.attention == attention
            out[f"{{name}} {{mode}} cache"] = [engine.layout.mesh.size, str(engine.layout.cache_sharding.spec)]
            out[f"{{name}} {{mode}}"] = {{f"{{c.prompt_index}},{{c.sample_index}}": c.token_ids for c in engine.generate(
                GenerationRequest(i, p, [0, 1]) for i, p in enumerate({prompts!r}))}}
        print(json.dumps(out))
    """, devices=4, timeout=600)
    assert sorted(want["llama"]) == sorted(want["mistral"]) == [f"{p},{s}" for p in range(4) for s in range(2)]
    assert out["llama host_dp cache"] == [4, "P('data',)"]
    assert out["llama global_mesh cache"] == out["mistral global_mesh cache"] == [4, "P('data', 'model')"]
    assert out["llama host_dp"] == want["llama"]
    assert out["llama global_mesh"] == want["llama"]
    assert out["llama global_mesh buffer"] == want["llama"]
    assert out["mistral global_mesh"] == want["mistral"]
    if cpu_attention.unavailable() is None:
        assert out["llama host_dp cpu"] == want["llama"]  # the engine's CPU kernel, each device its own rows


def _decode_program_text(attention: str, head_dim: int = 64, kernel: KernelTuning = KernelTuning(), steps: int = 4,
                         platform: str = "cuda", window: int | None = None) -> str:
    """The engine's decode program (bfloat16, 2 layers, 8 slots, a cache of 1,024 positions in the
    pages of `kernel` with pallas, one with cpu, else four; with a `window`, Mistral's sliding
    window), lowered for `platform` from abstract shapes: StableHLO text. For CUDA, lowering runs Pallas' Triton lowering here, no GPU needed
    (jax.default_backend is patched so that the kernel is not handed to the interpreter)."""
    import equinox as eqx

    from engine.decode import DecodeSpec, decode_chunk, new_cache, new_state
    from engine.llama import LlamaConfig, LlamaLM

    heads = 4
    config = LlamaConfig.from_hf(dict(
        model_type="llama" if window is None else "mistral", vocab_size=256, hidden_size=heads * head_dim,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False, sliding_window=window))

    def bfloat16(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype), tree)

    model = bfloat16(eqx.filter_eval_shape(LlamaLM.init, config, key=jax.random.key(0)))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    spec = DecodeSpec(SamplingParams(max_new_tokens=64), (), one, one, one, attention, kernel)
    cache_dtype = cpu_attention.BFLOAT16_BITS if attention == "cpu" else jnp.bfloat16  # as kernels.cache_dtype
    cache = jax.eval_shape(functools.partial(new_cache, config, 8, spec.cache_ends(1024), cache_dtype))
    state = jax.eval_shape(functools.partial(new_state, 8))
    program = jax.jit(functools.partial(decode_chunk, spec=spec, steps=steps))
    with mock.patch("jax.default_backend", return_value="gpu" if platform == "cuda" else platform):
        return program.trace(model, cache, state, jax.ShapeDtypeStruct((8,), jnp.bool_)).lower(lowering_platforms=(platform,)).as_text()


def test_the_decode_program_lowers_for_a_gpu_with_the_kernel():
    """The kernel's blocks and dtypes are checked by Triton's lowering on the CPU, before any GPU
    time: one Triton call over the engine's one page (the layers share one traced function);
    with four pages, one per page in each of the decode program's page-count branches (1 + 2 +
    3 + 4); with the chunk through the kernel, one more where the chunk holds a block of 16;
    none with the engine's attention. A sliding window is the kernel's start index, an operand
    of the same one call (and of the chunk's)."""
    triton = "custom_call @__gpu$xla.gpu.triton"
    assert _decode_program_text("pallas").count(triton) == 1
    assert _decode_program_text("pallas", kernel=KernelTuning(pages=4, num_stages=2)).count(triton) == 10
    chunk_kernel = KernelTuning(chunk_kernel=1, in_place=0)
    assert _decode_program_text("pallas", kernel=chunk_kernel, steps=16).count(triton) == 2  # and the chunk of 16
    assert _decode_program_text("pallas", kernel=chunk_kernel).count(triton) == 1  # 4 steps: below the kernel's blocks
    assert _decode_program_text("pallas", kernel=KernelTuning(in_place=0)).count(triton) == 1  # the pages, then the chunk buffer
    windowed = _decode_program_text("pallas", window=256)
    assert windowed.count(triton) == 1
    operands = [len(re.search(r"xla\.gpu\.triton\(([^)]*)\)", text).group(1).split(","))
                for text in (_decode_program_text("pallas"), windowed)]
    assert operands == [4, 5]  # q, keys, values, lengths; and each row's first position
    assert _decode_program_text("pallas", kernel=chunk_kernel, steps=16, window=256).count(triton) == 2
    assert _decode_program_text("xla").count(triton) == 0
    # Why `auto` keeps xla for heads that are not a power of two: Triton's blocks cannot hold them.
    with pytest.raises(ValueError, match="power of 2"):
        _decode_program_text("pallas", head_dim=80)


@pytest.mark.skipif(cpu_attention.unavailable() is not None, reason="the CPU kernel cannot be built here")
def test_the_cpu_kernels_decode_program_writes_the_cache_in_place():
    """With the CPU kernel each decode step writes its keys and values into the cache's one page,
    carried through the loop, inside the one kernel call a layer that attends over it: no chunk
    buffer (its writes are dynamic_update_slices), no scatter into the page in the loop or after
    it (the two left write the step's tokens into the chunk's [slots, steps] output). The
    engine's own attention keeps the buffer."""
    cpu, xla = (_decode_program_text(attention, platform="cpu") for attention in ("cpu", "xla"))
    assert cpu.count("custom_call @pipeline_decode_step") == 1  # the layers share one traced function
    assert cpu.count("custom_call @pipeline_decode_attention") == 0
    assert cpu.count("stablehlo.dynamic_update_slice") == 0 < xla.count("stablehlo.dynamic_update_slice")
    assert cpu.count("stablehlo.scatter") == 2 < xla.count("stablehlo.scatter")


def test_kernel_blocks():
    """Blocks of the largest power of two up to 64 dividing the page; splits until 1,024 programs;
    the engine's pages with the kernel are multiples of its longest block (no longer than a page)."""
    assert kernel_blocks(544, 128 * 8) == (1, 32)  # the 8B seed workload's pages: 17 blocks of 32
    assert kernel_blocks(544, 16 * 8) == (17, 32)  # a small batch: every block its own program
    assert kernel_blocks(96, 256 * 4) == (1, 32)
    assert kernel_blocks(512, 64) == (8, 64)
    assert kernel_blocks(512, 256) == (4, 64)
    assert kernel_blocks(10, 1024) is None
    assert kernel_blocks(40, 1024) is None  # 8-position blocks: below the kernel's 16
    assert kernel_blocks(576, 1024, KernelTuning(min_programs=2048)) == (3, 64)  # 9 blocks: 3 splits of 3
    assert kernel_blocks(640, 1024, KernelTuning(max_block_k=128)) == (1, 128)
    engine = KernelTuning()
    assert cache_ends("xla", 2176, engine) == (544, 1088, 1632, 2176)  # quarters: the engine's attention
    assert cache_ends("cpu", 2100, engine) == (2100,)  # the CPU kernel's: one page, each row read to its length
    assert cache_ends("pallas", 2176, engine) == (2176,)  # the 8B's: one page, read in blocks of 64
    assert cache_ends("pallas", 2100, engine) == (2112,)  # rounded up to a block
    assert cache_ends("pallas", 2176, KernelTuning(pages=4)) == (576, 1152, 1728, 2176)
    assert cache_ends("pallas", 384, KernelTuning(pages=4, max_block_k=32)) == (96, 192, 288, 384)
    assert cache_ends("pallas", 26, KernelTuning(pages=4)) == (16, 32)  # blocks of 16: a quarter holds no more
    assert cache_ends("pallas", 26, engine) == (32,)
    assert str(KernelTuning.parse("num_warps=8,max_block_k=128")) == \
        "max_block_k=128,pages=1,min_programs=1024,num_warps=8,num_stages=4,chunk_kernel=0,in_place=1"
    with pytest.raises(ValueError, match="kernel tuning 'warps=8': expected name=integer pairs of max_block_k, "):
        KernelTuning.parse("warps=8")
    with pytest.raises(ValueError, match="kernel tuning 'max_block_k=96': max_block_k must be a power of two >= 16"):
        KernelTuning.parse("max_block_k=96")
