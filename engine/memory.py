"""Memory planning: how many rows fit on a device, and how much memory a run peaked at.

Owns: the estimate of weights + KV cache + prefill working memory per device, the choice of
`engine.batch_size: auto` and of `engine.lanes: auto`, the refusal of an explicit batch that
cannot fit (before anything is compiled), and reading peak memory back. It allocates nothing.

    plan = plan_batch(config, dtype=jnp.bfloat16, cache_dtype=jnp.float32, batch_size="auto",
                      max_prompt_tokens=512, max_new_tokens=256, devices=jax.local_devices(), lanes="auto")
    plan.batch_size, plan.reason, plan.lanes

The estimate is linear in the batch: per row, its KV cache for prompt + new tokens plus the
decode chunk's per-row temporaries (the chunk's own keys/values, float32 logits, one layer's
attention scores; the cache itself is read in place); plus, once per lane, the working memory of
one prefill call (its rows x chunk tokens: attention scores over the whole cache length, the
cache rows it reads, MLP activations); plus the weights, replicated on every local device (host
data parallel) or split over the whole mesh (global mesh: `weight_shards` devices share each
weight, and when `data` splits them too they are counted gathered back as well,
`device_share`; `row_shards` share each row's KV heads, rows are split `batch_shards`
ways). Checked against XLA's own `memory_analysis()` of the compiled programs by
scripts/memory_analysis.py, on one device and (`--mesh`) on a global mesh.
"""

from __future__ import annotations

import dataclasses
import os
import resource

import jax
import jax.numpy as jnp

from engine.config import InvalidConfig
from engine.decode import PROMPT_LOGPROB_BLOCK
from engine.llama import LlamaConfig, parameter_bytes

