"""The compiled programs of generation: a prefill chunk written into the cache, and a chunk of decode steps.

Owns: the device-side decode state (one slot per row being generated), the preallocated KV
cache (`KVCache`: per layer a `PagedKV` of keys and values (batch, kv_heads, key_position,
head_dim) split along key_position into four page buffers, written in place and never
copied), and the on-device stop rule (EOS / stop token ids / max_new_tokens). The host
(engine.py) decides which rows go to which slots and when; it does not own stop strings or
scheduling.

    cache = new_cache(config, slots, spec.cache_ends(seq_len), cache_dtype)  # compiled with spec.cache_sharding
    state = new_state(slots)
    cache, state, (first, done, logprobs) = prefill_chunk(model, cache, state, tokens, slots, starts, offsets,
                                                          lengths, is_last, prompt_index, sample_index, spec=spec,
                                                          fresh=True)
    cache, state, (out, done, logprobs) = decode_chunk(model, cache, state, kill, spec=spec, steps=16)

Every program's shapes come from the engine's config alone (slots, cache length, the prefill
chunk's rows x tokens, decode steps), never from the prompts: a run compiles the same few
programs whatever its mix of prompt lengths (issue 13: 24 programs for 240 mixed prompts before).

- A prefill call runs `R` rows of `C` tokens, each the next chunk of a prompt (a longer prompt
  takes several chunks, each attending to what the previous ones wrote, gathered from the start
  of its cache row; later chunks of one prompt may share a call, as every layer writes all rows'
  keys/values before any row attends; a first chunk attends to itself only), writing their
  keys/values straight into the cache rows of the prompt's samples, and samples the first token
  of every prompt whose chunk ends it. With the CPU kernel the call is packed instead: its R x C
  tokens hold pieces of up to R prompts end to end, no row padded at a prompt's end.
- A decode chunk runs up to `steps` tokens in one `lax.while_loop` (no Python per token), stopping
  early when every slot is done. It attends over the cache where it lives, masked by each row's
  position: only over the first of its four pages (`cache_pages`: quarters) that hold every live
  row, plus a small buffer of the chunk's own keys/values, scattered into the cache once after the
  loop. With a kernel (the CPU's, or on a GPU Pallas') each step writes into the cache's one page
  instead, carried through the loop, and the kernel reads each row to its length
  (`DecodeSpec.decode_in_place`). No
  window of the cache is copied (before issue 13 a per-chunk copy of a window doubled
  the GPU peak).
- With prefill beside decoding (`engine.overlap_prefill`), prompts are prefilled into a staging
  cache of a few slots, and `adopt_rows` moves their whole rows and decode state into free slots
  of the decode cache between decode calls.
- How many pages a call reads is chosen on the device, by a `lax.switch` inside the one program:
  the choice adds no programs (a decode chunk: 1-4 pages; a prefill chunk: the first or all).
  With a kernel that reads each row to its own length (`engine.decode_attention: cpu`) the cache
  is one page and there is no switch: one kernel call a layer, one branch to trace and compile;
  a prefill chunk on one device likewise, the kernel reading its prompts' cache rows in place,
  causally, once the chunk is written there.

Both return what the host reads back (`HostOut`: new tokens, done flags and, with
`sampling.logprobs` and `sampling.top_logprobs`, the tokens' log-probabilities and their
alternatives) as separate arrays laid out by
`spec.host_sharding`: on a global mesh they are replicated, so every host holds a copy.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from engine import cpu_attention
from engine.config import SamplingParams
from engine.jax_compat import hax
from engine.kernels import KernelTuning, reads_in_place
from engine.llama import (
    DecodeStep, LayerKV, LlamaConfig, LlamaLM, PagedKV, PrefillChunk, PrefillSegments, by_pages, cache_pages, page_spans,
    set_rows,
)
from engine.sampler import (
    draws, empty_keys, marks_prompts, penalize, penalizes, row_keys, sample_at, token_logprobs, top_logprobs,
)


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
    attention: str = "xla"
    """Decode attention: xla, pallas or cpu (`engine.decode_attention`, resolved by engine/kernels.py)."""
    kernel: KernelTuning = KernelTuning()
    """With pallas, how the kernel reads the cache's pages (`engine.kernels.TUNING`)."""

    def cache_ends(self, seq_len: int) -> tuple[int, ...]:
        """Where the cache's pages end (`new_cache`), for `seq_len` positions."""
        return cache_ends(self.attention, seq_len, self.kernel)

    @property
    def decode_in_place(self) -> bool:
        """Decode steps write their keys/values into the cache's one page, carried through the
        loop, and the kernel attends over it (`_decode_in_place`): the CPU kernel's way, and the
        Pallas kernel's unless `KernelTuning.in_place` is 0."""
        return self.attention == "cpu" or (self.attention == "pallas" and bool(self.kernel.in_place))

    @property
    def prefill_in_place(self) -> bool:
        """Prefill chunks attend through the CPU kernel, their prompts' cache rows read in place
        once the chunk is written (`engine.kernels.reads_in_place`). A first chunk then runs the
        later chunks' program: it reads only its own positions there (`prefill_chunk`)."""
        return reads_in_place(self.attention, len(self.cache_sharding.device_set))


