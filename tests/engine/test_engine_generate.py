"""Generation behaviour users see: determinism per (prompt, sample), n samples, finish reasons
and cuts for EOS / stop ids / stop strings / max_new_tokens, batch planning messages, early
abandonment, and data parallelism over forced host devices (in a subprocess)."""

from __future__ import annotations

import os
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from engine_testlib import VOCAB, hf_greedy, hf_log_softmax, hf_logprobs, run_on_forced_devices, with_generation_config

PROMPTS = [np.random.RandomState(10 + i).randint(0, VOCAB, n).tolist() for i, n in enumerate([4, 11, 7, 15, 9])]
SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, n=3, seed=7)


def _run(engine, requests) -> dict[tuple[int, int], object]:
    return {(c.prompt_index, c.sample_index): c for c in engine.generate(requests)}


def test_sampling_is_independent_of_batch_and_order(llama):
    """A row's tokens come from fold_in(fold_in(key(seed), prompt), sample): the same whether it
    ran with every other row in 8 slots, or alone-ish in 2 slots, in another order."""
    path, _ = llama
    big = Engine.load(path, dtype="float32", sampling=SAMPLED, engine=EngineConfig(batch_size=8), max_prompt_tokens=16)
    everything = _run(big, [GenerationRequest(i, p, range(3)) for i, p in enumerate(PROMPTS)])
    assert sorted(everything) == [(p, s) for p in range(len(PROMPTS)) for s in range(3)]

    small = Engine.load(path, dtype="float32", sampling=SAMPLED, engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    resumed = _run(small, [GenerationRequest(3, PROMPTS[3], [2]), GenerationRequest(1, PROMPTS[1], [1, 0])])
    assert sorted(resumed) == [(1, 0), (1, 1), (3, 2)]
    for key, completion in resumed.items():
        assert completion.token_ids == everything[key].token_ids, key

    # n samples of one prompt share its prefill but not their randomness.
    samples = {tuple(everything[(p, s)].token_ids) for p in range(len(PROMPTS)) for s in range(3)}
    assert len(samples) > len(PROMPTS)
    seeded = Engine.load(path, dtype="float32", sampling=SamplingParams(**{**SAMPLED.__dict__, "seed": 8}), engine=EngineConfig(batch_size=8), max_prompt_tokens=16)
    other_seed = _run(seeded, [GenerationRequest(0, PROMPTS[0], [0, 1, 2])])
    assert any(other_seed[(0, s)].token_ids != everything[(0, s)].token_ids for s in range(3))


def test_first_tokens_are_the_same_drawn_per_pair_or_per_slot(llama):
    """A prefill call draws each (prompt, sample) pair's first token over its row's logits: per
    pair where the lane has a slot for each of the call's pairs (2 rows x 2 samples in 8 slots),
    else per slot (in 2 slots). Sampled and greedy, n = 2, both ways give every sample the same
    tokens, a resumed sample included; greedy, a prompt's samples all get the tokens of n = 1."""
    path, _ = llama
    requests = [GenerationRequest(i, p, [0, 1] if i != 2 else [1]) for i, p in enumerate(PROMPTS)]

    def run(sampling, asked=requests, **engine):
        loaded = Engine.load(path, dtype="float32", sampling=sampling, max_prompt_tokens=16,
                             engine=EngineConfig(prefill_chunk_tokens=8, **engine))
        return loaded, {key: c.token_ids for key, c in _run(loaded, asked).items()}

    for sampling in (SamplingParams(max_new_tokens=6, n=2), SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, n=2, seed=4)):
        per_pair, got = run(sampling, batch_size=8, prefill_tokens=16)
        per_slot, want = run(sampling, batch_size=2)
        assert per_pair._prefill_rows * 2 <= per_pair._lane_slots and per_slot._prefill_rows * 2 > per_slot._lane_slots
        assert len(got) == 2 * len(PROMPTS) - 1 and all(got.values())
        assert got == want, sampling
    _, one = run(SamplingParams(max_new_tokens=6), [GenerationRequest(i, p, [0]) for i, p in enumerate(PROMPTS)],
                 batch_size=8)
    _, two = run(SamplingParams(max_new_tokens=6, n=2), batch_size=8)
    assert all(tokens == one[(prompt, 0)] for (prompt, _), tokens in two.items())


def test_later_chunks_of_a_lone_prompt_share_prefill_calls(llama):
    """When fewer prompts are being prefilled than a call has rows, one prompt's later chunks
    take several rows of one call, each attending to what the rows before it wrote in that call:
    a 40-token prompt in calls of 4 rows of 8 tokens takes 2 calls (first chunk, then the other
    four; with the CPU kernel, packed, its first 32 tokens, then 8) instead of 5, and its samples
    get the tokens of one chunk per call."""
    path, _ = llama
    prompt = np.random.RandomState(3).randint(0, VOCAB, 40).tolist()

    def run(prefill_tokens: int):
        engine = Engine.load(path, dtype="float32", sampling=SAMPLED, max_prompt_tokens=40,
                             engine=EngineConfig(batch_size=4, prefill_chunk_tokens=8, prefill_tokens=prefill_tokens))
        out = _run(engine, [GenerationRequest(0, prompt, range(3))])
        return {key: c.token_ids for key, c in out.items()}, engine.stats.prefill_calls

    packed, packed_calls = run(32)  # 4 rows per call
    single, single_calls = run(8)  # 1 row per call
    assert (packed_calls, single_calls) == (2, 5)
    assert sorted(packed) == [(0, 0), (0, 1), (0, 2)] and all(len(t) == 10 for t in packed.values())
    assert packed == single


