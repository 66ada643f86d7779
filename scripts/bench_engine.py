"""Throughput of the engine side by side with transformers' `generate`, in one run.

Builds a random-weight Llama checkpoint with transformers (no download), then generates the
same greedy workload (every row makes exactly --new tokens: the checkpoint has no EOS) with our
engine and with transformers in the same dtype, and prints tokens/s and their ratio. Our
compile time is shown apart: tokens/s is from a second, fully compiled pass (or, with
--single-pass, from the first pass minus the time it waited for its programs), compiled into a fresh
compilation cache folder, so that the compile time is compiling, not loading.

Each side's time is also split: `*_prefill_s` is ours running the prefill programs during the
timed pass, and transformers' `generate` of one new token on the same batches (its prompts and
one step), timed after its whole run; `prefill_speedup` and `decode_speedup` compare the two
parts (decode: the whole time minus prefill, host work included). The same FLOPs go into both
sides' prefill, so where prefill is a large share, it bounds the whole run's ratio. With two
lanes (`engine.lanes`, `ours_lanes`) our prefill calls run beside the other lane's decoding:
`ours_prefill_s` is then summed over the lanes, and the two parts are not compared.

transformers runs on CUDA when torch sees a GPU, else on the CPU. Everything torch does
(building the checkpoint, the peer's runs) happens in spawned child processes before JAX
starts in this one, so each side has the device to itself: JAX reserves 75 % of GPU memory
when it starts, and torch's cache would otherwise hold memory JAX needs.

    python scripts/bench_engine.py --preset cpu-tiny --dtype float32 bfloat16
    python scripts/bench_engine.py --preset cpu-125m --dtype bfloat16
    python scripts/bench_engine.py --preset cpu-tiny --dtype float32 --temperature 0.8 --top-p 0.95
    python scripts/bench_engine.py --preset cpu-tiny --logprobs                        # each token's log-probability too
    python scripts/bench_engine.py --preset cpu-tiny --top-logprobs 5                  # and its 5 likeliest alternatives
    python scripts/bench_engine.py --preset cpu-tiny --penalties                       # ours with the three penalties (their cost)
    python scripts/bench_engine.py --preset tinyllama-1.1b --dtype bfloat16            # on a GPU
    python scripts/bench_engine.py --preset llama3-8b --dtype bfloat16                 # on a GPU
    python scripts/bench_engine.py --preset cpu-mixed                                  # batch 16 and 64
    python scripts/bench_engine.py --preset cpu-mixed-prefill --batch 64 --dtype float32
    python scripts/bench_engine.py --preset cpu-mixed --batch 16 --attention xla cpu   # both attentions, one run
    python scripts/bench_engine.py --preset tinyllama-1.1b --window 128 --attention pallas xla   # a sliding window, on a GPU
    python scripts/bench_engine.py --preset tinyllama-1.1b --activations rows features  # each order of the activations
    python scripts/bench_engine.py --preset cpu-tiny --engine "" prefill_tokens=1024    # other EngineConfig fields, in turn

The mixed presets (issue 13) draw 300 prompt lengths log-uniformly between 4 and 512 tokens and
time our engine twice, each in a fresh process: cold (an empty compilation cache folder, so
compile time is included) and warm (the folder the cold run filled: programs are loaded, not
compiled). transformers gets the same token ids, sorted by length and batched (left-padded
within a batch), which favours it. Each side is timed two ways, the same for both:
`generate_s` from the first generate call to the last token, `load_generate_s` from before
loading the checkpoint (`Engine.load`, `from_pretrained`) to the last token, and `process_s`
from before the library's import (JAX and the engine, or torch and transformers) to the last
token. Our engine gets its programs (compiling them, or loading them from the cache) from
`Engine.load` on, while it reads the weights, and a call waits for a program not ready yet:
`generate_s` holds only what is left of that getting when generate starts, `load_generate_s`
all of it. `run_s` is our programs'
running time, summed over the lanes when there are two (they run side by side).

`--overlap-prefill off auto` times each mode of `engine.overlap_prefill` (prefill between decode
calls, or beside them) cold and warm, and checks that both give the same tokens. Fresh processes
vary between runs; `--alternate N` instead times the modes in one process, an engine each on
the same checkpoint: after a first generate each (compiled), N rounds of one warm generate each,
alternating which goes first (our side only):

    python scripts/bench_engine.py --preset cpu-mixed --batch 16 --overlap-prefill off auto
    python scripts/bench_engine.py --preset cpu-mixed --batch 16 --overlap-prefill off auto --alternate 4
    python scripts/bench_engine.py --preset cpu-mixed --batch 16 --overlap-prefill off auto --lanes 1 2 --alternate 4
    python scripts/bench_engine.py --preset cpu-tiny --dtype float32 --lanes 1 2 --skip-hf

Presets (layers x width, vocab; prompts x prompt tokens, new tokens, batch) are the workloads
in docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import itertools
import json
import multiprocessing
import os
import tempfile
import time

import numpy as np

PRESETS = {
    "cpu-tiny": dict(layers=4, hidden=256, heads=4, kv_heads=4, intermediate=688, vocab=32000, prompts=64, prompt_len=64, new=128, batch=64),
    "cpu-125m": dict(layers=12, hidden=768, heads=12, kv_heads=12, intermediate=2048, vocab=32000, prompts=32, prompt_len=128, new=128, batch=32),
    "tinyllama-1.1b": dict(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000, prompts=256, prompt_len=128, new=256, batch=256),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, prompts=128, prompt_len=128, new=2048, batch=128),
    # Mixtral 8x7B's shape (8 experts, 2 a token): for scripts/memory_analysis.py.
    "mixtral-8x7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32000, experts=8, prompts=64, prompt_len=128, new=1024, batch=64),
    # Qwen3-30B-A3B's shape (128 experts of 768 a layer, 8 a token; heads of 128): for scripts/memory_analysis.py.
    "qwen3-30b-a3b": dict(layers=48, hidden=2048, heads=32, kv_heads=4, intermediate=6144, vocab=151936, experts=128,
                          experts_per_token=8, model_type="qwen3_moe", hf=dict(head_dim=128, moe_intermediate_size=768, norm_topk_prob=True),
                          prompts=128, prompt_len=128, new=1024, batch=128),
    # Llama-3-70B's shape at configs/llama3-70b-global-mesh.yaml's lengths: for scripts/memory_analysis.py --mesh.
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256, prompts=128, prompt_len=2048, new=1024, batch=64),
    "cpu-mixed": dict(layers=4, hidden=256, heads=4, kv_heads=4, intermediate=688, vocab=32000, prompts=300, prompt_len=512, new=64,
                      batch=(16, 64), mixed=(4, 512)),
    "cpu-mixed-prefill": dict(layers=4, hidden=256, heads=4, kv_heads=4, intermediate=688, vocab=32000, prompts=300, prompt_len=512,
                              new=8, batch=(16, 64), mixed=(4, 512)),
}
"""prompt_len: every prompt's length, or with `mixed` (lo, hi) the longest allowed (lengths are drawn
log-uniformly in [lo, hi]); batch: one size or several, each timed."""


def _in_child(fn, *args):
    """fn(*args) in a fresh spawned process: its torch threads and GPU memory end with it."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def expert_keys(p: dict) -> dict:
    """A preset's config.json keys for its experts (Mixtral's, unless p['model_type'] says
    otherwise): p['experts'] of them, p['experts_per_token'] (2) a token, and p['hf']'s keys."""
    return dict(num_local_experts=p["experts"], num_experts_per_tok=p.get("experts_per_token", 2), **p.get("hf", {}))


