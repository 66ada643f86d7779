"""Memory planning: how many rows fit on a device, and how much memory a run peaked at.

Owns: the estimate of weights + KV cache + prefill working memory per device, the choice of
`engine.batch_size: auto`, the refusal of an explicit batch that cannot fit (before anything is
compiled), and reading peak memory back. It allocates nothing.

    plan = plan_batch(config, dtype=jnp.bfloat16, cache_dtype=jnp.float32, batch_size="auto",
                      max_prompt_tokens=512, max_new_tokens=256, devices=jax.local_devices())
    plan.batch_size, plan.reason

The estimate is linear in the batch: per row, its KV cache for prompt + new tokens plus the
prefill's activations (attention scores [heads, L, L] in float32 dominate for long prompts)
and a few float32 logit rows; plus the weights, replicated on every local device (host data
parallel) or split over the whole mesh (global mesh: `weight_shards` devices share each weight,
`row_shards` share each row's KV heads, rows are split `batch_shards` ways).
"""

from __future__ import annotations

import dataclasses
import os
import resource

import jax
import jax.numpy as jnp

from engine.llama import LlamaConfig, parameter_bytes

GiB = 1024**3
AUTO_CAP_CPU = 128
"""On CPU decode is compute-bound: past ~128 rows a bigger batch buys no tokens/s, only memory."""
AUTO_CAP_ACCELERATOR = 512
"""Per device; past this the attention over the cache, not the weights, dominates each step."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    batch_size: int
    """Rows decoded together across all local devices (a multiple of the device count)."""
    reason: str
    """One phrase saying why this batch size: 'explicit', or what bounded the auto choice."""
    weights_bytes: int
    """Per device (replicated for host data parallelism, split on a global mesh)."""
    row_bytes: int
    """KV cache + prefill working memory of one row, per device holding part of it."""
    limit_bytes: int
    """The stated fraction of one device's memory."""

    def need_bytes(self, batch_size: int, num_devices: int) -> int:
        return self.weights_bytes + -(-batch_size // num_devices) * self.row_bytes


def device_memory_bytes(device: jax.Device, num_local_devices: int) -> int:
    """What the allocator lets this device use; on CPU, the host's RAM shared by its devices."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // num_local_devices


def kv_row_bytes(config: LlamaConfig, seq_len: int, cache_dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * seq_len * jnp.dtype(cache_dtype).itemsize


def working_row_bytes(config: LlamaConfig, prompt_len: int, dtype) -> int:
    """Prefill of one row: fresh KV of every layer, one layer's activations, and its logits."""
    item = jnp.dtype(dtype).itemsize
    fresh_kv = kv_row_bytes(config, prompt_len, dtype)
    activations = prompt_len * (4 * config.hidden_size + 3 * config.intermediate_size) * item
    scores = 2 * config.num_attention_heads * prompt_len * prompt_len * 4
    logits = 4 * config.vocab_size * 4
    return fresh_kv + activations + scores + logits


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
) -> BatchPlan:
    """devices: this host's devices (their memory is planned); batch_shards: ways rows are split
    (default: one per device); weight_shards / row_shards: devices sharing each weight / each row."""
    n = batch_shards or len(devices)
    weights = -(-parameter_bytes(config, dtype) // weight_shards)
    # decode.decode_chunk copies each layer's attended cache window before its loop (XLA does not
    # fuse that slice into the loop): up to a second cache per row. Measured on an H100 (8B, 1,024
    # new tokens): 49.3 GiB peak against 37.5 GiB planned without this term.
    cache = kv_row_bytes(config, max_prompt_tokens + max_new_tokens, cache_dtype)
    row = 2 * cache + working_row_bytes(config, max_prompt_tokens, dtype)
    row = -(-row // row_shards)
    device_bytes = device_memory_bytes(devices[0], len(devices))
    limit = int(device_bytes * memory_fraction)
    plan = BatchPlan(0, "", weights, row, limit)
    where = f"{memory_fraction:.0%} of {devices[0].platform} device memory ({device_bytes / GiB:.1f} GiB) is {limit / GiB:.2f} GiB"
    if weights + row > limit:
        raise ValueError(
            f"the weights alone need {weights / GiB:.2f} GiB per device and one row {row / GiB:.3f} GiB, but {where} "
            + ("(use more devices, bfloat16, or shorter prompts)" if weight_shards > 1 else
               "(shard the model over the pod with engine.mode: global_mesh, or use bfloat16 or shorter prompts)")
        )
    rows_per_device = (limit - weights) // row
    if batch_size == "auto":
        cap = AUTO_CAP_CPU if devices[0].platform == "cpu" else AUTO_CAP_ACCELERATOR * n
        fit = rows_per_device * n
        chosen = min(fit, cap) // n * n
        reason = f"auto: memory fits {fit} rows, capped at {cap}" if fit > cap else f"auto: largest that fits {where}"
        return dataclasses.replace(plan, batch_size=chosen, reason=reason)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"engine.batch_size must be a positive integer or 'auto', got {batch_size!r}")
    if batch_size % n:
        raise ValueError(f"engine.batch_size={batch_size} must be a multiple of the {n} data-parallel devices"
                         f" ({'engine.mesh.data' if batch_shards else 'local devices'})")
    need = plan.need_bytes(batch_size, n)
    if need > limit:
        kv = kv_row_bytes(config, max_prompt_tokens + max_new_tokens, cache_dtype) * -(-batch_size // n)
        raise ValueError(
            f"engine.batch_size={batch_size} needs ~{need / GiB:.2f} GiB per device (weights {weights / GiB:.2f} GiB"
            f" + KV cache {kv / GiB:.2f} GiB + prefill working memory, for prompts up to {max_prompt_tokens} and"
            f" {max_new_tokens} new tokens) but {where}; at most {rows_per_device * n} rows fit:"
            " lower engine.batch_size or use auto"
        )
    return dataclasses.replace(plan, batch_size=batch_size, reason="explicit")


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
