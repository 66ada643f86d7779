"""Benchmark: the generate step's peak memory does not grow with the number of prompts.

Runs the real steps (`pipeline run tokenize`, then `pipeline run generate`, each its own process)
on a small and a large set of short prompts with a tiny random-weight model and few new tokens,
and prints each generate process's peak RSS (from `wait4`) and the difference. The goal
(issue 13): 1M prompts stay within 1 GB of 10k.

    python scripts/bench_generate_memory.py                       # 10k and 1M prompts
    python scripts/bench_generate_memory.py --prompts 10000 100000  # a quicker run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # demo/ is not installed
sys.path.insert(0, str(REPO / "scripts"))

from bench_tokenize import write_prompts  # noqa: E402
from demo.checkpoint import build_checkpoint  # noqa: E402


def run_step(step: str, config: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `pipeline run STEP` in its own process."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", step, "--config", str(config)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    wall_s = time.perf_counter() - started
    stderr = process.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"pipeline run {step} failed:\n{stderr[-3000:]}")
    return wall_s, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--new", type=int, default=2, help="new tokens per prompt (default 2)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-generate-memory-") as tmp:
        folder = Path(tmp)
        model = build_checkpoint(folder / "model", layers=1, hidden=32, heads=2, kv_heads=1)
        results = []
        for count in args.prompts:
            work = folder / f"n{count}"
            work.mkdir()
            prompts, _ = write_prompts(work, count, "jsonl")
            config = work / "config.yaml"
            config.write_text(json.dumps({  # JSON is YAML
                "run": {"root": str(work / "runs"), "name": "bench"},
                "model": {"path": str(model), "dtype": "float32"},
                "prompts": {"path": str(prompts), "id_field": "id", "max_prompt_tokens": 64},
                "sampling": {"max_new_tokens": args.new, "temperature": 0.0},
                "engine": {"batch_size": 256, "part_rows": 65536},
                "wandb": {"mode": "disabled"},
            }))
            run_step("tokenize", config)
            wall_s, peak = run_step("generate", config)
            results.append((count, wall_s, peak))
            print(f"{count:>9,} prompts: generate {wall_s:7.1f} s, peak RSS {peak / 2**30:.2f} GiB", flush=True)
        (small, _, small_peak), (large, _, large_peak) = results[0], results[-1]
        print(f"peak RSS at {large:,} prompts - at {small:,}: {(large_peak - small_peak) / 2**30:+.2f} GiB "
              f"(goal: within 1 GiB)")


if __name__ == "__main__":
    main()