def build_checkpoint(p: dict, folder: str, dtype: str) -> None:
    """Random weights drawn on the GPU when there is one (an 8B model drawn in float32 on the
    CPU takes minutes and 32 GB), saved in `dtype`. With p['window'] a Mistral v0.1 checkpoint:
    the same blocks, attending over a sliding window of that many positions; with p['experts'] a
    Mixtral one, each MLP that many experts of the preset's width, p['experts_per_token'] (2) a token."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                              MixtralForCausalLM)

    shape = dict(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"], num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], max_position_embeddings=4096,
        eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
    )
    if p.get("experts"):
        config, model_class = MixtralConfig(**shape, sliding_window=p.get("window"), **expert_keys(p)), MixtralForCausalLM
    elif p.get("window"):
        config, model_class = MistralConfig(**shape, sliding_window=p["window"]), MistralForCausalLM
    else:
        config, model_class = LlamaConfig(**shape), LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(_torch_device()):
        model = model_class._from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)


PENALTIES = dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3)
"""--penalties: ours with all three, whose programs carry each row's token counts and prompt tokens."""


def bench_ours(folder: str, p: dict, dtype: str, prompts: np.ndarray, single_pass: bool, attention: str,
               lanes: int | str, options: dict | None = None) -> dict:
    from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, kernels

    sampling = SamplingParams(max_new_tokens=p["new"], logprobs=p.get("logprobs", False), top_logprobs=p.get("top_logprobs", 0),
                              **p.get("penalties", {}), **p.get("sampling", {}))
    config = EngineConfig(batch_size=p["batch"], decode_attention=attention, lanes=lanes, **(options or {}))
    engine = Engine.load(folder, dtype=dtype, sampling=sampling, engine=config, max_prompt_tokens=p["prompt_len"])
    requests = [GenerationRequest(i, row.tolist(), [0]) for i, row in enumerate(prompts)]

    def prefill_run_s() -> float:
        return sum(engine.stats.programs.get(kind, {}).get("run_s", 0.0) for kind in ("prefill_fresh", "prefill"))

    start = time.perf_counter()
    first = list(engine.generate(requests))
    first_wall = time.perf_counter() - start
    compile_s, compilations = engine.stats.compile_time_s, engine.stats.compilations
    if single_pass:
        # What getting programs added to the pass: the decode program compiles beside the
        # prefill, so compile_s (summed over threads) would count some of it twice.
        wall, second, prefill_s = first_wall - engine.stats.compile_wait_s, first, prefill_run_s()
    else:
        before = prefill_run_s()
        start = time.perf_counter()
        second = list(engine.generate(requests))
        wall = time.perf_counter() - start
        prefill_s = prefill_run_s() - before
        # The same rows and tokens; the order rows finish in may differ (lanes finish side by side).
        assert {(c.prompt_index, c.sample_index): c.token_ids for c in first} == {(c.prompt_index, c.sample_index): c.token_ids for c in second}
    tokens = sum(len(c.token_ids) for c in second)
    assert tokens == len(prompts) * p["new"], "every row should make exactly --new tokens"
    if p.get("logprobs"):
        assert all(len(c.logprobs) == len(c.token_ids) for c in second)
    if p.get("top_logprobs"):
        assert all(len(c.top_logprobs) == len(c.token_ids) for c in second)
    attention = engine.attention + (f" ({kernels.TUNING})" if engine.attention == "pallas" else "")
    return dict(tok_s=tokens / wall, wall_s=wall, prefill_s=prefill_s, first_pass_s=first_wall, compile_s=compile_s,
                compilations=compilations, lanes=engine.plan.lanes, attention=attention,
                peak_memory_gib=(engine.stats.peak_memory_bytes or 0) / 2**30, describe=engine.describe(),
                device_kind=engine.devices[0].device_kind)


