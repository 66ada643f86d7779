"""Scoring prompts (`sampling.prompt_logprobs`) side by side with transformers, in one run.

Builds a random-weight Llama checkpoint with transformers (no download), then gives each side the
same prompts (a mixed preset's: lengths log-uniform between its bounds, random token ids) and
asks for every prompt token's log-probability given the tokens before it:

- ours: `Engine.generate` with `prompt_logprobs=True` and `max_new_tokens=1` (prefill only, one
  token drawn), a first call to get the programs, then `--repeats` timed calls; the same without
  prompt_logprobs shows what the scoring adds to the prefill;
- transformers: a forward pass over the prompts sorted by length, batched (right-padded within a
  batch, which favours it), the float32 log-softmax of the logits gathered at each next token.

Prints one JSON line: each side's best time, the ratio, and the largest difference between the
two sides' log-probabilities.

    python scripts/bench_scoring.py --preset cpu-mixed-prefill --batch 64 --dtype float32
    python scripts/bench_scoring.py --dtype bfloat16

Time it on a machine with nothing else running: figures taken under load are not comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as bench  # noqa: E402 - the presets, the checkpoint and the prompts


def score_hf(folder: str, dtype: str, batch: int, prompts: list[list[int]], repeats: int) -> dict:
    """transformers' log-probabilities of each prompt's tokens after the first, and its best time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    best, out = float("inf"), {}
    for _ in range(repeats):
        start = time.perf_counter()
        for idx in bench.by_length(prompts, batch):
            ids, mask = bench.padded([prompts[i] for i in idx], left=False)
            with torch.inference_mode():
                logits = model(ids, attention_mask=mask).logits[:, :-1].float()
                scores = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
            for r, i in enumerate(idx):
                out[i] = scores[r, : len(prompts[i]) - 1].tolist()
        best = min(best, time.perf_counter() - start)
    return dict(seconds=best, scores=out, device=f"cpu, torch {torch.__version__}")


def score_ours(folder: str, dtype: str, batch: int, prompts: list[list[int]], repeats: int, max_prompt_tokens: int,
               prompt_logprobs: bool) -> dict:
    """Our engine's prompt log-probabilities (with prompt_logprobs) and its best warm time."""
    from engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    engine = Engine.load(folder, dtype=dtype, sampling=SamplingParams(max_new_tokens=1, prompt_logprobs=prompt_logprobs),
                         engine=EngineConfig(batch_size=batch), max_prompt_tokens=max_prompt_tokens)

    def run() -> dict[int, list[float]]:
        got = engine.generate(GenerationRequest(i, ids, [0]) for i, ids in enumerate(prompts))
        return {c.prompt_index: c.prompt_logprobs for c in got}

    out, best = run(), float("inf")  # the first call gets the programs
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return dict(seconds=best, scores=out, describe=engine.describe())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mixed = sorted(name for name, p in bench.PRESETS.items() if "mixed" in p)
    parser.add_argument("--preset", choices=mixed, default="cpu-mixed-prefill")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side (the best counts)")
    args = parser.parse_args()
    p = bench.PRESETS[args.preset]
    prompts = bench.mixed_prompts(p)
    with tempfile.TemporaryDirectory(prefix="bench-scoring-") as folder:
        bench._in_child(bench.build_checkpoint, p, folder, args.dtype)
        hf = bench._in_child(score_hf, folder, args.dtype, args.batch, prompts, args.repeats)  # torch before JAX starts
        os.environ.setdefault("PIPELINE_CACHE_DIR", os.path.join(folder, "compile-cache"))
        ours = score_ours(folder, args.dtype, args.batch, prompts, args.repeats, p["prompt_len"], True)
        plain = score_ours(folder, args.dtype, args.batch, prompts, args.repeats, p["prompt_len"], False)
    diffs = [abs(a - b) for i, theirs in hf["scores"].items() for a, b in zip(ours["scores"][i][1:], theirs)]
    assert all(len(ours["scores"][i]) == len(prompts[i]) for i in range(len(prompts)))
    tokens = sum(len(x) - 1 for x in prompts)
    print(json.dumps({
        "preset": args.preset, "dtype": args.dtype, "batch": args.batch, "prompts": len(prompts), "scored_tokens": tokens,
        "ours_s": round(ours["seconds"], 3), "ours_without_scores_s": round(plain["seconds"], 3),
        "transformers_s": round(hf["seconds"], 3), "speedup": round(hf["seconds"] / ours["seconds"], 2),
        "ours_tokens_per_s": round(tokens / ours["seconds"]), "transformers_tokens_per_s": round(tokens / hf["seconds"]),
        "max_abs_diff": float(np.max(diffs)), "mean_abs_diff": float(np.mean(diffs)),
        "ours": ours["describe"], "transformers": hf["device"],
    }))


if __name__ == "__main__":
    main()
