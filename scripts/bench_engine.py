"""Throughput of the engine side by side with transformers' `generate`, in one run.

Builds a random-weight Llama checkpoint with transformers (no download), then generates the
same greedy workload (every row makes exactly --new tokens: the checkpoint has no EOS) with our
engine and with transformers in the same dtype, and prints tokens/s and their ratio. Our
compile time is shown apart: tokens/s is from a second, fully compiled pass.

    python scripts/bench_engine.py --preset cpu-tiny --dtype float32 bfloat16
    python scripts/bench_engine.py --preset cpu-125m --dtype bfloat16
    python scripts/bench_engine.py --preset tinyllama-1.1b --dtype bfloat16 --skip-hf   # on a GPU

Presets (layers x width, vocab; prompts x prompt tokens, new tokens, batch) are the workloads
in docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

PRESETS = {
    "cpu-tiny": dict(layers=4, hidden=256, heads=4, kv_heads=4, intermediate=688, vocab=32000, prompts=64, prompt_len=64, new=128, batch=64),
    "cpu-125m": dict(layers=12, hidden=768, heads=12, kv_heads=12, intermediate=2048, vocab=32000, prompts=32, prompt_len=128, new=128, batch=32),
    "tinyllama-1.1b": dict(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000, prompts=256, prompt_len=128, new=256, batch=256),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, prompts=128, prompt_len=128, new=2048, batch=128),
}


def build_checkpoint(p: dict, folder: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"], num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], max_position_embeddings=4096,
        eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)


def bench_ours(folder: str, p: dict, dtype: str, prompts: np.ndarray) -> dict:
    from engine import Engine, GenerationRequest, SamplingParams

    engine = Engine.load(folder, dtype=dtype, sampling=SamplingParams(max_new_tokens=p["new"]), batch_size=p["batch"],
                         max_prompt_tokens=p["prompt_len"])
    requests = [GenerationRequest(i, row.tolist(), [0]) for i, row in enumerate(prompts)]
    start = time.perf_counter()
    first = list(engine.generate(requests))
    first_wall = time.perf_counter() - start
    compile_s, compilations = engine.stats.compile_time_s, engine.stats.compilations
    start = time.perf_counter()
    second = list(engine.generate(requests))
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in second)
    assert tokens == len(prompts) * p["new"], "every row should make exactly --new tokens"
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    return dict(tok_s=tokens / wall, wall_s=wall, first_pass_s=first_wall, compile_s=compile_s, compilations=compilations,
                peak_memory_gib=(engine.stats.peak_memory_bytes or 0) / 2**30, describe=engine.describe())


def bench_hf(folder: str, p: dict, dtype: str, prompts: np.ndarray) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    batches = [torch.tensor(prompts[i : i + p["batch"]]) for i in range(0, len(prompts), p["batch"])]

    def run(ids: torch.Tensor, new: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)

    run(batches[0][:2], 2)  # warm-up
    start = time.perf_counter()
    tokens = sum(run(ids, p["new"]).shape[1] - ids.shape[1] for ids in batches) * p["batch"]
    wall = time.perf_counter() - start
    return dict(tok_s=tokens / wall, wall_s=wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, help="override the preset's prompt count")
    parser.add_argument("--new", type=int, help="override the preset's new tokens per prompt")
    parser.add_argument("--batch", type=int, help="override the preset's batch size")
    parser.add_argument("--skip-hf", action="store_true", help="only time our engine (e.g. on a GPU without torch CUDA)")
    args = parser.parse_args()
    p = dict(PRESETS[args.preset])
    for key in ("prompts", "new", "batch"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    prompts = np.random.RandomState(0).randint(0, p["vocab"], (p["prompts"], p["prompt_len"]))

    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(p, folder)
        for dtype in args.dtype:
            ours = bench_ours(folder, p, dtype, prompts)
            result = {"preset": args.preset, "dtype": dtype, **{k: p[k] for k in ("prompts", "prompt_len", "new", "batch")},
                      "ours_tok_s": round(ours["tok_s"], 1), "ours_compile_s": round(ours["compile_s"], 2),
                      "ours_compilations": ours["compilations"], "ours_first_pass_s": round(ours["first_pass_s"], 2),
                      "ours_peak_memory_gib": round(ours["peak_memory_gib"], 2)}
            if not args.skip_hf:
                hf = bench_hf(folder, p, dtype, prompts)
                result.update(hf_tok_s=round(hf["tok_s"], 1), ratio=round(ours["tok_s"] / hf["tok_s"], 2))
            print(ours["describe"], flush=True)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