def bench_hf(folder: str, p: dict, dtype: str, prompts: np.ndarray) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = _torch_device()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    batches = [torch.tensor(prompts[i : i + p["batch"]], device=device) for i in range(0, len(prompts), p["batch"])]

    # The same temperature, top_p and top_k as ours: top_k=0 switches off transformers' default of 50.
    draw = dict(do_sample=True, **p["sampling"]) if "sampling" in p else dict(do_sample=False)

    # With --logprobs (--top-logprobs), transformers' way to the same numbers: each step's raw logits,
    # log-softmaxed, at the token drawn (their K largest).
    logits = dict(output_logits=True, return_dict_in_generate=True) if p.get("logprobs") or p.get("top_logprobs") else {}

    def run(ids: torch.Tensor, new: int) -> torch.Tensor:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=0, **draw, **logits)
            if not logits:
                return out
            new_ids = out.sequences[:, ids.shape[1]:]
            distributions = torch.stack(out.logits, 1).float().log_softmax(-1)
            if p.get("logprobs"):
                logprobs = distributions.gather(-1, new_ids[..., None])
                assert logprobs.shape[:2] == new_ids.shape
            if p.get("top_logprobs"):
                top = distributions.topk(p["top_logprobs"], dim=-1)
                assert top.values.shape[:2] == new_ids.shape
            return out.sequences

    def timed(new: int) -> tuple[int, float]:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = sum(run(ids, new).shape[1] - ids.shape[1] for ids in batches) * p["batch"]
        if device == "cuda":
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - start

    run(batches[0][:2], 2)  # warm-up
    tokens, wall = timed(p["new"])
    _, prefill_s = timed(1)  # the prompts and one token: what the whole run spends before decoding
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return dict(tok_s=tokens / wall, wall_s=wall, prefill_s=prefill_s, device=f"{name}, torch {torch.__version__}",
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)


