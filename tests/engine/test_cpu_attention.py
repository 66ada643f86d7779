"""The engine's C++ CPU decode-attention kernel (`engine.decode_attention: cpu`,
engine/cpu_attention.py): the same attention as the engine's own XLA operations over ragged
rows, GQA and every head size path, a row's result the same whatever the batch, how it is built
(and the message when it cannot be), and which setting a CPU host gets."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import EngineConfig, cpu_attention
from engine.config import InvalidConfig
from engine.kernels import attend_pages_kernel, cache_dtype, resolve
from engine_testlib import random_normal, ragged_attention_case

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
pytestmark = pytest.mark.skipif(cpu_attention.unavailable() is not None,
                                reason=f"the CPU kernel cannot be built here: {cpu_attention.unavailable()}")


# The kernel's general loop, its two fixed head sizes, and its loop for many queries (a prefill
# chunk's: 16 or more per KV head), with head sizes and query counts that leave partial blocks.
@pytest.mark.parametrize("head_dim, group", [(16, 2), (64, 2), (128, 2), (64, 16), (20, 21)])
def test_cpu_kernel_matches_the_engines_attention_over_ragged_rows(head_dim, group):
    """Pages of 32, 16 and 10 positions, rows of lengths 0..58 (some with nothing in a page, one
    with nothing at all before the chunk), `group` query heads per KV head, and a chunk buffer
    with its first 3 steps written: the kernel's result equals _attend_pages' to float32
    rounding, with one kernel call per page."""
    page_lens = (32, 16, 10)
    q, pages, chunk, chunk_mask, lengths, want = ragged_attention_case(
        batch=7, kv_heads=2, group=group, head_dim=head_dim, page_lens=page_lens, steps=4, lengths=[0, 5, 32, 40, 48, 58, 1],
        seed=head_dim + group)
    scale = 1 / math.sqrt(head_dim)
    axes = ("batch", "position", "kv_heads", "q_per_kv", "head_dim")

    def attend(q, pages, chunk):
        return attend_pages_kernel(q, pages, lengths, chunk, chunk_mask, scale, attention="cpu").rearrange(axes).array

    np.testing.assert_allclose(attend(q, pages, chunk), want, rtol=3e-6, atol=3e-6)
    assert str(jax.make_jaxpr(attend)(q, pages, chunk)).count("ffi_call[") == len(page_lens)


def test_a_rows_result_does_not_depend_on_the_batch():
    """Each (row, KV head) is computed alone, in one order, whichever thread takes it: a row
    attended in a batch of 9 gives the very bits it gives alone or among 2, and the same read in
    place from the whole cache by its row index (as a prefill chunk reads its prompts' rows)."""
    lengths = [96, 3, 50, 0, 77, 96, 12, 64, 31]
    q, pages, *_ = ragged_attention_case(batch=9, kv_heads=4, group=1, head_dim=64, page_lens=(96,), steps=4,
                                         lengths=lengths, seed=7)
    keys, values, query = pages[0].k.array, pages[0].v.array, q["position", 0].array
    lengths = jnp.asarray(lengths, jnp.int32)
    o, l, m = jax.jit(cpu_attention.page_residuals, static_argnums=4)(query, keys, values, lengths, 0.125)
    for rows in ([4], [2, 7], [8]):
        index = jnp.asarray(rows)
        o1, l1, m1 = cpu_attention.page_residuals(query[index], keys[index], values[index], lengths[index], 0.125)
        assert np.array_equal(o1, o[index]) and np.array_equal(l1, l[index]) and np.array_equal(m1, m[index])
        o2, l2, m2 = cpu_attention.page_residuals(query[index], keys, values, lengths[index], 0.125, rows=index)
        assert np.array_equal(o2, o[index]) and np.array_equal(l2, l[index]) and np.array_equal(m2, m[index])
    # a row whose cache row is out of range (a prefill call's padding row) reads nothing
    o, l, m = cpu_attention.page_residuals(query[:2], keys, values, lengths[:2], 0.125, rows=jnp.asarray([9, -1]))
    assert float(jnp.max(jnp.abs(o))) == 0 and float(jnp.max(l)) == 0
    assert float(jnp.max(jnp.abs(o[3]))) == 0 and float(jnp.max(l[3])) == 0  # nothing written: o = l = 0
    assert float(m[3].max()) == float(jnp.finfo(jnp.float32).min)


def test_a_causal_querys_result_does_not_depend_on_the_queries_after_it():
    """A prefill chunk's queries go through the kernel in blocks of 16, each block reading only the
    keys its last query reaches: the first 16 queries of a causal chunk of 40 (three blocks) give
    the very bits they give as a chunk of their own, at each start in the cache row."""
    q, pages, *_ = ragged_attention_case(batch=3, kv_heads=2, group=40, head_dim=64, page_lens=(96,), steps=4,
                                         lengths=[0, 0, 0], seed=3)
    keys, values, query = pages[0].k.array, pages[0].v.array, q["position", 0].array
    starts = jnp.asarray([0, 7, 50], jnp.int32)
    whole = cpu_attention.page_residuals(query, keys, values, starts, 0.125, causal=1, normalize=True)
    alone = cpu_attention.page_residuals(query[:, :, :16], keys, values, starts, 0.125, causal=1, normalize=True)
    for w, a in zip(whole, alone):
        assert np.array_equal(w[:, :, :16], a)
    assert float(jnp.max(jnp.abs(alone[0]))) > 0 and float(jnp.min(alone[1])) > 0  # every query read something


@pytest.mark.parametrize("group", [2, 16])
def test_a_bfloat16_cache_gives_the_bits_of_the_same_values_in_float32(group):
    """A bfloat16 model's cache holds bfloat16 values; the kernel reads them as they are (half
    the bytes), as bfloat16 or as its bits in uint16, and widens each exactly, so decode (2
    queries per KV head) and a prefill chunk's loop for many queries (16) give the very bits of
    the same values kept in float32."""
    lengths = jnp.asarray([40, 0, 17, 64, 5], jnp.int32)
    q, pages, *_ = ragged_attention_case(batch=5, kv_heads=2, group=group, head_dim=64, page_lens=(64,), steps=4,
                                         lengths=[40, 0, 17, 64, 5], seed=group)
    keys, values = (x.array.astype(jnp.bfloat16) for x in pages[0])
    query = q["position", 0].array
    rows = jnp.asarray([3, 0, 2, 4, 1], jnp.int32)  # read in place, out of order
    wides = cpu_attention.page_residuals(query, keys.astype(jnp.float32), values.astype(jnp.float32), lengths, 0.125,
                                         rows=rows)
    bits = (jax.lax.bitcast_convert_type(x, cpu_attention.BFLOAT16_BITS) for x in (keys, values))
    for halves in (cpu_attention.page_residuals(query, keys, values, lengths, 0.125, rows=rows),
                   cpu_attention.page_residuals(query, *bits, lengths, 0.125, rows=rows)):  # as the engine stores them
        for half, wide in zip(halves, wides):
            assert half.dtype == jnp.float32 and np.array_equal(half, wide)
    assert float(jnp.max(jnp.abs(wides[0]))) > 0


@pytest.mark.parametrize("stored", [jnp.float32, cpu_attention.BFLOAT16_BITS])
def test_a_decode_step_writes_its_keys_and_attends_in_one_call(stored):
    """A decode step's one kernel call (`attend_step_cpu`) over a page of 64 positions, float32 or
    bfloat16's bits: rows writing at 0, 5, 30 and the page's last position, and one writing
    nothing (at the page's length: it reads its first position). The page comes back with the
    step's keys and values where they go (rounded as the cache stores them) and nothing else
    changed, and the attention is the kernel's residuals over that page normalized, bit for bit,
    as the engine computed them before the two were one call; a row's result is the same alone."""
    from haliax import Axis

    from engine.jax_compat import hax
    from engine.kernels import attend_step_cpu
    from engine.llama import LayerKV, PagedKV

    q, pages, *_ = ragged_attention_case(batch=5, kv_heads=2, group=2, head_dim=64, page_lens=(64,), steps=4,
                                         lengths=[0] * 5, seed=11)
    page = LayerKV(*(hax.named(cpu_attention.as_stored(x.array, stored), x.axes) for x in pages[0]))
    step_axes = (Axis("batch", 5), Axis("kv_heads", 2), Axis("position", 1), Axis("head_dim", 64))
    draw = random_normal(1)
    k, v = (hax.named(draw(5, 2, 1, 64), step_axes) for _ in range(2))
    write_at = jnp.asarray([0, 5, 63, 64, 30], jnp.int32)
    read = jnp.asarray([1, 6, 64, 1, 31], jnp.int32)  # as the engine's decode step reads them
    got, written = jax.jit(attend_step_cpu, static_argnums=6)(q, page, k, v, write_at, read, 0.125)

    want_page = PagedKV((page,)).write(jnp.arange(5)[:, None], write_at[:, None], jnp.swapaxes(k.array, 1, 2),
                                       jnp.swapaxes(v.array, 1, 2)).pages[0]
    for got_x, want_x, old in zip(written, want_page, page):
        assert got_x.dtype == stored and np.array_equal(got_x.array, want_x.array)
        assert int(jnp.sum(jnp.any(got_x.array != old.array, axis=-1))) == 8  # 4 rows x 2 heads, one position each
    query = q["position", 0].array
    o, l, _ = cpu_attention.page_residuals(query, want_page.k.array, want_page.v.array, read, 0.125)
    attention = got.rearrange(("batch", "position", "kv_heads", "q_per_kv", "head_dim")).array[:, 0]
    assert np.array_equal(attention, o / l[..., None])
    alone, _ = attend_step_cpu(q["batch", 2:3], LayerKV(*(x["batch", 2:3] for x in page)), k["batch", 2:3], v["batch", 2:3],
                               write_at[2:3], read[2:3], 0.125)
    assert np.array_equal(alone.array[:, 0], attention[2:3])


# The loop for many queries (8 positions x 2 query heads: 16 a KV head; 16 x 2 and 12 x 2: two
# blocks of 16, each reading the keys its own queries reach) and the general one (4 x 2).
@pytest.mark.parametrize("chunk, head_dim", [(8, 16), (4, 16), (8, 64), (16, 64), (12, 16)])
def test_a_prefill_chunk_attends_the_same_through_the_kernel(chunk, head_dim):
    """Prefill chunks of 4 prompts (two query heads per KV head) at positions 20, 37 and 0 of
    their cache rows, the last a padding row with no cache row: written into the cache and
    attending in one kernel call, their prompts' rows read in place, causally, they write the
    same cache bits as the XLA operations' scatter, and attend as those do (the later chunks
    their gathered rows over pages of 32, 16 and 16 and their own keys, a first chunk its own
    keys alone), to float32 rounding; the padding row comes out zero and writes nothing."""
    from haliax import Axis

    from engine.jax_compat import hax
    from engine.llama import Attention, LayerKV, PagedKV, PrefillChunk, PrefillSegments

    draw = random_normal(head_dim + chunk)
    Batch, Pos, KVHeads, HeadDim = Axis("batch", 4), Axis("position", chunk), Axis("kv_heads", 2), Axis("head_dim", head_dim)

    def normal(*axes):
        return hax.named(draw(*(a.size for a in axes)), axes)

    page = LayerKV(*(normal(Axis("batch", 5), KVHeads, Axis("key_position", 64), HeadDim) for _ in range(2)))
    pages = tuple(LayerKV(*(x["key_position", start:end] for x in page)) for start, end in ((0, 32), (32, 48), (48, 64)))
    q = normal(Batch, Pos, KVHeads, Axis("q_per_kv", 2), HeadDim)
    k, v = (normal(Batch, KVHeads, Pos, HeadDim) for _ in range(2))
    slots, starts = jnp.asarray([[2], [0], [3], [5]]), jnp.asarray([20, 37, 0, 0])  # 5: out of range, a padding row
    positions = starts[:, None] + jnp.arange(chunk)[None, :]
    write_positions = jnp.where(slots < 5, positions, 64)

    def attend(q, k, v, rows, attention: str, fresh: bool = False):
        q, k, v = (hax.named(x.array[rows], (Axis("batch", len(rows)),) + x.axes[1:]) for x in (q, k, v))
        cache = PagedKV((page,) if attention == "cpu" else pages)
        segments = PrefillSegments(slots[rows], starts[rows], jnp.arange(len(rows)) * chunk, jnp.full(len(rows), chunk))
        write_rows = jnp.broadcast_to(slots[rows][:, None, :], (len(rows), chunk, 1))
        context = PrefillChunk(cache, write_rows, positions[rows], write_positions[rows], segments,
                               jnp.max(starts[rows]) + chunk, fresh, attention)
        attn, written = Attention._prefill(q, k, v, context, 0.25)
        keys = jnp.concatenate([p.k.array for p in written.pages], axis=2)  # the pages' positions, end to end
        return attn.rearrange(("batch", "position", "kv_heads", "q_per_kv", "head_dim")).array, keys

    attend = jax.jit(attend, static_argnums=(4, 5))  # as the engine calls it (and one program, not an op at a time)
    everything, later, first = jnp.arange(4), jnp.asarray([0, 1]), jnp.asarray([2])
    got, keys = attend(q, k, v, everything, "cpu")
    assert np.array_equal(keys, attend(q, k, v, everything, "xla")[1])
    assert not np.array_equal(keys, page.k.array)
    np.testing.assert_allclose(got[:2], attend(q, k, v, later, "xla")[0], rtol=3e-6, atol=3e-6)
    np.testing.assert_allclose(got[2:3], attend(q, k, v, first, "xla", fresh=True)[0], rtol=3e-6, atol=3e-6)
    assert float(jnp.max(jnp.abs(got[3]))) == 0
    assert str(jax.make_jaxpr(attend, static_argnums=(4, 5))(q, k, v, everything, "cpu")).count("ffi_call[") == 1


@pytest.mark.parametrize("stored", [jnp.float32, cpu_attention.BFLOAT16_BITS])
def test_a_packed_prefill_call_writes_its_pieces_and_gives_each_query_the_bits_of_its_own_row(stored):
    """A packed prefill call's one row of tokens holds pieces of prompts (5, 32, 1, 17 and 40
    positions; the last with no cache row, then 7 positions in no piece), feature first. Each
    piece's keys and values land in its prompt's rows (two samples for the first, from where the
    piece starts; rounded as the cache stores them) and nothing else changes; then each piece's
    queries (3 query heads a KV head) get the very bits they get as a causal row of their own over
    that page, and a prompt's 40 queries the same bits, and its page, cut into two calls anywhere.
    No row, no piece: zeros."""
    kv_heads, per_kv, dim, positions = 2, 3, 64, 96
    draw = random_normal(11)
    page = [cpu_attention.as_stored(draw(6, kv_heads, positions, dim), stored) for _ in range(2)]
    counts, starts, rows = [5, 32, 1, 17, 40], [0, 10, 3, 50, 0], [[0, 5], [1, 9], [2, 9], [3, 9], [9, 9]]
    offsets = np.cumsum([0] + counts[:-1])
    q = draw(kv_heads, per_kv, dim, sum(counts) + 7)  # feature first, as the engine's activations
    new = draw(2, kv_heads, dim, sum(counts) + 7)
    packed, *written = cpu_attention.prefill_step(q, *page, *new, (rows, starts, offsets, counts), 0.125)

    want = [np.array(x) for x in page]
    for samples, start, offset, count in zip(rows, starts, offsets, counts):
        for cache, given in zip(want, new):
            piece = np.transpose(cpu_attention.as_stored(given[..., offset : offset + count], stored), (0, 2, 1))
            for r in samples:
                if r < 6:  # 9: out of range, no row
                    cache[r, :, start : start + count] = piece
    for got, expected in zip(written, want):
        assert got.dtype == stored and np.array_equal(got, expected)
    assert int(np.sum(np.any(want[0] != np.asarray(page[0]), axis=-1))) == kv_heads * (2 * 5 + 32 + 1 + 17)

    for (row, _), start, offset, count in zip(rows, starts, offsets, counts):
        span = slice(offset, offset + count)
        rows_first = jnp.transpose(q[..., span], (0, 3, 1, 2)).reshape(1, kv_heads, count * per_kv, dim)
        alone, _, _ = cpu_attention.page_residuals(rows_first, *written, jnp.asarray([start]), 0.125,
                                                   rows=jnp.asarray([row]), causal=per_kv, normalize=True)
        feature_first = jnp.transpose(alone[0].reshape(kv_heads, count, per_kv, dim), (0, 2, 3, 1))
        assert np.array_equal(packed[..., span], feature_first), (row, count)
    assert float(jnp.max(jnp.abs(packed[..., 55:]))) == 0  # the piece with no row, and no piece
    assert float(jnp.min(jnp.abs(packed[..., :55]).max(axis=2))) > 0

    def one_prompt(start: int, end: int, cache, offset: int = 0):  # its positions start..end-1 in one call
        pieces = ([[1]], [start], [offset], [end - start])
        return cpu_attention.prefill_step(q[..., start:end], *cache, *new[..., start:end], pieces, 0.125)

    whole, *whole_page = one_prompt(0, 40, page)
    for cut in (1, 5, 16, 32, 39):  # as the engine cuts a prompt: the calls before wrote its start
        first, *cache = one_prompt(0, cut, page)
        rest, *cache = one_prompt(cut, 40, cache)
        assert np.array_equal(jnp.concatenate([first, rest], axis=-1), whole), cut
        assert all(np.array_equal(a, b) for a, b in zip(cache, whole_page)), cut
    with pytest.raises(Exception, match="a segment reaches past the call's positions"):
        one_prompt(0, 10, page, offset=1)


def test_a_long_piece_attends_as_a_plain_softmax_and_a_bfloat16_page_as_its_values_in_float32():
    """A late prefill call's long pieces (300 positions from 100, and 212 from 0: 19 and 14 blocks
    of queries, rows far apart in memory) over a bfloat16 page give the very bits of the same
    values kept in float32 (the kernel widens a pair's keys and values once, then reads them as
    float32), and both equal a plain causal softmax over the cache rows to float32 rounding."""
    kv_heads, dim, positions = 2, 64, 416
    draw = random_normal(5)
    halves = [draw(3, kv_heads, positions, dim).astype(jnp.bfloat16) for _ in range(2)]
    q = draw(kv_heads, 1, dim, 512)
    new = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in draw(2, kv_heads, dim, 512)]
    pieces = ([[2], [0]], [100, 0], [0, 300], [300, 212])
    as_bits = [jax.lax.bitcast_convert_type(x, cpu_attention.BFLOAT16_BITS) for x in halves]
    narrow, *narrow_page = cpu_attention.prefill_step(q, *as_bits, *new, pieces, 0.125)
    wide, *wide_page = cpu_attention.prefill_step(q, *(x.astype(jnp.float32) for x in halves), *new, pieces, 0.125)
    assert np.array_equal(narrow, wide)
    for bits, page in zip(narrow_page, wide_page):
        assert np.array_equal(jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32), page)

    keys, values = (np.asarray(x, np.float64) for x in wide_page)
    for (row,), start, offset, count in zip(*pieces):
        queries = np.asarray(q[:, 0, :, offset : offset + count], np.float64)  # [kv_heads, dim, count]
        scores = np.einsum("hdq,hkd->hqk", queries, keys[row, :, : start + count]) * 0.125
        scores[:, np.arange(count)[:, None] < np.arange(start + count)[None, :] - start] = -np.inf  # causal
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("hqk,hkd->hdq", weights / weights.sum(-1, keepdims=True), values[row, :, : start + count])
        np.testing.assert_allclose(wide[:, 0, :, offset : offset + count], want, rtol=2e-5, atol=2e-5)