def test_logprobs_are_transformers_log_softmax_of_each_token(llama):
    """`sampling.logprobs`: each sampled token's log-probability under the model, before
    temperature, top-k and top-p, is transformers' log-softmax of its logits over the prompt and
    the tokens before it (float32), for the first token (from a prefill call) and the rest (from
    decode chunks); `sampling.top_logprobs`: the 5 most probable tokens there and theirs, whether
    or not the sampled one is among them. The same numbers come from another batch size, within
    rounding from the XLA attention, and a stop token cuts them with the tokens (without the
    settings there are none: `greedy_ref`)."""
    path, hf = llama
    sampling = SamplingParams(**{**SAMPLED.__dict__, "logprobs": True, "top_logprobs": 5})
    big = Engine.load(path, dtype="float32", sampling=sampling, engine=EngineConfig(batch_size=8), max_prompt_tokens=16)
    got = _run(big, [GenerationRequest(i, p, range(3)) for i, p in enumerate(PROMPTS)])
    assert len(got) == 3 * len(PROMPTS)
    every, chosen_in_top = [], []
    for (p, _), c in got.items():
        distributions = hf_log_softmax(hf, PROMPTS[p] + c.token_ids)[len(PROMPTS[p]) - 1 :]
        expected = distributions[np.arange(10), c.token_ids]
        assert len(c.logprobs) == len(c.token_ids) == len(c.top_token_ids) == len(c.top_logprobs) == 10
        np.testing.assert_allclose(c.logprobs, expected, atol=1e-4, rtol=0)
        best = np.argsort(-distributions, axis=1, kind="stable")[:, :5]
        assert c.top_token_ids == best.tolist()
        np.testing.assert_allclose(c.top_logprobs, np.take_along_axis(distributions, best, axis=1), atol=1e-4, rtol=0)
        every += c.logprobs
        chosen_in_top += [token in top for token, top in zip(c.token_ids, c.top_token_ids)]
    assert max(every) < 0 and max(every) - min(every) > 1.0, "the test model's tokens are not all alike"
    assert any(chosen_in_top) and not all(chosen_in_top), "sampled tokens both among the top 5 and not"

    (p, s), row = next((key, c) for key, c in got.items() if len(set(c.token_ids[2:])) > 1)
    stop = row.token_ids[next(t for t in range(2, 10) if row.token_ids[t] not in row.token_ids[:t])]
    cut = row.token_ids.index(stop)
    other = Engine.load(path, dtype="float32", max_prompt_tokens=16,
                        sampling=SamplingParams(**{**sampling.__dict__, "stop_token_ids": (stop,)}),
                        engine=EngineConfig(batch_size=2, decode_attention="xla"))
    (c,) = other.generate([GenerationRequest(p, PROMPTS[p], [s])])
    assert (c.finish_reason, c.token_ids) == ("stop", row.token_ids[:cut])
    np.testing.assert_allclose(c.logprobs, row.logprobs[:cut], atol=1e-5, rtol=0)
    assert c.top_token_ids == row.top_token_ids[:cut]
    np.testing.assert_allclose(c.top_logprobs, row.top_logprobs[:cut], atol=1e-5, rtol=0)

    small = Engine.load(path, dtype="float32", sampling=sampling, engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    (c,) = small.generate([GenerationRequest(p, PROMPTS[p], [s])])
    assert (c.token_ids, c.logprobs, c.top_token_ids, c.top_logprobs) == (
        row.token_ids, row.logprobs, row.top_token_ids, row.top_logprobs)


def test_prompt_logprobs_are_transformers_log_softmax_of_each_prompt_token(llama, monkeypatch):
    """`sampling.prompt_logprobs`: each prompt token's log-probability given the tokens before it
    is transformers' log-softmax of the prompt's logits (float32), None for the first token, for
    prompts of one piece and of several (a 40-token prompt over three packed calls of 16 tokens),
    the same list for each of a prompt's samples. The XLA attention's unpacked calls (rows of 8)
    give them within rounding (their LM head in blocks of 5 positions, the last one padded), and another
    batch size (a resume asking for one sample) the same numbers."""
    from engine import decode

    path, hf = llama
    prompts = PROMPTS + [np.random.RandomState(3).randint(0, VOCAB, 40).tolist()]
    requests = [GenerationRequest(i, p, range(2)) for i, p in enumerate(prompts)]
    sampling = SamplingParams(max_new_tokens=3, n=2, prompt_logprobs=True)

    def run(**engine) -> dict:
        loaded = Engine.load(path, dtype="float32", sampling=sampling, max_prompt_tokens=40,
                             engine=EngineConfig(prefill_chunk_tokens=8, prefill_tokens=16, **engine))
        return _run(loaded, requests if engine.get("batch_size", 8) == 8 else [GenerationRequest(5, prompts[5], [1])])

    got = run(batch_size=8, overlap_prefill=True)  # prefilled by the staging thread
    assert sorted(got) == [(p, s) for p in range(len(prompts)) for s in range(2)]
    every = []
    for p, prompt in enumerate(prompts):
        expected = hf_logprobs(hf, prompt)
        first, second = got[(p, 0)].prompt_logprobs, got[(p, 1)].prompt_logprobs
        assert len(first) == len(prompt) and first[0] is None and first == second, p
        np.testing.assert_allclose(first[1:], expected, atol=1e-4, rtol=0)
        every += first[1:]
    assert max(every) < 0 and max(every) - min(every) > 1.0, "the test model's tokens are not all alike"

    with monkeypatch.context() as patch:
        patch.setattr(decode, "PROMPT_LOGPROB_BLOCK", 5)  # 16 positions a call
        unpacked = run(batch_size=8, decode_attention="xla", overlap_prefill=False)  # prefilled by the lane
    for key, c in got.items():
        np.testing.assert_allclose(unpacked[key].prompt_logprobs[1:], c.prompt_logprobs[1:], atol=1e-5, rtol=0)
    (c,) = run(batch_size=2).values()
    assert c.token_ids == got[(5, 1)].token_ids and c.prompt_logprobs[0] is None
    np.testing.assert_allclose(c.prompt_logprobs[1:], got[(5, 1)].prompt_logprobs[1:], atol=1e-6, rtol=0)
    assert all(c.prompt_logprobs is None for c in _run(
        Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=3), max_prompt_tokens=16),
        [GenerationRequest(i, p, [0]) for i, p in enumerate(prompts[:2])]).values())


class _VllmPenalties:
    """vLLM's presence and frequency penalties as a transformers logits processor: a token's
    logit loses frequency per time the completion (input_ids past the prompt) holds it, and
    presence once if it holds it at all."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        import torch

        completion = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, completion, torch.ones_like(completion, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf_penalized(hf, prompt: list[int], new: int, processors: list) -> list[int]:
    """transformers' greedy tokens with these logits processors applied in order."""
    from transformers import LogitsProcessorList

    return hf_greedy(hf, prompt, new, logits_processor=LogitsProcessorList(processors))


def _greedy_rows(path: str, sampling: SamplingParams, engine: EngineConfig,
                 prompts: list[list[int]] = PROMPTS) -> dict[tuple[int, int], list[int]]:
    loaded = Engine.load(path, dtype="float32", sampling=sampling, engine=engine, max_prompt_tokens=32)
    return {key: c.token_ids for key, c in _run(loaded, [GenerationRequest(i, p, [0]) for i, p in enumerate(prompts)]).items()}


