"""The token choice on its own (engine/sampler.py): logits come vocabulary first, [vocab, rows],
as the LM head computes them. Greedy is numpy's argmax (the first maximum) whatever the
vocabulary size; the sampling filters keep what they promise; a row's token depends on its own
logits and key only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import SamplingParams
from engine.sampler import greedy, inverse_cdf, row_keys, sample, sample_at, step_keys, top_k


def _keys(rows: int, seed: int = 0):
    return step_keys(row_keys(seed, jnp.arange(rows), jnp.zeros(rows, jnp.int32)), jnp.zeros(rows, jnp.int32))


@pytest.mark.parametrize("vocab", [32000, 130, 5])
def test_greedy_is_the_first_maximum_of_each_row(vocab):
    """130 and 5 are not multiples of the 128-entry blocks greedy reduces in: padding must never win."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((vocab, 6)).astype(np.float32)
    logits[:, 1] = -np.inf  # every entry -inf: numpy says 0
    logits[[vocab - 1, 2 % vocab], 2] = 50.0  # a tie: the lower index wins
    logits[vocab - 1, 3] = 60.0  # the best is the last entry, beside the padding
    logits[:, 4] = logits[0, 4]  # all equal
    assert np.asarray(greedy(jnp.asarray(logits))).tolist() == np.argmax(logits, axis=0).tolist()


def test_top_k_1_and_a_tiny_top_p_always_take_the_best_token():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((300, 64)).astype(np.float32) * 3)
    best = np.argmax(np.asarray(logits), axis=0)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        assert np.asarray(sample(logits, _keys(64), params)).tolist() == best.tolist(), params


def test_temperature_sampling_follows_the_softmax_and_top_k_cuts_the_tail():
    """Three tokens at probability 0.6 / 0.3 / 0.1 (at temperature 1), 4,000 rows, each its own key."""
    rows = 4000
    probs = np.array([0.6, 0.3, 0.1])
    logits = np.full((50, rows), -np.inf, np.float32)
    logits[[7, 20, 33], :] = np.log(probs)[:, None]
    logits = jnp.asarray(logits)
    drawn = np.asarray(sample(logits, _keys(rows), SamplingParams(temperature=1.0)))
    counts = np.array([(drawn == t).mean() for t in (7, 20, 33)])
    assert counts.sum() == 1.0 and np.abs(counts - probs).max() < 0.03, counts
    top2 = np.asarray(sample(logits, _keys(rows, seed=1), SamplingParams(temperature=1.0, top_k=2)))
    assert set(top2.tolist()) == {7, 20} and abs((top2 == 7).mean() - 2 / 3) < 0.03


def test_a_rows_token_depends_on_its_own_logits_and_key_only():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((1000, 16)).astype(np.float32)
    keys = _keys(16, seed=5)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    tokens = np.asarray(sample(jnp.asarray(logits), keys, params))
    order = rng.permutation(16)
    shuffled = np.asarray(sample(jnp.asarray(logits[:, order]), keys[order], params))
    assert shuffled.tolist() == tokens[order].tolist()
    assert len(set(tokens.tolist())) > 8  # not a constant