def test_a_float32_prefill_call_rotates_its_queries_and_keys_to_the_bits_of_apply_rotary():
    """Given unrotated queries and keys and the rotary tables, a float32 call rotates them itself
    (as the engine's float32 prefill calls do): the very bits of `llama.apply_rotary` (XLA's
    rotation) followed by the call, in its attention and in the keys it writes, for pieces from
    various starts, one into two samples' rows."""
    import haliax as hax

    from engine.llama import LlamaConfig, apply_rotary, rotary_tables

    config = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 256, "intermediate_size": 64,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "rope_theta": 10000.0})
    kv_heads, per_kv, dim, cache_positions = 2, 2, 64, 128
    counts, starts, rows = [5, 32, 17, 40], [0, 10, 50, 3], [[0, 4], [1, 9], [2, 9], [3, 9]]  # 9: no row
    offsets, width = np.cumsum([0] + counts[:-1]), sum(counts)
    token_positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
    cos, sin = rotary_tables(config, hax.named(jnp.asarray(token_positions[None, :]), ("batch", "position")), jnp.float32)
    draw = random_normal(7)
    page = [draw(5, kv_heads, cache_positions, dim) for _ in range(2)]
    q = hax.named(draw(kv_heads, per_kv, dim, 1, width), ("kv_heads", "q_per_kv", "head_dim", "batch", "position"))
    k, v = (hax.named(x, ("kv_heads", "head_dim", "batch", "position")) for x in draw(2, kv_heads, dim, 1, width))
    pieces = (rows, starts, offsets, counts)

    rotated_q, rotated_k = jax.jit(lambda q, k, c, s: (apply_rotary(q, c, s).array, apply_rotary(k, c, s).array))(q, k, cos, sin)
    as_call = lambda x: x.reshape(*x.shape[:-2], width)  # noqa: E731 (the call's one row of positions)
    want = cpu_attention.prefill_step(as_call(rotated_q), *page, as_call(rotated_k), as_call(v.array), pieces, 0.125)
    tables = tuple(x.rearrange(("head_dim", "batch", "position")).array.reshape(dim, width) for x in (cos, sin))
    got = cpu_attention.prefill_step(as_call(q.array), *page, as_call(k.array), as_call(v.array), pieces, 0.125, tables)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    assert np.array_equal(got[1][4, :, :5], got[1][0, :, :5])  # the second sample's row: the same rotated keys
    unrotated = cpu_attention.prefill_step(as_call(q.array), *page, as_call(k.array), as_call(v.array), pieces, 0.125)
    assert not np.array_equal(unrotated[0], want[0]) and not np.array_equal(unrotated[1], want[1])
    with pytest.raises(ValueError, match="rotates float32"):
        cpu_attention.prefill_step(as_call(q.array), *(cpu_attention.as_stored(x, cpu_attention.BFLOAT16_BITS) for x in page),
                                   as_call(k.array), as_call(v.array), pieces, 0.125, tables)