def test_presence_and_frequency_penalties_are_vllms_over_the_completion(llama):
    """`sampling.presence_penalty` and `frequency_penalty`: before each choice, a token's logit
    loses frequency_penalty per time the completion already holds it and presence_penalty once
    if it holds it at all; the prompt's tokens do not count (vLLM's rule, written here as a
    transformers logits processor). Greedy, each prompt's tokens are transformers' under that
    rule, and the penalties change some rows. In 2 slots, where rows reuse the slots of
    finished ones (prefilled into them, or staged beside decoding and moved), the rows are the
    same, greedy and sampled; the log-probabilities stay the model's own, as without penalties."""
    path, hf = llama
    presence, frequency = 0.5, 0.7
    greedy = SamplingParams(max_new_tokens=12, presence_penalty=presence, frequency_penalty=frequency)
    engine = Engine.load(path, dtype="float32", sampling=greedy, engine=EngineConfig(batch_size=8), max_prompt_tokens=16)
    got = _run(engine, [GenerationRequest(i, p, [0]) for i, p in enumerate(PROMPTS)])
    plain = _greedy_rows(path, SamplingParams(max_new_tokens=12), EngineConfig(batch_size=8))
    for i, prompt in enumerate(PROMPTS):
        assert got[(i, 0)].token_ids == _hf_penalized(hf, prompt, 12, [_VllmPenalties(len(prompt), presence, frequency)]), i
    assert sum(got[(i, 0)].token_ids != plain[(i, 0)] for i in range(len(PROMPTS))) >= 2
    repeats = sum(len(c.token_ids) - len(set(c.token_ids)) for c in got.values())
    assert repeats < sum(len(tokens) - len(set(tokens)) for tokens in plain.values())

    small = Engine.load(path, dtype="float32", sampling=greedy, max_prompt_tokens=16,
                        engine=EngineConfig(batch_size=2, overlap_prefill=False))  # prefilled into the slots
    assert {key: c.token_ids for key, c in _run(small, [GenerationRequest(i, p, [0]) for i, p in enumerate(PROMPTS)]).items()} == \
        {key: c.token_ids for key, c in got.items()}

    sampled = SamplingParams(**{**SAMPLED.__dict__, "presence_penalty": presence, "frequency_penalty": frequency, "logprobs": True})
    requests = [GenerationRequest(i, p, range(3)) for i, p in enumerate(PROMPTS)]
    big = _run(Engine.load(path, dtype="float32", sampling=sampled, engine=EngineConfig(batch_size=8), max_prompt_tokens=16), requests)
    two = _run(Engine.load(path, dtype="float32", sampling=sampled, max_prompt_tokens=16,
                           engine=EngineConfig(batch_size=2, overlap_prefill=True)), requests)  # staged, then moved
    assert {k: c.token_ids for k, c in big.items()} == {k: c.token_ids for k, c in two.items()}
    (p, s), row = next(iter(big.items()))
    expected = hf_logprobs(hf, PROMPTS[p] + row.token_ids)[len(PROMPTS[p]) - 1 :]
    np.testing.assert_allclose(row.logprobs, expected, atol=1e-4, rtol=0)


def test_repetition_penalty_is_transformers_over_prompt_and_completion(llama):
    """`sampling.repetition_penalty`: each token already in the prompt or the completion has its
    logit divided by the penalty where positive and multiplied where not, the first token too
    (transformers' `repetition_penalty`). Greedy, the rows are transformers' with prompts split
    over prefill calls of 8-token chunks, packed (the CPU kernel) or a chunk a row (the XLA
    attention), with first tokens drawn per pair or per slot (n = 2 in 2 slots), and in 1 or 2
    slots that rows reuse; with the presence and frequency penalties after it, as
    vLLM orders them, staged beside decoding. Each prompt runs on with its greedy tokens up to
    one that repeats a token before it, so that its first token is one the prompt holds and the
    first token's penalty counts; and a row in a reused slot follows one whose prompt is its own
    penalized tokens, so a prompt left from the slot's last row would change them."""
    from transformers import RepetitionPenaltyLogitsProcessor

    path, hf = llama
    penalty = 1.5
    plain = _greedy_rows(path, SamplingParams(max_new_tokens=12), EngineConfig(batch_size=8))
    prompts = []
    for i, p in enumerate(PROMPTS):
        tokens = plain[(i, 0)]
        ahead = next((t for t in range(len(tokens)) if tokens[t] in p + tokens[:t]), None)
        if ahead is not None:  # greedy, the prompt's first token is then tokens[ahead], a repeat
            prompts.append(p + tokens[:ahead])
    repeated = _greedy_rows(path, SamplingParams(max_new_tokens=1), EngineConfig(batch_size=8), prompts)
    assert len(prompts) >= 3 and all(repeated[(i, 0)][0] in p for i, p in enumerate(prompts))
    expected = {(i, 0): _hf_penalized(hf, p, 12, [RepetitionPenaltyLogitsProcessor(penalty)]) for i, p in enumerate(prompts)}
    assert sum(expected[(i, 0)][0] != repeated[(i, 0)][0] for i in range(len(prompts))) >= 2
    sampling = SamplingParams(max_new_tokens=12, repetition_penalty=penalty)
    for engine in (EngineConfig(batch_size=8, prefill_chunk_tokens=8, prefill_tokens=16),
                   EngineConfig(batch_size=2, prefill_chunk_tokens=8, decode_attention="xla", overlap_prefill=False)):
        assert _greedy_rows(path, sampling, engine, prompts) == expected, engine
    # n = 2 in 2 slots: a call's 2 rows make 4 pairs, so the first tokens are drawn per slot.
    two = SamplingParams(max_new_tokens=12, repetition_penalty=penalty, n=2)
    assert _greedy_rows(path, two, EngineConfig(batch_size=2, overlap_prefill=False), prompts) == expected
    # In one slot, a row whose prompt is the next row's penalized tokens goes first.
    last = len(prompts) - 1
    after = _greedy_rows(path, sampling, EngineConfig(batch_size=1, overlap_prefill=False), [expected[(last, 0)], prompts[last]])
    assert after[(1, 0)] == expected[(last, 0)]

    combined = SamplingParams(max_new_tokens=12, repetition_penalty=penalty, presence_penalty=0.5, frequency_penalty=0.7)
    got = _greedy_rows(path, combined, EngineConfig(batch_size=2, overlap_prefill=True))
    for i, p in enumerate(PROMPTS):
        assert got[(i, 0)] == _hf_penalized(hf, p, 12, [RepetitionPenaltyLogitsProcessor(penalty),
                                                         _VllmPenalties(len(p), 0.5, 0.7)]), i


def test_min_new_tokens_holds_stop_tokens_back_as_transformers_does(llama):
    """`sampling.min_new_tokens`: no stop token is chosen before the completion holds that many
    tokens, the first token included (transformers' `min_new_tokens`). The stop token here is the
    first token of row 0, which this model repeats: unheld, row 0 stops at once. Held for 1 and 4
    tokens, and for the least minimum at which a row stops on the first token it may, every row
    is transformers' greedy row with that EOS and that minimum, cut before its stop token, in one
    prefill call per prompt or in calls of 2 slots that draw per slot."""
    path, hf = llama
    plain = _greedy_rows(path, SamplingParams(max_new_tokens=12), EngineConfig(batch_size=8))
    stop = plain[(0, 0)][0]
    assert plain[(0, 0)][1:4].count(stop) >= 1  # the model picks it again within the minimum
    unheld = _greedy_rows(path, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)), EngineConfig(batch_size=8))
    assert unheld[(0, 0)] == []

    def transformers_rows(minimum: int) -> dict[tuple[int, int], tuple[list[int], bool]]:
        """Each prompt's greedy tokens before the stop token, and whether it stopped there."""
        rows = {}
        for i, prompt in enumerate(PROMPTS):
            tokens = hf_greedy(hf, prompt, 12, min_new_tokens=minimum, eos_token_id=stop, pad_token_id=stop)
            rows[(i, 0)] = (tokens[: tokens.index(stop)], True) if stop in tokens else (tokens, False)
        return rows

    # A minimum at which some row stops on the first token it may stop on: one more held token
    # would change that row, one fewer would let it stop earlier.
    edge = next(m for m in range(1, 8) if any(stopped and len(tokens) == m for tokens, stopped in transformers_rows(m).values()))
    for minimum in sorted({1, edge, 4}):
        held = SamplingParams(max_new_tokens=12, min_new_tokens=minimum, stop_token_ids=(stop,))
        expected = {key: tokens for key, (tokens, _) in transformers_rows(minimum).items()}
        assert _greedy_rows(path, held, EngineConfig(batch_size=8)) == expected, minimum
        assert _greedy_rows(path, SamplingParams(**{**held.__dict__, "n": 2}), EngineConfig(batch_size=2)) == expected, minimum


