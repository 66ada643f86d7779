"""The engine's settings: what to sample (`SamplingParams`) and how to run it (`EngineConfig`).

One definition of each, with its defaults and its checks: the pipeline's YAML sections
`sampling:` and `engine:` are these classes (pipeline/run/config.py reads YAML into them), and
`Engine.load` takes them as they are. Plain dataclasses only: importing this module does not
import JAX, so reading a config stays fast.

    sampling = SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, n=4)
    engine = Engine.load(path, dtype="bfloat16", sampling=sampling, engine=EngineConfig(batch_size=32),
                         max_prompt_tokens=512, tokenizer=tok)

A value out of range raises `InvalidConfig` (a ValueError) naming the config key path, the
value and what would be valid: `sampling.top_p must be a number in (0, 1], got 1.5`.
"""

from __future__ import annotations

import collections.abc
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal


MAX_TOP_LOGPROBS = 20
"""The most alternatives `sampling.top_logprobs` returns per token (vLLM's and OpenAI's cap)."""


class InvalidConfig(ValueError):
    """A setting is out of range; the message names its key path (the CLI exits 2)."""


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise InvalidConfig('{key} must be {expected}, got {value!r}') unless ok."""
    if not ok:
        raise InvalidConfig(f"{key} must be {expected}, got {value!r}")


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool: the checks below compare values, and a tuple or a
    string given from Python would otherwise raise TypeError instead of naming the key."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_sequence(value: Any) -> bool:
    """A list, a tuple, a numpy array...: not a string or a mapping, which iterate as something else."""
    return isinstance(value, collections.abc.Iterable) and not isinstance(value, (str, bytes, collections.abc.Mapping))


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    """Upper bound on generated tokens per sample; hitting it gives finish_reason 'length'."""
    min_new_tokens: int = 0
    """No EOS or stop token is chosen before the completion holds this many tokens (their logits
    are out of reach until then; a stop string can still end it); 0 = off, at most
    max_new_tokens. transformers' `min_new_tokens`, vLLM's `min_tokens`."""
    temperature: float = 0.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1 = off.
    Without top_k, tokens as probable as the least probable one kept are all kept (a tie)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    min_p: float = 0.0
    """Keep only tokens at least min_p times as probable as the most probable one (after
    temperature); 0 = off. With top_k and top_p, a token must pass all three."""
    repetition_penalty: float = 1.0
    """Each token already in the prompt or the completion has its logit divided by it where
    positive, multiplied by it where negative; 1 = off, above 1 discourages repeats. As
    transformers' and vLLM's `repetition_penalty`, applied before the two below."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of each token the completion already holds, however often; in
    [-2, 2], 0 = off. As vLLM's and OpenAI's: over the generated tokens, not the prompt, before
    temperature, top_k, top_p and min_p (greedy too). A negative one favours repeats."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for each time the completion already holds it; in
    [-2, 2], 0 = off. Applied with presence_penalty, as vLLM applies them."""
    n: int = 1
    """Samples per prompt; they share one prefill of the prompt."""
    seed: int = 0
    """Sample s of prompt p draws from fold_in(fold_in(key(seed), p), s) (engine/sampler.py)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the completion is cut before the first one (finish_reason 'stop')."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the checkpoint's EOS ids; finish_reason 'stop', token excluded."""
    logprobs: bool = False
    """Also return each generated token's log-probability under the model: the log-softmax of its
    logits in float32, before temperature, top_k and top_p (the model's own distribution, as
    vLLM's default `raw_logprobs`), one per token of `token_ids` (`Completion.logprobs`; the
    output column `completion_logprobs`)."""
    prompt_logprobs: bool = False
    """Also return each prompt token's log-probability given the prompt's tokens before it (the
    log-softmax of the model's logits at the position before it, in float32), None for the first
    token, which has no context (`Completion.prompt_logprobs`; the output columns
    `prompt_token_ids` and `prompt_logprobs`): scoring a set of texts, as vLLM's
    `prompt_logprobs`. Every prefill call then computes the LM head at every position."""
    top_logprobs: int = 0
    """Also return, for each generated token, the `top_logprobs` most probable tokens at its
    position and their log-probabilities under the model (as `logprobs`: float32, before
    temperature and the other rules, most probable first), whether or not one of them was chosen
    (`Completion.top_token_ids`, `Completion.top_logprobs`; the output columns
    `completion_top_token_ids` and `completion_top_logprobs`): a teacher's distribution for
    distillation, or calibration, as vLLM's `logprobs=K` and OpenAI's `top_logprobs`. At most
    MAX_TOP_LOGPROBS; 0 = off."""

    def __post_init__(self):
        # Tuples keep the dataclass hashable (it is baked into compiled programs) when a caller passes lists.
        # A bare string is refused, not split into one-character stops ("\n\n" would stop at each "\n").
        require(_is_sequence(self.stop) and all(isinstance(s, str) for s in self.stop), "sampling.stop", self.stop,
                "a list of strings (one stop string: ['\\n\\n'])")
        require(_is_sequence(self.stop_token_ids) and all(_is_int(t) for t in self.stop_token_ids),
                "sampling.stop_token_ids", self.stop_token_ids, "a list of integer token ids")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        require(_is_int(self.max_new_tokens) and self.max_new_tokens > 0, "sampling.max_new_tokens",
                self.max_new_tokens, "an integer > 0")
        require(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens, "sampling.min_new_tokens",
                self.min_new_tokens, f"an integer in [0, max_new_tokens = {self.max_new_tokens}]")
        require(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
                "sampling.temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        require(_is_number(self.top_p) and 0 < self.top_p <= 1, "sampling.top_p", self.top_p, "a number in (0, 1]")
        require(_is_int(self.top_k) and self.top_k >= 0, "sampling.top_k", self.top_k, "an integer >= 0 (0 = off)")
        require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "sampling.min_p", self.min_p, "a number in [0, 1] (0 = off)")
        require(_is_number(self.repetition_penalty) and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "sampling.repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_number(value) and -2 <= value <= 2, f"sampling.{name}", value, "a number in [-2, 2] (0 = off)")
        require(_is_int(self.n) and self.n > 0, "sampling.n", self.n, "an integer > 0")
        # jax.random.key keeps 32 bits: seeds outside [0, 2**32) would silently share keys.
        require(_is_int(self.seed) and 0 <= self.seed < 2**32, "sampling.seed", self.seed, "an integer in [0, 2**32)")
        require(all(self.stop), "sampling.stop", list(self.stop), "non-empty strings")
        require(all(t >= 0 for t in self.stop_token_ids), "sampling.stop_token_ids", list(self.stop_token_ids),
                "token ids >= 0")
        require(isinstance(self.logprobs, bool), "sampling.logprobs", self.logprobs, "true or false")
        require(isinstance(self.prompt_logprobs, bool), "sampling.prompt_logprobs", self.prompt_logprobs, "true or false")
        require(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "sampling.top_logprobs",
                self.top_logprobs, f"an integer in [0, {MAX_TOP_LOGPROBS}] (0 = off)")


@dataclass(frozen=True)
class MeshConfig:
    data: int | Literal["auto"] = "auto"
    """Devices splitting the batch (each also holds 1/data of every weight); auto = the devices left."""
    model: int | Literal["auto"] = "auto"
    """Devices splitting heads and MLP (tensor parallel); must divide the KV heads; auto = gcd(devices, KV heads)."""

    def __post_init__(self):
        require(self.data == "auto" or (_is_int(self.data) and self.data > 0),
                "engine.mesh.data", self.data, "an integer > 0 or auto")
        require(self.model == "auto" or (_is_int(self.model) and self.model > 0),
                "engine.mesh.model", self.model, "an integer > 0 or auto")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: never part of a result's identity (the same rows come out)."""

    batch_size: int | Literal["auto"] = "auto"
    """Rows decoded together per host (per pod with global_mesh); auto fits weights + KV cache in memory_fraction."""
    memory_fraction: float = 0.85
    """Share of one device's memory that the weights, KV cache and prefill may plan to use."""
    decode_chunk_steps: int = 16
    """Decode steps per compiled call; finished slots are refilled between calls."""
    mode: Literal["host_dp", "global_mesh"] = "host_dp"
    """host_dp: each host holds the whole model and generates its own shards; global_mesh: the
    weights are sharded over every device of the pod and all hosts decode the same batches."""
    mesh: Literal["auto"] | MeshConfig = "auto"
    """global_mesh only: {data: INT|auto, model: INT|auto} devices per mesh axis; auto = tensor
    parallel over gcd(devices, KV heads), the rest data parallel (checked against the model at load)."""
    prefill_chunk_tokens: int = 32
    """Prompt tokens per row of one prefill call; a longer prompt takes several rows (chunks), in
    one call when rows are free. With the CPU attention kernel a call is packed instead: its rows
    hold the prompts end to end, and this sets only their shape."""
    prefill_tokens: int | Literal["auto"] = "auto"
    """Token budget of one prefill call: prefill_tokens // prefill_chunk_tokens rows (at most
    batch_size), each one chunk of a prompt: the first chunks of that many prompts, or the later
    chunks of the prompts started, several of one prompt when fewer prompts are left. With the
    CPU kernel the call's tokens are filled with the next prompts in order, up to that many
    prompts a call, no row padded at a prompt's end. auto: 512 on the CPU; on an accelerator up
    to 4,096, as much as fits beside the batch (engine/memory.py)."""
    lanes: int | Literal["auto"] = "auto"
    """host_dp only: decode streams run side by side, each with batch_size / lanes rows, its own
    KV cache and its own calls. auto: 2 on a CPU host with two or more cores and a batch of 32 or
    more in float32, 64 or more in bfloat16 (XLA's CPU runtime runs much of a decode step on one
    thread; a bfloat16 product costs about as much for 16 rows as for 32), else 1 (engine/memory.py)."""
    overlap_prefill: bool | Literal["auto"] = "auto"
    """host_dp only: prefill the next prompts in a thread of their own, into a small staging cache,
    while the lane decodes, and move each prefilled row into a slot as one frees. auto: on a CPU
    host with two or more cores and one lane, where a prefill call has as many rows as the lane
    (XLA's CPU runtime leaves a core idle during much of a decode step; two lanes already fill
    it), else off (engine/memory.py)."""

    compile_during_load: bool | Literal["auto"] = "auto"
    """Start getting the run's programs (compiling them, or loading them from the compile cache)
    in `Engine.load`, from the model's shapes alone, while the weights are read; else at the first
    `generate`. auto: on where the weights come from remote storage (gs://...: the read waits on
    the network) or the model runs on an accelerator (its host's cores are free while the weights
    load); off for a CPU model read from a local folder, where the getting and the read share the
    cores and Python's lock and on a 2-core machine gained nothing (docs/performance-notes.md)."""

    decode_attention: Literal["auto", "xla", "pallas", "cpu"] = "auto"
    """How a decode step attends over the KV cache: xla, the engine's own operations over the
    cache pages that hold the longest live row; pallas, JAX's Pallas GPU decode-attention kernel,
    each row read to its own length (over several devices each runs it on its own rows and KV
    heads; on the CPU Pallas' interpreter runs it, for checks only); cpu, the engine's C++ CPU
    kernel (built on first use with the machine's compiler), each row read to its own length, its
    rows spread over the CPU's threads. auto: pallas on GPUs in bfloat16 or float16 when head_dim
    is a power of two >= 16, cpu on CPUs where the kernel builds, else xla (engine/kernels.py).
    Every way has the sliding window (Mistral v0.1's, Phi-3 mini's, the Gemmas', Qwen's). Neither
    kernel caps scores: Gemma 2 runs xla, and pallas or cpu is refused."""

    def __post_init__(self):
        require(self.decode_attention in ("auto", "xla", "pallas", "cpu"), "engine.decode_attention", self.decode_attention,
                "auto, xla, pallas or cpu")
        require(self.batch_size == "auto" or (_is_int(self.batch_size) and self.batch_size > 0),
                "engine.batch_size", self.batch_size, "an integer > 0 or auto")
        require(self.mode in ("host_dp", "global_mesh"), "engine.mode", self.mode, "host_dp or global_mesh")
        if self.mesh != "auto" and self.mode != "global_mesh":
            raise InvalidConfig(f"engine.mesh applies only with engine.mode: global_mesh (engine.mode is {self.mode}); "
                                "remove it or set engine.mode=global_mesh")
        require(_is_number(self.memory_fraction) and 0 < self.memory_fraction <= 1,
                "engine.memory_fraction", self.memory_fraction, "a number in (0, 1]")
        require(_is_int(self.decode_chunk_steps) and self.decode_chunk_steps > 0,
                "engine.decode_chunk_steps", self.decode_chunk_steps, "an integer > 0")
        require(_is_int(self.prefill_chunk_tokens) and self.prefill_chunk_tokens > 0,
                "engine.prefill_chunk_tokens", self.prefill_chunk_tokens, "an integer > 0")
        require(self.lanes == "auto" or (_is_int(self.lanes) and self.lanes > 0), "engine.lanes", self.lanes,
                "an integer > 0 or auto")
        if self.lanes not in ("auto", 1) and self.mode != "host_dp":
            raise InvalidConfig(f"engine.lanes applies only with engine.mode: host_dp (engine.mode is {self.mode}); "
                                "remove it or set it to 1: every host of a global mesh must make the same calls in one order")
        require(self.overlap_prefill == "auto" or isinstance(self.overlap_prefill, bool), "engine.overlap_prefill", self.overlap_prefill,
                "true, false or auto")
        if self.overlap_prefill is True and self.mode != "host_dp":
            raise InvalidConfig(f"engine.overlap_prefill applies only with engine.mode: host_dp (engine.mode is {self.mode}); "
                                "remove it: every host of a global mesh must make the same calls in one order")
        require(self.compile_during_load == "auto" or isinstance(self.compile_during_load, bool), "engine.compile_during_load",
                self.compile_during_load, "true, false or auto")
        require(self.prefill_tokens == "auto" or (_is_int(self.prefill_tokens) and self.prefill_tokens >= self.prefill_chunk_tokens),
                "engine.prefill_tokens", self.prefill_tokens,
                f"auto or an integer >= engine.prefill_chunk_tokens ({self.prefill_chunk_tokens})")