def test_the_kernel_is_built_once_per_source_and_machine(tmp_path, monkeypatch):
    """The library is built into $PIPELINE_KERNEL_DIR under a name that hashes what it was built
    from, and a second call finds it instead of building again."""
    monkeypatch.setenv("PIPELINE_KERNEL_DIR", str(tmp_path / "kernels"))
    path = cpu_attention.build()
    assert os.path.dirname(path) == str(tmp_path / "kernels") and os.path.basename(path).startswith("decode_attention-")
    built = os.stat(path).st_mtime_ns
    assert cpu_attention.build() == path and os.stat(path).st_mtime_ns == built
    assert os.listdir(tmp_path / "kernels") == [os.path.basename(path)]  # no partial file left behind
    monkeypatch.setattr(cpu_attention, "FLAGS", cpu_attention.FLAGS + ("-DPIPELINE_TEST_FLAG",))
    assert cpu_attention.library_path() != path


def test_a_kernel_that_cannot_be_built_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_KERNEL_DIR", str(tmp_path / "kernels"))
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo broken 1.0 && exit 0\necho 'fatal error: no headers' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    with pytest.raises(cpu_attention.KernelUnavailable, match=r"building .*decode_attention.cc failed .*fatal error: no headers"):
        cpu_attention.build()
    assert os.listdir(tmp_path / "kernels") == []  # nothing half written is left to be loaded
    monkeypatch.setenv("CXX", str(tmp_path / "missing-c++"))
    with pytest.raises(cpu_attention.KernelUnavailable, match="the C\\+\\+ compiler .*missing-c\\+\\+ does not run"):
        cpu_attention.build()
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(cpu_attention.shutil, "which", lambda name: None)
    with pytest.raises(cpu_attention.KernelUnavailable, match="no C\\+\\+ compiler found"):
        cpu_attention.build()


