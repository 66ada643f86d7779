"""The generation engine: load a checkpoint, then turn requests into completions.

Owns: `Engine.load` (config checks, memory plan, weights), the host-side scheduler (sort rows
by prompt length, bucket prompt and window lengths so few programs compile, refill finished
slots from the queue), stop strings and detokenisation, and the run's statistics. It does not
read prompt files or write results: the generate step does. Where arrays live is engine/mesh.py's:
`mode="host_dp"` uses this host's devices only; `mode="global_mesh"` shards the weights over
every device of the pod, and then every host must call `generate` with the same requests: the
scheduler is deterministic, so all hosts run the same compiled calls in the same order.

    engine = Engine.load("gs://bucket/llama", dtype="bfloat16", sampling=SamplingParams(n=4),
                         engine=EngineConfig(batch_size="auto"), max_prompt_tokens=512, tokenizer=tok)
    print(engine.describe())
    for c in engine.generate([GenerationRequest(0, ids, sample_indices=range(4))]):
        ...  # Completion(prompt_index, sample_index, token_ids, text, finish_reason)

Rows (prompt, sample) are scheduled in order of prompt length. A row's tokens depend only on
(seed, prompt_index, sample_index): see sampler.py. Finished rows free their slot at the end of
a decode chunk; once an eighth of the slots are free (or none is busy) they are refilled with
one prefill of the next prompts, so finished rows stop costing work after at most a chunk.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine import checkpoint
from engine.config import EngineConfig, InvalidConfig, SamplingParams, require
from engine.decode import DecodeSpec, decode_chunk, init_caches, init_state, prefill_into_slots
from engine.llama import LlamaConfig, UnsupportedModelError, load_checkpoint
from engine.memory import GiB, BatchPlan, peak_memory_bytes, plan_batch
from engine.mesh import Layout, mesh_shape

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_COMPILED: dict[tuple, Any] = {}
"""Compiled programs by (program, static args, sampling spec, input structure and shapes)."""


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_index: int
    """0-based position of the prompt in the input; part of every sample's random key."""
    input_ids: Sequence[int]
    """The prompt's token ids (chat template and BOS already applied)."""
    sample_indices: Sequence[int]
    """Which of the n samples to make (a resume asks only for the missing ones)."""


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    """Generated ids; the EOS/stop token is excluded, and a stop string's tokens are cut."""
    text: str
    """Decoded token_ids, cut before the stop string; '' without a tokenizer."""
    finish_reason: Literal["eos", "stop", "length"]
    """eos: an EOS id of the checkpoint; stop: a stop string or stop token id; length: max_new_tokens."""


@dataclasses.dataclass
class EngineStats:
    batch_size: int
    """Slots decoded together (the plan's batch size)."""
    compilations: int = 0
    """Programs compiled so far: one per (prefill rows, prompt bucket) and per decode window."""
    compile_time_s: float = 0.0
    generated_tokens: int = 0
    """Tokens returned in completions plus the EOS/stop tokens they ended on."""
    peak_memory_bytes: int | None = None
    """Largest device peak reported by the allocator; on CPU the process's peak RSS."""
    decode_time_s: float = 0.0
    """Time running compiled prefill and decode programs (compilation excluded)."""
    prompt_tokens: int = 0
    """Prompt tokens prefilled (each prompt once, however many samples share it)."""
    padded_prompt_tokens: int = 0
    """Prompt positions computed including bucket padding; / prompt_tokens = padding overhead."""