@pytest.fixture(scope="module")
def greedy_ref(llama):
    """Greedy tokens of PROMPTS[1] with no stop rule: 12 tokens, finish_reason length."""
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=12), engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    assert c.finish_reason == "length" and len(c.token_ids) == 12 and c.text == "" and c.logprobs is None and c.top_token_ids is c.top_logprobs is None
    return c.token_ids


def test_stop_token_ids_and_eos_cut_before_the_token(llama, greedy_ref, tmp_path):
    path, _ = llama
    stop = greedy_ref[5]
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)), engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    assert (c.finish_reason, c.token_ids) == ("stop", greedy_ref[: greedy_ref.index(stop)])

    eos = greedy_ref[7]
    eos_path = with_generation_config(path, tmp_path / "eos", eos_token_id=[VOCAB - 1, eos])
    engine = Engine.load(eos_path, dtype="float32", sampling=SamplingParams(max_new_tokens=12), engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    assert set(engine.eos_token_ids) == {VOCAB - 1, eos}
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    assert (c.finish_reason, c.token_ids) == ("eos", greedy_ref[: greedy_ref.index(eos)])


def test_stop_strings_cut_text_and_tokens(llama, greedy_ref, tokenizer):
    """Chunks of 4 steps so a two-word stop string can straddle a chunk boundary."""
    path, _ = llama
    j = 3
    one_word = f"x{greedy_ref[j]}y"
    first = greedy_ref.index(greedy_ref[j])
    two_words = f"x{greedy_ref[4]}y x{greedy_ref[5]}y"
    pair = next(i for i in range(11) if greedy_ref[i : i + 2] == greedy_ref[4:6])
    engine = Engine.load(
        path, dtype="float32", engine=EngineConfig(batch_size=2, decode_chunk_steps=4), max_prompt_tokens=16, tokenizer=tokenizer,
        sampling=SamplingParams(max_new_tokens=12, stop=(two_words, one_word, "never there")),
    )
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    cut = min(first, pair)
    assert c.finish_reason == "stop"
    assert c.token_ids == greedy_ref[:cut]
    assert c.text == (tokenizer.decode(greedy_ref[:cut]) + " " if cut else "")

    engine = Engine.load(
        path, dtype="float32", engine=EngineConfig(batch_size=2, decode_chunk_steps=4), max_prompt_tokens=16, tokenizer=tokenizer,
        sampling=SamplingParams(max_new_tokens=12, stop=(two_words,)),
    )
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    assert (c.finish_reason, c.token_ids) == ("stop", greedy_ref[:pair])
    assert c.text == (tokenizer.decode(greedy_ref[:pair]) + " " if pair else "")


@pytest.mark.parametrize("completion, stops, kept, decoding", [
    # Overlapping: "ExSumive" begins first, "Sum" is whole first. Cut before "Ex" at 16 steps a chunk, after it at 1.
    (b"CExSumive and more", ("ExSumive", "Sum"), "CEx", "replace"),
    # A character's first byte decodes as U+FFFD until its second comes: no stop there. Cut at 1 step a chunk.
    ("ab\u00e9cd\u00e9".encode(), ("\ufffd",), None, "replace"),
    ("ab\u00e9cd".encode(), ("b\ufffd", "\ufffdc"), None, "replace"),
    # A byte that no later one completes is a U+FFFD that stays, wherever the checks fall.
    (b"ab\xffcd", ("\ufffd",), "ab", "replace"),
    (b"ab\xc3", ("\ufffd",), "ab", "replace"),  # the row's last token: its end shows it stays
    # A byte-fallback tokenizer decodes a character cut part-way as one U+FFFD per byte, longer
    # than the whole character: the kept ids lost the emoji and "b" whose text was kept.
    (b"a\xf0\x9f\x98\x80bSxyz", ("S",), "a\U0001f600b", "one-per-byte"),
])
def test_a_stop_strings_cut_does_not_depend_on_when_the_rows_text_is_checked(completion, stops, kept, decoding):
    """The engine checks a row's text once per decode chunk: a row cut differently at another
    `engine.decode_chunk_steps`, a setting in no hash (found by user audits). Every schedule of
    checks must cut where a check after every token does (vLLM, transformers)."""
    from types import SimpleNamespace

    import codecs

    codecs.register_error("one-per-byte", lambda err: ("\ufffd" * (err.end - err.start), err.end))
    tokens = list(completion)  # one token per byte: é is two tokens
    engine = SimpleNamespace(sampling=SimpleNamespace(stop=stops), engine_config=SimpleNamespace(decode_chunk_steps=4),
                             _decode=lambda ids: bytes(ids).decode("utf-8", errors=decoding))  # byte-level BPE's, or byte fallback's
    engine._find_stop_string = Engine._find_stop_string.__get__(engine)

    def checked_every(steps: int):
        for end in range(steps, len(tokens) + steps, steps):
            if (cut := engine._find_stop_string(tokens[:end], whole=end >= len(tokens))) is not None:
                return cut
        return None

    found = {steps: checked_every(steps) for steps in (1, 2, 3, 4, 16)}
    assert all(cut == found[1] for cut in found.values()), found
    if kept is None:
        assert found[1] is None
    else:
        assert found[1] == (list(kept.encode()), kept)


def test_explicit_batch_that_cannot_fit_fails_before_compiling(llama):
    path, _ = llama
    with pytest.raises(ValueError, match=r"engine\.batch_size=100000 needs ~.* GiB .* lower engine\.batch_size or use auto"):
        Engine.load(path, dtype="float32", engine=EngineConfig(batch_size=100_000, memory_fraction=0.01), max_prompt_tokens=256)


@pytest.mark.parametrize("arguments, error, message", [
    ({"max_prompt_tokens": 16.5}, ValueError, "prompts.max_prompt_tokens must be an integer > 0, got 16.5"),
    ({"sampling": {"max_new_tokens": 8}}, TypeError, "Engine.load: sampling must be a SamplingParams, got dict"),
    ({"engine": {"batch_size": 2}}, TypeError, "Engine.load: engine must be an EngineConfig, got dict"),
    ({"tokenizer": "/path/to/tokenizer"}, TypeError, "Engine.load: tokenizer must have decode(ids, skip_special_tokens=True)"),
])
def test_load_names_an_argument_of_the_wrong_kind(llama, arguments, error, message):
    """From Python, where no YAML reader checked them: 16.5 failed inside JAX at the first generate,
    a dict or a path string as an AttributeError deep in the load or at the first finished row."""
    path, _ = llama
    with pytest.raises(error) as err:
        Engine.load(path, **{"dtype": "float32", "engine": EngineConfig(batch_size=2), **arguments})
    assert str(err.value).startswith(message), str(err.value)


def test_load_takes_a_pathlib_path(llama):
    import pathlib

    engine = Engine.load(pathlib.Path(llama[0]), dtype="float32", engine=EngineConfig(batch_size=2), max_prompt_tokens=8)
    assert engine.source == llama[0]


def test_auto_batch_size_says_what_it_chose(llama):
    path, _ = llama
    engine = Engine.load(path, dtype="bfloat16", engine=EngineConfig(batch_size="auto", memory_fraction=0.5), max_prompt_tokens=64)
    assert engine.stats.batch_size >= 1
    assert f"batch_size {engine.stats.batch_size} (auto" in engine.describe()


def test_overlong_prompt_is_refused_not_truncated(llama):
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=12), engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    with pytest.raises(ValueError, match="prompt 4 has 17 tokens"):
        list(engine.generate([GenerationRequest(4, [1] * 17, [0])]))


