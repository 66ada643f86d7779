"""Decode attention alone, the engine's two ways (`engine.decode_attention`) over the same paged
KV cache (docs/performance-notes.md, "On a GPU").

- xla: the engine's own attention (`engine.llama._attend_pages`): per cache page, the scores,
  the softmax and the weighted values as separate XLA operations, over the first pages that
  hold the longest row (`engine.llama.by_pages`), masked by each row's length.
- pallas: JAX's Pallas GPU decode-attention kernel (`jax.experimental.pallas.ops.gpu.
  decode_attention`) as the engine runs it (`engine.kernels.attend_pages_kernel`, its tuning
  `engine.kernels.TUNING`, over the engine's pages for it): one call per page over the same
  buffers in place, each row stopping at its own length, the pages and the chunk buffer
  combined by their softmax residuals. Each --tuning adds the kernel read another way
  (`engine.kernels.KernelTuning`: its longest block, which also rounds the pages, the pages,
  programs, Triton's warps and stages), over the same keys and values paged as the engine
  would for it (`engine.decode.cache_ends`).

Each layer of a decode step attends once: over its cache pages and the decode chunk's buffer
(one position written, as at a chunk's first step). On a GPU both are timed, a few layers in
a row; anywhere they are checked against each other. On the CPU the kernel runs in Pallas'
interpreter, slowly: keep shapes small there, and read only the check.

    python scripts/bench_decode_attention.py --preset llama3-8b 1100 2100               # a GPU
    python scripts/bench_decode_attention.py --preset llama3-8b --tuning num_warps=8 \
        --tuning max_block_k=128,num_stages=3 1100 2100                                 # and two other ways
    python scripts/bench_decode_attention.py --preset tinyllama-1.1b --ragged 256       # lengths 1..256
    python scripts/bench_decode_attention.py --preset cpu-tiny --batch 2 --layers 1 40  # the check, on a CPU

Prints one JSON line per position: the bytes the engine's attention and an exact one must read,
and per way the ms per layer, the kernel's (splits, block) per page and the largest difference
from the engine's own attention relative to the largest output. With kernel ways timed, a last
line names the fastest over all positions and its full tuning.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as bench  # noqa: E402 - the presets

CHUNK = 16
"""Decode steps per chunk: the engine's default `decode_chunk_steps`, the chunk buffer's length."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("positions", nargs="+", type=int, help="rows' lengths (cache positions written)")
    parser.add_argument("--preset", choices=sorted(bench.PRESETS), default="cpu-tiny")
    parser.add_argument("--batch", type=int, help="rows (default: the preset's batch)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="cache dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--layers", type=int, default=2, help="layers attended in a row, each over its own pages")
    parser.add_argument("--ragged", action="store_true", help="each row's length drawn from 1..position, not all at position")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tuning", action="append", default=[], metavar="NAME=N,...",
                        help="also the kernel tuned so (engine.kernels.KernelTuning fields, e.g. max_block_k=128,num_warps=8); repeatable")
    args = parser.parse_args()
    rows = []
    for row in run(args):
        print(json.dumps(row), flush=True)
        rows.append(row)
    if fastest := fastest_way(rows):
        print(json.dumps(fastest), flush=True)


def fastest_way(rows: list[dict]) -> dict | None:
    """The kernel way with the least time summed over the rows (only ways timed in every row)."""
    kernel_ways = [name for name in rows[0]["ways"] if name != "xla"] if rows else []
    totals = {name: sum(row["ways"][name].get("ms_per_layer", math.inf) for row in rows) for name in kernel_ways}
    totals = {name: round(total, 3) for name, total in totals.items() if math.isfinite(total)}
    if not totals:
        return None
    best = min(totals, key=totals.get)
    return {"ms_per_layer_summed": totals, "fastest": best, "tuning": rows[0]["ways"][best]["tuning"]}


