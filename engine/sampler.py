"""The per-row token choice (greedy, temperature, top-k, top-p, min-p, repetition, presence and
frequency penalties) on device.

Owns the randomness rule: row (prompt p, sample s) draws its t-th token with
`fold_in(fold_in(fold_in(key(seed), p), s), t)`, so a row's tokens do not depend on which batch,
slot or host it ran in. It does not own stop strings (the host checks those, see engine.py).

    params = SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9)
    keys = row_keys(params.seed, prompt_index, sample_index)       # [rows]
    scores = penalize(logits, params, counts, in_prompt) if penalizes(params) else logits  # [rows, vocab] each
    tokens = sample_at(scores, keys, steps, params)                 # logits [vocab, rows] -> [rows]
    logprobs = token_logprobs(logits, tokens)                       # with sampling.logprobs: [rows]
    values, ids = top_logprobs(logits, params.top_logprobs)         # with sampling.top_logprobs: [rows, k] each

A greedy choice draws nothing, so a greedy program hashes no key (`draws`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.config import SamplingParams


def row_keys(seed: int | jax.Array, prompt_index: jax.Array, sample_index: jax.Array) -> jax.Array:
    """One key per row: fold_in(fold_in(key(seed), prompt_index), sample_index)."""
    root = jax.random.key(seed)
    return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(root, p), s))(prompt_index, sample_index)


def empty_keys(rows: int) -> jax.Array:
    """Keys for empty slots, all zero bits: never drawn from (a row's prefill sets its key before
    its first draw), so none is hashed. The init program, first on every run's path, compiled in
    0.09-0.12 s instead of 0.24-0.25 with `row_keys` here (cpu-mixed-prefill, bfloat16, cold)."""
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    return jax.random.wrap_key_data(jnp.zeros((rows, *data.shape), data.dtype))


def step_keys(keys: jax.Array, steps: jax.Array) -> jax.Array:
    """The key for each row's token number `steps` (0 = the token sampled from the prefill)."""
    return jax.vmap(jax.random.fold_in)(keys, steps)


def draws(params: SamplingParams) -> bool:
    """Whether the choice draws random numbers: a greedy one does not, so its programs need no
    keys. Each fold_in lowers to a threefry hash traced anew for its shape: leaving the three of a
    greedy prefill program out took 0.1-0.2 s off a warm process's program time
    (cpu-mixed-prefill, docs/performance-notes.md)."""
    return params.temperature != 0.0


def sample_at(logits: jax.Array, keys: jax.Array, steps: jax.Array, params: SamplingParams) -> jax.Array:
    """`sample` of each row's token number `steps`, given the rows' keys (`row_keys`): the step
    keys are derived only when the choice draws."""
    if not draws(params):
        return greedy(logits)
    return sample(logits, step_keys(keys, steps), params)


def penalizes(params: SamplingParams) -> bool:
    """Whether the choice takes the tokens a row has seen into account (a repetition, presence
    or frequency penalty): its programs then carry each row's token counts (`DecodeState.counts`,
    and with a repetition penalty `DecodeState.in_prompt`)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def marks_prompts(params: SamplingParams) -> bool:
    """Whether the choice also needs each row's prompt tokens (a repetition penalty:
    `DecodeState.in_prompt`)."""
    return params.repetition_penalty != 1.0


def penalize(logits: jax.Array, params: SamplingParams, counts: jax.Array | None = None,
             in_prompt: jax.Array | None = None) -> jax.Array:
    """logits [vocab, rows] with the penalties, in float32, in vLLM's order: repetition_penalty
    over each token in the row's prompt (in_prompt [rows, vocab] bool) or completion (counts
    [rows, vocab], how often each token is in it), logits divided by it where positive and
    multiplied where not, as transformers' `RepetitionPenaltyLogitsProcessor`; then less
    frequency_penalty per occurrence in the completion and presence_penalty once, the prompt
    not counted. counts None: an empty completion (a prompt's first token)."""
    logits = logits.astype(jnp.float32)
    if marks_prompts(params):
        seen = in_prompt.T
        if counts is not None:
            seen = seen | (counts.T > 0)
        penalty = params.repetition_penalty
        logits = jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
    if counts is None:
        return logits
    counts = counts.T
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts.astype(jnp.float32)
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0).astype(jnp.float32)
    return logits


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Each row's log-probability of its token under the model: log-softmax of logits [vocab,
    rows] in float32, before temperature, top-k and top-p (`SamplingParams.logprobs`)."""
    logits = logits.astype(jnp.float32)
    return jnp.take_along_axis(logits, tokens[None, :], axis=0)[0] - jax.nn.logsumexp(logits, axis=0)


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Each row's k most probable tokens under the model, most probable first: (log-probabilities
    [rows, k] float32, ids [rows, k] int32), from logits [vocab, rows] as `token_logprobs`
    (`SamplingParams.top_logprobs`). Ties go to the lower id (`top_k`)."""
    logits = logits.astype(jnp.float32)
    values, ids = top_k(logits, k)
    return values - jax.nn.logsumexp(logits, axis=0)[:, None], ids.astype(jnp.int32)


