"""scripts/bench_decode_attention.py on the CPU: the engine's paged attention agrees with JAX's
Pallas decode-attention kernel (run by Pallas' interpreter) over the same pages, for rows at
one length and for ragged ones, with and without grouped queries."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import bench_decode_attention as bench  # noqa: E402
from bench_engine import PRESETS  # noqa: E402

from engine.llama import cache_pages  # noqa: E402


def rows(preset: str, positions: list[int], ragged: bool) -> list[dict]:
    args = argparse.Namespace(positions=positions, preset=preset, batch=2, dtype=None, layers=1, ragged=ragged, repeats=1, split=None,
                              page_multiple=16)
    return list(bench.run(args))


@pytest.mark.parametrize("preset, positions", [("cpu-tiny", [40, 150]), ("tinyllama-1.1b", [300])])
@pytest.mark.parametrize("ragged", [False, True])
def test_engine_attention_matches_the_pallas_kernel(preset, positions, ragged):
    for row in rows(preset, positions, ragged):
        assert "pallas_error" not in row, row
        assert row["max_difference"] < 1e-5, row
        # The engine reads whole pages up to the longest row; the kernel stops at each row's length.
        assert 0 < row["exact_MB_per_layer"] <= row["xla_MB_per_layer"]
        if not ragged:
            read = next(end for end in cache_pages(PRESETS[preset]["prompt_len"] + PRESETS[preset]["new"]) if end >= row["position"])
            assert row["xla_MB_per_layer"] / row["exact_MB_per_layer"] == pytest.approx(read / row["position"], rel=0.01)