def run(args: argparse.Namespace):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from haliax import Axis

    from engine import kernels
    from engine.decode import cache_ends, page_masks
    from engine.jax_compat import hax
    from engine.llama import LayerKV, _attend_pages, page_spans, pages_covering

    p = dict(bench.PRESETS[args.preset])
    batch = args.batch or (p["batch"][0] if isinstance(p["batch"], tuple) else p["batch"])
    kv_heads, group, head_dim = p["kv_heads"], p["heads"] // p["kv_heads"], p["hidden"] // p["heads"]
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    if dtype != jnp.float32 and not on_gpu:
        raise SystemExit("--dtype bfloat16 needs a GPU: on the CPU the engine's XLA and Pallas attentions keep a float32 "
                         "cache (XLA's CPU dots over a 16-bit one are slow or missing)")
    try:
        tunings = {"pallas": kernels.TUNING} | {f"pallas:{text}": kernels.KernelTuning.parse(text) for text in args.tuning}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    seq_len = p["prompt_len"] + p["new"]
    layouts = {"xla": cache_ends("xla", seq_len, kernels.TUNING)} | {
        name: cache_ends("pallas", seq_len, tuning) for name, tuning in tunings.items()}
    scale = 1.0 / math.sqrt(head_dim)
    Batch, Pos, KVHeads, QPerKV, HeadDim = (Axis("batch", batch), Axis("position", 1), Axis("kv_heads", kv_heads),
                                           Axis("q_per_kv", group), Axis("head_dim", head_dim))
    Chunk = Axis("chunk", CHUNK)

    key = jax.random.key(0)

    def normal(shape):
        nonlocal key
        key, part = jax.random.split(key)
        return jax.random.normal(part, shape, jnp.float32).astype(dtype)

    def buffers(length):  # keys, values (batch, kv_heads, length, head_dim)
        return normal((batch, kv_heads, length, head_dim)), normal((batch, kv_heads, length, head_dim))

    # The same keys and values in every way, paged as the engine pages them for that way.
    whole = [(buffers(max(ends[-1] for ends in layouts.values())), buffers(CHUNK)) for _ in range(args.layers)]
    paged = {ends: [([tuple(x[:, :, start:end] for x in kv) for start, end in page_spans(ends)], chunk) for kv, chunk in whole]
             for ends in set(layouts.values())}
    del whole
    q0 = normal((batch, kv_heads, group, head_dim))

    def named(q, pages, chunk):
        """The decode step's q, cache pages (LayerKVs), chunk buffer and its mask (the first
        position written), as the engine holds them."""
        pages = [LayerKV(*(hax.named(x, (Batch, KVHeads, Axis("key_position", x.shape[2]), HeadDim)) for x in page))
                 for page in pages]
        chunk = LayerKV(*(hax.named(x, (Batch, KVHeads, Chunk, HeadDim)) for x in chunk))
        first = hax.named(jnp.broadcast_to(jnp.arange(CHUNK) == 0, (batch, 1, CHUNK)), (Batch, Pos, Chunk))
        return hax.named(q[:, None], (Batch, Pos, KVHeads, QPerKV, HeadDim)), pages, chunk, first

    def unnamed(out, like):
        return out.rearrange(("batch", "position", "kv_heads", "q_per_kv", "head_dim")).array[:, 0].astype(like.dtype)

    def xla_layer(q, pages, chunk, lengths):
        """The engine's own attention (`engine.llama._attend_pages`), each page masked by the rows' lengths."""
        nq, pages, chunk, first = named(q, pages, chunk)
        masks = page_masks(layouts["xla"], len(pages), lengths)  # as the engine's decode loop masks them
        parts = [(page.k, page.v, mask, "key_position") for page, mask in zip(pages, masks)]
        parts.append((chunk.k, chunk.v, first, "chunk"))
        return unnamed(_attend_pages(nq, parts, scale), q)

    def pallas_layer(q, pages, chunk, lengths, *, tuning):
        """The engine's kernel path (`engine.kernels.attend_pages_kernel`) over the same parts."""
        nq, pages, chunk, first = named(q, pages, chunk)
        return unnamed(kernels.attend_pages_kernel(nq, pages, lengths, chunk, first, scale, tuning=tuning), q)

    def stack(layer_fn):
        """Every layer in a row over its first `count` pages: the pages that hold the longest row,
        as the engine's decode call reads (`pages_covering`; on the device, `by_pages`)."""
        def f(q, layers, lengths, count):
            for pages, chunk in layers:
                q = layer_fn(q, pages[:count], chunk, lengths)
            return q
        return jax.jit(f, static_argnames="count")

    ways = {"xla": stack(xla_layer)} | {name: stack(functools.partial(pallas_layer, tuning=tuning)) for name, tuning in tunings.items()}
    per_position = 2 * kv_heads * head_dim * dtype.itemsize  # keys and values
    rng = np.random.default_rng(0)
    for position in args.positions:
        if not 1 <= position <= seq_len:
            raise SystemExit(f"position {position} is outside the cache (1..{seq_len})")
        lengths = rng.integers(1, position + 1, batch) if args.ragged else np.full(batch, position)
        lengths = jnp.asarray(lengths, jnp.int32)
        longest = int(lengths.max())
        row = {"preset": args.preset, "position": position, "ragged": args.ragged, "batch": batch, "dtype": dtype.name,
               "device": str(jax.devices()[0].device_kind), "ways": {}}
        xla_ends = layouts["xla"]
        row["xla_MB_per_layer"] = round(batch * xla_ends[pages_covering(longest, xla_ends) - 1] * per_position / 1e6, 3)
        row["exact_MB_per_layer"] = round(int(lengths.sum()) * per_position / 1e6, 3)
        reference = None
        for name, fn in ways.items():
            ends = layouts[name]
            count = pages_covering(longest, ends)
            layers = paged[ends]
            way = row["ways"][name] = {"page_ends": ends}
            if name in tunings:
                way["tuning"] = str(tunings[name])
                way["blocks"] = [kernels.kernel_blocks(end - start, batch * kv_heads, tunings[name])
                                 for start, end in page_spans(ends)[:count]]
            try:
                out = jax.block_until_ready(fn(q0, layers, lengths, count)).astype(jnp.float32)
            except Exception as e:  # the kernel's module is experimental and version-bound: report, keep the rest
                way["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            if reference is None:
                reference = out
            else:
                way["max_difference"] = float(jnp.max(jnp.abs(reference - out)) / jnp.max(jnp.abs(reference)))
            if on_gpu or name == "xla":  # the interpreter is no measure
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(q0, layers, lengths, count))
                    times.append(time.perf_counter() - start)
                way["ms_per_layer"] = round(statistics.median(times) / args.layers * 1e3, 3)
        yield row


if __name__ == "__main__":
    main()
