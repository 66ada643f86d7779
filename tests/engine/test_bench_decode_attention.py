"""scripts/bench_decode_attention.py on the CPU: the engine's paged attention agrees with JAX's
Pallas decode-attention kernel (run by Pallas' interpreter) over the same keys and values, for
rows at one length and for ragged ones, with and without grouped queries, tuned as the engine
runs it and otherwise (other blocks, and so other pages)."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import bench_decode_attention as bench  # noqa: E402
from bench_engine import PRESETS  # noqa: E402

from engine.llama import cache_pages  # noqa: E402


def rows(preset: str, positions: list[int], ragged: bool, tuning: list[str]) -> list[dict]:
    args = argparse.Namespace(positions=positions, preset=preset, batch=2, dtype=None, layers=1, ragged=ragged, repeats=1,
                              tuning=tuning)
    return list(bench.run(args))


@pytest.mark.parametrize("preset, positions, tuning", [("cpu-tiny", [40, 150], ["max_block_k=16,min_programs=8"]),
                                                       ("tinyllama-1.1b", [300], [])])
@pytest.mark.parametrize("ragged", [False, True])
def test_engine_attention_matches_the_pallas_kernel(preset, positions, tuning, ragged):
    for row in rows(preset, positions, ragged, tuning):
        assert list(row["ways"]) == ["xla", "pallas"] + [f"pallas:{t}" for t in tuning]
        for name, way in row["ways"].items():
            assert "error" not in way, row
            assert name == "xla" or way["max_difference"] < 1e-5, row
        assert row["ways"]["xla"]["ms_per_layer"] > 0  # the kernel ways are timed on a GPU only
        # The engine reads whole pages up to the longest row; the kernel stops at each row's length.
        assert 0 < row["exact_MB_per_layer"] <= row["xla_MB_per_layer"]
        if not ragged:
            read = next(end for end in cache_pages(PRESETS[preset]["prompt_len"] + PRESETS[preset]["new"]) if end >= row["position"])
            assert row["xla_MB_per_layer"] / row["exact_MB_per_layer"] == pytest.approx(read / row["position"], rel=0.01)



def test_other_tunings_read_other_pages():
    """cpu-mixed's cache (576 positions): the engine's attention pages it in quarters of 144,
    the kernel in one page read in 9 blocks of 64, each its own program (2 rows x 4 KV heads
    are far from 1,024 programs); in quarters of 192 (blocks of 64); tuned for 8 programs,
    one program per row and KV head. The kernel ways agree with the engine's attention."""
    row, = rows("cpu-mixed", [300], False, ["pages=4", "min_programs=8"])
    ways = row["ways"]
    assert [ways[name]["page_ends"] for name in ways] == [(144, 288, 432, 576), (576,), (192, 384, 576), (576,)]
    assert ways["pallas"]["blocks"] == [(9, 64)]
    assert ways["pallas:pages=4"]["blocks"] == [(3, 64)] * 2  # the 2 pages holding 300 positions
    assert ways["pallas:min_programs=8"]["blocks"] == [(1, 64)]
    assert all(way["max_difference"] < 1e-5 for name, way in ways.items() if name != "xla"), row
    assert bench.fastest_way([row]) is None  # nothing timed on a CPU


def test_the_fastest_way_and_its_tuning():
    def row(times):
        return {"ways": {name: {"ms_per_layer": ms, "tuning": f"t{name}"} for name, ms in times.items()}}

    rows_ = [row({"xla": 0.1, "pallas": 0.5, "pallas:a": 0.4}), row({"xla": 0.1, "pallas": 0.3, "pallas:a": 0.5})]
    assert bench.fastest_way(rows_) == {"ms_per_layer_summed": {"pallas": 0.8, "pallas:a": 0.9}, "fastest": "pallas",
                                        "tuning": "tpallas"}
