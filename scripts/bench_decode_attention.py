"""Decode attention alone, the engine's two ways (`engine.decode_attention`) over the same paged
KV cache (docs/performance-notes.md, "On a GPU").

- xla: the engine's own attention (`engine.llama._attend_pages`): per cache page, the scores,
  the softmax and the weighted values as separate XLA operations, over the first pages that
  hold the longest row (`engine.llama.by_pages`), masked by each row's length.
- pallas: JAX's Pallas GPU decode-attention kernel (`jax.experimental.pallas.ops.gpu.
  decode_attention`) as the engine runs it (`engine.kernels.attend_pages_kernel`): one call per
  page over the same buffers in place, each row stopping at its own length, the pages and the
  chunk buffer combined by their softmax residuals. With --split N, also the kernel with every
  program reading N positions of a page (the engine's choice: `engine.kernels.kernel_blocks`).

Each layer of a decode step attends once: over its cache pages and the decode chunk's buffer
(one position written, as at a chunk's first step). On a GPU both are timed, a few layers in
a row; anywhere they are checked against each other. On the CPU the kernel runs in Pallas'
interpreter, slowly: keep shapes small there, and read only the check.

    python scripts/bench_decode_attention.py --preset llama3-8b 1100 2100               # a GPU
    python scripts/bench_decode_attention.py --preset llama3-8b --split 32 1100         # and 17 programs a page
    python scripts/bench_decode_attention.py --preset tinyllama-1.1b --ragged 256       # lengths 1..256
    python scripts/bench_decode_attention.py --preset cpu-tiny --batch 2 --layers 1 40  # the check, on a CPU

Prints one JSON line per position: ms per layer for each way, the bytes each must read, the
kernel's blocks per page, and the largest difference between each kernel way's output and the
engine's own relative to the largest output.
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
    parser.add_argument("--page-multiple", type=int, default=16,
                        help="round the cache's quarter pages to this many positions (the engine: 16); 64 or 128 let the kernel read bigger blocks")
    parser.add_argument("--split", type=int, help="also time the kernel with every program reading this many positions of a page")
    args = parser.parse_args()
    for row in run(args):
        print(json.dumps(row), flush=True)


def run(args: argparse.Namespace):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from haliax import Axis

    from engine.jax_compat import hax
    from engine.kernels import attend_pages_kernel, kernel_blocks
    from engine.llama import LayerKV, _attend_pages, cache_pages, page_spans, pages_covering

    p = dict(bench.PRESETS[args.preset])
    batch = args.batch or (p["batch"][0] if isinstance(p["batch"], tuple) else p["batch"])
    kv_heads, group, head_dim = p["kv_heads"], p["heads"] // p["kv_heads"], p["hidden"] // p["heads"]
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    if dtype != jnp.float32 and not on_gpu:
        raise SystemExit("--dtype bfloat16 needs a GPU: on the CPU the engine keeps a float32 cache (XLA's CPU dots "
                         "over a 16-bit one are slow or missing)")
    ends = cache_pages(p["prompt_len"] + p["new"], args.page_multiple)
    spans = page_spans(ends)
    scale = 1.0 / math.sqrt(head_dim)
    Batch, Pos, KVHeads, QPerKV, HeadDim = (Axis("batch", batch), Axis("position", 1), Axis("kv_heads", kv_heads),
                                           Axis("q_per_kv", group), Axis("head_dim", head_dim))

    key = jax.random.key(0)

    def normal(shape):
        nonlocal key
        key, part = jax.random.split(key)
        return jax.random.normal(part, shape, jnp.float32).astype(dtype)

    def buffers(length):  # keys, values (batch, kv_heads, length, head_dim)
        return normal((batch, kv_heads, length, head_dim)), normal((batch, kv_heads, length, head_dim))

    layers = [([buffers(end - start) for start, end in spans], buffers(CHUNK)) for _ in range(args.layers)]
    q0 = normal((batch, kv_heads, group, head_dim))

    Chunk = Axis("chunk", CHUNK)

    def named(q, pages, chunk):
        """The decode step's q, cache pages (LayerKVs), chunk buffer and its mask (the first
        position written), as the engine holds them."""
        pages = [LayerKV(*(hax.named(x, (Batch, KVHeads, Axis("key_position", end - start), HeadDim)) for x in page))
                 for page, (start, end) in zip(pages, spans)]
        chunk = LayerKV(*(hax.named(x, (Batch, KVHeads, Chunk, HeadDim)) for x in chunk))
        first = hax.named(jnp.broadcast_to(jnp.arange(CHUNK) == 0, (batch, 1, CHUNK)), (Batch, Pos, Chunk))
        return hax.named(q[:, None], (Batch, Pos, KVHeads, QPerKV, HeadDim)), pages, chunk, first

    def unnamed(out, like):
        return out.rearrange(("batch", "position", "kv_heads", "q_per_kv", "head_dim")).array[:, 0].astype(like.dtype)

    def xla_layer(q, pages, chunk, lengths):
        """The engine's own attention (`engine.llama._attend_pages`), each page masked by the rows' lengths."""
        nq, pages, chunk, first = named(q, pages, chunk)
        parts = []
        for page, (start, end) in zip(pages, spans):
            written = start + jnp.arange(end - start)[None, None, :] < lengths[:, None, None]
            parts.append((page.k, page.v, hax.named(written, (Batch, Pos, page.k.resolve_axis("key_position"))), "key_position"))
        parts.append((chunk.k, chunk.v, first, "chunk"))
        return unnamed(_attend_pages(nq, parts, scale), q)

    def pallas_layer(q, pages, chunk, lengths, *, split=None):
        """The engine's kernel path (`engine.kernels.attend_pages_kernel`) over the same parts."""
        nq, pages, chunk, first = named(q, pages, chunk)
        return unnamed(attend_pages_kernel(nq, pages, lengths, chunk, first, scale, split=split), q)

    def stack(layer_fn):
        """Every layer in a row over its first `count` pages: the pages that hold the longest row,
        as the engine's decode call reads (`pages_covering`; on the device, `by_pages`)."""
        def f(q, layers, lengths, count):
            for pages, chunk in layers:
                q = layer_fn(q, pages[:count], chunk, lengths)
            return q
        return jax.jit(f, static_argnames="count")

    xla = stack(xla_layer)
    pallas = stack(pallas_layer)
    ways = {"xla": xla, "pallas": pallas}
    if args.split:
        ways[f"pallas_split{args.split}"] = stack(functools.partial(pallas_layer, split=args.split))
    itemsize = dtype.itemsize
    rng = np.random.default_rng(0)
    for position in args.positions:
        if not 1 <= position <= ends[-1]:
            raise SystemExit(f"position {position} is outside the cache (1..{ends[-1]})")
        lengths = rng.integers(1, position + 1, batch) if args.ragged else np.full(batch, position)
        lengths = jnp.asarray(lengths, jnp.int32)
        row = {"preset": args.preset, "position": position, "ragged": args.ragged, "batch": batch, "dtype": dtype.name,
               "device": str(jax.devices()[0].device_kind)}
        count = pages_covering(int(lengths.max()), ends)
        read = ends[count - 1]
        per_position = 2 * kv_heads * head_dim * itemsize  # keys and values
        row["xla_MB_per_layer"] = round(batch * read * per_position / 1e6, 3)
        row["exact_MB_per_layer"] = round(int(lengths.sum()) * per_position / 1e6, 3)
        row["kernel_blocks"] = [kernel_blocks(end - start, batch * kv_heads) for start, end in spans[:count]]
        a = jax.block_until_ready(xla(q0, layers, lengths, count)).astype(jnp.float32)
        timed = {"xla": xla}
        for name, fn in ways.items():
            if name == "xla":
                continue
            try:
                b = jax.block_until_ready(fn(q0, layers, lengths, count)).astype(jnp.float32)
            except Exception as e:  # the kernel's module is experimental and version-bound: report, keep the xla figures
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            suffix = name.removeprefix("pallas")
            row[f"max_difference{suffix}"] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
            if on_gpu:  # the interpreter is no measure
                timed[name] = fn
        for name, fn in timed.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(fn(q0, layers, lengths, count))
                times.append(time.perf_counter() - start)
            row[f"{name}_ms_per_layer"] = round(statistics.median(times) / args.layers * 1e3, 3)
        yield row


if __name__ == "__main__":
    main()