@pytest.mark.parametrize("request_, message", [
    (GenerationRequest(0, np.array([[1, 2, 3]]), [0]), "prompt 0: input_ids must be one list of integer token ids, got an "
                                                       "array of shape (1, 3) and dtype int64 (a tokenizer's batch of one"),
    (GenerationRequest(1, [1.7, 5.2], [0]), "prompt 1: input_ids must be one list of integer token ids, got an array of "
                                            "shape (2,) and dtype float64"),
    (GenerationRequest(2, [1, VOCAB, 3, VOCAB + 5], [0]), f"prompt 2 has token ids outside [0, {VOCAB}): {VOCAB} at "
                                                          "position 1 and 1 more"),
    (GenerationRequest(3, [1, 2], [0, 0]), "prompt 3: sample_indices must be a list of distinct samples in [0, "
                                           "sampling.n = 2), got [0, 0]"),
    (GenerationRequest(3, [1, 2], [2]), "prompt 3: sample_indices must be a list of distinct samples in [0, sampling.n = 2), "
                                        "got [2]"),
    # Ran sample 0, samples 0 and 1, or failed on `int`'s iteration without naming the prompt:
    (GenerationRequest(3, [1, 2], [0.7]), "prompt 3: sample_indices must be a list of distinct samples in [0, sampling.n = 2), "
                                          "got [0.7]"),
    (GenerationRequest(3, [1, 2], "01"), "prompt 3: sample_indices must be a list of distinct samples in [0, sampling.n = 2), "
                                         "got '01'"),
    (GenerationRequest(3, [1, 2], 1), "prompt 3: sample_indices must be a list of distinct samples in [0, sampling.n = 2), "
                                      "got 1"),
    (GenerationRequest(3, [1, 2], np.array(0)), "prompt 3: sample_indices must be a list of distinct samples in [0, "
                                                "sampling.n = 2), got array(0)"),
    (GenerationRequest(-1, [1, 2], [0]), "GenerationRequest.prompt_index must be an integer in [0, 2**31), got -1"),
    (GenerationRequest(2**31, [1, 2], [0]), "GenerationRequest.prompt_index must be an integer in [0, 2**31), got 2147483648"),
    (GenerationRequest(True, [1, 2], [0]), "GenerationRequest.prompt_index must be an integer in [0, 2**31), got True"),
    ((5, [1, 2], [0]), "generate takes GenerationRequests, got a tuple: (5, [1, 2], [0])"),  # was an AttributeError
])
def test_a_bad_request_is_refused_naming_it_before_any_work(llama, request_, message):
    """A library user's mistakes (a tokenizer's [1, L] batch, float ids, an id past the vocabulary,
    a sample outside sampling.n or twice): one ValueError naming the prompt, before any work; were
    silently truncated, prefilled again per sample, or a broadcast error deep in the scheduler."""
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=2, n=2),
                         engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    with pytest.raises(ValueError) as err:
        list(engine.generate([request_]))
    assert str(err.value).startswith(message), str(err.value)
    assert engine.stats.compilations == 0 and engine.stats.prompt_tokens == 0


def test_a_bad_request_comes_after_the_completions_before_it_and_requests_after_it_are_not_read(llama):
    """A library user's 200 good requests and a bad one got 60 completions, then the ValueError:
    requests are read ahead, and the error left with the rows read with it."""
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=2, n=2),
                         engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    read = []

    def requests():
        for i in range(7):
            read.append(i)
            yield GenerationRequest(i, PROMPTS[i % len(PROMPTS)], [0, 1]) if i != 5 else GenerationRequest(5, [], [0])

    got = []
    with pytest.raises(ValueError, match="prompt 5 has 0 tokens"):
        for c in engine.generate(requests()):
            got.append((c.prompt_index, c.sample_index))
    assert sorted(got) == [(i, s) for i in range(5) for s in (0, 1)] and read == list(range(6))

    # A stop is its own generate's: another's, asked while this one is set aside, swallowed its error.
    bad = engine.generate(requests())
    next(bad)
    assert list(engine.generate([GenerationRequest(0, PROMPTS[0], [0])], stop=lambda: True)) == []
    with pytest.raises(ValueError, match="prompt 5 has 0 tokens"):
        list(bad)
    assert engine.stopped  # the latest call's (the one begun last): stopped

    # Two requests of one prompt_index are two prompts: the second joined the first's prefill and got its tokens.
    other = [(t + 1) % VOCAB for t in PROMPTS[1]]
    alone = {c.sample_index: c.token_ids for c in engine.generate([GenerationRequest(0, other, [1])])}
    both = [(c.sample_index, c.token_ids) for c in engine.generate([GenerationRequest(0, PROMPTS[1], [0]),
                                                                      GenerationRequest(0, other, [1])])]
    assert dict(both)[1] == alone[1] and dict(both)[0] != alone[1]
    with pytest.raises(TypeError, match="takes an iterable of GenerationRequests .*got one GenerationRequest"):
        list(engine.generate(GenerationRequest(0, other, [1])))


def test_generator_can_be_abandoned(llama, greedy_ref):
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=12), engine=EngineConfig(batch_size=2), max_prompt_tokens=16)
    gen = engine.generate([GenerationRequest(i, p, [0]) for i, p in enumerate(PROMPTS)])
    next(gen)
    gen.close()
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    assert c.token_ids == greedy_ref
    assert engine.stats.peak_memory_bytes and engine.stats.compilations >= 0


def test_data_parallel_over_two_forced_devices_matches_one(llama):
    """Rows split over two local devices get one device's tokens, and with prompt_logprobs its
    prompt log-probabilities (each prefill call's positions split over the devices too)."""
    path, _ = llama
    sampling = dict(max_new_tokens=6, temperature=0.9, n=2, prompt_logprobs=True)
    two = run_on_forced_devices(f"""
        import json, sys
        sys.path.insert(0, {str(os.getcwd())!r})
        import jax
        from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
        assert jax.local_device_count() == 2
        engine = Engine.load({path!r}, dtype="float32", sampling=SamplingParams(**{sampling!r}),
                             engine=EngineConfig(batch_size=4), max_prompt_tokens=16)
        out = {{f"{{c.prompt_index}},{{c.sample_index}}": [c.token_ids, c.prompt_logprobs] for c in engine.generate(
            GenerationRequest(i, p, [0, 1]) for i, p in enumerate({PROMPTS!r}))}}
        print(json.dumps(out))
    """, devices=2, timeout=300)
    one_engine = Engine.load(path, dtype="float32", sampling=SamplingParams(**sampling), engine=EngineConfig(batch_size=4), max_prompt_tokens=16)
    one = {f"{c.prompt_index},{c.sample_index}": c for c in one_engine.generate(GenerationRequest(i, p, [0, 1]) for i, p in enumerate(PROMPTS))}
    assert {key: tokens for key, (tokens, _) in two.items()} == {key: c.token_ids for key, c in one.items()}
    for key, (_, scores) in two.items():
        assert scores[0] is None and len(scores) == len(one[key].prompt_logprobs), key
        np.testing.assert_allclose(scores[1:], one[key].prompt_logprobs[1:], atol=1e-5, rtol=0)


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("engine-lane-")]