def cache_ends(attention: str, seq_len: int, kernel: KernelTuning) -> tuple[int, ...]:
    """Where the cache's pages end along key positions (`cache_pages`): quarters of multiples of
    16 positions for the engine's own attention. With cpu one page: the C++ kernel reads each row
    to its own length wherever it lives, so more pages only add calls, and the parts combined
    after them (one call and two parts a layer compile in a third less time than four calls and
    five parts: docs/performance-notes.md; over several devices a later prefill chunk, attended the
    XLA way, then reads its rows whole). With pallas, `kernel.pages` pages, each a multiple of
    the longest block the kernel may read (up to `kernel.max_block_k`; no longer than a page),
    the cache rounded up to it, so that the kernel reads every page in blocks that long: up to a
    block - 1 more positions per row, never written nor read."""
    if attention == "cpu":
        return (seq_len,)
    if attention != "pallas":
        return cache_pages(seq_len)
    share = -(-seq_len // kernel.pages)
    block = max(16, min(kernel.max_block_k, 1 << (share.bit_length() - 1)))
    return cache_pages(-(-seq_len // block) * block, block, kernel.pages)


class KVCache(NamedTuple):
    """The decode cache: one PagedKV per layer, its pages (batch = slots, kv_heads, key_position, head_dim)."""

    layers: tuple[PagedKV, ...]

    @property
    def ends(self) -> tuple[int, ...]:
        return self.layers[0].ends

    @property
    def seq_len(self) -> int:
        return self.ends[-1]

    @property
    def slots(self) -> int:
        return self.layers[0].pages[0].k.resolve_axis("batch").size


class DecodeState(NamedTuple):
    last_token: jax.Array  # [slots] int32: the newest token, not yet in the cache
    position: jax.Array  # [slots] int32: where last_token's key/value will be written
    generated: jax.Array  # [slots] int32: tokens generated so far, last_token included
    done: jax.Array  # [slots] bool: finished or empty slot
    keys: jax.Array  # [slots] PRNG keys, one per (prompt, sample) row
    counts: jax.Array | None = None
    """With a penalty (`sampler.penalizes`), [slots, vocab] int32: how often each token is in the
    row's completion before last_token; else None."""
    in_prompt: jax.Array | None = None
    """With a repetition penalty, [slots, vocab] bool: the tokens of the row's prompt; else None."""


class HostOut(NamedTuple):
    """What a program gives the host, laid out by `spec.host_sharding`."""

    tokens: jax.Array
    """New tokens: [slots] from a prefill call, [slots, steps] from a decode chunk; -1 where none."""
    done: jax.Array
    """[slots]: the slot's row is done (the device's stop rule, or killed by the host)."""
    logprobs: jax.Array | None
    """With `sampling.logprobs`: each new token's log-probability (`token_logprobs`), float32,
    shaped as tokens (0 where none); else None, and the programs compute none."""
    prompt_logprobs: jax.Array | None = None
    """From a prefill call with `sampling.prompt_logprobs`: [R x C], at each of the call's
    positions the log-probability of its target (the prompt's next token; 0 where none); else None."""
    top_logprobs: jax.Array | None = None
    """With `sampling.top_logprobs` = k: at each new token's position the k most probable tokens'
    log-probabilities (`sampler.top_logprobs`), shaped as tokens + [k] (0 where none); else None."""
    top_ids: jax.Array | None = None
    """Their ids, as top_logprobs (-1 where none)."""


class NewTokens(NamedTuple):
    """A call's new tokens and what the sampling asks of them, laid out as `HostOut`'s fields of
    the same names (None where not asked for): [slots] from a prefill call, [slots, steps] from a
    decode chunk, which fills them a column a step."""

    tokens: jax.Array
    logprobs: jax.Array | None
    top_logprobs: jax.Array | None
    top_ids: jax.Array | None

    @classmethod
    def at(cls, live: jax.Array, tokens: jax.Array, logits: jax.Array, spec: "DecodeSpec") -> "NewTokens":
        """Each live row's token, from logits [vocab, rows]; -1, 0 (or None) where not live."""
        logprobs = _where(live, token_logprobs(logits, tokens)) if spec.sampling.logprobs else None
        top_values = top_ids = None
        if spec.sampling.top_logprobs:
            values, ids = top_logprobs(logits, spec.sampling.top_logprobs)
            top_values, top_ids = jnp.where(live[:, None], values, 0.0), jnp.where(live[:, None], ids, -1)
        return cls(jnp.where(live, tokens, -1), logprobs, top_values, top_ids)


def new_cache(config: LlamaConfig, slots: int, ends: tuple[int, ...], cache_dtype) -> KVCache:
    """Zeros, in pages ending at `ends` (`DecodeSpec.cache_ends`); meant to be compiled with the
    cache's output sharding, so each device (of every host on a global mesh) allocates only its
    own block."""
    lengths = [end - start for start, end in page_spans(ends)]

    def zeros(length: int):
        axes = (Axis("batch", slots), config.KVHeads, Axis("key_position", length), config.HeadDim)
        return hax.named(jnp.zeros(tuple(a.size for a in axes), cache_dtype), axes)

    def layer():
        return PagedKV(tuple(LayerKV(zeros(n), zeros(n)) for n in lengths))

    return KVCache(tuple(layer() for _ in range(config.num_hidden_layers)))


def new_state(slots: int, vocab: int = 0, sampling: SamplingParams | None = None) -> DecodeState:
    """Every slot empty (done); with a penalty in `sampling`, each row's token counts over the
    vocabulary, and with a repetition penalty its prompt's tokens too. Separate buffers: the
    state is donated, and one buffer cannot be donated twice."""

    def zeros():
        return jnp.zeros(slots, jnp.int32)

    counts = jnp.zeros((slots, vocab), jnp.int32) if sampling is not None and penalizes(sampling) else None
    prompt = jnp.zeros((slots, vocab), bool) if sampling is not None and marks_prompts(sampling) else None
    return DecodeState(zeros(), zeros(), zeros(), jnp.ones(slots, bool), empty_keys(slots), counts, prompt)


def _constrain(tree, sharding):
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def _is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def _hold_stops(scores: jax.Array, generated: jax.Array, spec: DecodeSpec) -> jax.Array:
    """scores [vocab, rows] with the stop tokens (EOS and stop_token_ids) out of reach (-inf) in
    the rows whose completions hold fewer than `sampling.min_new_tokens` tokens (generated
    [rows]), as transformers' `MinNewTokensLengthLogitsProcessor` does."""
    if not spec.sampling.min_new_tokens or not spec.stop_ids:
        return scores
    stop = jnp.zeros(scores.shape[0], bool).at[jnp.asarray(spec.stop_ids, jnp.int32)].set(True, mode="drop")
    early = generated < spec.sampling.min_new_tokens
    return jnp.where(stop[:, None] & early[None, :], -jnp.inf, scores)


def prefill_chunk(
    model: LlamaLM,
    cache: KVCache,
    state: DecodeState,
    tokens: jax.Array,
    slots: jax.Array,
    starts: jax.Array,
    offsets: jax.Array,
    lengths: jax.Array,
    is_last: jax.Array,
    prompt_index: jax.Array,
    sample_index: jax.Array,
    targets: jax.Array | None = None,
    *,
    spec: DecodeSpec,
    fresh: bool,
):
    """One prefill call: tokens [R, C], read row-major as one row of R x C, hold up to S pieces of
    prompts (segments): piece s is the lengths [S] tokens from offsets [S], its prompt's tokens
    from position starts [S] on (length 0: no piece); slots [S, n]: the cache rows of the prompt's
    samples (out of range = none); is_last [S]: the piece ends the prompt, so its first token is
    sampled into each of its slots, with the randomness of (prompt_index [S], sample_index
    [S, n]). With `spec.prefill_in_place` (the CPU kernel) pieces go anywhere, several prompts in a
    row, one row's end running on into the next: each piece attends to its cache row in place,
    each token up to itself, the piece written there first (one kernel call a layer; first and
    later pieces in one program). Otherwise piece r is row r (offsets r x C, S = R): fresh, every
    piece starts its prompt (the call attends to itself only, no cache row is read; the host
    never mixes first and later chunks in one call, so a prompt's numerics do not depend on its
    neighbours); else the call attends to the first pages of its cache rows covering every
    piece and to itself. targets [R, C], with `sampling.prompt_logprobs` (else None): the prompt's
    token after each position, -1 where none (`_prompt_logprobs`). Returns (cache, state,
    HostOut: first token per slot, -1 where none; done per slot; the token's log-probability;
    each position's target's log-probability)."""
    R, C = tokens.shape
    S, n = slots.shape
    num_slots, seq_len = cache.slots, cache.seq_len
    Batch, Pos = Axis("batch", R), Axis("position", C)
    # Each token's piece: `inside` [R x C, S] is True at most once per token.
    flat = jnp.arange(R * C, dtype=jnp.int32)
    inside = (flat[:, None] >= offsets[None, :]) & (flat[:, None] < (offsets + lengths)[None, :])
    piece, valid = jnp.argmax(inside, axis=1), jnp.any(inside, axis=1)
    positions = jnp.where(valid, starts[piece] + flat - offsets[piece], 0).reshape(R, C)
    write_positions = jnp.where(valid.reshape(R, C), positions, seq_len)  # out of range: dropped
    write_rows = jnp.where(valid[:, None], slots[piece], num_slots).reshape(R, C, n)
    segments = PrefillSegments(slots, starts, offsets, lengths)
    reach = jnp.max(starts + lengths)
    attention = "cpu" if spec.prefill_in_place else "xla"
    contexts = tuple(PrefillChunk(kv, write_rows, positions, write_positions, segments, reach, fresh, attention)
                     for kv in cache.layers)
    hidden, layers = model.forward(hax.named(tokens, (Batch, Pos)), hax.named(positions, (Batch, Pos)), contexts)

    ends = jnp.maximum(offsets + lengths - 1, 0)  # each piece's last token, row-major
    flat = hidden.rearrange(("embed", "batch", "position")).array.reshape(-1, R * C)  # [embed, R x C]
    logits = model.logits(hax.named(flat[:, ends], (model.config.Embed, Axis("batch", S)))).rearrange(("vocab", "batch")).array

    # Each (piece, sample) pair j = s * n + i that starts decoding now, and which slot it fills.
    flat_slots = jnp.where(jnp.repeat(is_last, n), slots.reshape(-1), num_slots)
    source = jnp.full(num_slots, -1, jnp.int32).at[flat_slots].set(jnp.arange(S * n, dtype=jnp.int32), mode="drop")
    is_new = source >= 0
    j = jnp.maximum(source, 0)
    # Each pair draws its first token over its row's logits with its own key. Drawn per pair and
    # given to the slots, or per slot where the lane has fewer slots than the call has pairs: the
    # same tokens either way (each column is drawn alone), over the fewer columns. A greedy call
    # of 16 rows in a lane of 32 took its best tokens over 16 columns instead of a gathered 32
    # (the prefill-heavy run's prefill 2-4 % less).
    if draws(spec.sampling):
        pair_keys = row_keys(spec.sampling.seed, jnp.repeat(prompt_index, n), sample_index.reshape(-1))
    else:  # a greedy choice draws nothing: no key is hashed (sampler.draws)
        pair_keys = empty_keys(S * n)
    pair_logits = jnp.repeat(logits, n, axis=1)
    in_prompt = state.in_prompt
    if in_prompt is not None:  # the repetition penalty: the tokens of each slot's prompt so far, this call's too
        began = jnp.where(((starts == 0) & (lengths > 0))[:, None], slots, num_slots).reshape(-1)
        in_prompt = in_prompt.at[began].set(False, mode="drop")  # a prompt's first piece: a new row
        in_prompt = in_prompt.at[write_rows.reshape(-1), jnp.repeat(tokens.reshape(-1), n)].set(True, mode="drop")

    def first_tokens(scores: jax.Array, prompts: jax.Array | None, keys: jax.Array) -> jax.Array:
        """Each column's first token: over its prompt's tokens' repetition penalty, stop tokens
        held back by min_new_tokens (none generated yet)."""
        none_yet = jnp.zeros(scores.shape[1], jnp.int32)
        if prompts is not None:
            scores = penalize(scores, spec.sampling, in_prompt=prompts)
        return sample_at(_hold_stops(scores, none_yet, spec), keys, none_yet, spec.sampling)

    if S * n <= num_slots:  # of the pairs, only those whose prompt ends here are kept: their slots are in range
        pair_prompts = None if in_prompt is None else in_prompt[jnp.minimum(flat_slots, num_slots - 1)]
        first = first_tokens(pair_logits, pair_prompts, pair_keys)[j]
    else:
        first = first_tokens(pair_logits[:, j], in_prompt, pair_keys[j])
    keys = pair_keys[j]
    done = _is_stop(first, spec.stop_ids) | (spec.sampling.max_new_tokens <= 1)
    state = DecodeState(
        last_token=jnp.where(is_new, first, state.last_token),
        position=jnp.where(is_new, jnp.repeat(starts + lengths, n)[j], state.position),
        generated=jnp.where(is_new, 1, state.generated),
        done=jnp.where(is_new, done, state.done),
        keys=jnp.where(is_new, keys, state.keys),
        # A new row's completion holds only its first token, last_token: nothing counted yet.
        counts=None if state.counts is None else jnp.where(is_new[:, None], 0, state.counts),
        in_prompt=in_prompt,
    )
    prompt_logprobs = None if targets is None else _prompt_logprobs(model, flat, targets.reshape(-1))
    return _finish(KVCache(tuple(layers)), state, NewTokens.at(is_new, first, logits[:, j // n], spec), spec,
                   prompt_logprobs)


PROMPT_LOGPROB_BLOCK = 256
"""Positions whose logits `_prompt_logprobs` holds at once: [vocab, 256] float32 is 33 MB at a
vocabulary of 32k, 131 MB at 128k (`memory.prefill_working_bytes`)."""


def _prompt_logprobs(model: LlamaLM, flat: jax.Array, targets: jax.Array) -> jax.Array:
    """Each position's log-probability of its target token (targets [T], -1: none, given 0),
    from the call's final hidden states flat [embed, T]: the LM head over PROMPT_LOGPROB_BLOCK
    positions at a time, never the whole call's logits."""
    Embed = model.config.Embed
    total = flat.shape[1]
    block = min(total, PROMPT_LOGPROB_BLOCK)
    blocks = -(-total // block)
    flat = jnp.pad(flat, ((0, 0), (0, blocks * block - total)))
    targets = jnp.pad(targets, (0, blocks * block - total), constant_values=-1)

    def one(block_of):
        states, wanted = block_of  # [embed, block], [block]
        logits = model.logits(hax.named(states, (Embed, Axis("batch", block)))).rearrange(("vocab", "batch")).array
        return jnp.where(wanted >= 0, token_logprobs(logits, jnp.maximum(wanted, 0)), 0.0)

    out = jax.lax.map(one, (flat.reshape(Embed.size, blocks, block).transpose(1, 0, 2), targets.reshape(blocks, block)))
    return out.reshape(-1)[:total]


def decode_chunk(model: LlamaLM, cache: KVCache, state: DecodeState, kill: jax.Array, *, spec: DecodeSpec, steps: int):
    """Up to `steps` decode steps for every live slot. kill [slots] marks rows the host finished
    (stop strings). Returns (cache, state, HostOut: tokens [slots, steps], -1 where a slot
    produced nothing; done [slots]; the tokens' log-probabilities).

    Inside the loop the cache is only read, where it lives, masked to each row's positions
    written before this chunk: only the first pages that hold every live row (`by_pages`). Each
    step's keys/values go to a small chunk buffer at the step index (the same for every row),
    which is scattered into the cache at each row's own position once, after the loop (a scatter
    inside the loop made XLA copy the cache every step).

    With the CPU kernel, or Pallas' (unless tuned otherwise: `DecodeSpec.decode_in_place`), and a
    one-page cache, the cache is carried through the loop instead and each step writes into it
    (`_decode_in_place`).
    """
    slots, seq_len = cache.slots, cache.seq_len
    state = state._replace(done=state.done | kill)
    if spec.decode_in_place and len(cache.ends) == 1:
        cache, state, out = _decode_in_place(model, cache, state, spec=spec, steps=steps)
        return _finish(cache, state, out, spec)
    start = state.position
    was_live = ~state.done

    def run(count: int):
        return _decode_loop(model, cache, count, state, spec=spec, steps=steps)

    chunks, state, out = by_pages(jnp.max(jnp.where(was_live, start, 0)), cache.ends, run)
    # Entries past a row's last live step are garbage written beyond its valid positions, where
    # nothing is read before it is overwritten; rows idle for the whole chunk (a slot being
    # prefilled, or empty) write nothing; positions past the cache are dropped.
    rows = jnp.arange(slots)[:, None]
    positions = jnp.where(was_live, start, seq_len)[:, None] + jnp.arange(steps)[None, :]
    layers = tuple(kv.write(rows, positions, jnp.swapaxes(ckv.k.array, 1, 2), jnp.swapaxes(ckv.v.array, 1, 2))
                   for kv, ckv in zip(cache.layers, chunks))
    return _finish(KVCache(layers), state, out, spec)


def _decode_loop(model: LlamaLM, cache: KVCache, count: int, state: DecodeState, *, spec: DecodeSpec, steps: int):
    """The decode steps of one chunk over the first `count` pages of `cache` (read only), as one
    lax.while_loop that stops early once every slot is done. Returns (the chunk's keys/values
    per layer, state, NewTokens [slots, steps])."""
    slots = cache.slots
    Batch, Pos, Chunk = Axis("batch", slots), Axis("position", 1), Axis("chunk", steps)
    masks = page_masks(cache.ends, count, state.position)
    chunk_axes = (Batch, model.config.KVHeads, Chunk, model.config.HeadDim)
    chunk_shape = tuple(a.size for a in chunk_axes)
    cache_dtype = cpu_attention.value_dtype(cache.layers[0].pages[0].k.dtype)  # the buffer holds values: bfloat16, not its bits
    chunks = tuple(LayerKV(*(hax.named(jnp.zeros(chunk_shape, cache_dtype), chunk_axes) for _ in range(2))) for _ in cache.layers)

    def body(carry):
        i, chunk_kv, st, out = carry
        chunk_mask = hax.named(jnp.broadcast_to(jnp.arange(steps) <= i, (slots, 1, steps)), (Batch, Pos, Chunk))
        contexts = tuple(DecodeStep(kv.pages[:count], ckv, i, masks, chunk_mask, state.position, spec.attention,
                                    spec.cache_sharding, spec.kernel)
                         for kv, ckv in zip(cache.layers, chunk_kv))
        st, out, chunk_kv = _step(model, st, out, i, contexts, spec)
        return i + 1, chunk_kv, st, out

    out = _new_out(slots, steps, spec)
    _, chunks, state, out = jax.lax.while_loop(_running(steps), body, (jnp.int32(0), chunks, state, out))
    return chunks, state, out


def page_masks(ends: tuple[int, ...], count: int, position: jax.Array) -> tuple[NamedArray, ...]:
    """Per page of the first `count` of the cache's pages (ending at `ends`), (batch, position,
    key_position): True where the row has written that position, before `position` [batch]."""
    Batch, Pos = Axis("batch", position.shape[0]), Axis("position", 1)
    masks = []
    for start, end in page_spans(ends)[:count]:
        written = start + jnp.arange(end - start)[None, :] < position[:, None]
        masks.append(hax.named(written[:, None, :], (Batch, Pos, Axis("key_position", end - start))))
    return tuple(masks)


def _decode_in_place(model: LlamaLM, cache: KVCache, state: DecodeState, *, spec: DecodeSpec, steps: int):
    """The decode steps of one chunk over a one-page cache read by a kernel (`decode_in_place`):
    the cache is carried through the lax.while_loop, each step writes its keys/values at each
    live row's position and attends over the page to that row's length (no chunk buffer, no
    scatter after the loop, no branch per page count). Returns (cache, state, NewTokens [slots,
    steps])."""
    seq_len = cache.seq_len

    def body(carry):
        i, pages, st, out = carry
        write_at = jnp.where(st.done, seq_len, st.position)  # past the cache: dropped
        contexts = tuple(DecodeStep((page,), None, i, (), None, write_at, spec.attention, spec.cache_sharding, spec.kernel)
                         for page in pages)
        st, out, pages = _step(model, st, out, i, contexts, spec)
        return i + 1, pages, st, out

    out = _new_out(cache.slots, steps, spec)
    pages = tuple(kv.pages[0] for kv in cache.layers)
    _, pages, state, out = jax.lax.while_loop(_running(steps), body, (jnp.int32(0), pages, state, out))
    return KVCache(tuple(PagedKV((page,)) for page in pages)), state, out


def _new_out(slots: int, steps: int, spec: DecodeSpec) -> NewTokens:
    """A decode chunk's new tokens before its first step: -1 and 0 (or None where not asked for)."""
    k = spec.sampling.top_logprobs
    return NewTokens(jnp.full((slots, steps), -1, jnp.int32),
                     jnp.zeros((slots, steps), jnp.float32) if spec.sampling.logprobs else None,
                     jnp.zeros((slots, steps, k), jnp.float32) if k else None,
                     jnp.full((slots, steps, k), -1, jnp.int32) if k else None)


def _where(live: jax.Array, values: jax.Array | None) -> jax.Array | None:
    """values where live, else 0; None stays None (no log-probabilities asked for)."""
    return None if values is None else jnp.where(live, values, 0.0)


def _running(steps: int):
    """A decode loop's condition: steps left and a live slot."""
    def cond(carry):
        i, _, st, _ = carry
        return (i < steps) & ~jnp.all(st.done)
    return cond


def _step(model: LlamaLM, st: DecodeState, out: NewTokens, i: jax.Array, contexts, spec: DecodeSpec):
    """One decode step of every slot at loop index i: the model over each slot's last token,
    a sampled token for each live slot (and its log-probability), its stop rule. Returns (state,
    out (`_new_out`) with column i, each layer's keys/values as its attention returned them)."""
    slots = st.done.shape[0]
    Batch, Pos = Axis("batch", slots), Axis("position", 1)
    hidden, kvs = model.forward(
        hax.named(st.last_token[:, None], (Batch, Pos)), hax.named(st.position[:, None], (Batch, Pos)), contexts,
    )
    logits = model.logits(hidden["position", 0]).rearrange(("vocab", "batch")).array
    live = ~st.done
    counts, scores = st.counts, logits
    if counts is not None:  # the penalties: last_token joins the counts, and the choice sees them
        counts = counts.at[jnp.arange(slots), st.last_token].add(live.astype(jnp.int32))
        scores = penalize(logits, spec.sampling, counts, st.in_prompt)
    token = sample_at(_hold_stops(scores, st.generated, spec), st.keys, st.generated, spec.sampling)
    generated = st.generated + live
    done = st.done | (live & (_is_stop(token, spec.stop_ids) | (generated >= spec.sampling.max_new_tokens)))
    st = DecodeState(
        last_token=jnp.where(live, token, st.last_token),
        position=st.position + live,
        generated=generated,
        done=done,
        keys=st.keys,
        counts=counts,
        in_prompt=st.in_prompt,
    )
    column = NewTokens.at(live, token, logits, spec)
    out = NewTokens(*(None if a is None else a.at[:, i].set(c) for a, c in zip(out, column)))
    return st, out, kvs


def adopt_rows(model: LlamaLM, cache: KVCache, state: DecodeState, staged: KVCache, staged_state: DecodeState,
               to: jax.Array, *, spec: DecodeSpec):
    """Moves prefilled rows from a staging cache into the decode cache: staging slot i's keys and
    values (every page, whole rows) and decode state go to slot to[i] (out of range: none).
    `model` is unused (every program takes it first). Returns (cache, state, HostOut: no tokens, done)
    like the other programs."""
    del model

    # Leaf by leaf: the two caches differ in their batch axis, so their trees do not match.
    leaves, treedef = jax.tree.flatten(cache)
    cache = jax.tree.unflatten(treedef, [set_rows(a, to, b) for a, b in zip(leaves, jax.tree.leaves(staged))])
    state = jax.tree.map(lambda into, rows: set_rows(into, to, rows), state, staged_state)
    return _finish(cache, state, NewTokens(jnp.full((cache.slots, 0), -1, jnp.int32), None, None, None), spec)


def _finish(cache: KVCache, state: DecodeState, new: NewTokens, spec: DecodeSpec, prompt_logprobs: jax.Array | None = None):
    host = HostOut(new.tokens, state.done.copy(), new.logprobs, prompt_logprobs,  # done: a copy, the state is donated to the next call
                   new.top_logprobs, new.top_ids)
    return _constrain(cache, spec.cache_sharding), _constrain(state, spec.batch_sharding), _constrain(host, spec.host_sharding)
