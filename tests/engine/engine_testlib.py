"""Helpers shared by the engine tests (a plain module: conftest.py is not imported by name)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 128


def with_generation_config(src: str, dst: Path, **values) -> str:
    """A copy of checkpoint src whose generation_config.json has `values`."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))
    return str(dst)


def run_on_forced_devices(script: str, devices: int, timeout: float = 400) -> dict:
    """Runs a Python script (dedented) in a fresh process whose JAX sees `devices` forced CPU
    devices, and returns the JSON object it prints last; its stderr's end if it fails."""
    import os
    import subprocess
    import sys
    import textwrap

    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def hf_log_softmax(model, ids: list[int]) -> np.ndarray:
    """transformers' distribution of the next token at each position of ids but the last,
    teacher-forced: the float32 log-softmax of its logits there, [len(ids) - 1, vocab]."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, dim=-1).numpy()


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """transformers' log-probability of each of ids[1:] given the ids before it (`hf_log_softmax`)."""
    return hf_log_softmax(model, ids)[np.arange(len(ids) - 1), ids[1:]]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **options) -> list[int]:
    """transformers' generate, greedy, no EOS unless `options` (more generate arguments, e.g. a
    logits_processor, or min_new_tokens and an eos_token_id) say otherwise; the explicit mask
    keeps token 0 from being read as padding."""
    import torch

    options = {"min_new_tokens": max_new_tokens, "pad_token_id": 0, **options}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, **options)
    return out[0, len(prompt):].tolist()


def random_normal(seed: int):
    """A function of a shape that gives float32 standard-normal arrays, drawn in turn from one
    numpy generator: jax.random would compile a program per shape, a second or more each here."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    return lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def ragged_attention_case(*, batch: int, kv_heads: int, group: int, head_dim: int, page_lens: tuple[int, ...],
                          steps: int, lengths: list[int], seed: int = 0, first: list[int] | None = None):
    """A decode step's attention inputs, random: q (batch, position, kv_heads, q_per_kv, head_dim),
    cache pages of `page_lens` positions, a chunk buffer of `steps` with its first 3 steps
    written, and rows that wrote `lengths` positions of the pages, each reading from its `first`
    position on (a sliding window's; the chunk's entry s is position lengths + s; None: 0).
    Returns (q, pages, chunk, chunk_mask, lengths, want): want is the engine's own attention over
    them (`_attend_pages`, batch, position, kv_heads, q_per_kv, head_dim)."""
    import math

    import jax.numpy as jnp
    from haliax import Axis

    from engine.jax_compat import hax
    from engine.llama import LayerKV, _attend_pages

    draw = random_normal(seed)
    Batch, Pos, KVHeads, QPerKV, HeadDim = (Axis("batch", batch), Axis("position", 1), Axis("kv_heads", kv_heads),
                                           Axis("q_per_kv", group), Axis("head_dim", head_dim))

    def normal(*axes):
        return hax.named(draw(*(a.size for a in axes)), axes)

    pages = [LayerKV(*(normal(Batch, KVHeads, Axis("key_position", n), HeadDim) for _ in range(2))) for n in page_lens]
    Chunk = Axis("chunk", steps)
    chunk = LayerKV(*(normal(Batch, KVHeads, Chunk, HeadDim) for _ in range(2)))
    chunk_mask = hax.named(jnp.broadcast_to(jnp.arange(steps) <= 2, (batch, 1, steps)), (Batch, Pos, Chunk))
    q = normal(Batch, Pos, KVHeads, QPerKV, HeadDim)
    lengths = jnp.asarray(lengths, jnp.int32)
    begin = jnp.zeros_like(lengths) if first is None else jnp.asarray(first, jnp.int32)
    parts, start = [], 0
    for page, n in zip(pages, page_lens):
        position = (start + jnp.arange(n))[None, None, :]
        read = (position < lengths[:, None, None]) & (position >= begin[:, None, None])
        parts.append((page.k, page.v, hax.named(read, (Batch, Pos, Axis("key_position", n))), "key_position"))
        start += n
    in_chunk = (lengths[:, None, None] + jnp.arange(steps)[None, None, :]) >= begin[:, None, None]
    parts.append((chunk.k, chunk.v, chunk_mask & hax.named(in_chunk, (Batch, Pos, Chunk)), "chunk"))
    want = _attend_pages(q, parts, 1 / math.sqrt(head_dim)).rearrange(("batch", "position", "kv_heads", "q_per_kv", "head_dim"))
    return q, pages, chunk, chunk_mask, lengths, want.array