ARGMAX_BLOCK = 128


def greedy(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the vocabulary, the first axis of logits [vocab, rows] (the first maximum),
    in two stages: the best block of ARGMAX_BLOCK entries, then the best entry in it. XLA's CPU
    argmax over a whole vocabulary is a slow serial reduction: [16, 32000] took 1.67 ms against
    0.15 ms this way (13 % of a cpu-mixed decode step)."""
    blocks = _blocks(logits, -jnp.inf)
    best = jnp.argmax(jnp.max(blocks, axis=1), axis=0)
    within = jnp.argmax(jnp.take_along_axis(blocks, best[None, None, :], axis=0)[0], axis=0)
    return (best * ARGMAX_BLOCK + within).astype(jnp.int32)


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """x [vocab, rows] as [vocab / ARGMAX_BLOCK, ARGMAX_BLOCK, rows], padded with `fill`."""
    vocab, rows = x.shape
    padded = -(-vocab // ARGMAX_BLOCK) * ARGMAX_BLOCK
    if padded != vocab:
        x = jnp.pad(x, ((0, padded - vocab), (0, 0)), constant_values=fill)
    return x.reshape(padded // ARGMAX_BLOCK, ARGMAX_BLOCK, rows)


def _last_positive(x: jax.Array) -> jax.Array:
    """Per column of x [n, rows], the index of its last entry > 0 (0 when there is none)."""
    return x.shape[0] - 1 - jnp.argmax((x > 0)[::-1], axis=0)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, a token drawn with probability proportional to weights [vocab, rows] (>= 0, not
    normalized), given one uniform u [rows] in [0, 1): the first token whose cumulative weight
    exceeds u times the row's total. A token of weight 0 is never drawn (unless all are 0: a row of
    -inf logits). Cumulated in two stages, over blocks of ARGMAX_BLOCK tokens and then within the
    chosen block: a cumulative sum over a whole vocabulary is slow on XLA's CPU backend."""
    blocks = _blocks(weights, 0.0)
    sums = jnp.sum(blocks, axis=1)  # [blocks, rows]
    totals = jnp.cumsum(sums, axis=0)
    target = u * totals[-1]
    # min(): rounding may put the target past the last block that has any weight, never beyond it.
    block = jnp.minimum(jnp.sum(totals <= target[None, :], axis=0), _last_positive(sums))
    inside = jnp.take_along_axis(blocks, block[None, None, :], axis=0)[0]  # [ARGMAX_BLOCK, rows]
    before = jnp.where(block > 0, jnp.take_along_axis(totals, jnp.maximum(block - 1, 0)[None, :], axis=0)[0], 0.0)
    within = jnp.sum(before[None, :] + jnp.cumsum(inside, axis=0) <= target[None, :], axis=0)
    return (block * ARGMAX_BLOCK + jnp.minimum(within, _last_positive(inside))).astype(jnp.int32)


def nucleus_floor(probs: jax.Array, top_p: float) -> jax.Array:
    """Per row of probs [vocab, rows] (normalized), the smallest probability in the nucleus: the
    least p such that the tokens more probable than p hold less than top_p. Found by bisection
    over the bits of a float32 (their order is the numbers' order for p >= 0), 31 masked sums
    over the vocabulary instead of a sort of it: XLA's CPU sort of [64, 32000] took 430 ms, more
    than a decode step of the tiny benchmark model 25 times over."""
    def body(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        level = jax.lax.bitcast_convert_type(middle, jnp.float32)
        inside = jnp.sum(jnp.where(probs > level[None, :], probs, 0.0), axis=0) < top_p
        return jnp.where(inside, low, middle + 1), jnp.where(inside, middle, high)

    rows = probs.shape[1]
    one = jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32)
    bounds = (jnp.zeros(rows, jnp.int32), jnp.full(rows, one, jnp.int32))
    _, high = jax.lax.fori_loop(0, 31, body, bounds, unroll=True)
    return jax.lax.bitcast_convert_type(high, jnp.float32)


def top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k of each row of scores [vocab, rows] (vocabulary first): (values, indices), each
    [rows, k], largest first, the lower index first among equals: exactly what lax.top_k of
    scores.T gives. When k is small beside the vocabulary, it takes the k blocks of ARGMAX_BLOCK
    entries with the best maxima (the lower block first among equals), which hold every entry
    of the top k, and runs lax.top_k over those only, in block order so that ties resolve as
    they would over the whole row. On the CPU lax.top_k of [64, 32000] with k = 50 took 4 ms."""
    vocab, rows = scores.shape
    if k * ARGMAX_BLOCK >= vocab:  # k blocks would cover the vocabulary (k beyond the block count included)
        return jax.lax.top_k(scores.T, k)
    blocks = _blocks(scores, -jnp.inf)  # the padding is -inf after every entry: it never wins a tie
    _, chosen = jax.lax.top_k(jnp.max(blocks, axis=1).T, k)  # [rows, k]
    chosen = jnp.sort(chosen, axis=1)
    candidates = jnp.take_along_axis(blocks, chosen.T[:, None, :], axis=0)  # [k, ARGMAX_BLOCK, rows]
    values, where = jax.lax.top_k(candidates.transpose(2, 0, 1).reshape(rows, k * ARGMAX_BLOCK), k)
    block = jnp.take_along_axis(chosen, where // ARGMAX_BLOCK, axis=1)
    return values, block * ARGMAX_BLOCK + where % ARGMAX_BLOCK


def sample(logits: jax.Array, keys: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [vocab, rows] float32 (vocabulary first, as `LlamaLM.logits` computes them fastest)
    -> token ids [rows] int32. Branches only on static params.

    Without top_k, a row draws one uniform number and takes the token where it falls in the
    cumulative distribution (`inverse_cdf`), over the whole vocabulary or over the nucleus
    (`nucleus_floor`; tokens tied with its least probable one are all kept). With top_k, its k
    best tokens (`top_k`) are cut by top_p in order and drawn with Gumbel noise. min_p then
    drops the tokens less than min_p times as probable as the row's best, as transformers'
    `MinPLogitsWarper` does after its top-k and top-p. On the CPU
    the Gumbel draw over a whole vocabulary ([64, 32000]) took 30 ms and top_p's sort 430 ms,
    against 1-7 ms this way."""
    if not draws(params):
        return greedy(logits)
    if params.top_k == 0:
        top = jnp.max(logits, axis=0)
        weights = jnp.exp((logits - jnp.where(jnp.isfinite(top), top, 0.0)[None, :]) / params.temperature)
        if params.top_p < 1.0:
            probs = weights / jnp.sum(weights, axis=0)[None, :]
            weights = jnp.where(probs >= nucleus_floor(probs, params.top_p)[None, :], probs, 0.0)
        if params.min_p > 0.0:  # weights are relative to the best token's (1, or its probability)
            weights = jnp.where(weights >= params.min_p * jnp.max(weights, axis=0)[None, :], weights, 0.0)
        return inverse_cdf(weights, jax.vmap(lambda key: jax.random.uniform(key, ()))(keys))
    values, indices = top_k(logits / params.temperature, min(params.top_k, logits.shape[0]))  # most likely first
    if params.top_p < 1.0:
        probs = jax.nn.softmax(values, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        values = jnp.where(mass_before < params.top_p, values, -jnp.inf)  # the first always stays
    if params.min_p > 0.0:
        values = jnp.where(values >= values[:, :1] + jnp.log(params.min_p), values, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, values)
    return jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
