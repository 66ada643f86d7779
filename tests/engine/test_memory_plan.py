"""Issue 13: the Llama-3-8B seed workload (batch 128, 128 + 2,048 tokens) is planned from shapes
alone, and XLA's own memory analysis of the compiled decode program, lowered on the CPU from
abstract inputs (no weights), agrees with the plan: the cache is read where it lives, so the
program's temporaries are small next to the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "memory_analysis.py")


def test_8b_decode_program_reads_the_cache_in_place_and_matches_the_plan():
    done = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "llama3-8b", "--dtype", "float32", "--cache-dtype", "float32", "--skip-prefill"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plan, decode = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert (plan["batch"], plan["prompt"], plan["new"]) == (128, 128, 2048)
    assert decode["program"] == "decode"
    assert decode["alias_gib"] == decode["output_gib"] > 60  # the whole cache is donated and updated in place
    assert decode["temp_gib"] < 1.0, decode  # no copy of the cache or of a window of it
    assert 1.0 <= decode["plan_over_peak"] <= 1.1, decode  # the plan never under-counts, by at most 10 %
