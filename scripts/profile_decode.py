"""Time the engine's compiled decode chunk alone, against what it must read.

Where `bench_engine.py` measures whole runs side by side with transformers, this isolates
the decode program: ms per decode step with every row at a given position, the bytes a step
reads (the weights, less the embedding table, and the cache pages that hold the rows, or with
a kernel (`engine.decode_attention: pallas` or `cpu`) the rows' positions: decode attends over
them in place), the bound at a given bandwidth, and the fraction reached (on an accelerator an
H100's 3.0 TB/s unless --bandwidth-tbps says otherwise; on a CPU only with it: `python
scripts/bench_dots.py --stream` measures the machine's). Compare
two commits by running it from each checkout on the same machine. It times one program at the
whole batch; on a CPU host the engine may run two at half the batch side by side (`engine.lanes`).

With --trace it also traces one call per position (`jax.profiler`) and prints where the time
went: the kernels of the trace's busiest line (on a GPU its compute stream, on the CPU a worker
thread), in µs per layer and step, largest first. With --hlo DIR it writes the optimized
program's text there, to look up what a kernel computes.

    python scripts/profile_decode.py --preset tinyllama-1.1b 16 128 368     # on a GPU
    python scripts/profile_decode.py --preset tinyllama-1.1b --trace 128 256 --hlo gpu-bench-out/hlo
    python scripts/profile_decode.py --preset cpu-tiny --dtype float32 64
    python scripts/profile_decode.py --preset cpu-mixed --batch 16 --dtype bfloat16 40 300
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
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
    parser.add_argument("--bandwidth-tbps", type=float,
                        help="the device's memory bandwidth, for the bound columns (default: an H100's ~3.0 on an "
                             "accelerator; none on a CPU, where the columns are left out)")
    parser.add_argument("--batch", type=int, help="decode slots (default: the preset's batch; the first of a mixed preset's)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--attention", choices=["auto", "xla", "pallas", "cpu"], default="auto",
                        help="engine.decode_attention (cpu: the engine's C++ kernel, each row read to its length)")
    parser.add_argument("--kernel-tuning", metavar="NAME=N,...", default="",
                        help="how the pallas attention reads the cache (engine.kernels.KernelTuning fields, e.g. in_place=1)")
    parser.add_argument("--checkpoint", help="keep the random checkpoint in this folder (built if empty) and "
                                             "reuse it, e.g. to profile two checkouts on the same weights")
    parser.add_argument("--trace", action="store_true", help="trace one call per position and print its kernels")
    parser.add_argument("--top", type=int, default=25, help="kernels printed with --trace")
    parser.add_argument("--hlo", metavar="DIR", help="write the optimized decode program's text to DIR")
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
    from engine import kernels as engine_kernels  # `kernels` is this script's trace reader
    from engine.decode import new_state
    from engine.engine import compiler_options
    from engine.llama import pages_covering

    engine_kernels.TUNING = engine_kernels.KernelTuning.parse(args.kernel_tuning)  # read by Engine.load
    # The decode program is compiled below, alone: none of the run's programs is got while loading
    # (on an accelerator `auto` would compile them in threads beside it).
    config = EngineConfig(batch_size=preset["batch"], decode_attention=args.attention, compile_during_load=False)
    engine = Engine.load(folder, dtype=args.dtype, sampling=SamplingParams(max_new_tokens=preset["new"]), engine=config,
                         max_prompt_tokens=preset["prompt_len"])
    slots, steps = preset["batch"], engine.engine_config.decode_chunk_steps
    bandwidth = args.bandwidth_tbps or (None if engine.devices[0].platform == "cpu" else 3.0)  # TB/s, for the bound
    ((cache, state),) = engine._init(slots)
    # Random keys and values (a key per page), written over the zeros in place (donated): two
    # caches of the 8B at batch 128 would not fit an H100.
    def fill(cache):
        leaves, tree = jax.tree.flatten(cache)
        return jax.tree.unflatten(tree, [(jax.random.normal(jax.random.key(i), x.shape) * 0.1).astype(x.dtype)
                                         for i, x in enumerate(leaves)])

    cache = jax.jit(fill, donate_argnums=0, out_shardings=engine.layout.cache_sharding)(cache)
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.model)) - engine.model.embed_tokens.array.nbytes
    kv_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache))
    ends = cache.ends
    kill = jnp.zeros(slots, bool)
    started = time.perf_counter()
    # The engine's decode program, jitted and compiled as the engine does: the cache and state
    # donated, the outputs' shardings explicit, the engine's XLA options.
    _, _, decode = engine._decode_program()
    program = engine._jit(decode)
    program = program.lower(engine.model, cache, state, kill).compile(compiler_options())
    compile_s = time.perf_counter() - started
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
        with open(os.path.join(args.hlo, f"decode-{args.preset}-{args.dtype}-b{slots}.hlo"), "w") as f:
            f.write(program.as_text())
    for position in args.positions or [preset["prompt_len"]]:
        def fresh_state():  # every row live at `position` (a new state, not a new cache)
            state = new_state(slots)._replace(done=jnp.zeros(slots, bool), position=jnp.full(slots, position, jnp.int32))
            return jax.device_put(state, engine._batch_sharding)

        times = []
        for _ in range(args.repeats):
            state = jax.block_until_ready(fresh_state())
            started = time.perf_counter()
            cache, state, host = jax.block_until_ready(program(engine.model, cache, state, kill))
            times.append(time.perf_counter() - started)
        step_s = statistics.median(times[2:] or times) / steps
        # What a call reads of the cache: the pages that hold the rows; the kernel, each row to its length.
        read = position if engine.attention in ("pallas", "cpu") else ends[pages_covering(position, ends) - 1]
        step_bytes = weight_bytes + kv_bytes * read // ends[-1]
        row = {"position": position, "ms_per_step": round(step_s * 1e3, 3), "compile_s": round(compile_s, 1),
               "cache_positions_read": read, "GB_per_step": round(step_bytes / 1e9, 3)}
        if bandwidth:
            row.update(bound_ms=round(step_bytes / (bandwidth * 1e12) * 1e3, 3),
                       fraction_of_bound=round(step_bytes / (bandwidth * 1e12) / step_s, 3))
        row["device"] = str(jax.devices()[0].device_kind)
        if args.trace:
            # Said before the trace: a GPU's first trace has run past its step's limit silently.
            print(f"position {position}: {row['ms_per_step']} ms a step (compiled in {row['compile_s']} s); tracing a call",
                  file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as folder:
                state = jax.block_until_ready(fresh_state())
                with jax.profiler.trace(folder):
                    cache, state, host = jax.block_until_ready(program(engine.model, cache, state, kill))
                row.update(kernels(folder, layer_steps=steps * engine.config.num_hidden_layers, top=args.top))
        yield row


RUNTIME_SPANS = ("ThunkExecutor", "SlinkyThreadPool", "$")
"""Names of a CPU trace's spans that hold kernels rather than run one (and Python's, '$...')."""


def kernels(folder: str, *, layer_steps: int, top: int) -> dict:
    """From the one call traced under folder: the busiest line of its trace (a device's line if
    there is one), its busy time, and its kernels in µs per layer and step, largest first, each
    with how many times a layer-step runs it."""
    path = next(f for f in glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True) if "perfetto" not in f)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    lines = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            lines[(str(names.get((e["pid"], None), e["pid"])), str(names.get((e["pid"], e.get("tid")), e.get("tid"))))].append(e)
    on_device = {k: v for k, v in lines.items() if "device" in k[0].lower()}
    line, events = max((on_device or lines).items(), key=lambda kv: len(kv[1]))
    busy, launches = collections.Counter(), collections.Counter()
    for e in events:
        if e["name"].startswith(RUNTIME_SPANS):
            continue
        busy[e["name"]] += e.get("dur", 0)
        launches[e["name"]] += 1
    return {"trace_line": " / ".join(line), "busy_ms": round(sum(busy.values()) / 1e3, 3),
            "kernels_per_layer_step": round(sum(launches.values()) / layer_steps, 1),
            "us_per_layer_step": {name: [round(us / layer_steps, 2), round(launches[name] / layer_steps, 2)]
                                  for name, us in busy.most_common(top)}}


if __name__ == "__main__":
    main()