def test_two_lanes_make_the_same_rows_as_one(llama):
    """Two lanes (each half the slots, its own cache and calls, in threads of their own) take rows
    from one queue; every (prompt, sample) comes out once, with the tokens one lane gives it, and
    the statistics count both lanes' work."""
    path, _ = llama
    prompts = PROMPTS + [np.random.RandomState(40 + i).randint(0, VOCAB, 3 + 2 * i).tolist() for i in range(7)]
    requests = [GenerationRequest(i, p, range(3)) for i, p in enumerate(prompts)]
    one = Engine.load(path, dtype="float32", sampling=SAMPLED, engine=EngineConfig(batch_size=4, lanes=1), max_prompt_tokens=16)
    two = Engine.load(path, dtype="float32", sampling=SAMPLED, engine=EngineConfig(batch_size=4, lanes=2), max_prompt_tokens=16)
    assert "batch_size 4 (explicit) in 2 lanes" in two.describe() and "prefill 2 rows" in two.describe()
    expected = _run(one, requests)
    completions = list(two.generate(requests))
    assert len(completions) == len(expected) == 3 * len(prompts)
    assert {(c.prompt_index, c.sample_index): c.token_ids for c in completions} == {k: c.token_ids for k, c in expected.items()}
    assert two.stats.generated_tokens == one.stats.generated_tokens
    assert two.stats.prompt_tokens >= sum(map(len, prompts))
    assert two.stats.prefill_calls > 0 and two.stats.decode_calls > 0
    assert not _lane_threads()


def _interrupted_start(monkeypatch, name: str) -> None:
    """A Ctrl-C that lands inside `Thread.start` of the thread `name`, once it runs."""
    start = threading.Thread.start

    def start_then_interrupt(thread):
        start(thread)
        if thread.name == name:
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)


def test_lanes_stop_together_and_can_be_abandoned(llama, greedy_ref, monkeypatch):
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=12),
                         engine=EngineConfig(batch_size=4, lanes=2, decode_chunk_steps=2), max_prompt_tokens=16)
    requests = [GenerationRequest(i, PROMPTS[i % len(PROMPTS)], [0]) for i in range(20)]
    gen = engine.generate(requests)
    next(gen)
    # Set aside, not closed (a notebook's): the lanes wait once 2 x batch_size completions wait to be
    # taken; they computed on into a queue that only grew (779 decode calls in 10 s).
    calls, deadline = -1, time.monotonic() + 30
    while calls != engine.stats.decode_calls and time.monotonic() < deadline:
        calls = engine.stats.decode_calls
        time.sleep(1.0)
    assert calls == engine.stats.decode_calls and engine.stats.generated_tokens < 12 * len(requests)
    gen.close()  # the lanes halt at their next call; none runs on
    assert not _lane_threads()

    asked = []
    finished = list(engine.generate(requests, stop=lambda: asked.append(1) or len(asked) > 6))
    assert engine.stopped and len(finished) < len(requests)
    assert not _lane_threads()
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    assert c.token_ids == greedy_ref and not engine.stopped

    # `stopped` is the latest call's: one begun before it and stopped after it ends leaves it.
    asked = []
    earlier = engine.generate(requests, stop=lambda: bool(asked))
    first = next(earlier)
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    asked.append(1)
    assert len([first, *earlier]) < len(requests) and c.token_ids == greedy_ref and not engine.stopped

    _interrupted_start(monkeypatch, "engine-lane-1")  # the lanes started before the try that halts them
    with pytest.raises(KeyboardInterrupt):
        list(engine.generate(requests))
    monkeypatch.undo()
    assert not _lane_threads()

    # The Ctrl-C lands while `start` waits for the thread, which runs but is not yet marked
    # started (so not alive to `is_alive`): it must not run a call once generate has returned.
    began = threading.Event()

    class MarkedLate(threading.Event):
        def set(self):  # the thread's own mark, held until the caller has left
            began.wait(30)
            super().set()

        def wait(self, timeout=None):
            raise KeyboardInterrupt

    start, init, calls = threading.Thread.start, engine._init, []

    def start_held(thread):
        if thread.name == "engine-lane-1":
            thread._started = MarkedLate()
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_held)
    monkeypatch.setattr(engine, "_init", lambda *slots: calls.append(threading.current_thread().name) or init(*slots))
    with pytest.raises(KeyboardInterrupt):
        list(engine.generate(requests))
    monkeypatch.setattr(threading.Thread, "start", start)  # `_init` still counted
    began.set()
    deadline = time.monotonic() + 30
    while _lane_threads() and time.monotonic() < deadline:  # lane 1 runs to its end: what it calls
        time.sleep(0.1)
    assert "engine-lane-1" not in calls and not _lane_threads()


def test_a_script_that_ends_with_a_generator_set_aside_exits_cleanly(llama):
    """Two lanes still inside XLA calls as the interpreter ended aborted the process (exit 134,
    'FATAL: exception not rethrown'): daemon threads. Unfinished generators are closed at exit."""
    import subprocess
    import textwrap

    path, _ = llama
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
        engine = Engine.load({path!r}, dtype="float32", sampling=SamplingParams(max_new_tokens=12),
                             engine=EngineConfig(batch_size=4, lanes=2, decode_chunk_steps=1), max_prompt_tokens=16)
        gen = engine.generate(GenerationRequest(i, {PROMPTS[1]!r}, [0]) for i in range(40))
        next(gen)
        print("set aside", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "set aside\n"), done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr and "FATAL" not in done.stderr, done.stderr[-3000:]


def test_a_script_that_ends_while_generate_runs_in_daemon_threads_exits_cleanly(llama):
    """A generator running in another thread cannot be closed at exit: its threads were still
    inside XLA calls as the interpreter finalized (exit 134). One whose requests stopped coming
    (a queue no one fills) must not hold the exit."""
    import subprocess
    import textwrap

    path, _ = llama
    script = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {os.getcwd()!r})
        from engine import Engine, EngineConfig, GenerationRequest, SamplingParams

        def consume(engine, requests, first):
            for _ in engine.generate(requests):
                first.set()

        def stalls():
            yield GenerationRequest(0, {PROMPTS[1]!r}, [0])
            threading.Event().wait()

        flowing = []
        for lanes in (1, 2):
            engine = Engine.load({path!r}, dtype="float32", sampling=SamplingParams(max_new_tokens=64),
                                 engine=EngineConfig(batch_size=4, lanes=lanes, decode_chunk_steps=1), max_prompt_tokens=16)
            for requests in ((GenerationRequest(i, {PROMPTS[1]!r}, [0]) for i in range(400)), stalls()):
                first = threading.Event()
                threading.Thread(target=consume, args=(engine, requests, first), daemon=True).start()
                flowing.append(first)
            flowing.pop()  # the stalled one yields nothing
        for first in flowing:
            first.wait()
        print("main ends", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "main ends\n"), done.stderr[-3000:]
    assert "FATAL" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]


