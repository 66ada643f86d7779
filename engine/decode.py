"""The two compiled programs of generation: prefill into cache slots, and a chunk of decode steps.

Owns: the device-side decode state (one slot per row being generated), the preallocated KV
cache ([batch, kv_heads, seq, head_dim] per layer, written in place, never concatenated), and
the on-device stop rule (EOS / stop token ids / max_new_tokens). The host (engine.py) decides
which rows go to which slots and when; it does not own stop strings or scheduling.

    caches = init_caches(config, slots, seq_len, cache_dtype, spec.cache_sharding)
    state = init_state(slots, spec.batch_sharding)
    caches, state, (first, done) = prefill_into_slots(model, caches, state, tokens, lengths, src,
                                                      prompt_index, sample_index, spec=spec)
    caches, state, (out, done) = decode_chunk(model, caches, state, kill, spec=spec, window=256, steps=16)

A decode chunk runs up to `steps` tokens in one `lax.while_loop` (no Python per token), stopping
early when every slot is done. It attends only to the first `window` cache positions (the host
picks the smallest window bucket covering every live slot, so short rows do not read the whole
preallocated cache each step) plus the chunk's own new positions.

Both return what the host reads back (new tokens and done flags) as separate arrays laid out
by `spec.host_sharding`: on a global mesh they are replicated, so every host holds a copy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from engine.config import SamplingParams
from engine.jax_compat import hax
from engine.llama import LlamaConfig, LlamaLM
from engine.sampler import row_keys, sample, step_keys


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Everything static the compiled programs close over (hashable)."""

    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    """EOS ids of the checkpoint plus sampling.stop_token_ids: a row is done after emitting one."""
    batch_sharding: jax.sharding.Sharding
    """How arrays with a leading slot axis (the decode state) are spread over the devices."""
    cache_sharding: jax.sharding.Sharding
    """How the KV cache [batch, kv_heads, seq, head_dim] is spread (engine/mesh.py)."""
    host_sharding: jax.sharding.Sharding
    """Layout of the tokens and done flags the host reads back after each call."""


class DecodeState(NamedTuple):
    last_token: jax.Array  # [slots] int32: the newest token, not yet in the cache
    position: jax.Array  # [slots] int32: where last_token's key/value will be written
    generated: jax.Array  # [slots] int32: tokens generated so far, last_token included
    done: jax.Array  # [slots] bool: finished or empty slot
    keys: jax.Array  # [slots] PRNG keys, one per (prompt, sample) row


Caches = tuple[tuple[NamedArray, NamedArray], ...]


def init_caches(config: LlamaConfig, slots: int, seq_len: int, cache_dtype, sharding) -> Caches:
    axes = (Axis("batch", slots), config.KVHeads, Axis("key_position", seq_len), config.HeadDim)
    shape = tuple(a.size for a in axes)

    # Made by a compiled program with its output sharding, so each device (of every host on a
    # global mesh) allocates only its own block.
    zeros = _zeros_program(shape, jnp.dtype(cache_dtype), sharding)
    return tuple((hax.named(zeros(), axes), hax.named(zeros(), axes)) for _ in range(config.num_hidden_layers))


