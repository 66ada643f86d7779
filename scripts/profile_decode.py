"""Time the engine's compiled decode chunk alone, against what it must read.

Where `bench_engine.py` measures whole runs side by side with transformers, this isolates
the decode program: ms per decode step with every row at a given position, the bytes a step
reads (weights + the whole KV cache, which decode attends over in place), the bound at a given
bandwidth, and the fraction reached. Compare two commits by running it from each checkout on
the same machine.

    python scripts/profile_decode.py --preset tinyllama-1.1b 16 128 368     # on a GPU
    python scripts/profile_decode.py --preset cpu-tiny --dtype float32 64
    python scripts/profile_decode.py --preset cpu-mixed --batch 16 --dtype bfloat16 40 300
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as bench  # noqa: E402 - the presets and the checkpoint builder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("positions", nargs="*", type=int, help="rows' positions to time (default: the prompt length)")
    parser.add_argument("--preset", choices=sorted(bench.PRESETS), default="cpu-tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--bandwidth-tbps", type=float, default=3.0, help="for the bound column (H100: ~3.0)")
    parser.add_argument("--batch", type=int, help="decode slots (default: the preset's batch; the first of a mixed preset's)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--checkpoint", help="keep the random checkpoint in this folder (built if empty) and "
                                             "reuse it, e.g. to profile two checkouts on the same weights")
    args = parser.parse_args()
    preset = dict(bench.PRESETS[args.preset])
    batches = preset["batch"] if isinstance(preset["batch"], tuple) else (preset["batch"],)
    preset["batch"] = args.batch or batches[0]
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.checkpoint or scratch
        if not os.path.exists(os.path.join(folder, "config.json")):
            bench._in_child(bench.build_checkpoint, preset, folder, args.dtype)
        for row in profile(folder, preset, args):
            print(json.dumps(row), flush=True)


def profile(folder: str, preset: dict, args: argparse.Namespace):
    import jax
    import jax.numpy as jnp

    from engine import Engine, EngineConfig, SamplingParams
    from engine.decode import decode_chunk

    engine = Engine.load(folder, dtype=args.dtype, sampling=SamplingParams(max_new_tokens=preset["new"]),
                         engine=EngineConfig(batch_size=preset["batch"]), max_prompt_tokens=preset["prompt_len"])
    slots, steps = preset["batch"], engine.engine_config.decode_chunk_steps
    cache, _ = engine._init(slots)
    cache = jax.tree.map(lambda c: (jax.random.normal(jax.random.key(1), c.shape) * 0.1).astype(c.dtype), cache)
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.model)) - engine.model.embed_tokens.array.nbytes
    kv_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache))
    kill = jnp.zeros(slots, bool)
    started = time.perf_counter()
    program = jax.jit(functools.partial(decode_chunk, spec=engine._spec, steps=steps), donate_argnums=(1, 2))
    _, state = engine._init(slots)
    program = program.lower(engine.model, cache, state, kill).compile()
    compile_s = time.perf_counter() - started
    for position in args.positions or [preset["prompt_len"]]:
        def fresh_state():
            _, state = engine._init(slots)
            return state._replace(done=jnp.zeros(slots, bool), position=jnp.full(slots, position, jnp.int32))

        times = []
        for _ in range(args.repeats):
            state = jax.block_until_ready(fresh_state())
            started = time.perf_counter()
            cache, state, host = jax.block_until_ready(program(engine.model, cache, state, kill))
            times.append(time.perf_counter() - started)
        step_s = statistics.median(times[2:] or times) / steps
        step_bytes = weight_bytes + kv_bytes
        yield {"position": position, "ms_per_step": round(step_s * 1e3, 3), "compile_s": round(compile_s, 1),
               "GB_per_step": round(step_bytes / 1e9, 3),
               "bound_ms": round(step_bytes / (args.bandwidth_tbps * 1e12) * 1e3, 3),
               "fraction_of_bound": round(step_bytes / (args.bandwidth_tbps * 1e12) / step_s, 3),
               "device": str(jax.devices()[0].device_kind)}


if __name__ == "__main__":
    main()