def test_a_count_of_jax_work_left_by_the_exiting_thread_does_not_hold_the_exit():
    """A KeyboardInterrupt landing between `_jax_work`'s count and its `try` leaves the count behind,
    in the main thread: the exit, which waits until no thread is inside jax work, waited for good.
    The thread running the exit is in none."""
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from engine import engine
        work = engine._jax_work()
        work.__enter__()  # the count, with no `try` to take it back (`work` kept: its generator not closed)
        print("main ends", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "main ends\n"), done.stderr[-3000:]


def test_an_error_in_a_lane_reaches_the_caller(llama):
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=4),
                         engine=EngineConfig(batch_size=4, lanes=2), max_prompt_tokens=16)
    requests = [GenerationRequest(i, PROMPTS[0], [0]) for i in range(3)] + [GenerationRequest(3, [VOCAB + 5], [0])]
    with pytest.raises(ValueError, match=rf"prompt 3 has token ids outside \[0, {VOCAB}\)"):
        list(engine.generate(requests))
    assert not _lane_threads()


def test_lanes_config_is_checked(llama):
    from engine.config import InvalidConfig

    path, _ = llama
    with pytest.raises(InvalidConfig, match="engine.lanes applies only with engine.mode: host_dp"):
        EngineConfig(mode="global_mesh", lanes=2)
    with pytest.raises(InvalidConfig, match="engine.lanes"):
        EngineConfig(lanes=0)
    with pytest.raises(ValueError, match=r"engine.batch_size=6 must be a multiple of engine.lanes=4"):
        Engine.load(path, dtype="float32", engine=EngineConfig(batch_size=6, lanes=4), max_prompt_tokens=16)


def _prefill_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "engine-prefill"]


def _staged(path, sampling, overlap_prefill, prefill_tokens=8, **engine):
    """4 slots, prompts in chunks of 4 tokens, 2 rows a prefill call (prefill_tokens / 4)."""
    return Engine.load(path, dtype="float32", sampling=sampling, max_prompt_tokens=16,
                       engine=EngineConfig(batch_size=4, prefill_chunk_tokens=4, prefill_tokens=prefill_tokens,
                                           overlap_prefill=overlap_prefill, **engine))


def test_prefill_beside_decode_makes_the_same_rows(llama):
    """engine.overlap_prefill: the next prompts are prefilled in a thread of their own, into a
    staging cache, while the lane decodes; prefilled rows move into the lane's free slots between
    its decode calls. Sampled rows, three samples a prompt, prompts of one to four chunks, and rows
    that finish on their first token: every (prompt, sample) comes out once, with the tokens, text
    and finish reason it gets when prompts are prefilled between decode calls."""
    path, _ = llama
    prompts = PROMPTS + [np.random.RandomState(60 + i).randint(0, VOCAB, 2 + 2 * i).tolist() for i in range(8)]
    requests = [GenerationRequest(i, p, range(3)) for i, p in enumerate(prompts)]
    for sampling in (SAMPLED, SamplingParams(**{**SAMPLED.__dict__, "max_new_tokens": 1})):
        between = _staged(path, sampling, overlap_prefill=False)
        beside = _staged(path, sampling, overlap_prefill=True)
        # Three staging rows: a prompt's samples share its prefill (a call has two rows).
        assert "beside decode, into 3 staging rows" in beside.describe() and "staging" not in between.describe()
        expected = {key: (c.token_ids, c.text, c.finish_reason) for key, c in _run(between, requests).items()}
        completions = list(beside.generate(requests))
        assert len(completions) == len(expected) == 3 * len(prompts)
        assert {(c.prompt_index, c.sample_index): (c.token_ids, c.text, c.finish_reason) for c in completions} == expected
        assert beside.stats.generated_tokens == between.stats.generated_tokens
        # Each prompt prefilled once for its three samples (between decode calls, samples that
        # found a prompt's other samples already started prefill it again: 4 slots).
        assert beside.stats.prompt_tokens == sum(map(len, prompts)) <= between.stats.prompt_tokens
        # Rows done on their first token never leave the staging cache: nothing to move, nothing to decode.
        moved = sampling.max_new_tokens > 1
        assert ("adopt" in beside.stats.programs) == moved and (beside.stats.decode_calls > 0) == moved
        assert beside.stats.programs_used <= beside.max_programs, beside.stats.programs
        assert not _prefill_threads()


def test_a_job_that_fits_the_lane_makes_the_same_calls_beside_decode(llama):
    """Where the staging cache has the lane's rows (here a prefill call's four), the lane prefills
    its first rows itself and the prefill thread only the rows after them: a job that fits the
    lane's slots makes the calls it makes with prefill between decode calls, with no wait for
    the thread and no call moving rows (it made an extra decode call and an adopt before)."""
    path, _ = llama
    requests = [GenerationRequest(i, PROMPTS[i % len(PROMPTS)], [0]) for i in range(4)]
    sampling = SamplingParams(max_new_tokens=8)
    counted = ("prefill_calls", "decode_calls", "prompt_tokens", "generated_tokens")
    between = _staged(path, sampling, overlap_prefill=False, prefill_tokens=16)
    expected = {key: c.token_ids for key, c in _run(between, requests).items()}
    calls = {stat: getattr(between.stats, stat) for stat in counted}
    more = [GenerationRequest(i, PROMPTS[i % len(PROMPTS)], [0]) for i in range(12)]
    expected_more = {key: c.token_ids for key, c in _run(between, more).items()}
    beside = _staged(path, sampling, overlap_prefill=True, prefill_tokens=16)
    assert "beside decode, into 4 staging rows" in beside.describe()
    assert {key: c.token_ids for key, c in _run(beside, requests).items()} == expected and len(expected) == 4
    assert {stat: getattr(beside.stats, stat) for stat in counted} == calls
    first = [] if beside.attention == "cpu" else ["prefill_fresh"]  # the CPU kernel's: first chunks in the later ones' program
    assert sorted(beside.stats.programs) == ["decode", "init", "prefill"] + first and not _prefill_threads()
    # A longer job: the thread's calls run the lane's programs (the same shapes), one more to move rows.
    assert {key: c.token_ids for key, c in _run(beside, more).items()} == expected_more
    assert sorted(beside.stats.programs) == ["adopt", "decode", "init", "prefill"] + first
    assert beside.stats.programs_used == 4 + len(first) == beside.max_programs, beside.stats.programs