def mixed_prompts(p: dict, seed: int = 0) -> list[list[int]]:
    """p['prompts'] prompts, lengths log-uniform in p['mixed'] = (lo, hi), random token ids."""
    rng = np.random.RandomState(seed)
    lo, hi = p["mixed"]
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), p["prompts"])).astype(int).clip(lo, hi)
    return [rng.randint(0, p["vocab"], n).tolist() for n in lengths]


def bench_ours_mixed(folder: str, p: dict, dtype: str, batch: int, prompts: list[list[int]], cache_dir: str,
                     variant: dict) -> dict:
    """One fresh process: Engine.load + generate, timed as a whole; compile cache in cache_dir.
    variant: EngineConfig fields (overlap_prefill, decode_attention, lanes)."""
    os.environ["PIPELINE_CACHE_DIR"] = cache_dir
    start = time.perf_counter()
    importlib.import_module("engine.engine")  # JAX, haliax and the engine (`engine` alone imports them lazily): process_s only

    load_start = time.perf_counter()
    ours = _mixed_engine(folder, p, dtype, batch, variant)
    generate_start = time.perf_counter()
    out = list(ours.generate(_mixed_requests(prompts)))
    end = time.perf_counter()
    tokens = sum(len(c.token_ids) for c in out)
    assert tokens == len(prompts) * p["new"], "every row should make exactly --new tokens"
    s = ours.stats
    return dict(process_s=end - start, load_generate_s=end - load_start, generate_s=end - generate_start,
                compile_s=s.compile_time_s, compilations=s.compilations,
                cache_loads=s.cache_loads, run_s=s.decode_time_s, prefill_calls=s.prefill_calls, decode_calls=s.decode_calls,
                prefill_pages_read=s.prefill_pages_read,
                padding=s.padded_prompt_tokens / max(1, s.prompt_tokens), describe=ours.describe(),
                tokens={c.prompt_index: c.token_ids for c in out})


def _mixed_engine(folder: str, p: dict, dtype: str, batch: int, variant: dict):
    from engine import Engine, EngineConfig, SamplingParams

    return Engine.load(folder, dtype=dtype, sampling=SamplingParams(max_new_tokens=p["new"]),
                       engine=EngineConfig(batch_size=batch, **variant), max_prompt_tokens=p["prompt_len"])


def _mixed_requests(prompts: list[list[int]]):
    from engine import GenerationRequest

    return (GenerationRequest(i, ids, [0]) for i, ids in enumerate(prompts))