def length_buckets(limit: int, *, fine: bool) -> list[int]:
    """16, 24, 32, 48, 64, 96, ... (fine: padding <= 1/3) or 16, 32, 64, ... up to limit, limit included."""
    buckets, size = [], 16
    while size < limit:
        buckets.append(size)
        if fine and size * 3 // 2 < limit:
            buckets.append(size * 3 // 2)
        size *= 2
    return sorted(set(buckets)) + [limit]


@dataclasses.dataclass
class _Row:
    prompt_index: int
    sample_index: int
    prompt: np.ndarray
    tokens: list[int] = dataclasses.field(default_factory=list)


class Engine:
    def __init__(self, model, config: LlamaConfig, *, dtype: str, engine_config: EngineConfig, sampling: SamplingParams,
                 max_prompt_tokens: int, plan: BatchPlan, eos_token_ids: tuple[int, ...], tokenizer, layout: Layout,
                 source: str):
        self.model = model
        self.config = config
        self.dtype = dtype
        self.engine_config = engine_config
        self.max_prompt_tokens = max_prompt_tokens
        self.sampling = sampling
        self.plan = plan
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.layout = layout
        self.devices = layout.local_devices
        self.source = source
        self.vocab_size = config.vocab_size
        self.stats = EngineStats(batch_size=plan.batch_size)
        self.stopped = False
        """The last `generate` ended early because its `stop` callback asked (on any host)."""
        self._batch_sharding = layout.batch_sharding
        # Only what the programs compute with: engines differing in n or stop strings share them.
        compiled_sampling = dataclasses.replace(sampling, n=1, stop=(), stop_token_ids=())
        stop_ids = tuple(sorted(set(eos_token_ids) | set(sampling.stop_token_ids)))
        self._spec = DecodeSpec(compiled_sampling, stop_ids, layout.batch_sharding, layout.cache_sharding, layout.host_sharding)
        self._seq_len = max_prompt_tokens + sampling.max_new_tokens
        self._cache_dtype = jnp.float32 if self.devices[0].platform == "cpu" else DTYPES[dtype]
        self._prompt_buckets = length_buckets(max_prompt_tokens, fine=True)
        self._window_buckets = length_buckets(self._seq_len, fine=False)

    @staticmethod
    def load(
        model_path: str,
        *,
        dtype: str = "bfloat16",
        sampling: SamplingParams = SamplingParams(),
        engine: EngineConfig = EngineConfig(),
        max_prompt_tokens: int = 512,
        tokenizer=None,
    ) -> "Engine":
        """Checks the checkpoint's config and the batch plan, then reads the weights.

        dtype: float32 or bfloat16 weights. max_prompt_tokens: the longest prompt `generate` will
        be given (it sizes the KV cache). engine.mode host_dp: this host's devices, weights
        replicated on each. global_mesh: every device of the pod, weights sharded by engine.mesh
        (engine/mesh.py); every host must make the same calls, and batch_size counts rows of the
        whole pod."""
        if dtype not in DTYPES:
            raise InvalidConfig(f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        require(max_prompt_tokens > 0, "prompts.max_prompt_tokens", max_prompt_tokens, "an integer > 0")
        config_path = f"{model_path.rstrip('/')}/config.json"
        hf_config = checkpoint.read_config(model_path)
        config = LlamaConfig.from_hf(hf_config, source=config_path)
        eos = checkpoint.eos_token_ids(model_path, hf_config)

        seq_len = max_prompt_tokens + sampling.max_new_tokens
        if seq_len > config.max_position_embeddings:
            raise ValueError(
                f"prompts.max_prompt_tokens + sampling.max_new_tokens = {seq_len} exceeds max_position_embeddings"
                f" {config.max_position_embeddings} in {config_path}"
            )
        if config.sliding_window is not None and seq_len > config.sliding_window:
            raise UnsupportedModelError(
                f"model.path {config_path}: sliding_window {config.sliding_window} is shorter than prompt + new tokens"
                f" ({seq_len}); sliding-window attention is not implemented"
            )
        if sampling.stop and tokenizer is None:
            raise ValueError("sampling.stop needs a tokenizer: pass Engine.load(..., tokenizer=...)")

        if dtype == "float32":
            # GPUs run float32 matmuls as TF32 by default (logits off by ~3e-2): float32 means float32.
            jax.config.update("jax_default_matmul_precision", "highest")
        if engine.mode == "global_mesh":
            layout = Layout.pod(mesh_shape(engine.mesh, num_devices=jax.device_count(), kv_heads=config.num_key_value_heads))
        else:
            layout = Layout.local(jax.local_devices())
        devices = layout.local_devices
        plan = plan_batch(
            config,
            dtype=DTYPES[dtype],
            cache_dtype=jnp.float32 if devices[0].platform == "cpu" else DTYPES[dtype],
            batch_size=engine.batch_size,
            max_prompt_tokens=max_prompt_tokens,
            max_new_tokens=sampling.max_new_tokens,
            devices=devices,
            memory_fraction=engine.memory_fraction,
            batch_shards=layout.data_size,
            weight_shards=layout.mesh.size if layout.is_global else 1,
            row_shards=layout.model_size,
        )
        model = load_checkpoint(model_path, config, dtype=DTYPES[dtype], sharding=layout.param_sharding)
        return Engine(model, config, dtype=dtype, engine_config=engine, sampling=sampling,
                      max_prompt_tokens=max_prompt_tokens, plan=plan, eos_token_ids=tuple(eos), tokenizer=tokenizer,
                      layout=layout, source=model_path)

    def describe(self) -> str:
        c, p, layout = self.config, self.plan, self.layout
        need = p.need_bytes(p.batch_size, layout.data_size)
        platform = self.devices[0].platform
        where = (f"a global mesh data {layout.data_size} x model {layout.model_size} over {layout.mesh.size} {platform}"
                 f" devices of {jax.process_count()} host(s)" if layout.is_global else f"{len(self.devices)} {platform} device(s)")
        return (
            f"{c.model_type} {c.num_hidden_layers}x{c.hidden_size} (vocab {c.vocab_size}) from {self.source},"
            f" {self.dtype} on {where};"
            f" batch_size {p.batch_size} ({p.reason}); memory ~{need / GiB:.2f} GiB per device"
            f" (weights {p.weights_bytes / GiB:.2f} GiB + {p.row_bytes / 2**20:.1f} MiB/row) of {p.limit_bytes / GiB:.2f} GiB allowed;"
            f" prompts <= {self.max_prompt_tokens} tokens, {self.sampling.max_new_tokens} new"
        )

    # ------------------------------------------------------------------ compiled programs

    def _run(self, kind: str, fn, static: tuple, *args):
        """Compiles once per program and input shapes (shared by engines in this process: a
        reload with the same shapes compiles nothing) and runs; compile time is counted apart."""
        leaves, treedef = jax.tree.flatten(args)
        key = (kind, static, self._spec, self.layout.is_global, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        compiled = _COMPILED.get(key)
        if compiled is None:
            start = time.perf_counter()
            with self.layout.tracing():
                compiled = jax.jit(fn, donate_argnums=(1, 2)).lower(*args).compile()
            self.stats.compile_time_s += time.perf_counter() - start
            self.stats.compilations += 1
            _COMPILED[key] = compiled
        start = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        self.stats.decode_time_s += time.perf_counter() - start
        return out

    # ---------------------------------------------------------------------------- generate

    def _rows(self, requests: Iterable[GenerationRequest]) -> list[_Row]:
        rows = []
        for r in requests:
            ids = np.asarray(list(r.input_ids), dtype=np.int32)
            if not 1 <= len(ids) <= self.max_prompt_tokens:
                raise ValueError(
                    f"prompt {r.prompt_index} has {len(ids)} tokens; the engine accepts 1 to"
                    f" prompts.max_prompt_tokens={self.max_prompt_tokens}"
                )
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                raise ValueError(f"prompt {r.prompt_index} has token ids outside [0, {self.vocab_size})")
            rows += [_Row(r.prompt_index, int(s), ids) for s in r.sample_indices]
        rows.sort(key=lambda row: (len(row.prompt), row.prompt_index, row.sample_index))
        return rows

    def generate(self, requests: Iterable[GenerationRequest], stop: Callable[[], bool] | None = None) -> Iterator[Completion]:
        """Yields one Completion per (prompt, sample) requested, in the order rows finish.
        Safe to abandon part way: nothing is left running on the device between yields (on a
        global mesh every host must abandon at the same point: use `stop`).

        stop: asked before every compiled call; once it returns True on any host, every host's
        generate returns there, together, and sets `self.stopped`."""
        self.stopped = False
        pending = collections.deque(self._rows(requests))
        if not pending:
            return
        n_dev = self.layout.data_size
        batch = self.plan.batch_size
        # A small job gets fewer slots (power of two) instead of decoding empty ones.
        slots = min(batch, -(-(1 << (len(pending) - 1).bit_length()) // n_dev) * n_dev)
        steps = self.engine_config.decode_chunk_steps
        refill_min = max(1, slots // 8)
        caches = init_caches(self.config, slots, self._seq_len, self._cache_dtype, self.layout.cache_sharding)
        state = init_state(slots, self._batch_sharding)
        live: list[_Row | None] = [None] * slots
        kill = np.zeros(slots, bool)
        try:
            while pending or any(live):
                if stop is not None and self.layout.any_host(stop()):
                    self.stopped = True
                    return
                free = [s for s in range(slots) if live[s] is None]
                if pending and free and (len(free) >= refill_min or len(free) == slots):
                    caches, state, (first, done), filled = self._refill(caches, state, pending, free, live, slots)
                    first, done = np.asarray(first), np.asarray(done)
                    for s in filled:
                        kill[s] = False
                        live[s].tokens.append(int(first[s]))
                        completion = self._maybe_finish(live[s], device_done=bool(done[s]))
                        if completion is not None:
                            live[s], kill[s] = None, not done[s]
                            yield completion
                    continue
                busy = [s for s in range(slots) if live[s] is not None]
                reach = max(len(live[s].prompt) + len(live[s].tokens) - 1 for s in busy)
                window = self._window_buckets[bisect.bisect_left(self._window_buckets, reach)]
                caches, state, (out, done) = self._run(
                    "decode",
                    functools.partial(decode_chunk, spec=self._spec, window=window, steps=steps),
                    (window, steps),
                    self.model, caches, state, jax.device_put(kill, self._batch_sharding),
                )
                kill[:] = False
                out, done = np.asarray(out), np.asarray(done)
                for s in busy:
                    row = live[s]
                    row.tokens += [int(t) for t in out[s] if t >= 0]
                    completion = self._maybe_finish(row, device_done=bool(done[s]))
                    if completion is not None:
                        live[s], kill[s] = None, not done[s]
                        yield completion
        finally:
            self.stats.peak_memory_bytes = peak_memory_bytes(self.devices)

    def _refill(self, caches, state, pending, free, live, slots):
        """One prefill of the next prompts into free slots; samples of a prompt share it."""
        taken = [pending.popleft() for _ in range(min(len(free), len(pending)))]
        prompts: dict[int, int] = {}
        for row in taken:
            prompts.setdefault(row.prompt_index, len(prompts))
        n_dev = self.layout.data_size
        sizes = sorted({-(-max(1, slots // d) // n_dev) * n_dev for d in (8, 4, 2, 1)})
        rows_p = sizes[bisect.bisect_left(sizes, len(prompts))] if len(prompts) <= sizes[-1] else len(prompts)
        longest = max(len(row.prompt) for row in taken)
        length = self._prompt_buckets[bisect.bisect_left(self._prompt_buckets, longest)]
        tokens = np.zeros((rows_p, length), np.int32)
        lengths = np.ones(rows_p, np.int32)
        src = np.full(slots, -1, np.int32)
        prompt_index = np.zeros(slots, np.int32)
        sample_index = np.zeros(slots, np.int32)
        seen = set()
        for row, s in zip(taken, free):
            p = prompts[row.prompt_index]
            if p not in seen:
                seen.add(p)
                tokens[p, : len(row.prompt)] = row.prompt
                lengths[p] = len(row.prompt)
                self.stats.prompt_tokens += len(row.prompt)
            src[s], prompt_index[s], sample_index[s] = p, row.prompt_index, row.sample_index
            live[s] = row
        self.stats.padded_prompt_tokens += rows_p * length
        put = functools.partial(jax.device_put, device=self._batch_sharding)
        replicated = self.layout.replicated
        caches, state, host = self._run(
            "prefill",
            functools.partial(prefill_into_slots, spec=self._spec),
            (),
            self.model, caches, state,
            jax.device_put(tokens, self._batch_sharding if rows_p % n_dev == 0 else replicated),
            jax.device_put(lengths, replicated),
            put(src), put(prompt_index), put(sample_index),
        )
        return caches, state, host, free[: len(taken)]

    # ------------------------------------------------------------------------- finishing

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _maybe_finish(self, row: _Row, *, device_done: bool) -> Completion | None:
        """The row's Completion if it has finished (device stop rule or a stop string), else None."""
        tokens = row.tokens
        body, reason = tokens, None
        if device_done:
            if tokens[-1] in self.eos_token_ids:
                body, reason = tokens[:-1], "eos"
            elif tokens[-1] in self.sampling.stop_token_ids:
                body, reason = tokens[:-1], "stop"
            else:
                reason = "length"
        cut = self._find_stop_string(body, whole=device_done)
        if cut is not None:
            body, text, reason = cut[0], cut[1], "stop"
        elif reason is None:
            return None
        else:
            text = self._decode(body)
        self.stats.generated_tokens += len(tokens)
        return Completion(row.prompt_index, row.sample_index, list(body), text, reason)

    def _find_stop_string(self, tokens: list[int], *, whole: bool) -> tuple[list[int], str] | None:
        """(tokens fully before the earliest stop string, text cut before it), or None."""
        stops = self.sampling.stop
        if not stops or not tokens:
            return None
        if not whole:
            # Cheap look at the tail first: a stop string ending in the newest chunk lies within it.
            tail = tokens[-(self.engine_config.decode_chunk_steps + 2 * max(map(len, stops)) + 8):]
            tail_text = self._decode(tail)
            if not any(stop in tail_text for stop in stops):
                return None
        text = self._decode(tokens)
        hits = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        # Largest k whose decoded prefix fits before the cut (decoded length grows with k).
        lo, hi = 0, len(tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._decode(tokens[:mid])) <= cut:
                lo = mid
            else:
                hi = mid - 1
        while lo > 0 and not text.startswith(self._decode(tokens[:lo])):
            lo -= 1
        return tokens[:lo], text[:cut]