def test_the_lane_decodes_on_while_the_prefill_thread_waits_for_requests(llama):
    """The prefill thread reads the requests (the next window of them once half of this one is
    taken); a read can wait (generate's next shard on a bucket). It read them holding its condition
    and the queue's lock, which the lane asks between its decode calls: the lane stopped decoding
    until the read came. Here the read of the second window waits until a completion comes."""
    from engine.engine import READ_AHEAD_ROWS_PER_SLOT

    path, _ = llama
    engine = _staged(path, SamplingParams(max_new_tokens=24), overlap_prefill=True, prefill_tokens=16)
    window = READ_AHEAD_ROWS_PER_SLOT * 4
    received: list = []
    waited: list = []

    def requests():
        for i in range(window + 16):
            if i == window:  # read when half the first window is taken: rows are in the lane then
                before, deadline = len(received), time.monotonic() + 20
                while len(received) == before and time.monotonic() < deadline:
                    time.sleep(0.01)
                waited.append((threading.current_thread().name, len(received) - before))
            yield GenerationRequest(i, PROMPTS[i % len(PROMPTS)], [0])

    for completion in engine.generate(requests()):
        received.append(completion)
    assert sorted(c.prompt_index for c in received) == list(range(window + 16))
    (reader, came), = waited
    assert reader == "engine-prefill" and came > 0, waited  # completions came while the read waited


def test_prefill_beside_decode_stops_with_the_lane(llama, greedy_ref, monkeypatch):
    """The prefill thread ends with generate: when the caller abandons it, when `stop` asks, when
    a prompt is bad (generate reads it ahead of the slots; the error names the prompt), and when
    a prefill call of the thread's own fails (a device error, injected: it reaches the caller).
    The engine generates as before afterwards."""
    path, _ = llama
    engine = _staged(path, SamplingParams(max_new_tokens=12), overlap_prefill=True, decode_chunk_steps=2)
    requests = [GenerationRequest(i, PROMPTS[i % len(PROMPTS)], [0]) for i in range(20)]
    gen = engine.generate(requests)
    next(gen)
    gen.close()
    assert not _prefill_threads()

    asked = []
    finished = list(engine.generate(requests, stop=lambda: asked.append(1) or len(asked) > 6))
    assert engine.stopped and len(finished) < len(requests)
    assert not _prefill_threads()

    bad = requests[:6] + [GenerationRequest(6, [VOCAB + 5], [0])]
    with pytest.raises(ValueError, match=rf"prompt 6 has token ids outside \[0, {VOCAB}\)"):
        list(engine.generate(bad))
    assert not _prefill_threads()

    prefill = engine._prefill

    def fails_in_the_thread(*args):
        if threading.current_thread().name == "engine-prefill":
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (injected in the prefill thread)")
        return prefill(*args)

    monkeypatch.setattr(engine, "_prefill", fails_in_the_thread)
    with pytest.raises(RuntimeError, match="injected in the prefill thread"):
        list(engine.generate(requests))
    assert not _prefill_threads()
    monkeypatch.undo()

    _interrupted_start(monkeypatch, "engine-prefill")  # the thread started before the lane held it to close
    with pytest.raises(KeyboardInterrupt):
        list(engine.generate(requests))
    monkeypatch.undo()
    assert not _prefill_threads()
    (c,) = engine.generate([GenerationRequest(1, PROMPTS[1], [0])])
    assert c.token_ids == greedy_ref and not engine.stopped


def test_overlap_prefill_config_is_checked(llama):
    from engine.config import InvalidConfig

    path, _ = llama
    with pytest.raises(InvalidConfig, match="engine.overlap_prefill applies only with engine.mode: host_dp"):
        EngineConfig(mode="global_mesh", overlap_prefill=True)
    with pytest.raises(InvalidConfig, match="engine.overlap_prefill must be true, false or auto, got 'yes'"):
        EngineConfig(overlap_prefill="yes")
    # auto: on with one lane on this 2-core CPU, off with two (they fill the cores already).
    assert "staging" in Engine.load(path, dtype="float32", engine=EngineConfig(batch_size=4, lanes=1), max_prompt_tokens=16).describe()
    assert "staging" not in Engine.load(path, dtype="float32", engine=EngineConfig(batch_size=4, lanes=2), max_prompt_tokens=16).describe()


def test_a_bfloat16_row_gets_the_same_tokens_whatever_rows_share_its_calls(tmp_path):
    """A resume (the same engine asked for only the rows a first run did not finish), another
    batch size and two lanes put other rows beside each row in its prefill and decode calls; in
    bfloat16 each row must still get the tokens the first run gave it. The benchmark's mixed
    prompts on its 4 x 256 model: with XLA's YNNPACK reductions (`compiler_options`) one row
    of 96 changed in three of these resumes, at batch 8 and at batch 64
    (docs/performance-notes.md, "Rows computed alone")."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import bench_engine

    preset = bench_engine.PRESETS["cpu-mixed"]
    bench_engine.build_checkpoint(preset, str(tmp_path), "bfloat16")
    prompts = bench_engine.mixed_prompts(preset)[:96]

    def load(batch_size, lanes=1):
        return Engine.load(str(tmp_path), dtype="bfloat16", sampling=SamplingParams(max_new_tokens=16),
                           engine=EngineConfig(batch_size=batch_size, lanes=lanes), max_prompt_tokens=512)

    def run(engine, indices):
        return {c.prompt_index: c.token_ids for c in engine.generate(GenerationRequest(i, prompts[i], [0]) for i in indices)}

    engine = load(16)
    first = run(engine, range(len(prompts)))
    assert len(first) == len(prompts)
    for m in (2, 3, 7):
        left = [i for i in range(len(prompts)) if i % m]
        resumed = run(engine, left)
        assert sorted(resumed) == left
        assert [i for i in left if resumed[i] != first[i]] == [], m
    for batch_size, lanes in ((8, 1), (32, 2)):
        other = run(load(batch_size, lanes), range(len(prompts)))
        assert [i for i in first if other[i] != first[i]] == [], (batch_size, lanes)


def test_a_bfloat16_cache_read_by_the_cpu_kernel_changes_no_token(tmp_path, monkeypatch):
    """With the CPU kernel on one device a bfloat16 model keeps its KV cache in bfloat16 (half
    the bytes a step reads), where it was float32: the keys and values are bfloat16 values
    either way and every read of them is in float32, so every row gets the tokens a float32
    cache gives it, sampled ones included."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import bench_engine

    from engine import kernels

    preset = bench_engine.PRESETS["cpu-mixed"]
    bench_engine.build_checkpoint(preset, str(tmp_path), "bfloat16")
    prompts = bench_engine.mixed_prompts(preset)[:48]  # 4 to 512 tokens: later prefill chunks too

    def run():
        engine = Engine.load(str(tmp_path), dtype="bfloat16", sampling=SamplingParams(max_new_tokens=20, temperature=0.9),
                             engine=EngineConfig(batch_size=16, decode_attention="cpu"), max_prompt_tokens=512)
        completions = {c.prompt_index: c.token_ids for c in engine.generate(GenerationRequest(i, p, [0]) for i, p in enumerate(prompts))}
        return engine.describe(), completions

    described, halves = run()
    assert "; decode attention cpu over a bfloat16 KV cache;" in described
    monkeypatch.setattr(kernels, "cache_dtype", lambda *args, **kwargs: jnp.float32)
    described, wides = run()
    assert "; decode attention cpu over a float32 KV cache;" in described
    assert len(halves) == len(prompts) and all(len(tokens) == 20 for tokens in halves.values())
    assert [i for i in halves if halves[i] != wides[i]] == []