GiB = 1024**3
AUTO_CAP_CPU = 128
"""On CPU decode is compute-bound: past ~128 rows a bigger batch buys no tokens/s, only memory."""
AUTO_CAP_ACCELERATOR = 512
"""Per device; past this the attention over the cache, not the weights, dominates each step."""
PREFILL_TOKENS_CPU = 512
"""`engine.prefill_tokens: auto` on the CPU: 16 rows of 32-token chunks; no budget or chunk tried
on the prefill-heavy workload was faster (docs/performance-notes.md)."""
PREFILL_TOKENS_ACCELERATOR = (4096, 2048, 1024, 512)
"""`auto` on an accelerator: the first of these whose call fits (`prefill_budget`). A bigger call
keeps the device busy: TinyLlama's prefill on an H200 took 0.47 s at 512 tokens a call and
0.26 s at 4,096, the whole benchmark run 1.95 s and 1.62 s."""
PREFILL_SHARE = 16
"""`auto` gives one prefill call at most 1/16 of the allowed memory: the rest is for rows."""
LANES_CPU = 2
LANES_CPU_MIN_ROWS = {4: 16, 2: 32}
"""`engine.lanes: auto` on a CPU host with two or more cores: two lanes where each keeps at least
this many rows, by the model's bytes per value (float32: a batch of 32 up; bfloat16: 64 up).
XLA's CPU runtime runs many of a step's small kernels one at a time while the other core waits
(docs/performance-notes.md); a second decode stream fills it. Whole steady-state runs took
10-17 % less time at batch 64 and 32 (cpu-tiny, cpu-125m) with the XLA attention; the mixed
workload at batch 16, in two lanes of 8, took as long or longer. A bfloat16 product costs
about as much for 16 rows as for 32 on the AMD EPYC (XLA's YNNPACK products, `python
scripts/bench_dots.py --rows`: 205 against 337 µs for a 2,048 x 768 weight, 366 against 403 for
768 x 2,048), so two lanes of 16 did each layer's products nearly twice: the 125M model at
batch 32 took 8.0-8.4 s in one lane against 8.7-9.4 s in two."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    batch_size: int
    """Rows decoded together across all local devices (a multiple of the device count)."""
    reason: str
    """One phrase saying why this batch size: 'explicit', or what bounded the auto choice."""
    weights_bytes: int
    """Per device (replicated for host data parallelism, split on a global mesh)."""
    row_bytes: int
    """KV cache + decode temporaries of one row, per device holding part of it."""
    limit_bytes: int
    """The stated fraction of one device's memory."""
    working_bytes: int = 0
    """One prefill call's working memory per device (independent of the batch size)."""
    prefill_tokens: int = PREFILL_TOKENS_CPU
    """Token budget of one prefill call: `engine.prefill_tokens`, or what `auto` chose."""
    lanes: int = 1
    """Decode streams side by side (`engine.lanes`), each with batch_size / lanes rows; their
    prefill calls may run at once, so each has its working memory."""
    staged: int = 0
    """Rows of each lane's staging cache, where its next prompts are prefilled while it decodes
    (`engine.overlap_prefill`; 0: off): as many as a prefill call has rows, or a prompt has
    samples if more (at most the lane's rows), each planned as a row."""

    def need_bytes(self, batch_size: int, num_devices: int) -> int:
        rows = -(-batch_size // num_devices) + self.lanes * -(-self.staged // num_devices)
        return self.weights_bytes + self.lanes * self.working_bytes + rows * self.row_bytes


def device_memory_bytes(device: jax.Device, num_local_devices: int) -> int:
    """What the allocator lets this device use; on CPU, the host's RAM shared by its devices."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // num_local_devices


def kv_row_bytes(config: LlamaConfig, seq_len: int, cache_dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * seq_len * jnp.dtype(cache_dtype).itemsize


def decode_row_bytes(config: LlamaConfig, seq_len: int, steps: int, dtype, cache_dtype) -> int:
    """A decode chunk's temporaries per row: the chunk's keys/values of every layer (the loop
    keeps two copies), float32 logits and the sampler's copy, one layer's scores and weights
    over the cache in float32, and one layer's activations. The cache's pages are read where
    they live, never copied."""
    chunk = 2 * 2 * config.num_hidden_layers * config.num_key_value_heads * steps * config.head_dim * jnp.dtype(cache_dtype).itemsize
    logits = 2 * config.vocab_size * 4
    scores = 2 * config.num_attention_heads * (seq_len + steps) * 4
    activations = (4 * config.hidden_size + 3 * config.mlp_units) * jnp.dtype(dtype).itemsize
    return chunk + logits + scores + activations


def token_count_bytes(config: LlamaConfig, in_prompt: bool = False) -> int:
    """Per row with a penalty: the completion's token counts (int32, in the decode state) and
    their float32 copy as the penalties use them, over the vocabulary, and with a repetition
    penalty the prompt's tokens (bool). Each device holds its rows' whole counts (they are split
    by rows only)."""
    return (2 * 4 + in_prompt) * config.vocab_size


def prefill_working_bytes(config: LlamaConfig, seq_len: int, rows: int, chunk: int, dtype, cache_dtype,
                          prompt_logprobs: bool = False) -> int:
    """One prefill call (rows x chunk tokens), one layer at a time: the cache rows it attends over
    (keys and values), its attention scores and weights over the whole cache length in float32,
    its activations, and the last position's float32 logits; with prompt_logprobs also a block of
    positions' float32 logits and their log-softmax (`decode.PROMPT_LOGPROB_BLOCK`)."""
    tokens = rows * chunk
    read = rows * kv_row_bytes(config, seq_len, cache_dtype) // config.num_hidden_layers
    scores = 2 * config.num_attention_heads * tokens * seq_len * 4
    activations = tokens * (4 * config.hidden_size + 3 * config.mlp_units) * jnp.dtype(dtype).itemsize
    logits = 2 * (rows + (min(tokens, PROMPT_LOGPROB_BLOCK) if prompt_logprobs else 0)) * config.vocab_size * 4
    return read + scores + activations + logits


def footprint(config: LlamaConfig, *, dtype, cache_dtype, seq_len: int, decode_chunk_steps: int, prefill_tokens: int,
              prefill_chunk_tokens: int, prompt_logprobs: bool = False) -> tuple[int, int, int]:
    """(weights, per row, one prefill call's working memory) in bytes, on one unsharded device."""
    weights = parameter_bytes(config, dtype)
    # The decode chunk reads the cache's pages in place (before issue 13 it copied a window of
    # any length: a second cache per row at worst, 49.3 GiB peak on an H100 for the 8B at 1,024
    # new tokens against 37.5 GiB planned).
    row = kv_row_bytes(config, seq_len, cache_dtype) + decode_row_bytes(config, seq_len, decode_chunk_steps, dtype, cache_dtype)
    prefill_rows = max(1, prefill_tokens // prefill_chunk_tokens)
    working = prefill_working_bytes(config, seq_len, prefill_rows, prefill_chunk_tokens, dtype, cache_dtype, prompt_logprobs)
    return weights, row, working


def device_share(weights: int, row: int, working: int, *, weight_shards: int = 1, row_shards: int = 1,
                 batch_shards: int = 1) -> tuple[int, int, int]:
    """`footprint`'s (weights, per row, prefill working memory) as one device holds them, where
    `weight_shards` devices share each weight, `row_shards` each row's KV heads, and rows and a
    prefill call are split `batch_shards` ways. On a global mesh (weight_shards = data x model,
    row_shards = model) a device stores its 1/(data x model) of each weight, plus, when `data`
    splits them too (FSDP), the weights gathered back over `data` for the layers' products: XLA's
    CPU backend keeps all of them gathered during a decode call (the gathers of weights the
    decode loop does not change are hoisted out of it; scripts/memory_analysis.py --mesh), so
    they are all counted."""
    share = -(-weights // weight_shards)
    if weight_shards > row_shards:  # FSDP over data = weight_shards / row_shards
        share += -(-weights // row_shards)
    return share, -(-row // row_shards), -(-working // (row_shards * batch_shards))


def plan_batch(
    config: LlamaConfig,
    *,
    dtype,
    cache_dtype,
    batch_size: int | str,
    max_prompt_tokens: int,
    max_new_tokens: int,
    devices: list[jax.Device],
    memory_fraction: float,
    batch_shards: int | None = None,
    weight_shards: int = 1,
    row_shards: int = 1,
    decode_chunk_steps: int = 16,
    prefill_tokens: int | str = 512,
    prefill_chunk_tokens: int = 32,
    lanes: int | str = 1,
    token_counts: bool = False,
    prompt_tokens: bool = False,
    prompt_logprobs: bool = False,
) -> BatchPlan:
    """devices: this host's devices (their memory is planned); batch_shards: ways rows are split
    (default: one per device); weight_shards / row_shards: devices sharing each weight / each row;
    prefill_tokens: a budget, or auto (`prefill_budget`); lanes: decode streams, or auto
    (`auto_lanes`, decided with the batch size and dtype); token_counts: rows carry their
    completion's token counts, and prompt_tokens their prompt's tokens (`token_count_bytes`);
    prompt_logprobs: prefill calls compute every position's logits (`prefill_working_bytes`). A
    staging cache is added by `plan_staging`."""
    n = batch_shards or len(devices)
    seq_len = max_prompt_tokens + max_new_tokens

    def per_device(tokens: int) -> tuple[int, int, int]:
        weights, row, working = device_share(*footprint(config, dtype=dtype, cache_dtype=cache_dtype, seq_len=seq_len,
                                                        decode_chunk_steps=decode_chunk_steps, prefill_tokens=tokens,
                                                        prefill_chunk_tokens=prefill_chunk_tokens,
                                                        prompt_logprobs=prompt_logprobs),
                                             weight_shards=weight_shards, row_shards=row_shards, batch_shards=n)
        return weights, row + (token_count_bytes(config, prompt_tokens) if token_counts else 0), working

    device_bytes = device_memory_bytes(devices[0], len(devices))
    limit = int(device_bytes * memory_fraction)
    if prefill_tokens == "auto":
        def fits(tokens: int) -> bool:
            weights, row, working = per_device(tokens)
            rows = -(-batch_size // n) if isinstance(batch_size, int) else 1
            return working <= limit // PREFILL_SHARE and weights + working + rows * row <= limit

        prefill_tokens = prefill_budget(devices[0].platform, prefill_chunk_tokens, fits)
    weights, row, working = per_device(prefill_tokens)
    plan = BatchPlan(0, "", weights, row, limit, working, prefill_tokens)
    where = (f"engine.memory_fraction {memory_fraction:g} of {devices[0].platform} device memory "
             f"({device_bytes / GiB:.1f} GiB) is {_size(limit)}")
    if weights + working + row > limit:
        raise InvalidConfig(
            f"one row needs {_size(weights + working + row)} per device (weights {_size(weights)}, prefill and decode "
            f"working memory {_size(working)}, the row's KV cache {_size(row)}), but {where} "
            + ("(raise engine.memory_fraction, or use more devices, bfloat16, or shorter prompts)" if weight_shards > 1 else
               "(raise engine.memory_fraction, shard the model over the pod with engine.mode: global_mesh, or use "
               "bfloat16 or shorter prompts)")
        )
    if batch_size == "auto":
        cap = AUTO_CAP_CPU if devices[0].platform == "cpu" else AUTO_CAP_ACCELERATOR * n
        sized_for = 1 if lanes == "auto" else lanes  # auto picks the lanes from the batch, below
        fit = (limit - weights - sized_for * working) // row * n
        chosen = min(fit, cap) // (sized_for * n) * (sized_for * n)
        if chosen < 1:
            raise InvalidConfig(f"engine.lanes={lanes} needs {sized_for * n} rows, but {where} fits {fit}: lower engine.lanes or use auto")
        reason = f"auto: memory fits {fit} rows, capped at {cap}" if fit > cap else f"auto: largest that fits {where}"
        plan = dataclasses.replace(plan, batch_size=chosen, reason=reason,
                                   lanes=auto_lanes(devices[0].platform, chosen, n, dtype) if lanes == "auto" else lanes)
        if lanes == "auto" and plan.need_bytes(chosen, n) > limit:  # two lanes' prefill working memory, where one fitted
            plan = dataclasses.replace(plan, lanes=1)
        return plan
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidConfig(f"engine.batch_size must be a positive integer or 'auto', got {batch_size!r}")
    if batch_size % n:
        raise InvalidConfig(f"engine.batch_size={batch_size} must be a multiple of the {n} data-parallel devices"
                         f" ({'engine.mesh.data' if batch_shards else 'local devices'})")
    if lanes == "auto":
        lanes = auto_lanes(devices[0].platform, batch_size, n, dtype)
    elif batch_size % (lanes * n):
        raise InvalidConfig(f"engine.batch_size={batch_size} must be a multiple of engine.lanes={lanes} times the {n}"
                         f" data-parallel devices ({lanes * n}): each lane takes an equal share of the rows")
    plan = dataclasses.replace(plan, lanes=lanes)
    rows_per_device = (limit - weights - lanes * working) // row
    need = plan.need_bytes(batch_size, n)
    if need > limit:
        kv = kv_row_bytes(config, seq_len, cache_dtype) * -(-batch_size // n)
        raise InvalidConfig(
            f"engine.batch_size={batch_size} needs ~{need / GiB:.2f} GiB per device (weights {weights / GiB:.2f} GiB"
            f" + KV cache {kv / GiB:.2f} GiB + prefill and decode working memory, for prompts up to {max_prompt_tokens} and"
            f" {max_new_tokens} new tokens) but {where}; at most {rows_per_device * n} rows fit:"
            " lower engine.batch_size or use auto"
        )
    return dataclasses.replace(plan, batch_size=batch_size, reason="explicit")


def _size(count: int) -> str:
    """Bytes for a message, in the unit that shows them (a tiny model's weights were 0.00 GiB)."""
    if count >= GiB / 10:
        return f"{count / GiB:.2f} GiB"
    if count >= 2**20 / 10:
        return f"{count / 2**20:.1f} MiB"
    return f"{count / 1024:.1f} KiB"


def plan_staging(plan: BatchPlan, overlap_prefill: bool | str, *, platform: str, prefill_chunk_tokens: int, samples: int,
                 batch_shards: int) -> BatchPlan:
    """`plan` with a staging cache per lane (`engine.overlap_prefill`; auto: `auto_overlap`) of as
    many rows as a prefill call has, or a prompt has samples (`sampling.n`) if more, so that they
    share their prompt's prefill; a multiple of batch_shards, at most a lane's rows. auto leaves
    it out where the rows do not fit, and where they are fewer than a lane's: the lane then
    waits for the thread even for its first rows and starts decoding a part of its batch, which
    was slower than prefilling between decode calls (the 125M model at batch 32 in bfloat16:
    9.5 s against 8.0 s; cpu-mixed at batch 64: 5.7 against 5.0 s). An explicit true raises
    where the rows do not fit."""
    explicit = overlap_prefill is True
    if not (explicit or overlap_prefill == "auto" and auto_overlap(platform, plan.lanes)):
        return plan
    n, lane = batch_shards, plan.batch_size // plan.lanes
    rows = max(1, plan.prefill_tokens // prefill_chunk_tokens, samples)
    staged = dataclasses.replace(plan, staged=min(-(-rows // n) * n, lane))
    if not explicit and staged.staged < lane:
        return plan
    if staged.need_bytes(plan.batch_size, n) <= plan.limit_bytes:
        return staged
    if explicit:
        raise InvalidConfig(f"engine.overlap_prefill needs {staged.staged} more rows of KV cache per lane than"
                         f" engine.batch_size={plan.batch_size} leaves room for: lower engine.batch_size or set it to auto")
    return plan  # auto: the batch filled the memory, no room to stage


def auto_lanes(platform: str, batch_size: int, num_devices: int, dtype=jnp.float32) -> int:
    """`engine.lanes: auto`: LANES_CPU on a CPU host with as many cores, where each lane keeps
    LANES_CPU_MIN_ROWS rows for the model's dtype and the batch splits evenly; else 1 (an
    accelerator keeps itself busy)."""
    min_rows = LANES_CPU_MIN_ROWS.get(jnp.dtype(dtype).itemsize, LANES_CPU_MIN_ROWS[4])
    if (platform != "cpu" or _cores() < LANES_CPU or batch_size < LANES_CPU * min_rows
            or batch_size % (LANES_CPU * num_devices)):
        return 1
    return LANES_CPU


def auto_overlap(platform: str, lanes: int) -> bool:
    """`engine.overlap_prefill: auto`: on a CPU host with two or more cores and one lane. XLA's
    CPU runtime runs much of a decode step on one thread; a prefill call beside it fills the other
    core (two lanes already do)."""
    return platform == "cpu" and _cores() >= 2 and lanes == 1


def _cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def prefill_budget(platform: str, chunk_tokens: int, fits) -> int:
    """`engine.prefill_tokens: auto`: PREFILL_TOKENS_CPU on the CPU; on an accelerator the first
    of PREFILL_TOKENS_ACCELERATOR for which fits(tokens) holds, else the smallest (the Llama-3-8B
    seed workload at batch 128 fills an 80 GB H100's share and gets 512; TinyLlama at batch 256
    gets 4,096). Never below one chunk."""
    if platform == "cpu":
        return max(PREFILL_TOKENS_CPU, chunk_tokens)
    budgets = [max(tokens, chunk_tokens) for tokens in PREFILL_TOKENS_ACCELERATOR]
    return next((tokens for tokens in budgets if fits(tokens)), budgets[-1])


def peak_memory_bytes(devices: list[jax.Device]) -> int | None:
    """Largest device peak from the allocator; on CPU the process's peak resident memory."""
    peaks = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    if peaks:
        return max(peaks)
    if devices and devices[0].platform == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None