@functools.lru_cache(maxsize=None)
def _zeros_program(shape: tuple[int, ...], dtype, sharding):
    """One compiled program per cache shape: a new jit object per call would compile again on
    every `generate` (about 0.25 s per pass on an H100, ~19 % of a TinyLlama benchmark pass)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def init_state(slots: int, sharding) -> DecodeState:
    return _state_program(slots, sharding)()


@functools.lru_cache(maxsize=None)
def _state_program(slots: int, sharding):
    # Separate buffers: the state is donated, and one buffer cannot be donated twice.
    def make():
        def zeros():
            return jnp.zeros(slots, jnp.int32)

        return DecodeState(zeros(), zeros(), zeros(), jnp.ones(slots, bool), row_keys(0, zeros(), zeros()))

    return jax.jit(make, out_shardings=sharding)


def _constrain(tree, sharding):
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def _is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def prefill_into_slots(
    model: LlamaLM,
    caches: Caches,
    state: DecodeState,
    tokens: jax.Array,
    lengths: jax.Array,
    src: jax.Array,
    prompt_index: jax.Array,
    sample_index: jax.Array,
    *,
    spec: DecodeSpec,
):
    """Runs the prompts tokens [P, L] (right-padded; lengths [P]) once, copies each prompt's
    keys/values into every slot s with src[s] = its row (src -1: slot untouched, so n samples
    share one prefill), and samples each new slot's first token. Returns (caches, state, first
    token per slot, done per slot), the last two laid out for the host."""
    P, L = tokens.shape
    slots = src.shape[0]
    Batch, Pos = Axis("batch", P), Axis("position", L)
    positions = hax.named(jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (P, L)), (Batch, Pos))
    causal = jnp.arange(L)[None, :] <= jnp.arange(L)[:, None]
    mask = hax.named(jnp.broadcast_to(causal, (P, L, L)), (Batch, Pos, Axis("key_position", L)))
    hidden, fresh = model.forward(hax.named(tokens, (Batch, Pos)), positions, mask)

    last = hidden.rearrange(("batch", "position", "embed")).array[jnp.arange(P), lengths - 1]
    logits = model.logits(hax.named(last, (Batch, model.config.Embed))).rearrange(("batch", "vocab")).array

    is_new = src >= 0
    row = jnp.maximum(src, 0)
    dst = jnp.where(is_new, jnp.arange(slots), slots)  # out of range: dropped
    new_caches = []
    for (cache_k, cache_v), (k, v) in zip(caches, fresh):
        layer = []
        for cache, fresh_kv in ((cache_k, k), (cache_v, v)):
            values = fresh_kv.rearrange(("batch", "kv_heads", "key_position", "head_dim")).array[row]
            array = cache.array.at[dst, :, :L, :].set(values.astype(cache.dtype), mode="drop")
            layer.append(hax.named(array, cache.axes))
        new_caches.append(tuple(layer))

    keys = row_keys(spec.sampling.seed, prompt_index, sample_index)
    first = sample(logits[row], step_keys(keys, jnp.zeros(slots, jnp.int32)), spec.sampling)
    done = _is_stop(first, spec.stop_ids) | (spec.sampling.max_new_tokens <= 1)
    state = DecodeState(
        last_token=jnp.where(is_new, first, state.last_token),
        position=jnp.where(is_new, lengths[row], state.position),
        generated=jnp.where(is_new, 1, state.generated),
        done=jnp.where(is_new, done, state.done),
        keys=jnp.where(is_new, keys, state.keys),
    )
    return _finish(tuple(new_caches), state, first, spec)


def decode_chunk(model: LlamaLM, caches: Caches, state: DecodeState, kill: jax.Array, *, spec: DecodeSpec, window: int, steps: int):
    """Up to `steps` decode steps for every live slot. kill [slots] marks rows the host finished
    (stop strings). Returns (caches, state, (tokens [slots, steps], -1 where a slot produced
    nothing, done [slots])), the last two laid out for the host.

    Inside the loop the cache is read-only, cut to its first `window` positions (the host picks
    a window covering every live slot's position); each step's keys/values go to a small chunk
    buffer at the step index (the same for every row), which is scattered into the cache at each
    row's own position once, after the loop.
    """
    slots = state.done.shape[0]
    Batch, Pos = Axis("batch", slots), Axis("position", 1)
    KPos, Chunk = Axis("key_position", window), Axis("chunk", steps)
    state = state._replace(done=state.done | kill)
    start = state.position
    readonly = tuple(tuple(hax.named(c.array[:, :, :window], c.axes[:2] + (KPos,) + c.axes[3:]) for c in kv) for kv in caches)
    chunk_axes = (Batch, model.config.KVHeads, Chunk, model.config.HeadDim)
    chunk_shape = tuple(a.size for a in chunk_axes)
    cache_dtype = caches[0][0].dtype
    chunks = tuple(tuple(hax.named(jnp.zeros(chunk_shape, cache_dtype), chunk_axes) for _ in range(2)) for _ in caches)
    cache_mask = hax.named((jnp.arange(window)[None, :] < start[:, None])[:, None, :], (Batch, Pos, KPos))
    max_new = spec.sampling.max_new_tokens

    def cond(carry):
        i, _, st, _ = carry
        return (i < steps) & ~jnp.all(st.done)

    def body(carry):
        i, chunk_kv, st, out = carry
        chunk_mask = hax.named(jnp.broadcast_to(jnp.arange(steps) <= i, (slots, 1, steps)), (Batch, Pos, Chunk))
        hidden, chunk_kv = model.forward(
            hax.named(st.last_token[:, None], (Batch, Pos)),
            hax.named(st.position[:, None], (Batch, Pos)),
            (cache_mask, chunk_mask),
            tuple((k, v, ck, cv, i) for (k, v), (ck, cv) in zip(readonly, chunk_kv)),
        )
        logits = model.logits(hidden["position", 0]).rearrange(("batch", "vocab")).array
        token = sample(logits, step_keys(st.keys, st.generated), spec.sampling)
        live = ~st.done
        generated = st.generated + live
        done = st.done | (live & (_is_stop(token, spec.stop_ids) | (generated >= max_new)))
        st = DecodeState(
            last_token=jnp.where(live, token, st.last_token),
            position=st.position + live,
            generated=generated,
            done=done,
            keys=st.keys,
        )
        out = out.at[:, i].set(jnp.where(live, token, -1))
        return i + 1, chunk_kv, st, out

    out = jnp.full((slots, steps), -1, jnp.int32)
    _, chunks, state, out = jax.lax.while_loop(cond, body, (jnp.int32(0), chunks, state, out))
    # Entries past a row's last live step are garbage written beyond its valid positions, where
    # nothing is read before it is overwritten; positions past the cache are dropped.
    rows = jnp.arange(slots)[:, None]
    positions = start[:, None] + jnp.arange(steps)[None, :]
    caches = tuple(
        tuple(
            hax.named(c.array.at[rows, :, positions, :].set(jnp.swapaxes(u.array, 1, 2), mode="drop"), c.axes)
            for c, u in zip(kv, ukv)
        )
        for kv, ukv in zip(caches, chunks)
    )
    return _finish(caches, state, out, spec)


def _finish(caches: Caches, state: DecodeState, tokens: jax.Array, spec: DecodeSpec):
    host = (tokens, state.done.copy())  # a copy: the state is donated to the next call
    return _constrain(caches, spec.cache_sharding), _constrain(state, spec.batch_sharding), _constrain(host, spec.host_sharding)