def test_which_attention_a_cpu_host_gets(monkeypatch):
    """auto is the kernel on a CPU, the engine's XLA attention where the kernel cannot be built;
    `cpu` is refused off the CPU and, with the reason, where it cannot be built."""
    assert resolve("auto", platform="cpu", head_dim=64, dtype="float32") == "cpu"
    assert resolve("auto", platform="cpu", head_dim=8, dtype="bfloat16") == "cpu"
    assert resolve("cpu", platform="cpu", head_dim=80, dtype="float32") == "cpu"
    assert resolve("xla", platform="cpu", head_dim=64, dtype="float32") == "xla"
    with pytest.raises(InvalidConfig, match="engine.decode_attention: cpu is the engine's CPU kernel; this host's devices are gpu"):
        resolve("cpu", platform="gpu", head_dim=64, dtype="bfloat16")
    monkeypatch.setattr(cpu_attention, "unavailable", lambda: "no C++ compiler found (install g++, or set CXX)")
    assert resolve("auto", platform="cpu", head_dim=64, dtype="float32") == "xla"
    with pytest.raises(InvalidConfig, match=r"cpu needs the engine's C\+\+ kernel, which cannot be built here: no C\+\+ compiler"):
        resolve("cpu", platform="cpu", head_dim=64, dtype="float32")
    with pytest.raises(InvalidConfig, match="engine.decode_attention must be auto, xla, pallas or cpu, got 'flash'"):
        EngineConfig(decode_attention="flash")


