"""Benchmark: the tokenize step against the fast tokenizer alone, side by side in one run.

Writes N short prompts (JSONL by default) to a temp folder, then times, in one process:
  - `tokenizer(batch)["input_ids"]`: transformers' fast tokenizer on the texts in memory;
  - `backend_tokenizer.encode_batch_fast(batch)`: the Rust tokenizer alone, no transformers;
  - the tokenize step end to end (read + check + tokenize + balance + write shards).
Tokenizer loading is outside every timing (the step reuses the cached tokenizer). Prints
the step's time over each baseline's; the goal is <= 1.3x the faster baseline. On a
shared machine, wall times swing with other processes: the best of --repeats (alternated)
and the CPU-time ratio (this process's user+sys seconds) are the steadier figures.

    python scripts/bench_tokenize.py                      # 1M prompts, the demo tokenizer
    python scripts/bench_tokenize.py --prompts 100000     # a quick run
    python scripts/bench_tokenize.py --model path/to/hf-checkpoint --format parquet
"""

from __future__ import annotations

import argparse
import sys
import json
import random
import tempfile
import time
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog explain to child how coral reefs grow translate "
         "into pirate speak sentence about moon landing write short story robot who learns paint "
         "why is sky blue list three facts summarize").split()


def write_prompts(folder: Path, count: int, fmt: str, seed: int = 0) -> tuple[Path, list[str]]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "?"
             for _ in range(count)]
    path = folder / f"prompts.{fmt}"
    if fmt == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts))
    elif fmt == "txt":
        path.write_text("".join(t + "\n" for t in texts))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [f"p{i}" for i in range(count)], "prompt": texts}), path)
    return path, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1_000_000, help="number of prompts (default 1M)")
    parser.add_argument("--model", default=None, help="checkpoint folder with a tokenizer (default: build the demo one)")
    parser.add_argument("--format", choices=("jsonl", "parquet", "txt"), default="jsonl")
    parser.add_argument("--repeats", type=int, default=1, help="alternate baseline/step this often; keep the best")
    parser.add_argument("--chat-template", action="store_true", help="also format with the chat template")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: demo/ is not installed
    from demo.checkpoint import build_checkpoint
    from pipeline.run.config import build_config
    from engine.checkpoint import load_tokenizer
    from pipeline.run.step import StepOutput
    from steps.tokenize import BATCH_ROWS, tokenize

    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        folder = Path(tmp)
        model = args.model or str(build_checkpoint(folder / "model", layers=1, hidden=32, heads=2, kv_heads=1))
        path, texts = write_prompts(folder, args.prompts, args.format)
        cfg = build_config({
            "run": {"root": str(folder / "runs"), "name": "bench"},
            "model": {"path": model},
            "prompts": {"path": str(path), "id_field": None if args.format == "txt" else "id",
                        "max_prompt_tokens": 100_000, "chat_template": args.chat_template},
        })
        tokenizer = load_tokenizer(model)
        backend = tokenizer.backend_tokenizer
        inputs = texts
        if args.chat_template:
            inputs = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                    add_generation_prompt=True) for t in texts]
        best = {name: [float("inf"), float("inf")] for name in ("transformers", "rust", "step")}

        def timed(name: str, work) -> object:
            wall, cpu = time.perf_counter(), time.process_time()
            value = work()
            best[name][0] = min(best[name][0], time.perf_counter() - wall)
            best[name][1] = min(best[name][1], time.process_time() - cpu)
            return value

        def with_transformers() -> int:
            return sum(sum(map(len, tokenizer(inputs[i:i + BATCH_ROWS])["input_ids"]))
                       for i in range(0, len(inputs), BATCH_ROWS))

        def with_rust() -> None:
            for i in range(0, len(inputs), BATCH_ROWS):
                [e.ids for e in backend.encode_batch_fast(inputs[i:i + BATCH_ROWS])]

        for repeat in range(args.repeats):
            tokens = timed("transformers", with_transformers)
            timed("rust", with_rust)
            out = StepOutput("tokenize", f"bench{repeat}", str(folder / "runs" / f"tokenize-{repeat}"))
            result = timed("step", lambda: tokenize(cfg, out))
            assert result.rows == len(texts) and result.summary.tokens == tokens, (result.summary, tokens)

    n = len(texts)
    print(f"{n:,} prompts ({args.format}{', chat template' if args.chat_template else ''}), "
          f"{tokens:,} tokens ({tokens / n:.1f} per prompt), best of {args.repeats}")
    for name, (wall, cpu) in best.items():
        print(f"  {name:<13} {wall:8.2f} s wall {n / wall:>10,.0f} prompts/s   {cpu:8.2f} s cpu")
    for name, label in (("transformers", "transformers tokenizer"), ("rust", "rust encode_batch_fast")):
        print(f"ratio step / {label}: {best['step'][0] / best[name][0]:.2f}x wall, "
              f"{best['step'][1] / best[name][1]:.2f}x cpu" + ("   (goal <= 1.3x)" if name == "rust" else ""))


if __name__ == "__main__":
    main()
