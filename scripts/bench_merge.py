"""Benchmark: the merge step against pyarrow alone reading, sorting and writing the same rows.

Builds a synthetic run root (tokenize shards, generate parts keyed by shard with round-robin prompt
assignment, markers), then times, each in a fresh process and side by side:
  pyarrow  read every part (pyarrow.dataset, threaded), sort_by (prompt_index, sample_index),
           write one zstd Parquet file
  merge    steps.merge.merge(cfg, out): key pass, coverage and duplicate checks, ordered bounded files
and prints wall time, peak RSS and the ratio merge / pyarrow (issue 7 asks for <= 1.5x at 1M rows).
pyarrow alone holds every row in memory; merge holds about one output file. With --upload it also
times the upload step putting the merged result into an offline W&B run (issue 7: under 10 s for
1M rows), with W&B's folders under the work folder.

    python scripts/bench_merge.py                    # 1M rows (building the input takes ~30 s)
    python scripts/bench_merge.py --rows 50000       # quick run
    python scripts/bench_merge.py --upload           # and the upload step, offline
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.run import status
from pipeline.run.config import build_config
from pipeline.run.step import StepInput, StepOutput
from steps.generate import SCHEMA

TOKENIZE_HASH, GENERATE_HASH, MERGE_HASH, UPLOAD_HASH = "be0c00000001", "be0c00000002", "be0c00000003", "be0c00000004"
"""Made-up step hashes of the synthetic run."""
WORDS = np.array("the a model river stone light sample token answer question seven blue quickly over".split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="merged rows (prompts x n)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--shards", type=int, default=16, help="tokenize shards")
    parser.add_argument("--part-rows", type=int, default=256, help="rows per generate part (engine.part_rows)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each; the best is reported")
    parser.add_argument("--dir", default=None, help="work folder (default: a temp folder, removed after)")
    parser.add_argument("--upload", action="store_true", help="also time the upload step (offline W&B)")
    parser.add_argument("--child", choices=["pyarrow", "merge", "upload"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.dir)))
        return
    work = args.dir or tempfile.mkdtemp(prefix="bench-merge-")
    try:
        started = time.perf_counter()
        _build(work, args.rows, args.n, args.shards, args.part_rows)
        print(f"input: {args.rows:,} rows in {len(_parts(work)):,} parts ({args.shards} shards, n={args.n}), "
              f"built in {time.perf_counter() - started:.1f}s", flush=True)
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for what in ("pyarrow", "merge"):
                r = _run_child(what, work)
                if what not in best or r["wall_s"] < best[what]["wall_s"]:
                    best[what] = r
        if best:
            ratio = best["merge"]["wall_s"] / best["pyarrow"]["wall_s"]
            print(f"best: pyarrow {best['pyarrow']['wall_s']:.2f}s, merge {best['merge']['wall_s']:.2f}s, "
                  f"ratio merge/pyarrow = {ratio:.2f} (target <= 1.5)")
        if args.upload:
            _run_child("upload", work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def _run_child(what: str, work: str) -> dict:
    child = subprocess.run([sys.executable, __file__, "--child", what, "--dir", work], capture_output=True, text=True)
    if child.returncode:
        sys.exit(f"{what} failed:\n{child.stderr}")
    r = json.loads(child.stdout.splitlines()[-1])
    print(f"  {what:<8} {r['wall_s']:6.2f}s  peak RSS {r['peak_rss_mb']:7.0f} MB  {r['note']}", flush=True)
    return r


def _child(what: str, work: str) -> dict:
    if what == "pyarrow":
        import pyarrow.dataset as ds
        import pyarrow.parquet as pq

        started = time.perf_counter()
        table = ds.dataset(_parts(work), format="parquet").to_table()
        table = table.sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")])
        pq.write_table(table, os.path.join(work, "pyarrow-sorted.parquet"), compression="zstd")
        wall_s = time.perf_counter() - started
        note = f"{table.num_rows:,} rows -> 1 file"
    elif what == "merge":
        from steps.merge import merge

        cfg, out = _config(work)
        started = time.perf_counter()
        result = merge(cfg, out)
        wall_s = time.perf_counter() - started
        note = f"{result.rows:,} rows -> {len(result.files)} files"
    else:
        from steps.upload import upload

        cfg, out = _config(work, step="upload")
        started = time.perf_counter()
        result = upload(cfg, out)  # imports wandb: counted, as in a real run
        wall_s = time.perf_counter() - started
        note = (f"{result.rows:,} rows in {result.summary.table_rows:,}-row table + Parquet -> "
                f"{result.summary.offline_run_dir}")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"wall_s": round(wall_s, 3), "peak_rss_mb": round(peak_mb), "note": note}


def _config(work: str, step: str = "merge"):
    """The config and the StepOutput the runner would hand `step` for the synthetic run."""
    cfg = build_config({"run": {"root": work, "name": "bench"}, "model": {"path": "unused"},
                        "prompts": {"path": "unused"}, "sampling": {"n": _meta(work)["n"]},
                        "wandb": {"mode": "offline"}})
    hashes = {"tokenize": TOKENIZE_HASH, "generate": GENERATE_HASH, "merge": MERGE_HASH, "upload": UPLOAD_HASH}
    urls = {name: storage.step_url(work, name, h) for name, h in hashes.items()}
    earlier = {"merge": ("tokenize", "generate"), "upload": ("tokenize", "generate", "merge")}[step]
    if step == "upload":
        _offline_wandb(work)
        if status.read_marker(urls["merge"]) is None:  # merge once, untimed, as the runner would
            from steps.merge import merge

            result = merge(*_config(work, "merge"))
            status.write_marker(urls["merge"], status.StepRecord(
                step="merge", hash=MERGE_HASH, version="1", files=result.files, summary=result.summary_dict(),
                rows=result.rows, started_at="", finished_at="", wall_s=0.0, config={},
                upstream={"generate": GENERATE_HASH}))
    upstream = {name: StepInput(name, hashes[name], urls[name]) for name in earlier}
    return cfg, StepOutput(step, hashes[step], urls[step], upstream)


def _offline_wandb(work: str) -> None:
    """W&B offline with every folder it writes under the work folder (as tests/conftest.py's wandb_env does)."""
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        os.makedirs(os.path.join(work, "wandb-env", var.lower()), exist_ok=True)
        os.environ[var] = os.path.join(work, "wandb-env", var.lower())
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")


def _parts(work: str) -> list[str]:
    url = storage.step_url(work, "generate", GENERATE_HASH)
    return [storage.join(url, f["path"]) for f in status.read_marker(url).files]


def _meta(work: str) -> dict:
    return storage.read_json(os.path.join(work, "bench.json"))


def _build(work: str, rows: int, n: int, shards: int, part_rows: int) -> None:
    """Tokenize shards and generate parts as those steps leave them, with markers."""
    for step, step_hash in (("tokenize", TOKENIZE_HASH), ("generate", GENERATE_HASH), ("merge", MERGE_HASH),
                            ("upload", UPLOAD_HASH)):
        storage.remove(storage.step_url(work, step, step_hash), recursive=True)  # a reused --dir starts clean
    rng = np.random.default_rng(0)
    prompts = rows // n
    pool_prompts = [" ".join(rng.choice(WORDS, rng.integers(10, 60))) for _ in range(1009)]
    pool_completions = [" ".join(rng.choice(WORDS, rng.integers(5, 90))) for _ in range(1013)]
    tokenize_url = storage.step_url(work, "tokenize", TOKENIZE_HASH)
    generate_url = storage.step_url(work, "generate", GENERATE_HASH)
    tokenize_files, generate_files = [], []
    for shard in range(shards):
        prompt_index = np.arange(shard, prompts, shards, dtype=np.int64)  # round-robin: shards interleave
        shard_table = pa.table({"prompt_index": prompt_index,
                                "prompt_id": [f"id-{p}" for p in prompt_index],
                                "num_tokens": pa.array(np.full(len(prompt_index), 40), pa.int32())})
        tokenize_files.append(storage.write_parquet(storage.join(tokenize_url, f"shard-{shard:05d}.parquet"),
                                                    shard_table))
        keys_p, keys_s = np.repeat(prompt_index, n), np.tile(np.arange(n, dtype=np.int32), len(prompt_index))
        for start in range(0, len(keys_p), part_rows):
            p, s = keys_p[start:start + part_rows], keys_s[start:start + part_rows]
            lengths = rng.integers(4, 96, len(p)).astype(np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            part = pa.table({
                "prompt_index": p, "prompt_id": [f"id-{x}" for x in p], "sample_index": s,
                "prompt": [pool_prompts[x % 1009] for x in p],
                "completion": [pool_completions[(x * 7 + y) % 1013] for x, y in zip(p.tolist(), s.tolist())],
                "completion_token_ids": pa.ListArray.from_arrays(
                    offsets, rng.integers(0, 32000, offsets[-1]).astype(np.int32)),
                "num_prompt_tokens": np.full(len(p), 40, np.int32), "num_completion_tokens": lengths,
                "finish_reason": np.where(lengths == 95, "length", "eos"),
            }).cast(SCHEMA)
            name = f"shard-{shard:05d}/part-{start:09d}.parquet"
            entry = storage.write_parquet(storage.join(generate_url, name), part)
            generate_files.append({**entry, "path": name})
    for url, step, files, upstream in ((tokenize_url, "tokenize", tokenize_files, {}),
                                       (generate_url, "generate", generate_files, {"tokenize": TOKENIZE_HASH})):
        status.write_marker(url, status.StepRecord(
            step=step, hash=url.rsplit("-", 1)[-1], version="1", files=files, summary={},
            rows=sum(f["rows"] for f in files), started_at="", finished_at="", wall_s=0.0, config={},
            upstream=upstream))
    storage.write_json(os.path.join(work, "bench.json"), {"n": n})


if __name__ == "__main__":
    main()
