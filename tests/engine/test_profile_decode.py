"""scripts/profile_decode.py, which the GPU runs rely on (scripts/gpu_bench.sh --profile): it
times the engine's decode program at the positions asked, counts the cache pages a call at
each position reads, and names the kernels of a traced call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "profile_decode.py")


def test_profile_decode_counts_the_pages_read_and_names_the_kernels(tmp_path):
    done = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "cpu-tiny", "--batch", "4", "--repeats", "2", "--trace", "--top", "5",
         "--hlo", str(tmp_path), "--attention", "xla", "16", "96"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["position"] for row in rows] == [16, 96]
    # cpu-tiny holds 64 + 128 positions in four pages of 48: rows at 16 read one page, at 96 two
    # (the engine's XLA attention; the CPU kernel reads each row to its position).
    assert [row["cache_positions_read"] for row in rows] == [48, 96]
    assert rows[0]["GB_per_step"] < rows[1]["GB_per_step"]
    for row in rows:
        assert row["ms_per_step"] > 0
        assert len(row["us_per_layer_step"]) == 5 and all(us > 0 for us, _ in row["us_per_layer_step"].values())
        assert not any(name.startswith("ThunkExecutor") for name in row["us_per_layer_step"])  # kernels, not runtime spans
    (hlo,) = tmp_path.glob("decode-cpu-tiny-bfloat16-b4.hlo")
    assert "while" in hlo.read_text()  # the decode loop's optimized program
