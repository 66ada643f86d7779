"""Device memory of the engine's compiled programs, from XLA itself, next to engine/memory.py's plan.

Lowers and compiles the decode chunk and the prefill chunk for a model shape with abstract
inputs (`jax.ShapeDtypeStruct`: no weights are made, nothing is allocated), on whatever device
JAX has (the CPU is enough: the seed workload's Llama-3-8B at batch 128 never needs a GPU to be
checked), and prints XLA's `memory_analysis()` of each beside the plan's estimate for the
same batch. The cache is planned in the accelerator's dtype (bfloat16), as on a GPU.

    python scripts/memory_analysis.py                                   # Llama-3-8B, batch 128, 128 + 2048
    python scripts/memory_analysis.py --preset cpu-tiny --batch 64 --prompt 64 --new 128
    python scripts/memory_analysis.py --preset cpu-125m --experts 8 --dtype float32 --cache-dtype float32   # a Mixtral
    python scripts/memory_analysis.py --preset mixtral-8x7b --dtype float32 --cache-dtype float32
    python scripts/memory_analysis.py --preset qwen3-30b-a3b --dtype float32 --cache-dtype float32 --dense-experts

Peak of a program = arguments + outputs - donated (aliased) buffers + temporaries.

The programs are traced with the activations rows first (`--activations rows`, the default), as
every accelerator runs them (`engine.llama.rows_first`); `--activations features` analyses the
CPU's own order instead.

`--mesh DATAxMODEL` analyses the global mesh (`engine.mode: global_mesh`) over that many CPU
devices forced into one process: the weights sharded as the engine shards them, the KV cache's
rows over `data` and its heads over `model`, decode attention in XLA's own operations (what a TPU
runs). XLA then reports one device's share, next to the plan's per-device figure:

    python scripts/memory_analysis.py --preset llama3-70b --mesh 2x8 --dtype float32 --cache-dtype float32 --skip-prefill

On a CPU, ask for float32 (`--dtype float32 --cache-dtype float32`) to see the program a GPU
runs: in bfloat16, XLA's CPU backend converts the whole cache to a float32 copy for attention's
dots (measured: 86.3 GiB of temporaries for the 8B at batch 128, against 0.57 GiB in float32), a
CPU-only artifact (where XLA's dots read the cache on a CPU, the engine keeps it in float32). The bfloat16 peak on an
accelerator is then at most the bfloat16 arguments (exact in either run) plus the float32
run's temporaries.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as bench  # noqa: E402 - the presets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(bench.PRESETS), default="llama3-8b")
    parser.add_argument("--batch", type=int, help="default: the preset's")
    parser.add_argument("--prompt", type=int, help="max prompt tokens (default: the preset's prompt length)")
    parser.add_argument("--new", type=int, help="new tokens (default: the preset's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="the KV cache's dtype (the engine keeps it float32 on CPU, the model dtype elsewhere)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=32)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--prompt-logprobs", action="store_true",
                        help="sampling.prompt_logprobs: the prefill program computes every position's log-probability")
    parser.add_argument("--mesh", metavar="DATAxMODEL", help="a global mesh over forced CPU devices, e.g. 2x8")
    parser.add_argument("--experts", type=int, help="a Mixtral of the preset's shape: each MLP this many experts, two a token")
    parser.add_argument("--activations", choices=["rows", "features"], default="rows",
                        help="the activations' order the programs are traced in: rows first, as an accelerator runs "
                             "them (default), or feature first, as the CPU does")
    parser.add_argument("--attention", choices=["auto", "xla", "cpu", "pallas"], default="auto",
                        help="engine.decode_attention (auto: what the engine runs on this device; xla: the engine's own "
                             "attention, reading the cache in place as a GPU's Pallas kernel does; pallas: its "
                             "interpreter on a CPU)")
    parser.add_argument("--dense-experts", action="store_true",
                        help="a mixture's every call as an accelerator runs it, every expert on every token (the CPU "
                             "groups calls of many tokens by expert)")
    args = parser.parse_args()
    if args.mesh and args.attention not in ("auto", "xla"):
        parser.error("--mesh analyses the global mesh, whose decode attention is XLA's own: leave --attention out")
    p = bench.PRESETS[args.preset]
    batch, prompt, new = args.batch or p["batch"], args.prompt or p["prompt_len"], args.new or p["new"]
    mesh = tuple(int(n) for n in args.mesh.lower().split("x")) if args.mesh else None
    if mesh:  # before JAX starts: the devices the mesh is made of
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={mesh[0] * mesh[1]}"

    import jax
    import jax.numpy as jnp

    from engine import cpu_attention, kernels
    from engine.decode import DecodeSpec, decode_chunk, new_cache, new_state, prefill_chunk
    from engine import llama
    from engine.llama import Experts, LlamaConfig, abstract_model

    llama.ROWS_FIRST = args.activations == "rows"  # read as the programs are traced

    if args.dense_experts:
        Experts.grouped_pays = lambda self, tokens, step=False: False
    from engine.memory import GiB, device_share, footprint
    from engine.mesh import Layout, MeshShape
    from engine.config import SamplingParams

    p = dict(p, experts=args.experts or p.get("experts"))
    config = LlamaConfig.from_hf(dict(
        model_type=p.get("model_type", "mixtral") if p["experts"] else "llama", vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        max_position_embeddings=max(4096, prompt + new), tie_word_embeddings=False,
        **(bench.expert_keys(p) if p["experts"] else {}),
    ))
    dtype, cache_dtype = jnp.dtype(args.dtype), jnp.dtype(args.cache_dtype)
    device = jax.devices()[0]
    if mesh:
        layout = Layout.pod(MeshShape(*mesh))
        param_sharding, batch_sharding, cache_sharding, host_sharding, sharding = (
            layout.param_sharding, layout.batch_sharding, layout.cache_sharding, layout.host_sharding, layout.replicated)
        attention = "xla"
    else:
        layout = None
        param_sharding = batch_sharding = cache_sharding = host_sharding = sharding = jax.sharding.SingleDeviceSharding(device)
        # The decode attention the engine would run here (engine.decode_attention: auto).
        attention = kernels.resolve(args.attention, platform=device.platform, head_dim=config.head_dim, dtype=args.dtype)

    def abstract(tree, where):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)

    model = abstract_model(config, dtype=dtype, sharding=param_sharding)  # the model Engine.load traces before the weights
    seq_len = prompt + new
    sampling = SamplingParams(max_new_tokens=new, prompt_logprobs=args.prompt_logprobs)
    spec = DecodeSpec(sampling, (), batch_sharding, cache_sharding, host_sharding, attention)
    # With the CPU kernel a bfloat16 cache is stored as its bits, as the engine stores it (the same bytes).
    stored = cpu_attention.BFLOAT16_BITS if spec.attention == "cpu" and cache_dtype == jnp.bfloat16 else cache_dtype
    cache = abstract(jax.eval_shape(functools.partial(new_cache, config, batch, spec.cache_ends(seq_len), stored)), cache_sharding)
    state = abstract(jax.eval_shape(functools.partial(new_state, batch)), batch_sharding)
    # One device's share, as plan_batch counts it for this layout (Engine.load).
    data, model_ways = mesh or (1, 1)
    weights, row, working = device_share(
        *footprint(config, dtype=dtype, cache_dtype=cache_dtype, seq_len=prompt + new, decode_chunk_steps=args.decode_steps,
                   prefill_tokens=args.prefill_tokens, prefill_chunk_tokens=args.prefill_chunk,
                   prompt_logprobs=args.prompt_logprobs),
        weight_shards=data * model_ways, row_shards=model_ways, batch_shards=data)
    planned = weights + working + -(-batch // data) * row
    print(json.dumps({"model": f"{config.num_hidden_layers}x{config.hidden_size}, {config.num_key_value_heads} KV heads, vocab {config.vocab_size}",
                      "dtype": args.dtype, "cache_dtype": args.cache_dtype, "batch": batch, "prompt": prompt, "new": new,
                      "mesh": args.mesh, "activations": args.activations,
                      "plan_gib": round(planned / GiB, 2), "plan_weights_gib": round(weights / GiB, 2),
                      "plan_row_mib": round(row / 2**20, 2), "plan_working_gib": round(working / GiB, 3)}), flush=True)

    programs = {"decode": (functools.partial(decode_chunk, spec=spec, steps=args.decode_steps),
                           (model, cache, state, jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=batch_sharding)))}
    if not args.skip_prefill:
        R, C = min(max(1, args.prefill_tokens // args.prefill_chunk), batch), args.prefill_chunk

        def i32(*shape, kind=jnp.int32):
            return jax.ShapeDtypeStruct(shape, kind, sharding=sharding)

        programs["prefill"] = (functools.partial(prefill_chunk, spec=spec, fresh=False),
                               (model, cache, state, i32(R, C), i32(R, 1), i32(R), i32(R), i32(R), i32(R, kind=jnp.bool_), i32(R),
                                i32(R, 1), i32(R, C) if args.prompt_logprobs else None))
    for name, (fn, inputs) in programs.items():
        start = time.perf_counter()
        jitted = jax.jit(fn, donate_argnums=(1, 2), out_shardings=(cache_sharding, batch_sharding, host_sharding))
        with layout.tracing() if layout else contextlib.nullcontext():  # on a mesh: activations' rows on `data`
            compiled = jitted.lower(*inputs).compile()
        m = compiled.memory_analysis()
        peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        print(json.dumps({"program": name, "compile_s": round(time.perf_counter() - start, 1),
                          "argument_gib": round(m.argument_size_in_bytes / GiB, 3), "output_gib": round(m.output_size_in_bytes / GiB, 3),
                          "alias_gib": round(m.alias_size_in_bytes / GiB, 3), "temp_gib": round(m.temp_size_in_bytes / GiB, 3),
                          "peak_gib": round(peak / GiB, 3), "plan_gib": round(planned / GiB, 3),
                          "plan_over_peak": round(planned / peak, 3), "device": device.platform,
                          "decode_attention": spec.attention}), flush=True)


if __name__ == "__main__":
    main()
