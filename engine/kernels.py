"""Decode attention through a kernel (`engine.decode_attention`: pallas, JAX's Pallas GPU decode-attention kernel; cpu, ours).

Owns: the choice between the engine's own attention (XLA operations: per cache page the scores,
the softmax and the weighted values, over every position of the pages that hold the longest live
row) and the library's fused kernel (`jax.experimental.pallas.ops.gpu.decode_attention`), which
reads each row's cache only up to that row's length, in place, and skips the blocks past it
(with a sliding window, from the window's first position: the kernel's start index);
and the kernel's use over the engine's pages: one call per page (with the kernel the engine
keeps its cache in one page, `KernelTuning.pages`: one call a layer), combined with the decode
chunk's buffer by their softmax residuals (the running maximum and sum of each part).

With `engine.decode_attention: cpu` the page (the engine keeps one for it too) goes instead to
the engine's own C++ CPU kernel (engine/cpu_attention.py), which returns the same residuals.
Each decode step writes its keys/values into that page and attends over it, to each row's
length and the new position, in one kernel call a layer (`attend_step_cpu`; the page written in
place, `engine.decode.DecodeSpec.decode_in_place`): no chunk buffer, no scatter, no combine.
A prefill call on one device goes through it too (`prefill_step_cpu`): the call's keys and
values written into the cache, then the queries of each prompt's piece over its cache row, read
in place, causally, in one call a layer; the call's rows hold the pieces end to end (packed).

The Pallas kernel is JAX's, not ours: this module only tunes its blocks and combines its results. It
runs on GPUs, over several devices under `jax.shard_map` (each device its own rows and KV
heads); on the CPU Pallas' interpreter runs it (slowly: for checks). A page whose length is not
a multiple of 16 (the kernel's smallest block; the engine's pages for it never are) is attended
the XLA way and combined the same way.

    attn = attend_pages_kernel(q, pages, lengths, chunk, chunk_mask, scale, sharding=cache_sharding)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import NamedSharding, PartitionSpec

from engine import cpu_attention
from engine.config import InvalidConfig
from engine.jax_compat import hax

BLOCK_H = 16
"""Query heads per kernel program (the kernel pads a KV head's query group to it)."""
_MIN_BLOCK = 16


class KernelTuning(NamedTuple):
    """How the kernel reads the cache (`TUNING`; scripts/bench_decode_attention.py times others).
    The blocks' defaults were the fastest of 19 tunings of the Llama-3-8B's decode attention on
    an H100 (docs/performance-notes.md): one page, blocks of 64 positions, four loads in flight.
    The cache written in place in the decode loop was timed on an H200 (`in_place`)."""

    max_block_k: int = 64
    """Longest block of key positions one step of a program's loop reads: the largest power of
    two up to this dividing the page. The engine's pages are multiples of it where the cache
    holds `pages` of them (`engine.decode.cache_ends`)."""
    pages: int = 1
    """Pages the cache is split into. The engine's own attention reads whole pages, up to the
    one holding the longest row, so it takes quarters; the kernel reads each row to its own
    length whatever the pages, and one page is one call a layer."""
    min_programs: int = 1024
    """A page is split along its positions until batch x kv_heads x splits reaches this many
    kernel programs (about eight per multiprocessor of an H100), so that small batches still
    fill the card."""
    num_warps: int = 4
    num_stages: int = 4
    """Triton's: warps per program, and loads of the loop kept in flight."""
    chunk_kernel: int = 0
    """With in_place=0, 1: the decode chunk's own positions (its buffer, 16 by default) through
    the kernel too, one more call a layer instead of about four small XLA kernels (on an H200,
    TinyLlama, one run: 0.8 % more tokens/s than XLA's); 0: XLA operations."""
    in_place: int = 1
    """1, with one page: each decode step writes its keys/values into the cache in place and the
    kernel attends to each row's length and the new position, with no chunk buffer, its writes
    and its attention (`engine.decode.decode_chunk`; the CPU kernel's way always). 0: the chunk
    buffer, written into the cache after each decode chunk. On an H200 on 2026-11-30 in place
    gave TinyLlama 1.6-4.9 % more tokens/s in each of four runs beside the buffer (one process
    each); on 2026-11-29 it had given 6 % less, 5.5 % less with a sliding window, and the 8B
    1.6 % less time (one run each; docs/performance-notes.md)."""

    @classmethod
    def parse(cls, text: str) -> KernelTuning:
        """'max_block_k=128,num_warps=8' (any fields, the rest default); '' is the default."""
        try:
            fields = dict(item.split("=") for item in text.split(",") if item)
            tuning = cls(**{name: int(value) for name, value in fields.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"kernel tuning {text!r}: expected name=integer pairs of {', '.join(cls._fields)} ({e})") from None
        if tuning.max_block_k < _MIN_BLOCK or tuning.max_block_k & (tuning.max_block_k - 1):
            raise ValueError(f"kernel tuning {text!r}: max_block_k must be a power of two >= {_MIN_BLOCK} (Triton's blocks)")
        if tuning.pages < 1:
            raise ValueError(f"kernel tuning {text!r}: pages must be at least 1")
        return tuning

    def __str__(self) -> str:
        return ",".join(f"{name}={value}" for name, value in self._asdict().items())


TUNING = KernelTuning()
"""What an engine runs (read by Engine.load into its DecodeSpec)."""


def resolve(setting: str, *, platform: str, head_dim: int, dtype: str, capped: str | None = None) -> str:
    """'xla', 'pallas' or 'cpu' for `engine.decode_attention`. auto: on GPUs JAX's Pallas kernel
    in a 16-bit dtype (float32 keeps the engine's own attention, whose products are held to
    float32 precision) when the heads suit it; on CPUs the engine's C++ kernel
    (engine/cpu_attention.py) where it builds, else the engine's own attention. The Pallas kernel
    is Triton's: its blocks span a whole head, so head_dim must be a power of two of at least 16
    on a GPU; `pallas` is refused on other accelerators and for other head sizes (on the CPU
    Pallas' interpreter runs any, for checks). `cpu` is refused off the CPU and where the kernel
    cannot be built. Every way has the sliding window. `capped`, why the scores are capped (Gemma
    2), refuses both kernels: auto is the engine's own attention."""
    if capped is not None:
        if setting in ("cpu", "pallas"):
            raise InvalidConfig(f"engine.decode_attention: {setting} has plain attention scores, but {capped}"
                                " (use auto or xla: the engine's own attention caps them)")
        return "xla"
    fits = head_dim >= _MIN_BLOCK and head_dim & (head_dim - 1) == 0
    if setting == "cpu":
        if platform != "cpu":
            raise InvalidConfig(f"engine.decode_attention: cpu is the engine's CPU kernel; this host's devices are {platform}"
                                " (use auto or xla)")
        why = cpu_attention.unavailable()
        if why:
            raise InvalidConfig(f"engine.decode_attention: cpu needs the engine's C++ kernel, which cannot be built here: {why}"
                                " (use auto or xla)")
        return setting
    if setting == "auto" and platform == "cpu":
        return "xla" if cpu_attention.unavailable() else "cpu"
    if setting == "auto":
        return "pallas" if platform == "gpu" and dtype != "float32" and fits else "xla"
    if setting == "pallas":
        if platform not in ("gpu", "cpu"):
            raise InvalidConfig(f"engine.decode_attention: pallas runs JAX's Pallas GPU kernel; this host's devices are"
                                f" {platform} (use auto or xla)")
        if platform == "gpu" and not fits:
            raise InvalidConfig(f"engine.decode_attention: pallas needs a head_dim that is a power of two >= 16 (the"
                                f" kernel's blocks span a head); this model's is {head_dim} (use auto or xla)")
    return setting


def reads_in_place(attention: str, devices: int) -> bool:
    """The CPU kernel makes every read of the cache, each row read where it lives (a prefill
    chunk's prompts' rows too): `cpu` attention over a cache on one device. Over several the
    rows live apart, and a later prefill chunk attends the XLA way."""
    return attention == "cpu" and devices == 1


def cache_dtype(attention: str, *, platform: str, dtype, devices: int):
    """The KV cache's dtype for a model in `dtype` whose cache spans `devices` devices: the model's
    on accelerators. On a CPU float32 (XLA's CPU dots read a 16-bit cache slowly: "Prefill and
    decode apart" in docs/performance-notes.md) unless the CPU kernel makes every read of it
    (`reads_in_place`). A bfloat16 model's keys and values are bfloat16 values either way (its
    projections round to it) and every read of the cache with the kernel is in float32, so a
    bfloat16 cache changes no bit, only the bytes it takes and a step reads: half. It is stored
    as the bits, in uint16 (`cpu_attention.BFLOAT16_BITS`: XLA's CPU backend writes bfloat16
    through float32)."""
    if platform != "cpu":
        return dtype
    if reads_in_place(attention, devices):
        return cpu_attention.BFLOAT16_BITS if jnp.dtype(dtype) == jnp.bfloat16 else dtype
    return jnp.float32


def kernel_blocks(page_len: int, programs: int, tuning: KernelTuning = KernelTuning()) -> tuple[int, int] | None:
    """(k_splits, block_k) for a page of `page_len` positions attended by `programs` (batch x
    kv_heads) kernel instances, or None where the kernel cannot read it: block_k is the largest
    power of two up to tuning.max_block_k dividing the page (Triton's blocks), at least 16; the
    page is split into the fewest equal parts, each a whole number of blocks, that give
    tuning.min_programs."""
    block_k = min(page_len & -page_len, tuning.max_block_k)
    if block_k < _MIN_BLOCK:
        return None
    blocks = page_len // block_k
    k_splits = next(k for k in range(1, blocks + 1)
                    if blocks % k == 0 and (programs * k >= tuning.min_programs or k == blocks))
    return k_splits, block_k


def page_residuals(q: jax.Array, keys: jax.Array, values: jax.Array, lengths: jax.Array, scale: float, *,
                   blocks: tuple[int, int], tuning: KernelTuning = KernelTuning(), begin: jax.Array | None = None):
    """One page through the kernel, read in `blocks` = (k_splits, block_k): q [batch, kv_heads,
    group, head_dim], keys/values [batch, kv_heads, page_len, head_dim], lengths [batch]
    (positions of the page each row has written), begin [batch] (the first of them each row
    reads: a sliding window's; None: 0). Returns (o, l, m): the unnormalized weighted values
    [batch, kv_heads, group, head_dim] float32 and the softmax's sum and maximum [batch, kv_heads,
    group]; a row with nothing to read gives o = l = 0 and m = float32 min. The kernel masks the
    positions before `begin` in the blocks it reads and skips its splits of the page that hold
    none of a row's positions."""
    from jax.experimental.pallas.ops.gpu import decode_attention  # imported here: experimental, GPU-only

    q = q.astype(keys.dtype)  # a bfloat16 model over the CPU's float32 cache
    batch, kv_heads = keys.shape[:2]
    k_splits, block_k = blocks
    inner = functools.partial(
        decode_attention.decode_attn_unbatched, sm_scale=scale, block_h=BLOCK_H, block_k=block_k, k_splits=k_splits,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages, grid=None, interpret=jax.default_backend() == "cpu", debug=False,
        return_residuals=True, normalize_output=False)
    n = jnp.broadcast_to(lengths[:, None], (batch, kv_heads))
    if begin is None:
        o, (l, m) = jax.vmap(jax.vmap(lambda q, k, v, n: inner(q, k, v, None, n)))(q, keys, values, n)
    else:
        b = jnp.broadcast_to(begin[:, None], (batch, kv_heads))
        o, (l, m) = jax.vmap(jax.vmap(inner))(q, keys, values, b, n)
    return o.astype(jnp.float32), l, m


def xla_residuals(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float):
    """The same (o, l, m) as `page_residuals` by XLA operations, for the keys where mask
    (broadcast to [batch, kv_heads, group, positions]) is True: the decode chunk's buffer, pages
    the kernel cannot read."""
    s = jnp.einsum("bhgd,bhkd->bhgk", q, keys, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    o = jnp.einsum("bhgk,bhkd->bhgd", e.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return o, jnp.sum(e, axis=-1), jnp.where(jnp.isfinite(m), m, jnp.finfo(jnp.float32).min)


def combine(parts) -> jax.Array:
    """Softmax attention from each part's (o, l, m): sum of o * exp(m - top) over sum of l * exp(m - top)."""
    top = functools.reduce(jnp.maximum, [m for _, _, m in parts])
    weights = [jnp.exp(m - top) for _, _, m in parts]
    out = sum(o * w[..., None] for (o, _, _), w in zip(parts, weights))
    return out / sum(l * w for (_, l, _), w in zip(parts, weights))[..., None]


def attend_pages_kernel(q: NamedArray, pages, lengths: jax.Array, chunk, chunk_mask: NamedArray | None, scale: float, *,
                        sharding: NamedSharding | None = None, tuning: KernelTuning | None = None,
                        attention: str = "pallas", first: jax.Array | None = None) -> NamedArray:
    """A decode step's attention (q one position: batch, position, kv_heads, q_per_kv, head_dim)
    over the cache `pages` (LayerKVs, keys/values batch, kv_heads, key_position, head_dim), each
    row up to its `lengths` [batch] positions written, and over the chunk buffer's keys/values
    (batch, kv_heads, chunk, head_dim) where chunk_mask (batch, position, chunk) is True: a
    prefix of the chunk, its steps so far (chunk None: the cache alone). `first` [batch]: the
    first position each row reads, its sliding window's (the chunk's entry s is position
    lengths + s; None: 0; pallas only). The same result as `engine.llama._attend_pages` over
    those parts, float32.

    `sharding` is the cache's (rows over `data`, KV heads over `model` on a global mesh): over
    several devices each runs the kernel on its own rows and heads (`jax.shard_map`), since XLA
    cannot split the kernel's call itself. `tuning`: how the kernel reads the pages (the
    engine's `DecodeSpec.kernel`; None: `TUNING`)."""
    kv = [(page.k.array, page.v.array) for page in pages]
    args = (q["position", 0].rearrange(_STEP_AXES).array, kv, lengths)
    chunk_args = (None, None)
    if chunk is not None:
        chunk_args = ((chunk.k.array, chunk.v.array), chunk_mask["position", 0].rearrange(("batch", "chunk")).array)
    args += chunk_args + (first,)
    attend = functools.partial(_attend_arrays, scale=scale, tuning=tuning or TUNING, attention=attention)
    specs = _device_specs(sharding)
    if specs:
        by_head, by_row = specs
        attend = jax.shard_map(attend, mesh=sharding.mesh, in_specs=(by_head, by_head, by_row, by_head, by_row, by_row),
                               out_specs=by_head, check_vma=False)
    return _as_step(attend(*args), q)


_STEP_AXES = ("batch", "kv_heads", "q_per_kv", "head_dim")
"""A decode step's queries and attention, as the kernels take and give them (one position)."""


def _device_specs(sharding) -> tuple[PartitionSpec, PartitionSpec] | None:
    """How a kernel's call is split over the cache's devices (`sharding`: rows over `data`, KV
    heads over `model` on a global mesh), since XLA cannot split the call itself: the specs of
    arrays (batch, kv_heads, ...) and (batch,) for `jax.shard_map`, each device its own rows and
    heads; None on one device, where the call runs as it is."""
    if not (isinstance(sharding, NamedSharding) and sharding.mesh.size > 1):
        return None
    rows, heads = (tuple(sharding.spec) + (None, None))[:2]
    return PartitionSpec(rows, heads), PartitionSpec(rows)


def _as_step(out: jax.Array, q: NamedArray) -> NamedArray:
    """A kernel's attention [batch, kv_heads, q_per_kv, head_dim] named as the step's queries q
    (batch, position, kv_heads, q_per_kv, head_dim)."""
    return hax.named(out[:, None], tuple(q.resolve_axis(a) for a in ("batch", "position") + _STEP_AXES[1:]))


def attend_step_cpu(q: NamedArray, page, k: NamedArray, v: NamedArray, write_at: jax.Array, lengths: jax.Array,
                    scale: float, *, sharding: NamedSharding | None = None, window: int | None = None):
    """A decode step with `engine.decode_attention: cpu` over the one-page cache `page` (LayerKV,
    keys/values batch, kv_heads, key_position, head_dim): the step's keys/values k, v (batch,
    kv_heads, position, head_dim) are written at write_at [batch] (past the page: none) and q
    (batch, position, kv_heads, q_per_kv, head_dim) attends over each row's first lengths [batch]
    positions, in one kernel call a layer (`cpu_attention.decode_step`: the page written in
    place, the softmax normalized inside). Returns (attention float32, the page). Over several
    devices (`sharding`, the cache's) each runs the call on its own rows and heads. window: each
    row reads only its last `window` positions (a sliding window)."""
    step = functools.partial(cpu_attention.decode_step, scale=scale, window=window)
    specs = _device_specs(sharding)
    if specs:
        by_head, by_row = specs
        step = jax.shard_map(step, mesh=sharding.mesh, in_specs=(by_head,) * 5 + (by_row, by_row),
                             out_specs=(by_head,) * 3, check_vma=False)
    out, keys, values = step(q["position", 0].rearrange(_STEP_AXES).array, page.k.array, page.v.array,
                             k["position", 0].array, v["position", 0].array, write_at, lengths)
    return _as_step(out, q), type(page)(hax.named(keys, page.k.axes), hax.named(values, page.v.axes))


def _attend_arrays(q, pages, lengths, chunk=None, mask=None, first=None, *, scale: float, tuning: KernelTuning,
                   attention: str = "pallas") -> jax.Array:
    """attend_pages_kernel on one device's arrays: q [batch, kv_heads, group, head_dim], pages
    [(keys, values)] and chunk (keys, values) [batch, kv_heads, positions, head_dim] or None,
    lengths [batch], mask [batch, chunk], first [batch] or None. Returns [batch, kv_heads, group,
    head_dim] float32."""
    if first is not None and attention == "cpu":
        raise ValueError("the CPU kernel's sliding window is its step in place (attend_step_cpu)")
    parts = _pages_residuals(q, pages, lengths, scale, tuning, attention, first)
    if chunk is None:
        return combine(parts)
    steps = chunk[0].shape[2]
    begin = None if first is None else jnp.clip(first - lengths, 0, steps)  # the chunk's entry s is position lengths + s
    if tuning.chunk_kernel and attention == "pallas":
        # the chunk's written positions are a prefix: its length per row
        parts.append(_residuals(q, *chunk, jnp.sum(mask, axis=1, dtype=jnp.int32), scale, tuning, begin=begin))
    else:
        if attention == "cpu":  # in float32, as the kernel reads the pages (a bfloat16 cache: the same values)
            chunk = tuple(x.astype(jnp.float32) for x in chunk)
        if begin is not None:
            mask = mask & (jnp.arange(steps)[None, :] >= begin[:, None])
        parts.append(xla_residuals(q, *chunk, mask[:, None, None, :], scale))
    return combine(parts)


def _pages_residuals(q, pages, lengths, scale: float, tuning: KernelTuning, attention: str, first=None) -> list:
    """(o, l, m) of each page [(keys, values)], in order, each row read to its first `lengths`
    [batch] positions of the cache (a page holds its share of them), from its `first` [batch]
    (None: 0)."""
    parts, start = [], 0
    for keys, values in pages:
        page_len = keys.shape[2]
        begin = None if first is None else jnp.clip(first - start, 0, page_len)
        parts.append(_residuals(q, keys, values, jnp.clip(lengths - start, 0, page_len), scale, tuning, attention, begin))
        start += page_len
    return parts


def _residuals(q, keys, values, written, scale: float, tuning: KernelTuning, attention: str = "pallas", begin=None):
    """(o, l, m) of keys/values [batch, kv_heads, positions, head_dim], each row's first
    `written` [batch] positions from its `begin` [batch] on (None: 0): by the CPU kernel
    (attention cpu, `cpu_attention.page_residuals`; no begin), else by the Pallas kernel where it
    can read them (`kernel_blocks`), else by XLA operations."""
    if attention == "cpu":
        return cpu_attention.page_residuals(q, keys, values, written, scale)
    blocks = kernel_blocks(keys.shape[2], q.shape[0] * q.shape[1], tuning)
    if blocks is None:
        index = jnp.arange(keys.shape[2])[None, :]
        read = index < written[:, None]
        if begin is not None:
            read = read & (index >= begin[:, None])
        return xla_residuals(q, keys, values, read[:, None, None, :], scale)
    return page_residuals(q, keys, values, written, scale, blocks=blocks, tuning=tuning, begin=begin)


def prefill_step_cpu(q: NamedArray, k: NamedArray, v: NamedArray, page, segments, scale: float,
                     rotary: tuple[NamedArray, NamedArray] | None = None, window: int | None = None):
    """A prefill call with `engine.decode_attention: cpu` in one kernel call a layer: its keys and
    values k, v (batch, kv_heads, position, head_dim) written into the one-page cache `page`
    (LayerKV: slots, kv_heads, key_position, head_dim), then its queries q (batch, position,
    kv_heads, q_per_kv, head_dim) over their prompts' cache rows, read in place, causally. Its
    tokens are read row-major as one row holding pieces of prompts, `segments`
    (`engine.llama.PrefillSegments`): piece s is written into its prompt's rows (`samples[s]`)
    from its start on, and the query at its position p reads the first starts[s] + p + 1
    positions of the first of them (what earlier calls wrote and the piece up to itself). A token
    in no piece, or in one with no cache row, comes out zero. On one device (the kernel's call is
    not split over devices). Returns (attention, float32: the same as `engine.llama._attend_pages`
    over the cache row up to each query's position; the page, written in place). rotary (cos,
    sin), each (batch, position, head_dim), float32: q and k are not rotated yet, and the kernel
    rotates them as `engine.llama.apply_rotary` would, to the same bits. window: each query reads
    only its last `window` positions (a sliding window)."""
    # Feature first, as the projections leave q, k and v and the output projection takes the
    # result: the kernel reads and writes each (head, dimension)'s row of the call's positions.
    axes = ("kv_heads", "q_per_kv", "head_dim", "batch", "position")
    q = q.rearrange(axes)
    heads, per_kv, dim, batch, chunk = q.array.shape
    k, v = (x.rearrange(("kv_heads", "head_dim", "batch", "position")).array.reshape(heads, dim, batch * chunk)
            for x in (k, v))
    rows = (segments.samples, segments.starts, segments.offsets, segments.lengths)
    if rotary is not None:  # q and k not rotated yet: the kernel rotates them (tables feature first)
        rotary = tuple(x.rearrange(("head_dim", "batch", "position")).array.reshape(dim, batch * chunk) for x in rotary)
    out, keys, values = cpu_attention.prefill_step(q.array.reshape(heads, per_kv, dim, batch * chunk), page.k.array,
                                                   page.v.array, k, v, rows, scale, rotary, window)
    return (hax.named(out.reshape(q.array.shape), tuple(q.resolve_axis(a) for a in axes)),
            type(page)(hax.named(keys, page.k.axes), hax.named(values, page.v.axes)))