def test_sample_at_hashes_keys_only_when_it_draws():
    """A row's token number t draws with fold_in(its row key, t); a greedy choice traces no
    fold_in at all (each is a threefry hash to trace, and to lower where its key is kept:
    program time on every run)."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((500, 8)).astype(np.float32))
    keys = row_keys(3, jnp.arange(8), jnp.zeros(8, jnp.int32))
    steps = jnp.arange(8, dtype=jnp.int32) * 5
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    assert (np.asarray(sample_at(logits, keys, steps, sampled)).tolist()
            == np.asarray(sample(logits, step_keys(keys, steps), sampled)).tolist())
    greedy_params = SamplingParams()
    assert np.asarray(sample_at(logits, keys, steps, greedy_params)).tolist() == np.argmax(np.asarray(logits), axis=0).tolist()
    traced = {name: str(jax.make_jaxpr(lambda x, k, t, p=p: sample_at(x, k, t, p))(logits, keys, steps))
              for name, p in (("greedy", greedy_params), ("sampled", sampled))}
    assert "random_fold_in" in traced["sampled"] and "random_fold_in" not in traced["greedy"]


def _drawn(logits: np.ndarray, params: SamplingParams, seed: int = 0) -> np.ndarray:
    return np.asarray(sample(jnp.asarray(logits), _keys(logits.shape[1], seed), params))


def test_top_p_without_top_k_draws_from_the_renormalized_nucleus():
    """0.5 / 0.3 / 0.15 / 0.05 at temperature 1: top_p 0.7 keeps the first two (0.5 < 0.7 before the
    second, 0.8 before the third), top_p 0.85 the first three; 4,000 rows, each its own key."""
    rows = 4000
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    tokens = [3, 140, 77, 200]  # over two of the 128-token blocks the draw cumulates in
    logits = np.full((260, rows), -np.inf, np.float32)
    logits[tokens, :] = np.log(probs)[:, None]
    for top_p, kept in ((0.7, 2), (0.85, 3)):
        drawn = _drawn(logits, SamplingParams(temperature=1.0, top_p=top_p), seed=kept)
        expected = probs[:kept] / probs[:kept].sum()
        shares = np.array([(drawn == t).mean() for t in tokens[:kept]])
        assert shares.sum() == 1.0 and np.abs(shares - expected).max() < 0.03, (top_p, shares, expected)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (40, 1.0), (40, 0.9)])
def test_min_p_keeps_the_tokens_transformers_keeps(top_k, top_p):
    """min_p 0.1 at temperature 1.3 over 300 tokens, with and without top_k and top_p: the tokens
    drawn in 3,000 rows are those transformers' warpers (temperature, top-k, top-p, min-p, in its
    order) leave a probability, every one of them, and in its proportions."""
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    rows, temperature = 3000, 1.3
    row = np.random.default_rng(7).standard_normal(300).astype(np.float32) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=0.1)
    drawn = _drawn(np.repeat(row[:, None], rows, axis=1), params, seed=top_k)

    def transformers_probs(min_p: float) -> np.ndarray:
        scores = torch.tensor(row)[None, :]
        warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + (
            [TopPLogitsWarper(top_p)] if top_p < 1 else []) + ([MinPLogitsWarper(min_p)] if min_p else [])
        for warper in warpers:
            scores = warper(None, scores)
        return torch.softmax(scores[0], -1).numpy()

    expected = transformers_probs(0.1)
    kept = np.flatnonzero(expected > 0)
    assert 5 < len(kept) < np.count_nonzero(transformers_probs(0.0)), "min_p should cut a tail, and leave a choice"
    assert set(drawn.tolist()) == set(kept.tolist())
    shares = np.bincount(drawn, minlength=300) / rows
    assert np.abs(shares - expected).max() < 0.03


def test_tokens_tied_with_the_least_probable_in_the_nucleus_are_all_kept():
    rows = 3000
    logits = np.full((40, rows), -np.inf, np.float32)
    logits[[5, 9, 30], :] = np.log(np.array([0.4, 0.3, 0.3]))[:, None]  # 9 and 30 tie
    drawn = _drawn(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert set(drawn.tolist()) == {5, 9, 30}
    assert abs((drawn == 5).mean() - 0.4) < 0.03


def test_a_weightless_token_is_never_drawn_whatever_the_uniform_number():
    """u close to 1 must land on the last token with any weight, not on the zeros after it (the
    vocabulary of 300 is not a multiple of the 128-token blocks either)."""
    weights = np.zeros((300, 4), np.float32)
    weights[[0, 129, 250], 0] = [1.0, 2.0, 3.0]
    weights[7, 1] = 1e-30  # one tiny weight only
    weights[:, 2] = 1.0 / 300  # uniform
    weights[299, 3] = 5.0  # the last token only
    for u in (0.0, 0.5, np.nextafter(np.float32(1.0), np.float32(0.0))):
        tokens = np.asarray(inverse_cdf(jnp.asarray(weights), jnp.full(4, u, jnp.float32))).tolist()
        assert tokens[0] in (0, 129, 250) and tokens[1] == 7 and 0 <= tokens[2] < 300 and tokens[3] == 299, (u, tokens)
    rng = np.random.default_rng(4)  # rounding: cumulated in blocks, then again within a block
    many = rng.exponential(size=(1000, 256)).astype(np.float32) * (rng.random((1000, 256)) < 0.3)
    for u in (np.nextafter(np.float32(1.0), np.float32(0.0)), np.float32(0.9999)):
        tokens = np.asarray(inverse_cdf(jnp.asarray(many), jnp.full(256, u, jnp.float32)))
        assert (many[tokens, np.arange(256)] > 0).all()
    high = np.asarray(inverse_cdf(jnp.asarray(weights), jnp.full(4, 0.985, jnp.float32))).tolist()
    assert high[0] == 250 and high[2] == 295  # the first token whose cumulative weight exceeds 295.5 / 300


def test_without_top_k_a_rows_token_depends_on_its_own_logits_and_key_only():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((1000, 16)).astype(np.float32)
    keys = _keys(16, seed=6)
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9)):
        tokens = np.asarray(sample(jnp.asarray(logits), keys, params))
        order = rng.permutation(16)
        shuffled = np.asarray(sample(jnp.asarray(logits[:, order]), keys[order], params))
        assert shuffled.tolist() == tokens[order].tolist() and len(set(tokens.tolist())) > 8, params


@pytest.mark.parametrize("vocab, k", [(32000, 50), (1000, 5), (300, 2), (300, 3)])
def test_top_k_in_blocks_is_lax_top_k_exactly_ties_included(vocab, k):
    """Values and indices, in order, as jax.lax.top_k over the whole row gives them: ties take the
    lower index first, also across blocks and beside the padding of a vocabulary that is not a
    multiple of the 128-token blocks (300 with k = 3 is answered by lax.top_k itself)."""
    rng = np.random.default_rng(vocab + k)
    scores = rng.integers(-3, 4, (vocab, 8)).astype(np.float32)  # few distinct values: ties everywhere
    scores[:, 1] = rng.standard_normal(vocab)
    scores[:, 2] = -np.inf
    scores[rng.integers(0, vocab, 40), 3] = 9.0  # the best value spread over several blocks
    scores[:, 4] = -np.inf
    scores[[vocab - 1, vocab - 2], 4] = 1.0  # the only finite entries, beside the padding
    values, indices = top_k(jnp.asarray(scores), k)
    expected_values, expected_indices = jax.lax.top_k(jnp.asarray(scores.T), k)
    assert np.asarray(indices).tolist() == np.asarray(expected_indices).tolist()
    assert np.array_equal(np.asarray(values), np.asarray(expected_values))