def by_length(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """The prompts' indices sorted by length, in batches: transformers' fairest padding."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[b : b + batch] for b in range(0, len(order), batch)]


def padded(rows: list[list[int]], left: bool):
    """(token ids, attention mask) as torch tensors, each row padded with 0 to the longest, on
    the left or the right."""
    import torch

    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        ids[r, where], mask[r, where] = torch.tensor(row), 1
    return ids, mask


def bench_hf_mixed(folder: str, p: dict, dtype: str, batch: int, prompts: list[list[int]]) -> dict:
    process_start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM

    load_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    out: dict[int, list[int]] = {}
    start = time.perf_counter()
    for idx in by_length(prompts, batch):
        ids, mask = padded([prompts[i] for i in idx], left=True)  # as generate expects for decoder-only models
        width = ids.shape[1]
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=p["new"], min_new_tokens=p["new"],
                                 do_sample=False, pad_token_id=0)
        for r, i in enumerate(idx):
            out[i] = gen[r, width:].tolist()
    end = time.perf_counter()
    return dict(generate_s=end - start, load_generate_s=end - load_start, process_s=end - process_start,
                device=f"cpu, torch {torch.__version__}", tokens=out)


def alternate_mixed(folder: str, p: dict, dtype: str, batch: int, prompts: list[list[int]], variants: list[dict], rounds: int,
                    cache_dir: str) -> dict:
    """One process, an engine per variant (EngineConfig fields): a first generate each (compiling
    or loading its programs), then `rounds` rounds of one timed generate each, the order turned
    round every round. Returns the wall times per variant, after checking every run's tokens."""
    os.environ["PIPELINE_CACHE_DIR"] = cache_dir
    engines = [_mixed_engine(folder, p, dtype, batch, variant) for variant in variants]

    def run(engine) -> dict[int, list[int]]:
        return {c.prompt_index: c.token_ids for c in engine.generate(_mixed_requests(prompts))}

    expected = [run(engine) for engine in engines]
    check_variants(dtype, variants, expected)
    walls: list[list[float]] = [[] for _ in engines]
    for r in range(rounds):
        order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            start = time.perf_counter()
            assert run(engines[i]) == expected[i], "a warm generate changed tokens"
            walls[i].append(round(time.perf_counter() - start, 2))
    return {"walls": walls, "describe": [engine.describe() for engine in engines]}


def check_variants(dtype: str, variants: list[dict], tokens: list[dict[int, list[int]]]) -> None:
    """Every variant's tokens (by prompt) must be the same, except across decode attentions in
    bfloat16, which round differently: there it prints how many rows are the same."""
    for i, (variant, got) in enumerate(zip(variants, tokens)):
        first = next(j for j, v in enumerate(variants) if dtype != "bfloat16" or v["decode_attention"] == variant["decode_attention"])
        assert got == tokens[first], f"{variant} changed tokens against {variants[first]}"
        if first == i and i > 0:
            same = sum(got[k] == tokens[0][k] for k in got)
            print(json.dumps({"dtype": dtype, "rows_equal": f"{same}/{len(got)}", "between": [variants[0], variant]}), flush=True)


def run_mixed(args, p: dict) -> None:
    prompts = mixed_prompts(p)
    variants = {f"{o}" + (f"/{a}" if len(args.attention) > 1 else "") + (f"/lanes={n}" if len(args.lanes) > 1 else ""):
                dict(overlap_prefill=OVERLAP[o], decode_attention=a, lanes=n)
                for o, a, n in itertools.product(args.overlap_prefill, args.attention, args.lanes)}
    batches = [args.batch] if args.batch else list(p["batch"])
    with tempfile.TemporaryDirectory() as folder:
        _in_child(build_checkpoint, p, folder, "float32" if "float32" in args.dtype else "bfloat16")
        if args.alternate:
            for dtype, batch in itertools.product(args.dtype, batches):
                with tempfile.TemporaryDirectory() as cache_dir:
                    out = _in_child(alternate_mixed, folder, p, dtype, batch, prompts, list(variants.values()),
                                    args.alternate, cache_dir)
                for describe in out["describe"]:
                    print(describe, flush=True)
                result = {"preset": args.preset, "dtype": dtype, "batch": batch, "warm_generate_s": {
                    name: walls for name, walls in zip(variants, out["walls"])}}
                result["mean_s"] = {o: round(sum(w) / len(w), 2) for o, w in result["warm_generate_s"].items()}
                print(json.dumps(result), flush=True)
            return
        lengths = [len(x) for x in prompts]
        print(json.dumps({"preset": args.preset, "prompts": len(prompts), "prompt_tokens": sum(lengths),
                          "median_len": int(np.median(lengths)), "max_len": max(lengths), "new": p["new"]}), flush=True)
        for dtype in args.dtype:
            for batch in batches:
                hf = None if args.skip_hf else _in_child(bench_hf_mixed, folder, p, dtype, batch, prompts)
                tokens = [_report_mixed(args, p, folder, dtype, batch, prompts, hf, variant) for variant in variants.values()]
                check_variants(dtype, list(variants.values()), tokens)


OVERLAP = {"auto": "auto", "on": True, "off": False}
"""--overlap-prefill's choices: `engine.overlap_prefill`."""


def _lanes(text: str):
    """--lanes' values: `engine.lanes`, auto or a count."""
    return text if text == "auto" else int(text)


def _engine_options(text: str) -> dict:
    """--engine's values: 'prefill_tokens=8192,prefill_chunk_tokens=128', EngineConfig fields,
    each value read as YAML reads a config's (8192, 0.8, true, auto); '' is the engine's
    defaults. A value the engine refuses is refused here, before anything is built."""
    import yaml

    from engine import EngineConfig
    from engine.config import InvalidConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"batch_size", "decode_attention", "lanes"}
    options = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(fields))}")
        options[name] = yaml.safe_load(value)
    try:
        EngineConfig(**options)
    except InvalidConfig as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return options