def test_which_cache_dtype_a_host_gets():
    """A bfloat16 model's KV cache is bfloat16 (stored as its bits in uint16) only where the CPU
    kernel makes every read of it: on one CPU device. Over several, or with the XLA attention,
    a CPU keeps float32; an accelerator the model's dtype."""
    bits, f32, bf16 = cpu_attention.BFLOAT16_BITS, jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    assert cache_dtype("cpu", platform="cpu", dtype=bf16, devices=1) == bits
    assert cpu_attention.value_dtype(bits) == bf16 and cpu_attention.value_dtype(f32) == f32
    assert cache_dtype("cpu", platform="cpu", dtype=f32, devices=1) == f32
    assert cache_dtype("cpu", platform="cpu", dtype=bf16, devices=4) == f32
    assert cache_dtype("xla", platform="cpu", dtype=bf16, devices=1) == f32
    assert cache_dtype("pallas", platform="gpu", dtype=bf16, devices=8) == bf16


def test_loading_the_kernel_leaves_the_processs_floating_point_alone(tmp_path):
    """A library built with -ffast-math turns on flush-to-zero for the whole process when loaded
    (hypothesis and numpy then see subnormal floats as zero); the kernel's build must not."""
    script = ("import numpy as np\nfrom engine import cpu_attention\nassert cpu_attention.unavailable() is None\n"
              "tiny = np.float32(1e-40)\nprint(bool(tiny > 0), bool(tiny * np.float32(2) > 0))\n")
    env = {**os.environ, "PIPELINE_KERNEL_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]
