"""Issue 13: the Llama-3-8B seed workload (batch 128, 128 + 2,048 tokens) is planned from shapes
alone, and XLA's own memory analysis of the compiled decode program, lowered on the CPU from
abstract inputs (no weights), agrees with the plan: the cache is read where it lives, so the
program's temporaries are small next to the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import cpu_attention

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "memory_analysis.py")


@pytest.mark.parametrize("activations", ["rows", "features"])  # an accelerator's order, and the CPU's
def test_8b_decode_program_reads_the_cache_in_place_and_matches_the_plan(activations):
    done = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "llama3-8b", "--dtype", "float32", "--cache-dtype", "float32", "--skip-prefill",
         "--activations", activations],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plan, decode = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert (plan["batch"], plan["prompt"], plan["new"], plan["activations"]) == (128, 128, 2048, activations)
    assert decode["program"] == "decode"
    assert decode["alias_gib"] == decode["output_gib"] > 60  # the whole cache is donated and updated in place
    assert decode["temp_gib"] < 1.0, decode  # no copy of the cache or of a window of it
    assert 1.0 <= decode["plan_over_peak"] <= 1.1, decode  # the plan never under-counts, by at most 10 %


@pytest.mark.parametrize("mesh", ["1x4", "2x2"])
def test_a_global_mesh_keeps_each_devices_heads_and_matches_the_plan(mesh):
    """The global mesh over four forced CPU devices (a 125M Llama, 12 heads): split over `model`
    alone, each device computes its own heads and MLP units, with no weight gathered whole (left
    to XLA's propagation, every projection's weight was: 0.32 GiB of temporaries a device
    against 0.006 now); split over `data` too (FSDP), the weights are gathered back, and the plan
    counts them (`device_share`). Either way the plan is at most 10 % above XLA's peak."""
    done = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "cpu-125m", "--batch", "16", "--prompt", "128", "--new", "128",
         "--mesh", mesh, "--dtype", "float32", "--cache-dtype", "float32", "--skip-prefill"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plan, decode = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert plan["mesh"] == mesh and decode["decode_attention"] == "xla"
    if mesh == "1x4":
        assert decode["temp_gib"] < 0.02, decode  # a 768 x 768 weight gathered whole on each of 12 layers is 0.03
    assert 1.0 <= decode["plan_over_peak"] <= 1.1, decode


@pytest.mark.skipif(cpu_attention.unavailable() is not None, reason="the CPU kernel cannot be built here")
@pytest.mark.parametrize("options", [[], ["--prompt-logprobs"]])
def test_a_bfloat16_model_on_the_cpu_is_analysed_with_both_programs(options):
    """The script's own example on a CPU: a bfloat16 cache there is the CPU kernel's (stored as
    its bits, as the engine stores it; the script had built it in bfloat16, which the kernel
    refuses), and both the decode and the packed prefill program compile, each within the plan;
    so too with `sampling.prompt_logprobs` (the LM head over blocks of the call's positions)."""
    done = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "cpu-tiny", "--batch", "64", "--prompt", "64", "--new", "128", *options],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plan, *programs = (json.loads(line) for line in done.stdout.strip().splitlines()[-3:])
    assert plan["cache_dtype"] == "bfloat16" and [p["program"] for p in programs] == ["decode", "prefill"]
    for program in programs:
        assert program["decode_attention"] == "cpu" and program["alias_gib"] == program["output_gib"] > 0, program
        assert program["plan_over_peak"] >= 1.0, program  # the plan never under-counts


def test_auto_prefill_budget_is_the_cpu_one_or_the_biggest_that_fits_on_an_accelerator():
    from engine.memory import prefill_budget

    assert prefill_budget("cpu", 32, lambda tokens: True) == 512
    assert prefill_budget("cpu", 1024, lambda tokens: True) == 1024  # never below one chunk
    assert prefill_budget("gpu", 32, lambda tokens: True) == 4096
    assert prefill_budget("tpu", 32, lambda tokens: tokens <= 1024) == 1024
    assert prefill_budget("gpu", 32, lambda tokens: False) == 512  # the smallest, for the plan to refuse or fit