def _report_mixed(args, p: dict, folder: str, dtype: str, batch: int, prompts: list[list[int]], hf: dict | None,
                  variant: dict) -> dict[int, list[int]]:
    """Our cold and warm runs (fresh processes, a fresh compile cache), beside transformers' `hf`;
    returns the tokens by prompt."""
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = _in_child(bench_ours_mixed, folder, p, dtype, batch, prompts, cache_dir, variant)
        warm = _in_child(bench_ours_mixed, folder, p, dtype, batch, prompts, cache_dir, variant)
    assert cold["tokens"] == warm["tokens"]
    result = {"preset": args.preset, "dtype": dtype, "batch": batch, **variant}
    for name, r in (("cold", cold), ("warm", warm)):
        result.update({f"{name}_process_s": round(r["process_s"], 2), f"{name}_load_generate_s": round(r["load_generate_s"], 2),
                       f"{name}_generate_s": round(r["generate_s"], 2),
                       f"{name}_compile_s": round(r["compile_s"], 2), f"{name}_compiled": r["compilations"],
                       f"{name}_loaded": r["cache_loads"]})
    result.update(run_s=round(warm["run_s"], 2), prefill_calls=warm["prefill_calls"], prefill_pages_read=warm["prefill_pages_read"],
                  decode_calls=warm["decode_calls"],
                  prefill_padding=round(warm["padding"], 2))
    if hf is not None:
        same = sum(hf["tokens"][i] == warm["tokens"][i] for i in range(len(prompts)))
        result.update(hf_generate_s=round(hf["generate_s"], 2), hf_load_generate_s=round(hf["load_generate_s"], 2),
                      hf_process_s=round(hf["process_s"], 2),
                      cold_generate_over_hf=round(cold["generate_s"] / hf["generate_s"], 2),
                      cold_load_generate_over_hf=round(cold["load_generate_s"] / hf["load_generate_s"], 2),
                      cold_process_over_hf=round(cold["process_s"] / hf["process_s"], 2),
                      warm_generate_speedup=round(hf["generate_s"] / warm["generate_s"], 2),
                      warm_load_generate_speedup=round(hf["load_generate_s"] / warm["load_generate_s"], 2),
                      warm_process_speedup=round(hf["process_s"] / warm["process_s"], 2),
                      same_tokens_as_hf=f"{same}/{len(prompts)}")
    print(cold["describe"], flush=True)
    print(json.dumps(result), flush=True)
    return warm["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, help="override the preset's prompt count")
    parser.add_argument("--new", type=int, help="override the preset's new tokens per prompt")
    parser.add_argument("--batch", type=int, help="override the preset's batch size")
    parser.add_argument("--window", type=int,
                        help="a Mistral checkpoint of the preset's shape, attending over a sliding window of this many positions")
    parser.add_argument("--experts", type=int,
                        help="a Mixtral checkpoint of the preset's shape, each MLP this many experts (two a token)")
    parser.add_argument("--experts-per-token", type=int, help="with --experts: the router's top k (default 2)")
    parser.add_argument("--skip-hf", action="store_true", help="only time our engine")
    parser.add_argument("--overlap-prefill", nargs="+", choices=sorted(OVERLAP), default=["auto"],
                        help="mixed presets: engine.overlap_prefill, one run (cold and warm) per value")
    parser.add_argument("--alternate", type=int, metavar="N",
                        help="mixed presets: instead, N rounds of warm generates, one per --overlap-prefill, --attention and --lanes value, in one process")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample instead of greedy (steady-state presets; both sides, same settings)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off on both sides (transformers' default is 50)")
    parser.add_argument("--logprobs", action="store_true",
                        help="steady-state presets: each new token's log-probability too (sampling.logprobs; "
                             "transformers: generate's output_logits, log-softmaxed)")
    parser.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                        help="steady-state presets: each new token's K likeliest alternatives too (sampling.top_logprobs; "
                             "transformers: generate's output_logits, log-softmaxed, topk)")
    parser.add_argument("--penalties", action="store_true",
                        help="steady-state presets: ours with all three penalties (repetition 1.2, presence and frequency "
                             "0.3: token counts and prompt tokens carried per row); transformers runs without")
    parser.add_argument("--attention", nargs="+", choices=["auto", "xla", "pallas", "cpu"], default=["auto"],
                        help="engine.decode_attention: each value is timed in turn (cpu: the engine's C++ kernel)")
    parser.add_argument("--lanes", nargs="+", type=_lanes, default=["auto"],
                        help="engine.lanes (auto or a count): each value is timed in turn")
    parser.add_argument("--kernel-tuning", nargs="+", metavar="NAME=N,...", default=[""],
                        help="how the pallas attention reads the cache (engine.kernels.KernelTuning fields, e.g. the fastest "
                             "of scripts/bench_decode_attention.py's --tuning ways; '' the engine's): each timed in turn")
    parser.add_argument("--engine", nargs="+", type=_engine_options, default=[{}], metavar="NAME=VALUE,...",
                        help="steady-state presets: other EngineConfig fields (e.g. prefill_tokens=8192,"
                             "prefill_chunk_tokens=128; '' the defaults): each timed in turn")
    parser.add_argument("--activations", nargs="+", choices=["auto", "rows", "features"], default=["auto"],
                        help="the activations' order (engine.llama.rows_first; auto: rows first on accelerators, "
                             "feature first on the CPU): each timed in turn")
    parser.add_argument("--single-pass", action="store_true",
                        help="time our first pass minus its wait for programs instead of a second pass (halves our run time)")
    args = parser.parse_args()
    p = dict(PRESETS[args.preset])
    for key in ("prompts", "new", "batch", "window", "experts", "experts_per_token"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    if "mixed" in p:
        if (args.temperature or args.kernel_tuning != [""] or args.logprobs or args.top_logprobs or args.penalties
                or args.activations != ["auto"] or args.engine != [{}]):
            parser.error("--temperature, --logprobs, --top-logprobs, --penalties, --kernel-tuning, --activations and "
                         "--engine apply to the steady-state presets only")
        run_mixed(args, p)
        return
    if args.temperature:
        p["sampling"] = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    p["logprobs"], p["top_logprobs"] = args.logprobs, args.top_logprobs
    if args.penalties:
        p["penalties"] = PENALTIES
    prompts = np.random.RandomState(0).randint(0, p["vocab"], (p["prompts"], p["prompt_len"]))
    from engine import kernels, llama

    try:
        tunings = [kernels.KernelTuning.parse(text) for text in args.kernel_tuning]
    except ValueError as e:
        parser.error(str(e))

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        _in_child(build_checkpoint, p, folder, "float32" if "float32" in args.dtype else "bfloat16")
        print(f"checkpoint built in {time.perf_counter() - start:.1f} s", flush=True)
        # The peer first, each run in its own process, so that JAX (started below) finds the device free.
        peers = {}
        for dtype in [] if args.skip_hf else args.dtype:
            peers[dtype] = _in_child(bench_hf, folder, p, dtype, prompts)
            print(json.dumps({"peer": "transformers", "dtype": dtype, **peers[dtype]}), flush=True)
        # A fresh compilation cache, so that ours_compile_s is compiling, not loading what an earlier run left.
        os.environ["PIPELINE_CACHE_DIR"] = os.path.join(folder, "pipeline-cache")
        for dtype, attention, lanes, tuning, order, options in itertools.product(
                args.dtype, args.attention, args.lanes, tunings, args.activations, args.engine):
            if attention == "xla" and tuning != tunings[0]:
                continue  # the tuning is the kernel's: xla once
            kernels.TUNING = tuning  # read by Engine.load
            llama.ROWS_FIRST = {"auto": None, "rows": True, "features": False}[order]  # read as the programs are traced
            ours = bench_ours(folder, p, dtype, prompts, args.single_pass, attention, lanes, options)
            result = {"preset": args.preset, "dtype": dtype, **{k: p[k] for k in ("prompts", "prompt_len", "new", "batch")},
                      **{key: p[key] for key in ("window", "experts", "experts_per_token") if p.get(key)},
                      "sampling": p.get("sampling", "greedy"), "logprobs": p["logprobs"], "top_logprobs": p["top_logprobs"], "ours_penalties": bool(p.get("penalties")), "ours_attention": ours["attention"], "ours_rows_first": llama.rows_first(),
                      **({"ours_engine": options} if options else {}),
                      "ours_tok_s": round(ours["tok_s"], 1), "ours_wall_s": round(ours["wall_s"], 2),
                      "ours_prefill_s": round(ours["prefill_s"], 2), "ours_lanes": ours["lanes"],
                      "ours_timed": "first pass minus its wait for programs" if args.single_pass else "second pass",
                      "ours_compile_s": round(ours["compile_s"], 2),
                      "ours_compilations": ours["compilations"], "ours_first_pass_s": round(ours["first_pass_s"], 2),
                      "ours_peak_memory_gib": round(ours["peak_memory_gib"], 2), "ours_device": ours["device_kind"]}
            if dtype in peers:
                hf = peers[dtype]
                result.update(hf_tok_s=round(hf["tok_s"], 1), hf_wall_s=round(hf["wall_s"], 2), hf_device=hf["device"],
                              ratio=round(ours["tok_s"] / hf["tok_s"], 2), hf_prefill_s=round(hf["prefill_s"], 2))
                if ours["lanes"] == 1:  # with lanes, our prefill overlaps decoding: no split of the wall time
                    result.update(prefill_speedup=round(hf["prefill_s"] / ours["prefill_s"], 2),
                                  decode_speedup=round((hf["wall_s"] - hf["prefill_s"]) / (ours["wall_s"] - ours["prefill_s"]), 2))
            print(ours["describe"], flush=True)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