def test_auto_prefill_budget_on_the_8b_seed_leaves_its_batch_room():
    """Batch 128 of the 8B seed workload barely fits an H100's share: `auto` must not take the
    room its rows need, and a small model gets the biggest call."""
    import jax.numpy as jnp

    from engine.llama import LlamaConfig
    from engine.memory import plan_batch

    class Accelerator:  # a device's memory as JAX reports it: all the plan reads of a device
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 60_909 * 2**20}  # what JAX gave itself on an H100-sized share

    def plan(layers, hidden, heads, kv_heads, intermediate, vocab, batch, prompt, new, token_counts=False, prompt_tokens=False):
        config = LlamaConfig.from_hf(dict(
            model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, tie_word_embeddings=False))
        return plan_batch(config, dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16, batch_size=batch, max_prompt_tokens=prompt,
                          max_new_tokens=new, devices=[Accelerator()], memory_fraction=0.85, prefill_tokens="auto",
                          token_counts=token_counts, prompt_tokens=prompt_tokens)

    seed = plan(32, 4096, 32, 8, 14336, 128256, 128, 128, 2048)
    assert (seed.batch_size, seed.prefill_tokens) == (128, 512)
    assert seed.need_bytes(128, 1) <= seed.limit_bytes
    # With a penalty each row also holds its token counts (int32) and their
    # float32 copy, over the vocabulary: 1 MiB a row here, 128 MiB for the batch.
    penalized = plan(32, 4096, 32, 8, 14336, 128256, 128, 128, 2048, token_counts=True)
    assert penalized.row_bytes - seed.row_bytes == 8 * 128256
    # A repetition penalty adds each row's prompt tokens, a byte per vocabulary entry.
    repeating = plan(32, 4096, 32, 8, 14336, 128256, 128, 128, 2048, token_counts=True, prompt_tokens=True)
    assert repeating.row_bytes - penalized.row_bytes == 128256
    tiny = plan(22, 2048, 32, 4, 5632, 32000, 256, 128, 256)
    assert (tiny.batch_size, tiny.prefill_tokens) == (256, 4096)


def test_auto_lanes_split_big_cpu_batches_only(monkeypatch):
    import jax.numpy as jnp

    from engine import memory

    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: {0, 1})
    assert memory.auto_lanes("cpu", 64, 1) == 2
    assert memory.auto_lanes("cpu", 32, 1) == 2
    assert memory.auto_lanes("cpu", 16, 1) == 1  # lanes of 8 rows were no faster (cpu-mixed)
    assert memory.auto_lanes("cpu", 34, 2) == 1  # does not split evenly over 2 lanes x 2 devices
    # bfloat16: lanes of 32 rows at least (a product of 16 rows cost about as much as of 32)
    assert memory.auto_lanes("cpu", 32, 1, jnp.bfloat16) == 1 and memory.auto_lanes("cpu", 64, 1, jnp.bfloat16) == 2
    assert memory.auto_lanes("cpu", 32, 1, jnp.float32) == 2
    assert memory.auto_lanes("gpu", 256, 1) == 1
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: {0})
    assert memory.auto_lanes("cpu", 64, 1) == 1


def test_a_staging_cache_is_planned_as_rows_and_left_out_where_it_does_not_fit(monkeypatch):
    """`engine.overlap_prefill`: auto stages on a CPU host with two cores and one lane; the
    staging cache has a prefill call's rows (or a prompt's samples if more, at most a lane's
    rows), each counted as a row of memory; auto drops it where the batch fills the memory,
    an explicit true says so, and where those rows are fewer than the lane's."""
    import dataclasses

    import pytest

    from engine import memory

    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: {0, 1})
    assert memory.auto_overlap("cpu", 1) and not memory.auto_overlap("cpu", 2) and not memory.auto_overlap("gpu", 1)
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: {0})
    assert not memory.auto_overlap("cpu", 1)

    plan = memory.BatchPlan(16, "explicit", weights_bytes=1000, row_bytes=100, limit_bytes=10_000, working_bytes=500,
                            prefill_tokens=512)

    def staged(overlap, samples=1, **changes):
        return memory.plan_staging(dataclasses.replace(plan, **changes), overlap, platform="cpu", prefill_chunk_tokens=32,
                                   samples=samples, batch_shards=1).staged

    assert staged(True) == 16 and staged(False) == 0  # 512 / 32 rows a call
    assert staged(True, prefill_tokens=128) == 4 and staged(True, samples=6, prefill_tokens=128) == 6
    assert staged(True, batch_size=8) == 8  # at most a lane's rows
    with_staging = memory.plan_staging(plan, True, platform="cpu", prefill_chunk_tokens=32, samples=1, batch_shards=1)
    assert with_staging.need_bytes(16, 1) - plan.need_bytes(16, 1) == 16 * 100
    tight = dict(limit_bytes=plan.need_bytes(16, 1) + 100)  # room for one more row, not sixteen
    assert staged("auto") == 0  # one core
    monkeypatch.setattr(memory.os, "sched_getaffinity", lambda pid: {0, 1})
    assert staged("auto", **tight) == 0 and staged("auto") == 16
    # fewer rows than the lane's: auto prefills between decode calls instead; true stages them
    assert staged("auto", batch_size=32) == 0 and staged(True, batch_size=32) == 16
    assert staged(True, batch_size=32, lanes=2) == 16  # lanes of 16 rows
    with pytest.raises(ValueError, match="engine.overlap_prefill needs 16 more rows of KV cache per lane"):
        staged(True, **tight)
