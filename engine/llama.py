"""The Llama family (Llama 2/3/3.1/3.2, Mistral, Mixtral, Qwen2/2.5, Qwen3, Qwen3-MoE, OLMo 2, Phi-3/3.5/4, Gemma 2 and 3) in haliax, and its checkpoint mapping.

Owns: the config read from a Hugging Face `config.json` (refusing values the code does not
implement), the blocks (RMS norm, rotary with llama3 scaling or Phi-3's longrope, whole or over
part of each head, grouped-query attention with an
optional q/k/v bias and a norm of the queries and keys (Qwen3's per head, OLMo 2's over all
heads), gated MLP (SiLU, Gemma's tanh GELU) or Mixtral's and Qwen3-MoE's mixture of them
(`Experts`: each expert on the tokens that picked it, or every expert on every token), decoder layer with its
norms before each part,
OLMo 2's after, Gemma's both), the LM
head, and the checkpoint mapping that places each tensor of a Hugging Face checkpoint (read by
engine/checkpoint.py) in the model, or a block of rows of one (Phi-3's fused projections).
Refuses: other architectures, rope types other than default/llama3 (Phi-3's: default/longrope,
as transformers' Phi3Config), a partial rotary outside Phi-3. Phi-3's longrope runs rows up to
its original positions with its short factors, as transformers does (engine.py refuses longer
rows). A sliding
window (Mistral v0.1's, Phi-3 mini's, the Gemmas' local layers', Qwen's) is a band of each query's
mask in the engine's own (XLA) attention, and each query's first key in the kernels (the CPU
kernel's, and the start index JAX's Pallas kernel takes). Gemma 2's capped scores run the XLA
way on every device.
It knows nothing about batching or sampling (see `engine/sampler.py`, `engine/engine.py`).

    config = LlamaConfig.from_hf(json.load(f), source="/ckpt/config.json")
    model = load_checkpoint("gs://bucket/ckpt", config, dtype=jnp.bfloat16)
    hidden, kv = model.forward(tokens, positions, mask)          # no cache: fresh LayerKV per layer
    logits = model.logits(hidden)

Layers are separate modules run by a Python loop, each with its own weight buffers: a scan over
stacked weights copied every layer's slice on each decode step (docs/performance-notes.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

from engine import checkpoint, cpu_attention, kernels
from engine.jax_compat import hax

SUPPORTED_MODEL_TYPES = ("gemma2", "gemma3_text", "granite", "granitemoe", "llama", "mistral", "mixtral", "olmo2", "olmoe",
                         "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or a config value this engine does not implement."""


class LoadStopped(Exception):
    """`load_checkpoint`'s `stop` asked, between two tensors: the weights are not read."""


# ----------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    """gemma2, gemma3_text, granite, granitemoe, llama, mistral, mixtral, olmo2, olmoe, phi3, qwen2,
    qwen2_moe, qwen3 or qwen3_moe: the weight names are the same; granite is llama with four
    scales (`embedding_multiplier`, `residual_multiplier`, `attention_multiplier`,
    `logits_scaling`), granitemoe granite with a mixture of experts in every layer, saved
    stacked (each layer's experts one tensor a projection, gate and up fused); qwen2 adds q/k/v
    biases, qwen3, olmo2 and gemma3_text norms of the queries and keys (`qk_norm`), olmo2 norms
    after each part of a layer instead of before (`post_norm`), the Gemmas both (`gemma`), phi3 saves q/k/v and gate/up fused
    (`fused_projections`), mixtral's MLP is a mixture of experts (`num_experts`), qwen3_moe is
    qwen3 with one in the layers `expert_layers` names (qwen2_moe qwen2 with one, and a shared
    expert), and olmoe is llama with olmo2's norms of the queries and keys and one in every
    layer."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """q/k/v projections carry a bias (qwen2 always; llama when attention_bias)."""
    o_bias: bool
    """o projection carries a bias (llama and qwen3 attention_bias only)."""
    rope_llama3: tuple[float, float, float, int] | None = None
    """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or None."""
    rope_short_factor: tuple[float, ...] | None = None
    """Phi-3.5's and Phi-4-mini's `longrope`: each frequency divided by its short factor, the
    factors transformers uses for rows up to `longrope_rows` positions."""
    rope_attention_factor: float = 1.0
    """longrope: cos and sin scaled by it (transformers' `attention_factor`; sqrt(1 + ln(factor) /
    ln(original positions)) unless config.json sets it)."""
    longrope_rows: int | None = None
    """longrope: original_max_position_embeddings, the longest row the engine runs. Past it
    transformers turns every position of the row, the cached ones' keys excepted, to the long
    factors, which the engine does not implement."""
    partial_rotary: float = 1.0
    """Phi-4-mini's 0.75: the rotation turns the first `rotary_dim` dimensions of each head only."""
    sliding_window: int | None = None
    """Mistral v0.1's or Phi-3 mini's window: a query at position p attends to the keys at
    positions p - sliding_window + 1 to p (transformers' mask). None: every earlier position."""
    qk_norm: Literal["head", "all"] | None = None
    """The queries and keys are RMS-normed before the rotation: each head over its head_dim
    (qwen3), or all heads together over the whole projection (olmo2, olmoe)."""
    post_norm: bool = False
    """olmo2: no norm before attention and the MLP; each one's output is normed before it is
    added to the residual."""
    fused_projections: bool = False
    """phi3: the checkpoint holds q, k and v as one `qkv_proj` and gate and up as one
    `gate_up_proj`, stacked on their output rows; the model keeps them apart, read as row blocks."""
    windowed_layers: tuple[bool, ...] | None = None
    """Which layers attend over `sliding_window` (Gemma 3's five local layers of six, Qwen's from
    max_window_layers on); None: every layer, where the model has a window."""
    local_rope_theta: float | None = None
    """Gemma 3: the windowed layers' rotary base (`rope_local_base_freq`); the others' is rope_theta."""
    rope_linear_factor: float | None = None
    """Gemma 3 4B and larger: the global layers' frequencies divided by it (a `linear` rope)."""
    weights_prefix: str = ""
    """Before every tensor's name: `language_model.` for the text model of Gemma 3's image-and-text
    checkpoints (Gemma3ForConditionalGeneration)."""
    gemma: bool = False
    """Gemma 2's and 3's differences: four norms a layer (around attention and around the MLP), each
    scaling by 1 + its weight in float32; the embeddings times sqrt(hidden_size) in the model's
    dtype; a tanh GELU in the MLP; attention scaled by query_pre_attn_scalar ** -0.5."""
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    """Gemma 2: each attention score s becomes cap * tanh(s / cap) (the engine's own attention only)."""
    final_logit_softcapping: float | None = None
    """Gemma 2: each logit becomes cap * tanh(logit / cap)."""
    num_experts: int | None = None
    """Mixtral, Qwen3-MoE: a layer's MLP is this many experts (each a gated MLP of
    `expert_intermediate_size`) and a router (`Experts`); None: one MLP."""
    experts_per_token: int = 0
    """How many experts each token's output sums (the router's top k)."""
    expert_intermediate_size: int | None = None
    """Each expert's MLP width: Qwen3-MoE's moe_intermediate_size; None: intermediate_size (Mixtral)."""
    expert_layers: tuple[bool, ...] | None = None
    """Qwen3-MoE: which layers have experts (the others, mlp_only_layers and those off its
    decoder_sparse_step, an MLP of intermediate_size); None: every layer, where the model has experts."""
    normalize_top_k: bool = True
    """The top k weights are divided by their sum: Mixtral always, Qwen3-MoE where norm_topk_prob."""
    shared_expert_intermediate_size: int | None = None
    """Qwen2-MoE: each mixture also runs one MLP of this width on every token, its output scaled by
    a sigmoid gate of the token and added to the experts' (`Experts.shared`)."""
    round_router_weights: bool = False
    """Qwen3-MoE: the top k weights are rounded to the activations' dtype before they weigh the
    experts' outputs, as transformers' model rounds them (its Mixtral weighs in float32)."""
    embedding_multiplier: float = 1.0
    """Granite: the embeddings are scaled by it (in float32, rounded once to the model's dtype)."""
    residual_multiplier: float = 1.0
    """Granite: attention's and the MLP's outputs are scaled by it before they join the residual."""
    attention_multiplier: float | None = None
    """Granite: the attention scores' scale, in place of 1 / sqrt(head_dim)."""
    logits_scaling: float = 1.0
    """Granite: the logits are divided by it."""

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (`Experts`)."""
        return bool(self.num_experts) and (self.expert_layers is None or self.expert_layers[layer])

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head the rotation turns: all but with a partial rotary."""
        return int(self.head_dim * self.partial_rotary)

    @property
    def norms_scale_in_float32(self) -> bool:
        """olmo2's and Gemma's norms scale by their weight in float32 before rounding (`RmsNorm`)."""
        return self.model_type == "olmo2" or self.gemma

    @property
    def attention_scale(self) -> float:
        """What the queries' scores are scaled by: 1 / sqrt(head_dim), Gemma's 1 / sqrt(query_pre_attn_scalar),
        Granite's attention_multiplier."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends over, or None (every earlier position)."""
        if self.sliding_window is None or (self.windowed_layers is not None and not self.windowed_layers[layer]):
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> tuple[float, float | None]:
        """Layer `layer`'s rotation: (base, linear factor). Gemma 3's windowed layers have a base
        of their own and no factor."""
        if self.local_rope_theta is not None and self.windowed_layers is not None and self.windowed_layers[layer]:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_linear_factor

    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_size)

    @property
    def Vocab(self) -> Axis:
        return Axis("vocab", self.vocab_size)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_size)

    @property
    def ExpertMlp(self) -> Axis:
        return Axis("mlp", self.expert_intermediate_size or self.intermediate_size)

    @property
    def mlp_units(self) -> int:
        """The most MLP units a layer computes for each token: intermediate_size, or a mixture's
        num_experts x each expert's width, where every expert runs on every token
        (`Experts._dense`; a call grouped by expert, on the CPU, computes fewer: the memory plan
        counts the most)."""
        layers = range(self.num_hidden_layers)
        mixture = self.num_experts * self.ExpertMlp.size + (self.shared_expert_intermediate_size or 0) if self.num_experts else 0
        return max([mixture] + [self.intermediate_size for i in layers if not self.has_experts(i)])

    @property
    def Experts(self) -> Axis:
        return Axis("experts", self.num_experts or 1)

    @property
    def KVHeads(self) -> Axis:
        return Axis("kv_heads", self.num_key_value_heads)

    @property
    def QPerKV(self) -> Axis:
        return Axis("q_per_kv", self.num_attention_heads // self.num_key_value_heads)

    @property
    def HeadDim(self) -> Axis:
        return Axis("head_dim", self.head_dim)

    @property
    def QHeadsDim(self) -> Axis:
        """Query heads x head_dim flattened, as transformers stores q_proj/o_proj."""
        return Axis("q_heads_dim", self.num_attention_heads * self.head_dim)

    @property
    def KVHeadsDim(self) -> Axis:
        return Axis("kv_heads_dim", self.num_key_value_heads * self.head_dim)

    @staticmethod
    def from_hf(cfg: dict[str, Any], *, source: str = "config.json") -> "LlamaConfig":
        """Reads a transformers config dict (v4 `rope_scaling` or v5 `rope_parameters` style)."""

        def refuse(key: str, value: Any, why: str) -> UnsupportedModelError:
            return UnsupportedModelError(f"model.path {source}: {key} {value!r} {why}")

        model_type = cfg.get("model_type")
        weights_prefix = ""
        if model_type == "gemma3":  # Gemma3ForConditionalGeneration: its text model, without the image tower
            cfg = {**cfg.get("text_config", {}), "model_type": "gemma3_text",
                   "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
            model_type, weights_prefix = "gemma3_text", "language_model."
        if model_type in GEMMA_DEFAULTS:  # the Hub's configs leave out transformers' defaults
            cfg = {**GEMMA_DEFAULTS[model_type], **cfg}
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise refuse("model_type", model_type, f"is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)},"
                         " gemma3's text model)")
        gemma = model_type in ("gemma2", "gemma3_text")
        activation_key, expected = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
        activation = cfg.get(activation_key, expected)
        if activation != expected:
            raise refuse(activation_key, activation, f"is not supported (only {expected})")
        caps = ("attn_logit_softcapping", "final_logit_softcapping") if model_type != "gemma2" else ()
        for key in (*caps, "use_bidirectional_attention"):
            if cfg.get(key):  # caps outside Gemma 2; EmbeddingGemma's attention both ways
                raise refuse(key, cfg[key], "is not supported (only null)")
        if cfg.get("mlp_bias", False):
            raise refuse("mlp_bias", cfg["mlp_bias"], "is not supported (only false)")
        if quantization := cfg.get("quantization_config"):
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            if method is None and isinstance(quantization, dict) and any(
                    key.startswith(("load_in_", "bnb_")) for key in quantization):
                method = "bitsandbytes"  # its older configs name no quant_method
            raise refuse("quantization_config", method or quantization, "is not supported (quantized weights)")
        if model_type in ("olmo2", "olmoe") and cfg.get("attention_bias", False):
            raise refuse("attention_bias", cfg["attention_bias"], f"is not supported for {model_type} (only false)")
        if cfg.get("clip_qkv") is not None:  # OLMoE's option to clamp queries, keys and values
            raise refuse("clip_qkv", cfg["clip_qkv"], "is not supported (only null)")
        # transformers reads config.json's rope_scaling over its rope_parameters, which transformers 5
        # writes into every config it saves: model cards tell users to add rope_scaling (Qwen's YaRN).
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        windowed_layers, local_rope_theta, linear_factor = None, None, None
        if model_type == "gemma3_text":
            rope, local_rope_theta, linear_factor = _gemma_rope(cfg, refuse)
        if gemma:  # all but each sliding_window_pattern-th layer (Gemma 3's 6; Gemma 2's 2: every other)
            pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or
                          (6 if model_type == "gemma3_text" else 2))
            windowed_layers = _windowed_layers(cfg, refuse, lambda i: bool((i + 1) % pattern))
        partial_rotary = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
        if partial_rotary != 1.0 and model_type != "phi3":  # Phi-4-mini's 0.75 rotates part of each head
            raise refuse("partial_rotary_factor", partial_rotary, f"is not supported for {model_type} (only phi3 rotates"
                         " part of each head)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if model_type == "phi3" and rope_type in ("su", "yarn"):
            rope_type = "longrope"  # what transformers' Phi3Config reads both names as (Phi-3-128k's first configs)
        default_theta = 1e6 if model_type == "mixtral" else 1e4  # transformers' MixtralConfig's default_theta
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", default_theta)))
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        supported = ("default", "longrope") if model_type == "phi3" else ("default", "llama3")  # transformers' checks
        if rope_type not in supported:
            raise refuse("rope type", rope_type, f"is not supported for {model_type} (supported: {', '.join(supported)})")
        rope_llama3, longrope = None, {}
        if rope_type == "llama3":
            rope_llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "longrope":
            longrope = _longrope(cfg, rope, max_positions=max_positions, rotary_dim=int(head_dim * partial_rotary),
                                 refuse=refuse)

        sliding_window = None
        if model_type in ("qwen2", "qwen2_moe", "qwen3"):  # a window over the layers from max_window_layers on
            if cfg.get("use_sliding_window", False) and cfg.get("sliding_window", 4096) is not None:
                sliding_window, first = int(cfg.get("sliding_window") or 4096), int(cfg.get("max_window_layers", 28))
                windowed_layers = _windowed_layers(cfg, refuse, lambda i: i >= first)
        elif model_type in ("mistral", "mixtral", "phi3") and cfg.get("sliding_window") is not None:
            sliding_window = int(cfg["sliding_window"])  # transformers' Llama and OLMo 2 ignore the key
        elif model_type == "qwen3_moe" and cfg.get("use_sliding_window", False) and cfg.get("sliding_window") is not None:
            sliding_window = int(cfg["sliding_window"])  # every layer (transformers' Qwen3-MoE has no max_window_layers)
        elif gemma:
            sliding_window = int(cfg["sliding_window"])

        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise refuse("num_key_value_heads", kv_heads, f"does not divide num_attention_heads {heads}")
        attention_bias = bool(cfg.get("attention_bias", False))
        granite = {}
        if model_type in ("granite", "granitemoe"):  # transformers' GraniteConfig defaults: every scale 1
            granite = dict(embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                           residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                           attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
                           logits_scaling=float(cfg.get("logits_scaling", 1.0)))
        return LlamaConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            gemma=gemma,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if model_type == "gemma2" else None,
            windowed_layers=windowed_layers,
            local_rope_theta=local_rope_theta,
            rope_linear_factor=linear_factor,
            weights_prefix=weights_prefix,
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and cfg.get("qkv_bias", True)) or attention_bias,
            qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmo2": "all", "olmoe": "all", "gemma3_text": "head"}.get(model_type),
            post_norm=model_type == "olmo2",
            fused_projections=model_type == "phi3",
            o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            rope_llama3=rope_llama3,
            partial_rotary=partial_rotary,
            sliding_window=sliding_window,
            **_experts(cfg, model_type, refuse),
            **longrope,
            **granite,
        )


_GEMMA = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
          "sliding_window": 4096, "tie_word_embeddings": True}
GEMMA_DEFAULTS = {
    "gemma2": {**_GEMMA, "vocab_size": 256_000, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3_text": {**_GEMMA, "vocab_size": 262_208, "max_position_embeddings": 131_072},
}
"""transformers' Gemma2Config and Gemma3TextConfig defaults, which the Hub's configs may leave out."""


def _gemma_rope(cfg: dict[str, Any], refuse) -> tuple[dict[str, Any], float, float | None]:
    """Gemma 3's rotations: (the global layers' rope parameters, the windowed layers' base, the
    global layers' linear factor: 8 from 4B on), from transformers 5's `rope_parameters` per
    layer type or an older config's rope_theta, rope_scaling and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    # As transformers reads them: a rope_scaling updates the global layers' parameters, and a
    # top-level base fills in only where a layer type names none.
    full = {**(params.get("full_attention") or {}), **(cfg.get("rope_scaling") or {})}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
    local = {**(params.get("sliding_attention") or {})}
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 1e4))
    for part, allowed in ((full, ("default", "linear")), (local, ("default",))):
        rope_type = part.get("rope_type", part.get("type", "default"))
        if rope_type not in allowed:
            raise refuse("rope type", rope_type, f"is not supported for gemma3_text (supported: {', '.join(allowed)})")
    linear = float(full["factor"]) if full.get("rope_type", full.get("type")) == "linear" else None
    return {"rope_theta": full.get("rope_theta", 1e6)}, float(local.get("rope_theta", 1e4)), linear


def _experts(cfg: dict[str, Any], model_type: str, refuse) -> dict[str, Any]:
    """The mixture of experts: Mixtral's num_local_experts and num_experts_per_tok (the router's
    top k); Qwen3-MoE's and Qwen2-MoE's num_experts (transformers 5 saves it as num_local_experts),
    their experts' moe_intermediate_size, norm_topk_prob, and which layers have experts: all but
    mlp_only_layers, on every decoder_sparse_step-th layer; Qwen2-MoE's shared expert's
    shared_expert_intermediate_size; OLMoE's num_experts and norm_topk_prob, every layer experts
    of intermediate_size. All but Mixtral round the top k weights (`round_router_weights`)."""
    if model_type in ("mixtral", "granitemoe"):
        experts, top_k, key = int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2)), "num_local_experts"
        # GraniteMoE softmaxes its top k scores (the same weights as Mixtral's top k of a softmax,
        # renormalized) and rounds them to the activations' dtype.
        found: dict[str, Any] = {"round_router_weights": model_type == "granitemoe"}
    elif model_type in MIXTURE_DEFAULTS:
        key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        defaults = MIXTURE_DEFAULTS[model_type]
        experts, top_k = int(cfg.get(key, defaults["num_experts"])), int(cfg.get("num_experts_per_tok", defaults["top_k"]))
        found = dict(normalize_top_k=bool(cfg.get("norm_topk_prob", False)), round_router_weights=True)
        if model_type == "qwen2_moe":
            found["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size", 5632))
        if model_type != "olmoe":
            if experts == 0:  # transformers makes every layer an MLP
                return {}
            step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
            found["expert_intermediate_size"] = int(cfg.get("moe_intermediate_size", defaults["width"]))
            found["expert_layers"] = tuple(i not in dense and (i + 1) % step == 0 for i in range(int(cfg["num_hidden_layers"])))
    else:
        return {}
    if not 1 <= top_k <= experts:
        raise refuse("num_experts_per_tok", top_k, f"must be between 1 and {key} {experts}")
    return {"num_experts": experts, "experts_per_token": top_k, **found}


MIXTURE_DEFAULTS = {"qwen2_moe": dict(num_experts=60, top_k=4, width=1408), "qwen3_moe": dict(num_experts=128, top_k=8, width=768),
                    "olmoe": dict(num_experts=64, top_k=8)}
"""transformers' defaults for what a mixture's config.json may leave out (an expert's width: OLMoE's
is intermediate_size)."""


def _windowed_layers(cfg: dict[str, Any], refuse, windowed: Callable[[int], bool]) -> tuple[bool, ...]:
    """Which layers attend over the sliding window: config.json's `layer_types`, else those
    `windowed` says (how transformers reads a config without them)."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        return tuple(windowed(i) for i in range(layers))
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise refuse("layer_types", types, f"must name sliding_attention or full_attention for each of the {layers} layers")
    return tuple(kind == "sliding_attention" for kind in types)


def _longrope(cfg: dict[str, Any], rope: dict[str, Any], *, max_positions: int, rotary_dim: int, refuse) -> dict[str, Any]:
    """LlamaConfig's longrope fields, as transformers 5 reads a Phi-3 config.json: the original
    positions from the top level (4,096 when absent), the factor from the positions' ratio unless
    `factor` is set, the attention factor from the factor unless `attention_factor` is set."""
    original = int(cfg.get("original_max_position_embeddings") or 4096)
    short = tuple(float(f) for f in rope.get("short_factor") or ())
    if len(short) != rotary_dim // 2:
        raise refuse("short_factor", list(short)[:4], f"must hold {rotary_dim // 2} factors (half the rotated"
                     f" dimensions), not {len(short)}")
    factor = float(rope.get("factor") or max_positions / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_short_factor": short, "rope_attention_factor": float(attention), "longrope_rows": original}


# ----------------------------------------------------------------------------------- blocks


def _normal(key: jax.Array, axes: tuple[Axis, ...], std: float = 0.02) -> NamedArray:
    return hax.random.normal(key, axes) * std


def _xla_cpu() -> bool:
    """The programs being traced are for XLA's CPU backend, whose bfloat16 gather `embed` works
    around."""
    return jax.default_backend() == "cpu"


ROWS_FIRST: bool | None = None
"""The activations' order (`rows_first`): None, by the backend; True or False forces one (the
tests run the accelerators' order on the CPU)."""


def rows_first() -> bool:
    """Activations rows first, (batch, position, features), and each projection x @ weight.T:
    on accelerators. The CPU keeps them feature first, weight @ x (`linear`). On a GPU feature
    first cost a transpose wherever rows meet heads: a TinyLlama decode step's q/k/v product
    came out [features, batch] and its split-K sum, the rotation and the turn to the kernel's
    (batch, heads, head_dim) took 23.6 us a layer in one fusion, and RMSNorm's sums over the
    first axis 7.9 us each (an H200, docs/performance-notes.md)."""
    return not _xla_cpu() if ROWS_FIRST is None else ROWS_FIRST


def set_rows(array: jax.Array, index, new: jax.Array) -> jax.Array:
    """array.at[index].set(new) in place, out-of-range indices dropped. new is either stored as
    array is (rows of another cache: copied as they are) or values, rounded to the dtype of the
    values array holds and given as bits to a `cpu_attention.BFLOAT16_BITS` array."""
    if new.dtype != array.dtype:
        new = cpu_attention.as_stored(new, array.dtype)
    return array.at[index].set(new, mode="drop")


def linear(x: NamedArray, weight: NamedArray, axis: str) -> NamedArray:
    """A projection weight times x, summed over `axis`: (weight's out axis, x's other axes...),
    or on accelerators (x's other axes..., weight's out axis), accumulated in float32 and
    rounded once to x's dtype, as torch's Linear does.

    On the CPU the engine holds activations feature axis first, (embed, batch, position), and weights as
    transformers saves them, (out, in): each projection is then the plain weight @ x, with no
    transpose of either side, and its result comes out feature first for the next one. XLA's
    CPU backend runs a decode step's projections fastest this way at the 125M shape: a fifth
    less time than x @ weight in float32, a quarter to a third less in bfloat16
    (scripts/bench_dots.py --stack), about 7 % of the whole decode step
    (docs/performance-notes.md). Asking for a float32 result matters there too: a bfloat16
    dot with a bfloat16 result runs a generic loop, one with a float32 result the YNNPACK
    library (`__ynn_fusion` in the optimized HLO), about 5x faster.

    On a global mesh the result is laid out as engine/mesh.py's COMPUTE_MAPPING says: a
    projection to heads or MLP units keeps them split over `model`, as its weight is, so each
    device computes its own (left to XLA's propagation, the CPU backend gathered every weight
    whole instead). A no-op elsewhere.

    On accelerators (`rows_first`) the activations are rows first and the product is x @
    weight.T: its result comes out rows first, as GPU kernels and attention read it."""
    operands = (x, weight) if rows_first() else (weight, x)
    return hax.auto_sharded(hax.dot(*operands, axis=axis, preferred_element_type=jnp.float32).astype(x.dtype))


def embed(table: NamedArray, tokens: NamedArray) -> NamedArray:
    """The rows of `table` (Vocab, Embed) for `tokens`. On the CPU a 16-bit table is gathered as
    the same bits in uint16: XLA's CPU backend gathers bfloat16 through float32, and inside the
    decode loop it converted the whole table once per call (81 ms of each 1.2 s decode call of
    the 125M model). XLA still copies the uint16 view once per call, a plain copy: 27 ms there."""
    if table.dtype.itemsize != 2 or not _xla_cpu():
        return table.take("vocab", tokens)
    bits = hax.named(jax.lax.bitcast_convert_type(table.array, jnp.uint16), table.axes)
    rows = bits.take("vocab", tokens)
    return hax.named(jax.lax.bitcast_convert_type(rows.array, table.dtype), rows.axes)


class RmsNorm(eqx.Module):
    """Normalises over its weight's one axis: embed for a layer's parts, head_dim for qwen3's
    query and key heads, q_heads_dim and kv_heads_dim for olmo2's queries and keys."""

    weight: NamedArray
    eps: float = eqx.field(static=True)
    scale_in_float32: bool = eqx.field(static=True, default=False)
    """olmo2's and Gemma's order: scaled by the weight in float32, then rounded to x's dtype once;
    else Llama's: rounded, then scaled in x's dtype (the same in float32, not in bfloat16)."""
    offset: float = eqx.field(static=True, default=0.0)
    """Gemma's 1: the scale is offset + weight (in float32), its checkpoint's weights saved as offsets."""

    @staticmethod
    def init(axis: Axis, config: "LlamaConfig") -> "RmsNorm":
        """A norm over `axis` in the config's model's manner."""
        return RmsNorm(hax.ones(axis), config.rms_norm_eps, config.norms_scale_in_float32, 1.0 if config.gemma else 0.0)

    def __call__(self, x: NamedArray) -> NamedArray:
        # As transformers: normalise in float32, then scale and cast back in the model's order.
        x32 = x.astype(jnp.float32)
        var = hax.mean(x32 * x32, axis=self.weight.axes[0].name)
        normed = x32 * hax.rsqrt(var + self.eps)
        if self.scale_in_float32:
            scale = self.weight.astype(jnp.float32)
            return ((scale + self.offset if self.offset else scale) * normed).astype(x.dtype)
        return self.weight * normed.astype(x.dtype)


def rope_inv_freq(config: LlamaConfig, rope: tuple[float, float | None] | None = None) -> np.ndarray:
    """Inverse frequencies [rotary_dim / 2] of a layer's rotation (`LlamaConfig.rope_of`; base
    rope_theta by default), with Llama 3.1's long-context rescaling or longrope's short factors
    when set."""
    dim = config.rotary_dim
    theta, linear = rope or (config.rope_theta, None)
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if linear is not None:
        inv_freq = inv_freq / linear
    if config.rope_short_factor is not None:
        return (inv_freq / np.asarray(config.rope_short_factor, np.float64)).astype(np.float32)
    if config.rope_llama3 is None:
        return inv_freq.astype(np.float32)
    factor, low_freq_factor, high_freq_factor, old_context_len = config.rope_llama3
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rotary_tables(config: LlamaConfig, positions: NamedArray, dtype,
                  rope: tuple[float, float | None] | None = None) -> tuple[NamedArray, NamedArray]:
    """cos and sin over (positions' axes..., head_dim of rotary_dim), as transformers' rotate-half
    layout, of a layer's rotation (`rope_inv_freq`), scaled by longrope's attention factor in
    float32 before the cast, as transformers scales them."""
    Half = Axis("head_dim", config.rotary_dim // 2)
    inv_freq = hax.named(jnp.asarray(rope_inv_freq(config, rope)), Half)
    angles = hax.broadcast_axis(positions.astype(jnp.float32), Half) * inv_freq
    angles = hax.concatenate("head_dim", [angles, angles])
    cos, sin = hax.cos(angles), hax.sin(angles)
    if config.rope_attention_factor != 1.0:
        cos, sin = cos * config.rope_attention_factor, sin * config.rope_attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rotary(x: NamedArray, cos: NamedArray, sin: NamedArray) -> NamedArray:
    """x rotated by the tables, rotate-half; with tables shorter than the head (a partial rotary),
    its first dimensions only, the rest passed through."""
    dim = cos.resolve_axis("head_dim").size
    if dim < x.resolve_axis("head_dim").size:
        return hax.concatenate("head_dim", [apply_rotary(x["head_dim", :dim], cos, sin), x["head_dim", dim:]])
    half = dim // 2
    x1 = x["head_dim", :half]
    x2 = x["head_dim", half:]
    rotated = hax.concatenate("head_dim", [-x2, x1])
    return x * cos + rotated * sin


class LayerKV(NamedTuple):
    """One layer's keys and values, each (batch, kv_heads, key_position, head_dim). Named by axis,
    so code reads `kv.k`, never `cache[i][0]`."""

    k: NamedArray
    v: NamedArray


def cache_pages(seq_len: int, multiple: int = 16, pages: int = 4) -> tuple[int, ...]:
    """Where the cache's pages end along key positions: `pages` pages of an equal share of the
    cache each (rounded up to `multiple` positions, the last one what is left; fewer when the
    cache is that short). A decode call whose live rows all fit the first k pages reads only
    those, where they live (`by_pages`): the engine's own attention costs what the longest live
    row holds, to a quarter, and nothing is copied. With the two pages before (a quarter and the
    rest), a row past the first quarter read the whole cache: a generation from short prompts
    read on average 1.6x the positions it held (Llama-3-8B seed workload, 128 + 2,048 tokens),
    with quarters 1.2x. Each page count is a branch of the decode program: more pages compile
    longer (docs/performance-notes.md)."""
    share = -(-seq_len // (pages * multiple)) * multiple  # a share, rounded up to a multiple
    return tuple(sorted({min(seq_len, share * i) for i in range(1, pages + 1)}))


def page_spans(ends: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, end) key positions of each page, from where the pages end."""
    return tuple(zip((0,) + ends[:-1], ends))


def by_pages(reach: jax.Array, ends: tuple[int, ...], run):
    """run(k) for the fewest pages k whose `ends` cover `reach` positions (a traced scalar), as
    one lax.switch over the page counts. Branches only read the cache: one that wrote it would
    make XLA copy it."""
    index = jnp.sum(jnp.asarray(ends[:-1], jnp.int32) < reach)
    return jax.lax.switch(index, [lambda k=k: run(k) for k in range(1, len(ends) + 1)])


def pages_covering(reach: int, ends: tuple[int, ...]) -> int:
    """On the host, the fewest pages whose `ends` cover `reach` positions: the page count a
    decode call's `by_pages` picks on the device (every count allowed)."""
    return 1 + sum(end < reach for end in ends[:-1])


class PagedKV(NamedTuple):
    """One layer's cache: keys and values (batch, kv_heads, key_position, head_dim) in separate
    page buffers along key_position (`cache_pages`), so a call that needs only the first pages
    reads them in place."""

    pages: tuple[LayerKV, ...]

    @property
    def ends(self) -> tuple[int, ...]:
        ends, end = [], 0
        for page in self.pages:
            end += page.k.resolve_axis("key_position").size
            ends.append(end)
        return tuple(ends)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return page_spans(self.ends)

    def write(self, rows: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> "PagedKV":
        """Scatters k, v [..., kv_heads, head_dim] to (rows, positions) (broadcast together, int32
        indices into the whole cache) in place; positions outside the cache are dropped."""
        pages = []
        for page, (start, end) in zip(self.pages, self.spans):
            inside = jnp.where((positions >= start) & (positions < end), positions - start, end - start)
            pages.append(LayerKV(*(
                hax.named(set_rows(old.array, (rows, slice(None), inside), new), old.axes)
                for old, new in ((page.k, k), (page.v, v))
            )))
        return PagedKV(tuple(pages))


def _scores(q: NamedArray, keys: NamedArray, scale: float, softcap: float | None) -> NamedArray:
    """float32 scores of q over keys (dot over head_dim, times scale), Gemma 2's capped: cap *
    tanh(s / cap), as transformers caps them."""
    s = hax.dot(q, keys, axis="head_dim", preferred_element_type=jnp.float32) * scale
    return s if softcap is None else hax.tanh(s / softcap) * softcap


def _attend_pages(q: NamedArray, parts, scale: float, softcap: float | None = None) -> NamedArray:
    """Softmax attention of q over several key sets, each (keys, values, mask, key axis name),
    without concatenating them: a page's scores, weights and weighted values are its own, and
    the parts are combined in a fixed order. A part whose mask is all False for a row adds exact
    zeros, so a row's result does not depend on how many pages its call read.

    Each part's scores take q through its own optimization barrier. Without it XLA's GPU
    compiler merges dots that share an operand (its DotMerger pass): the small dot over the
    chunk buffer joined the pages' dots over their concatenation, a copy of the pages in every
    layer at every step (on an H200, TinyLlama's second-costliest kernel: a [kv_heads, batch,
    208, head_dim] concatenate). With the barriers the copies are gone and a decode call at
    position 256 took 4 % less time; the 8B seed workload's time did not change."""
    scores = []
    for keys, _, mask, axis in parts:
        q_part, keys = jax.lax.optimization_barrier((q, keys))
        s = _scores(q_part, keys, scale, softcap)
        scores.append(hax.where(mask, s, -jnp.inf))
    top = functools.reduce(hax.maximum, [hax.max(s, axis=axis) for s, (*_, axis) in zip(scores, parts)])
    total, attn = None, None
    for s, (_, values, _, axis) in zip(scores, parts):
        e = hax.exp(s - top)
        part = hax.dot(e.astype(values.dtype), values, axis=axis, preferred_element_type=jnp.float32)
        total = hax.sum(e, axis=axis) if total is None else total + hax.sum(e, axis=axis)
        attn = part if attn is None else attn + part
    return attn / total


class PrefillSegments(NamedTuple):
    """Where a prefill call's prompts are in its tokens (batch, position), read row-major as one
    row: segment s is the lengths[s] tokens from offsets[s], the piece of a prompt from its
    position starts[s] on, whose keys/values go to the cache rows samples[s] [segments, n] (out
    of range: none; the samples of one prompt share its prefill, the first sample's row read:
    `rows`). Unused entries have length 0. The XLA way, segment r is batch row r: offsets r x
    position, and the keys/values go where `PrefillChunk.write_rows` says."""

    samples: jax.Array
    starts: jax.Array
    offsets: jax.Array
    lengths: jax.Array

    @property
    def rows(self) -> jax.Array:
        """[segments]: the cache row each segment reads, its prompt's first sample's."""
        return self.samples[:, 0]


class PrefillChunk(NamedTuple):
    """How a prefill call attends: each token's key/value is written straight into the cache
    rows `write_rows` at `write_positions`, then its query attends over its prompt's cache row
    up to itself. Prompts longer than a call take several, each attending to what the earlier
    ones wrote."""

    cache: PagedKV
    """The whole cache (slots rows); written in place, returned updated."""
    write_rows: jax.Array
    """[rows, C, n] int32: cache rows receiving each token's keys/values (the samples of one
    prompt share its prefill); out of range (= slots) for none."""
    positions: jax.Array
    """[rows, C] int32: each token's position in its prompt; a token attends to keys at or before it."""
    write_positions: jax.Array
    """[rows, C] int32: cache position of each token; out of range for padding (not written)."""
    segments: PrefillSegments
    """The call's prompts' pieces: which cache row each reads, from where."""
    reach: jax.Array
    """int32 scalar: cache positions the call's rows use once this chunk is written (the longest
    start + length); a later chunk reads the first pages covering it (`by_pages`)."""
    fresh: bool
    """Every row starts its prompt here, so nothing before the chunk is read: it attends to its
    own keys only instead of gathering its cache row (static: one program each way)."""
    attention: str = "xla"
    """How the chunk attends (static): xla, each batch row one segment, a later chunk its cache
    row's first pages gathered, one branch per page count (`by_pages`), and its own keys; cpu,
    the engine's C++ kernel, any segments anywhere in the call (a call packed with prompts),
    each read in place once written, each query up to itself (`engine.kernels.prefill_step_cpu`;
    one device's cache)."""


class DecodeStep(NamedTuple):
    """How one decode step attends: to the first pages of the cache, read in place and never
    written inside the decode loop, and to the chunk buffer holding this decode chunk's own
    keys/values, where the step's new key/value is written at index `step`."""

    pages: tuple[LayerKV, ...]
    chunk: LayerKV
    """(batch, kv_heads, chunk, head_dim): keys/values of this chunk's steps so far."""
    step: jax.Array
    page_masks: tuple[NamedArray, ...]
    """Per page (batch, position, key_position): its positions written before this decode chunk."""
    chunk_mask: NamedArray
    """(batch, position, chunk): chunk steps up to this one."""
    lengths: jax.Array
    """[batch] int32: positions of each row written before this decode chunk (what page_masks
    hold). In place (chunk None): where this step writes each row's key/value, the cache's length
    for a row that writes nothing."""
    attention: str = "xla"
    """How the step attends (static): xla, the operations below; pallas, JAX's fused kernel, or
    cpu, the engine's C++ CPU kernel (engine/kernels.py), each row read to its own length."""
    sharding: Any = None
    """The cache's NamedSharding (static): over several devices the kernel runs per device."""
    kernel: Any = None
    """With pallas, the kernel's KernelTuning (static; None: engine.kernels.TUNING)."""


def _qk_norm(config: LlamaConfig, flat: Axis) -> RmsNorm | None:
    """The norm of the queries (flat: QHeadsDim) or keys (KVHeadsDim), where the model has one:
    over each head's head_dim (qwen3) or over the whole projection (olmo2)."""
    if config.qk_norm is None:
        return None
    axis = config.HeadDim if config.qk_norm == "head" else flat
    return RmsNorm.init(axis, config)


class Attention(eqx.Module):
    """Grouped-query attention: query heads are (KVHeads, QPerKV), so no head is ever repeated.

    Projection weights keep transformers' 2-D [out, in] layout with the head axes flattened;
    activations are unflattened after the matmul. With 4-D weights XLA on CPU copied every
    projection to a 2-D layout on each decode step (measured on the tiny bench model)."""

    config: LlamaConfig = eqx.field(static=True)
    q_proj: NamedArray  # (QHeadsDim, Embed)
    k_proj: NamedArray  # (KVHeadsDim, Embed)
    v_proj: NamedArray
    o_proj: NamedArray  # (Embed, QHeadsDim)
    q_bias: NamedArray | None
    k_bias: NamedArray | None
    v_bias: NamedArray | None
    o_bias: NamedArray | None
    q_norm: RmsNorm | None = None  # qwen3: (HeadDim,), each head; olmo2: (QHeadsDim,), all heads
    k_norm: RmsNorm | None = None  # qwen3: (HeadDim,); olmo2: (KVHeadsDim,)
    window: int | None = eqx.field(static=True, default=None)
    """This layer's sliding window (`LlamaConfig.window_of`), or None."""

    @staticmethod
    def init(config: LlamaConfig, *, key: jax.Array, layer: int = 0) -> "Attention":
        c = config
        k_q, k_k, k_v, k_o = jax.random.split(key, 4)
        q_axes = (c.KVHeads, c.QPerKV, c.HeadDim)
        kv_axes = (c.KVHeads, c.HeadDim)
        return Attention(
            config=c,
            q_proj=_normal(k_q, (c.QHeadsDim, c.Embed)),
            k_proj=_normal(k_k, (c.KVHeadsDim, c.Embed)),
            v_proj=_normal(k_v, (c.KVHeadsDim, c.Embed)),
            o_proj=_normal(k_o, (c.Embed, c.QHeadsDim)),
            q_bias=hax.zeros(q_axes) if c.qkv_bias else None,
            k_bias=hax.zeros(kv_axes) if c.qkv_bias else None,
            v_bias=hax.zeros(kv_axes) if c.qkv_bias else None,
            o_bias=hax.zeros(c.Embed) if c.o_bias else None,
            q_norm=_qk_norm(c, c.QHeadsDim),
            k_norm=_qk_norm(c, c.KVHeadsDim),
            window=c.window_of(layer),
        )

    def __call__(self, x: NamedArray, cos: NamedArray, sin: NamedArray, context) -> tuple[NamedArray, LayerKV]:
        """x (Embed, Batch, Pos), or (Batch, Pos, Embed) on accelerators (`rows_first`); returns
        (output, keys/values), by the kind of `context`:

        - a mask (Batch, Pos, KPos), True where a query may attend (prefill without a cache):
          keys are this call's own positions, in order, returned as a fresh LayerKV; a windowed
          layer also leaves out the keys before each query's window.
        - PrefillChunk: the chunk's keys/values are written into the cache rows it names, then
          it attends over its row of the cache (or, fresh, over the chunk alone); returns the
          updated PagedKV.
        - DecodeStep (one position): attends over the cache's pages (read only) and the chunk buffer;
          returns the updated chunk buffer. Keeping the big cache read-only inside the decode
          loop matters: a per-row scatter into it made XLA copy the whole cache every step. With
          the CPU kernel, or Pallas' (unless tuned otherwise), and one page (no chunk buffer, no branch per
          page count), writes the step's key/value into the page and attends over it; returns the
          updated page (`DecodeSpec.decode_in_place`; the compiled programs write the page in place).
        """
        c = self.config
        q, k = linear(x, self.q_proj, "embed"), linear(x, self.k_proj, "embed")
        if c.qk_norm == "all":  # olmo2: over all heads together, before they are told apart (no bias)
            q, k = self.q_norm(q), self.k_norm(k)
        q = hax.unflatten_axis(q, "q_heads_dim", (c.KVHeads, c.QPerKV, c.HeadDim))
        k = hax.unflatten_axis(k, "kv_heads_dim", (c.KVHeads, c.HeadDim))
        v = hax.unflatten_axis(linear(x, self.v_proj, "embed"), "kv_heads_dim", (c.KVHeads, c.HeadDim))
        if self.q_bias is not None:
            q, k, v = q + self.q_bias, k + self.k_bias, v + self.v_bias
        if c.qk_norm == "head":  # qwen3: each head over its head_dim, after the bias
            q, k = self.q_norm(q), self.k_norm(k)
        # A float32 prefill call through the CPU kernel has the kernel rotate q and k as it reads
        # them: the same bits, without the program's two passes over them a layer (bfloat16's
        # rotation is cheaper in XLA than in the kernel: docs/performance-notes.md).
        rotary = None
        if isinstance(context, PrefillChunk) and context.attention == "cpu" and x.dtype == jnp.float32 \
                and c.rotary_dim == c.head_dim:  # the kernel turns whole heads
            rotary = (cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Attention runs rows first over the cache's rows: q, k and v (small) turn, then its result.
        q = q.rearrange(("batch", "position", "kv_heads", "q_per_kv", "head_dim"))
        k = k.rearrange(("batch", "kv_heads", "position", "head_dim"))
        v = v.rearrange(("batch", "kv_heads", "position", "head_dim"))
        scale = c.attention_scale
        window, softcap = self.window, c.attn_logit_softcapping
        kernel = context.attention if isinstance(context, (DecodeStep, PrefillChunk)) else "xla"
        if softcap and kernel != "xla":
            raise ValueError(f"capped scores are attended the XLA way, not with {kernel!r}")
        if isinstance(context, DecodeStep):
            attn, new_kv = self._decode(q, k, v, context, scale, window, softcap)
        else:
            if isinstance(context, PrefillChunk):
                attn, new_kv = self._prefill(q, k, v, context, scale, rotary, window, softcap)
            else:
                keys, values = k.rename({"position": "key_position"}), v.rename({"position": "key_position"})
                mask = context
                if window is not None:  # the call's positions in order: a key's index is its position
                    index = jnp.arange(mask.resolve_axis("position").size)
                    mask = mask & hax.named(in_window(index[None, :], index[:, None], window), ("position", "key_position"))
                new_kv, attn = LayerKV(keys, values), _attend(q, keys, values, mask, scale, softcap)
        heads = ("kv_heads", "q_per_kv", "head_dim")
        attn = attn.rearrange(("batch", "position") + heads if rows_first() else heads + ("batch", "position"))
        attn = attn.astype(x.dtype)
        out = linear(hax.flatten_axes(attn, heads, "q_heads_dim"), self.o_proj, "q_heads_dim")
        if self.o_bias is not None:
            out = out + self.o_bias
        return out, new_kv

    @staticmethod
    def _prefill(q, k, v, context: PrefillChunk, scale: float, rotary=None, window: int | None = None,
                 softcap: float | None = None) -> tuple[NamedArray, PagedKV]:
        """The call's keys/values written into the cache, and its attention; returns both. A fresh
        chunk attends to its own keys (causal); a later one to its cache row's first pages
        covering the call's rows (each page's rows gathered) and its own keys. With the CPU
        kernel, the write and the attention are one kernel call: any piece attends to its cache
        row in place, the piece written there (causal); with `rotary` (cos, sin), q and k come
        unrotated and the kernel rotates them. With a `window`, each query reads only its last
        `window` positions; with a `softcap`, its scores are capped (the XLA way)."""
        if context.attention == "cpu":
            if len(context.cache.pages) != 1:
                raise ValueError(f"the CPU kernel's prefill reads one page of the cache, not {len(context.cache.pages)}")
            attn, page = kernels.prefill_step_cpu(q, k, v, context.cache.pages[0], context.segments, scale, rotary,
                                                  window)
            return attn, PagedKV((page,))
        cache = _write_chunk(context, k, v)
        return Attention._attend_written(q, k, v, cache, context, scale, window, softcap), cache

    @staticmethod
    def _attend_written(q, k, v, cache: PagedKV, context: PrefillChunk, scale: float, window: int | None,
                        softcap: float | None) -> NamedArray:
        """The XLA way's attention of a prefill chunk once `cache` holds its keys/values."""
        Batch, Pos = q.resolve_axis("batch"), q.resolve_axis("position")
        if context.fresh:
            C = Pos.size
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)), (Batch.size, C, C))
            if window is not None:
                mask = mask & in_window(context.positions[:, None, :], context.positions[:, :, None], window)
            mask = hax.named(mask, (Batch, Pos, Axis("key_position", C)))
            return _attend(q, k.rename({"position": "key_position"}), v.rename({"position": "key_position"}), mask, scale,
                           softcap)
        read = jnp.minimum(context.segments.rows[: Batch.size], cache.pages[0].k.array.shape[0] - 1)  # a row a segment

        def attend(count: int):
            parts = []
            for page, (start, end) in zip(cache.pages[:count], cache.spans):
                KPos = Axis("key_position", end - start)
                axes = (Batch, k.resolve_axis("kv_heads"), KPos, k.resolve_axis("head_dim"))
                keys, values = (hax.named(x.array[read], axes) for x in page)
                key_positions, query_positions = start + jnp.arange(end - start)[None, None, :], context.positions[:, :, None]
                mask = key_positions <= query_positions
                if window is not None:
                    mask = mask & in_window(key_positions, query_positions, window)
                mask = hax.named(mask, (Batch, Pos, KPos))
                parts.append((keys, values, mask, "key_position"))
            return _attend_pages(q, parts, scale, softcap)

        # Every page count is a branch, as in decode: the calls of later chunks, earliest first
        # (Engine._prefill), mostly need fewer than all.
        return by_pages(context.reach, cache.ends, attend)

    @staticmethod
    def _decode(q, k, v, context: DecodeStep, scale: float, window: int | None = None, softcap: float | None = None):
        if context.chunk is None:  # in place: the kernel's one page, carried through the decode loop
            seq_len = context.pages[0].k.resolve_axis("key_position").size
            read = jnp.where(context.lengths < seq_len, context.lengths + 1, 1)  # a row writing nothing reads one
            if context.attention == "cpu":  # the write and the attention in one call
                return kernels.attend_step_cpu(q, context.pages[0], k, v, context.lengths, read, scale,
                                               sharding=context.sharding, window=window)
            page = PagedKV(context.pages).write(jnp.arange(context.lengths.shape[0])[:, None], context.lengths[:, None],
                                                jnp.swapaxes(k.array, 1, 2), jnp.swapaxes(v.array, 1, 2)).pages[0]
            first = None if window is None else jnp.maximum(read - window, 0)  # the query is the last position read
            return kernels.attend_pages_kernel(q, (page,), read, None, None, scale, sharding=context.sharding,
                                               tuning=context.kernel, attention=context.attention, first=first), page
        chunk = context.chunk
        chunk = LayerKV(*(
            hax.named(jax.lax.dynamic_update_slice(old.array, new.array.astype(old.dtype), (0, 0, context.step, 0)), old.axes)
            for old, new in ((chunk.k, k), (chunk.v, v))
        ))
        if context.attention in ("pallas", "cpu"):
            # this step's query is at lengths + step: its window's first position lengths + step + 1 - window
            first = None if window is None else jnp.maximum(context.lengths + context.step + 1 - window, 0)
            return kernels.attend_pages_kernel(q, context.pages, context.lengths, chunk, context.chunk_mask, scale,
                                               sharding=context.sharding, tuning=context.kernel,
                                               attention=context.attention, first=first), chunk
        masks, chunk_mask = context.page_masks, context.chunk_mask
        if window is not None:  # this step's query is at lengths + step; chunk entry s at lengths + s
            query = (context.lengths + context.step)[:, None, None]
            masks = tuple(mask & hax.named(in_window(start + jnp.arange(end - start)[None, None, :], query, window), mask.axes)
                          for mask, (start, end) in zip(masks, PagedKV(context.pages).spans))
            Chunk = chunk_mask.resolve_axis("chunk")
            chunk_mask = chunk_mask & hax.named(in_window(jnp.arange(Chunk.size), context.step, window), (Chunk,))
        parts = [(page.k, page.v, mask, "key_position") for page, mask in zip(context.pages, masks)]
        parts.append((chunk.k, chunk.v, chunk_mask, "chunk"))  # the current position is always there
        return _attend_pages(q, parts, scale, softcap), chunk


def in_window(key_positions: jax.Array, query_positions: jax.Array, window: int) -> jax.Array:
    """True where a key is inside its query's sliding window: the query's last `window` positions,
    its own included (earlier than the query: the causal mask's part). Broadcasts."""
    return key_positions > query_positions - window


def _attend(q: NamedArray, keys: NamedArray, values: NamedArray, mask: NamedArray, scale: float,
            softcap: float | None = None) -> NamedArray:
    """Softmax attention of q over keys/values (batch, kv_heads, key_position, head_dim) where
    mask (batch, position, key_position) is True."""
    scores = _scores(q, keys, scale, softcap)
    scores = hax.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = hax.nn.softmax(scores, axis="key_position").astype(values.dtype)
    return hax.dot(probs, values, axis="key_position", preferred_element_type=jnp.float32)


def _write_chunk(context: PrefillChunk, k: NamedArray, v: NamedArray) -> PagedKV:
    """Scatters the chunk's keys/values (batch, kv_heads, position, head_dim) into the cache at
    (write_rows[r, j, i], write_positions[r, j]) in place; out-of-range indices are dropped."""
    n = context.write_rows.shape[-1]
    rows = context.write_rows.reshape(-1)
    positions = jnp.repeat(context.write_positions.reshape(-1), n)

    def per_write(x: NamedArray) -> jax.Array:  # [rows x C x n, kv_heads, head_dim]
        x = x.rearrange(("batch", "position", "kv_heads", "head_dim")).array
        return jnp.repeat(x.reshape(-1, *x.shape[2:]), n, axis=0)

    return context.cache.write(rows, positions, per_write(k), per_write(v))


class Mlp(eqx.Module):
    gate_proj: NamedArray  # (Mlp, Embed)
    up_proj: NamedArray  # (Mlp, Embed)
    down_proj: NamedArray  # (Embed, Mlp)

    @staticmethod
    def init(config: LlamaConfig, *, key: jax.Array, units: Axis | None = None, experts: Axis | None = None) -> "Mlp":
        """units: the MLP's width (an expert's, `LlamaConfig.ExpertMlp`); None: config.Mlp.
        experts: a mixture's experts, one MLP each, stacked: every weight has this axis first."""
        k_gate, k_up, k_down = jax.random.split(key, 3)
        c, units, stack = config, units or config.Mlp, (experts,) if experts else ()
        return Mlp(
            _normal(k_gate, stack + (units, c.Embed)),
            _normal(k_up, stack + (units, c.Embed)),
            _normal(k_down, stack + (c.Embed, units)),
            gelu=c.gemma,
        )

    gelu: bool = eqx.field(static=True, default=False)
    """Gemma's tanh GELU instead of the SiLU."""

    def __call__(self, x: NamedArray) -> NamedArray:
        gate = linear(x, self.gate_proj, "embed")
        up = linear(x, self.up_proj, "embed")
        return linear(geglu(gate, up) if self.gelu else swiglu(gate, up), self.down_proj, "mlp")


EXPERT_TILE = 64
"""Tokens per product in the grouped way of a mixture of experts (`Experts._grouped`). Each
product reads its expert's weights once: smaller tiles waste less on an expert's last, partly
filled tile but read the weights more often. On the CPU 64 ran fastest of 32, 64 and 128, and
XLA's float32 products of 64 columns give each column the bits a product of 1,024 gives, as
products of 1-48 columns did not (docs/performance-notes.md)."""


class Experts(eqx.Module):
    """The mixture of experts of Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE, in place of the MLP: a
    router scores the experts for each token; its top k scores, softmaxed over all experts in
    float32 (Mixtral's, and the others' with norm_topk_prob, then divided by their sum; all but
    Mixtral's rounded to the activations' dtype), weight the outputs of those k experts' gated
    MLPs. The weighted outputs are added in float32 and the sum rounded once to the activations'
    dtype, as transformers 5's grouped experts (its default) add them; where the weights are
    rounded, each weighted output is rounded first, as its product of a rounded weight and an
    output is. Qwen2-MoE adds a shared expert's output to that sum (`shared`).

    Two ways to get there, the same sums (`_dense`, `_grouped`): a call of few tokens (a decode
    step) runs every expert on every token, whose weights it reads anyway once its tokens pick
    most experts; a call of many (a prefill chunk) on the CPU groups the tokens by expert and runs
    each expert on its own only, in tiles of EXPERT_TILE tokens: num_experts / experts_per_token
    fewer products (4x for Mixtral's 2 of 8) but for the tiles' padding. On accelerators every
    call is dense: the tiles' loop re-reads an expert's weights for each tile, which nothing has
    measured there yet (docs/performance-notes.md)."""

    router: NamedArray  # (Experts, Embed)
    experts: Mlp
    """Every expert's gated MLP, stacked: gate_proj and up_proj (Experts, ExpertMlp, Embed),
    down_proj (Experts, Embed, ExpertMlp). One weight for all experts keeps a layer's program one
    product per projection however many experts it has (Qwen3-MoE's 128 each their own products
    did not compile its decode program in 10 minutes on the CPU), and the loader fills each
    weight from the experts' tensors (`checkpoint_mapping`)."""
    top_k: int = eqx.field(static=True)
    normalize: bool = eqx.field(static=True, default=True)
    """`LlamaConfig.normalize_top_k`."""
    round_weights: bool = eqx.field(static=True, default=False)
    """`LlamaConfig.round_router_weights`."""
    shared: Mlp | None = None
    """Qwen2-MoE's shared expert: an MLP every token runs (`LlamaConfig.shared_expert_intermediate_size`)."""
    shared_gate: NamedArray | None = None
    """(shared_gate: 1, Embed): the shared expert's output is scaled by the sigmoid of this
    weight times the token, rounded, and added to the picked experts' sum."""

    @staticmethod
    def init(config: LlamaConfig, *, key: jax.Array) -> "Experts":
        k_router, k_experts, k_shared, k_gate = jax.random.split(key, 4)
        shared = config.shared_expert_intermediate_size
        return Experts(_normal(k_router, (config.Experts, config.Embed)),
                       Mlp.init(config, key=k_experts, units=config.ExpertMlp, experts=config.Experts),
                       config.experts_per_token, config.normalize_top_k, config.round_router_weights,
                       Mlp.init(config, key=k_shared, units=Axis("mlp", shared)) if shared else None,
                       _normal(k_gate, (Axis("shared_gate", 1), config.Embed)) if shared else None)

    @property
    def Experts(self) -> Axis:
        return self.router.resolve_axis("experts")

    def __call__(self, x: NamedArray) -> NamedArray:
        tokens, top, index = self.route(x)
        step = any(axis.name == "position" and axis.size == 1 for axis in x.axes)
        if self.grouped_pays(math.prod(axis.size for axis in tokens), step=step and x.dtype.itemsize == 2):
            out = self._grouped(x, tokens, top, index)
        else:
            out = self._dense(x, tokens, top, index)
        if self.shared is None:
            return out
        # Qwen2-MoE: sigmoid(gate . x) rounded, times the shared expert's output, rounded, added.
        gate = linear(x, self.shared_gate, "embed")["shared_gate", 0]
        return out + hax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype) * self.shared(x)

    def route(self, x: NamedArray) -> tuple[tuple[Axis, ...], jax.Array, jax.Array]:
        """x's token axes (all but embed), and for each token (in their order) the weights
        [..., top_k] (float32; summing to 1 where `normalize`) and indices of the experts it
        picks, best first."""
        scores = linear(x, self.router, "embed")
        tokens = tuple(axis for axis in scores.axes if axis.name != "experts")
        probs = jax.nn.softmax(scores.rearrange(tokens + (self.Experts,)).array.astype(jnp.float32), axis=-1)
        top, index = jax.lax.top_k(probs, self.top_k)
        if self.normalize:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        if self.round_weights:
            top = top.astype(x.dtype).astype(jnp.float32)
        return tokens, top, index

    def grouped_pays(self, tokens: int, *, step: bool = False) -> bool:
        """Whether a call of this many tokens runs grouped: on the CPU, where the tiles' products
        (at most tokens x top_k, plus a tile per expert) are fewer than the dense ones; but not
        a decode step of 16-bit weights (`step`), whose program's loop would hold a copy of every
        layer's experts (`expert`: 55 GiB at Qwen3-30B-A3B's shape, batch 128, in bfloat16)."""
        experts = self.Experts.size
        return jax.default_backend() == "cpu" and not step and tokens * (experts - self.top_k) > experts * EXPERT_TILE

    def expert(self, e: int | jax.Array, zero: jax.Array | None = None) -> Mlp:
        """Expert e's MLP (e may be traced): each stacked weight's slice at e.

        A 16-bit weight is sliced as the same bits in uint16: XLA's CPU backend slices bfloat16
        through float32, and converted all of a layer's experts to float32 once per call, a copy
        twice their size. In uint16 it still copies them once a call, at their size (as `embed`'s
        gather), and scheduled every layer's copies before the first layer ran (85 GiB of them in
        a prefill program at Mixtral 8x7B's shape in bfloat16). `zero`, a uint16 0 that XLA cannot
        know is 0, computed from the call's routing, is xored into the copy, which then waits for
        the layer's routing (3.5 GiB of temporaries). A decode program's loop over steps still
        took the copies out of the loop, all at once (`grouped_pays`)."""
        def slice_of(w: NamedArray) -> NamedArray:
            if w.dtype.itemsize != 2:
                return hax.named(jax.lax.dynamic_index_in_dim(w.array, e, 0, keepdims=False), w.axes[1:])
            bits = jax.lax.bitcast_convert_type(w.array, jnp.uint16)
            bits = jax.lax.dynamic_index_in_dim(bits if zero is None else bits ^ zero, e, 0, keepdims=False)
            return hax.named(jax.lax.bitcast_convert_type(bits, w.dtype), w.axes[1:])

        return jax.tree.map(slice_of, self.experts, is_leaf=lambda w: isinstance(w, NamedArray))

    def _dense(self, x: NamedArray, tokens: tuple[Axis, ...], top: jax.Array, index: jax.Array) -> NamedArray:
        """Every expert on every token, all in one product per projection; an expert a token did
        not pick weighs 0, which leaves its sum as it was."""
        weights = jnp.sum(jax.nn.one_hot(index, self.Experts.size, dtype=jnp.float32) * top[..., None], axis=-2)
        every = self.experts(x).astype(jnp.float32)  # (experts, embed, tokens...), each rounded to x's dtype first
        parts = self._weighed(every * hax.named(weights, tokens + (self.Experts,)), x.dtype)
        return hax.sum(parts, "experts").astype(x.dtype)

    def _weighed(self, parts, dtype):
        """Picks' weighted outputs (float32) as transformers holds them before it adds them in
        float32: rounded to the activations' dtype where its weights are (`round_weights`)."""
        return parts.astype(dtype).astype(jnp.float32) if self.round_weights else parts

    def _grouped(self, x: NamedArray, tokens: tuple[Axis, ...], top: jax.Array, index: jax.Array) -> NamedArray:
        """Each expert on the tokens that picked it. The picks are sorted by expert, each expert's
        in a run of columns; a loop over the experts takes each one's weights and multiplies its
        run EXPERT_TILE columns at a time. An expert's last tile runs into the next experts'
        columns, which their own turns, later, overwrite; the picks' columns are followed by a
        tile of zeros for the last one to read."""
        embed = x.resolve_axis("embed")
        count, k, tile = math.prod(axis.size for axis in tokens), self.top_k, EXPERT_TILE
        columns = x.rearrange((embed,) + tokens).array.reshape(embed.size, count)
        expert_of = index.reshape(count * k)  # each pick's expert, picks token by token
        order = jnp.argsort(expert_of, stable=True)
        runs = jnp.bincount(expert_of, length=self.Experts.size)
        starts = jnp.cumsum(runs) - runs
        zero = (runs[0] >> 31).astype(jnp.uint16)  # a count's sign bit (`expert`)
        picked = jnp.concatenate([columns[:, order // k], jnp.zeros((embed.size, tile), x.dtype)], axis=1)
        Tile = Axis("expert_tile", tile)

        def run(e: jax.Array, out: jax.Array) -> jax.Array:
            expert = self.expert(e, zero)

            def one_tile(t, out):
                first = starts[e] + t * tile
                block = hax.named(jax.lax.dynamic_slice_in_dim(picked, first, tile, axis=1), (embed, Tile))
                done = expert(block).rearrange((embed, Tile)).array.astype(jnp.float32)
                return jax.lax.dynamic_update_slice_in_dim(out, done, first, axis=1)

            return jax.lax.fori_loop(0, (runs[e] + tile - 1) // tile, one_tile, out)

        # In float32: a bfloat16 buffer made each tile's write 15x slower on the CPU.
        out = jax.lax.fori_loop(0, self.Experts.size, run, jnp.zeros(picked.shape, jnp.float32))
        back = jnp.zeros_like(order).at[order].set(jnp.arange(count * k))  # each pick's column in `out`
        parts = self._weighed(out[:, back].reshape(embed.size, count, k) * top.reshape(count, k), x.dtype)
        total = parts[..., 0]
        for pick in range(1, k):
            total = total + parts[..., pick]
        return hax.named(total.astype(x.dtype).reshape((embed.size,) + tuple(axis.size for axis in tokens)), (embed,) + tokens)


def swiglu(gate: NamedArray, up: NamedArray) -> NamedArray:
    """silu(gate) * up, the SiLU computed in float32 and rounded once to the activations' dtype,
    as torch computes it: in bfloat16 the same bits as transformers' `act_fn(gate) * up`. jax's
    bfloat16 silu rounds after each of its steps (negate, exp, add, divide, multiply): 35 % of
    its results differed from torch's, and on the CPU its loop took 0.36 ms a layer of a
    bfloat16 prefill call against about 0.28 this way (docs/performance-notes.md). The same
    program in float32."""
    return hax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up


def geglu(gate: NamedArray, up: NamedArray) -> NamedArray:
    """gelu(gate) * up with the tanh GELU (transformers' gelu_pytorch_tanh), computed in float32
    and rounded once, as `swiglu`."""
    return hax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype) * up


class DecoderLayer(eqx.Module):
    """Attention, then the MLP, each added to the residual. Llama's norms come before each part
    (input_layernorm, post_attention_layernorm: the MLP's input, as transformers names it);
    olmo2's after (post_attention_layernorm on attention's output, post_feedforward_layernorm
    on the MLP's), with no input_layernorm; Gemma's both before and after each (input_layernorm,
    post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm)."""

    input_layernorm: RmsNorm | None
    self_attn: Attention
    post_attention_layernorm: RmsNorm
    mlp: Mlp | Experts
    post_feedforward_layernorm: RmsNorm | None = None
    pre_feedforward_layernorm: RmsNorm | None = None
    residual_multiplier: float = eqx.field(static=True, default=1.0)
    """Granite's scale of each part's output before it joins the residual."""

    @staticmethod
    def init(config: LlamaConfig, *, key: jax.Array, layer: int = 0) -> "DecoderLayer":
        k_attn, k_mlp = jax.random.split(key)
        norm = functools.partial(RmsNorm.init, config.Embed, config)
        return DecoderLayer(
            None if config.post_norm else norm(),
            Attention.init(config, key=k_attn, layer=layer),
            norm(),
            Experts.init(config, key=k_mlp) if config.has_experts(layer) else Mlp.init(config, key=k_mlp),
            norm() if config.post_norm or config.gemma else None,
            norm() if config.gemma else None,
            config.residual_multiplier,
        )

    def __call__(self, x, cos, sin, context):
        if self.pre_feedforward_layernorm is not None:  # gemma
            attn, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, context)
            x = x + self.post_attention_layernorm(attn)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x, new_kv
        if self.post_feedforward_layernorm is not None:  # olmo2
            attn, new_kv = self.self_attn(x, cos, sin, context)
            x = x + self.post_attention_layernorm(attn)
            x = x + self.post_feedforward_layernorm(self.mlp(x))
            return x, new_kv
        attn, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, context)
        x = x + _scaled(attn, self.residual_multiplier)
        x = x + _scaled(self.mlp(self.post_attention_layernorm(x)), self.residual_multiplier)
        return x, new_kv


def _scaled(x: NamedArray, scale: float) -> NamedArray:
    """x times a Python float as torch multiplies a tensor by one: in float32, rounded once to x's
    dtype (Granite's scales); x itself at 1."""
    return x if scale == 1.0 else (x.astype(jnp.float32) * scale).astype(x.dtype)


@eqx.filter_jit
def _run_layer(layer: DecoderLayer, x: NamedArray, cos: NamedArray, sin: NamedArray, context):
    """One decoder layer, as its own jit: inside a program, JAX traces it once for all the
    layers (they share shapes) instead of once per layer, which halves the time to trace and
    lower a deep model's programs, paid by every host on every start. XLA inlines it when
    compiling."""
    x, kv = layer(x, cos, sin, context)
    return hax.auto_sharded(x), kv


# ---------------------------------------------------------------------------------- LM head


class LlamaLM(eqx.Module):
    config: LlamaConfig = eqx.field(static=True)
    embed_tokens: NamedArray  # (Vocab, Embed)
    layers: tuple[DecoderLayer, ...]
    norm: RmsNorm
    lm_head: NamedArray | None  # (Vocab, Embed); None when tied to embed_tokens

    @staticmethod
    def init(config: LlamaConfig, *, key: jax.Array) -> "LlamaLM":
        k_embed, k_head, k_layers = jax.random.split(key, 3)
        layer_keys = jax.random.split(k_layers, config.num_hidden_layers)
        return LlamaLM(
            config=config,
            embed_tokens=_normal(k_embed, (config.Vocab, config.Embed)),
            layers=tuple(DecoderLayer.init(config, key=k, layer=i) for i, k in enumerate(layer_keys)),
            norm=RmsNorm.init(config.Embed, config),
            lm_head=None if config.tie_word_embeddings else _normal(k_head, (config.Vocab, config.Embed)),
        )

    def forward(self, tokens: NamedArray, positions: NamedArray, context):
        """Hidden states after the final norm, and per layer the LayerKV that Attention returns.

        context: a mask (Batch, Pos, KPos) for every layer (prefill without a cache: returns
        each layer's fresh keys/values), or one PrefillChunk / DecodeStep per layer."""
        # auto_sharded: on a global mesh (engine/mesh.py) keeps rows on the data axis between
        # layers, so FSDP gathers weights instead of splitting activations; a no-op otherwise.
        c = self.config
        x = embed(self.embed_tokens, tokens).rearrange((..., "embed") if rows_first() else ("embed", ...))  # `linear`
        if c.gemma:  # sqrt(hidden) as a float32, rounded to the model's dtype, as transformers scales
            x = x * jnp.asarray(np.float32(math.sqrt(c.hidden_size))).astype(x.dtype)
        x = _scaled(x, c.embedding_multiplier)
        x = hax.auto_sharded(x)
        ropes = dict.fromkeys(c.rope_of(i) for i in range(len(self.layers)))
        tables = {rope: rotary_tables(c, positions, x.dtype, rope) for rope in ropes}
        per_layer = isinstance(context, (tuple, list))
        new_kvs = []
        for i, layer in enumerate(self.layers):
            cos, sin = tables[c.rope_of(i)]
            x, kv = _run_layer(layer, x, cos, sin, context[i] if per_layer else context)
            new_kvs.append(kv)
        return self.norm(x), tuple(new_kvs)

    def logits(self, hidden: NamedArray) -> NamedArray:
        """float32 logits (vocab, hidden's other axes...): the head times hidden, weight first as
        every projection (`linear`); rows first, (hidden's other axes..., vocab), on accelerators
        (`rows_first`). Callers name the order they take (the sampler: the vocabulary first)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        # On a global mesh each device makes its own part of the vocabulary (engine/mesh.py).
        operands = (hidden, head) if rows_first() else (head, hidden)
        logits = hax.auto_sharded(hax.dot(*operands, axis="embed", preferred_element_type=jnp.float32))
        cap = self.config.final_logit_softcapping
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits if cap is None else hax.tanh(logits / cap) * cap


@functools.lru_cache(maxsize=8)
def _skeleton(config: LlamaConfig) -> LlamaLM:
    """LlamaLM as `jax.ShapeDtypeStruct`s (nothing allocated), traced once per config: the memory
    plan, the checkpoint's check, the abstract model and the read all place weights by it (an
    8B model's trace takes 0.07 s). Never changed in place: `eqx.tree_at` makes new trees."""
    # The key made inside the trace: a concrete one opens the devices (status beside a job holding a TPU).
    return eqx.filter_eval_shape(lambda: LlamaLM.init(config, key=jax.random.key(0)))


def parameter_bytes(config: LlamaConfig, dtype) -> int:
    """Bytes of the weights in dtype, from shapes alone (nothing is allocated)."""
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(_skeleton(config)))
    return count * jnp.dtype(dtype).itemsize


# ------------------------------------------------------------------------ checkpoint mapping


class Saved(NamedTuple):
    """Where one weight of LlamaLM comes from: rows [first_row, first_row + the weight's rows) of
    the checkpoint's tensor `name` (all of it, but for a fused projection's blocks); or, for a
    mixture's stacked expert weights, its slice at `expert` of the weight's first axis."""

    name: str
    where: Callable[[LlamaLM], NamedArray]
    first_row: int = 0
    expert: int | None = None


def checkpoint_mapping(config: LlamaConfig) -> list[Saved]:
    """Every weight of LlamaLM and the transformers tensor it is read from; a fused tensor's
    blocks in the order of their rows, a stacked weight's experts one after another from 0."""
    mapping = [Saved("model.embed_tokens.weight", lambda m: m.embed_tokens)]
    # A mixture's block, its router and each expert's tensors by projection: Mixtral's w1 (gate),
    # w3 (up) and w2 (down) in block_sparse_moe, Qwen3-MoE's gate_proj, up_proj and down_proj in
    # mlp; GraniteMoE's stacked tensors (`_stacked_experts`) in block_sparse_moe.
    experts_block, router = "mlp", "gate"
    expert_tensors = tuple((f"{name}_proj", name) for name in ("gate", "up", "down"))
    if config.model_type == "mixtral":
        experts_block, expert_tensors = "block_sparse_moe", (("w1", "gate"), ("w3", "up"), ("w2", "down"))
    elif config.model_type == "granitemoe":
        experts_block, router = "block_sparse_moe", "router.layer"
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."

        def layer(m, i=i):
            return m.layers[i]

        def attention(name: str) -> Callable[[LlamaLM], NamedArray]:
            return lambda m, L=layer: getattr(L(m).self_attn, name)

        def mlp(name: str) -> Callable[[LlamaLM], NamedArray]:
            return lambda m, L=layer: getattr(L(m).mlp, name)

        norms = ("post_attention", "post_feedforward") if config.post_norm else ("input", "post_attention")
        if config.gemma:
            norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
        mapping += [Saved(p + f"{name}_layernorm.weight", lambda m, L=layer, n=name: getattr(L(m), f"{n}_layernorm").weight)
                    for name in norms]
        if config.fused_projections:  # phi3: gate then up, and q then k then v, each one tensor's rows
            q_rows, kv_rows = config.QHeadsDim.size, config.KVHeadsDim.size
            mapping += [Saved(p + "mlp.gate_up_proj.weight", mlp("gate_proj")),
                        Saved(p + "mlp.gate_up_proj.weight", mlp("up_proj"), config.intermediate_size)]
            mapping += [Saved(p + "self_attn.qkv_proj.weight", attention(f"{name}_proj"), first)
                        for name, first in (("q", 0), ("k", q_rows), ("v", q_rows + kv_rows))]
        else:
            if not config.has_experts(i):
                mapping += [Saved(p + f"mlp.{name}_proj.weight", mlp(f"{name}_proj")) for name in ("gate", "up")]
            mapping += [Saved(p + f"self_attn.{name}_proj.weight", attention(f"{name}_proj")) for name in ("q", "k", "v")]
        if config.has_experts(i):  # the router, then each expert's gate, up and down projections
            mapping.append(Saved(p + f"{experts_block}.{router}.weight", lambda m, L=layer: L(m).mlp.router))
            if config.model_type == "granitemoe":
                mapping += _stacked_experts(config, p + experts_block, layer)
            else:
                mapping += [Saved(p + f"{experts_block}.experts.{e}.{saved}.weight",
                                  lambda m, L=layer, name=name: getattr(L(m).mlp.experts, f"{name}_proj"), expert=e)
                            for saved, name in expert_tensors for e in range(config.num_experts)]
            if config.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert and its gate
                mapping += [Saved(p + f"mlp.shared_expert.{name}_proj.weight",
                                  lambda m, L=layer, name=name: getattr(L(m).mlp.shared, f"{name}_proj"))
                            for name in ("gate", "up", "down")]
                mapping.append(Saved(p + "mlp.shared_expert_gate.weight", lambda m, L=layer: L(m).mlp.shared_gate))
        else:
            mapping.append(Saved(p + "mlp.down_proj.weight", mlp("down_proj")))
        mapping.append(Saved(p + "self_attn.o_proj.weight", attention("o_proj")))
        if config.qkv_bias:
            mapping += [Saved(p + f"self_attn.{name}_proj.bias", attention(f"{name}_bias")) for name in ("q", "k", "v")]
        if config.o_bias:
            mapping.append(Saved(p + "self_attn.o_proj.bias", attention("o_bias")))
        if config.qk_norm is not None:
            mapping += [Saved(p + f"self_attn.{name}_norm.weight", lambda m, norm=attention(f"{name}_norm"): norm(m).weight)
                        for name in ("q", "k")]
    mapping.append(Saved("model.norm.weight", lambda m: m.norm.weight))
    if not config.tie_word_embeddings:
        mapping.append(Saved("lm_head.weight", lambda m: m.lm_head))
    return [saved._replace(name=config.weights_prefix + saved.name) for saved in mapping]


def _stacked_experts(config: LlamaConfig, block: str, layer: Callable) -> list[Saved]:
    """GraniteMoE's experts, each layer's saved as two stacked tensors: `input_linear` (experts,
    gate and up rows, hidden), `output_linear` (experts, hidden, width). Each expert's gate, up and
    down are rows of them, read as rows of the expert's shape."""
    width, hidden, experts = config.ExpertMlp.size, config.hidden_size, config.num_experts

    def weight(name: str) -> Callable[[LlamaLM], NamedArray]:
        return lambda m: getattr(layer(m).mlp.experts, f"{name}_proj")

    return ([Saved(f"{block}.input_linear.weight", weight("gate"), e * 2 * width, expert=e) for e in range(experts)]
            + [Saved(f"{block}.input_linear.weight", weight("up"), e * 2 * width + width, expert=e) for e in range(experts)]
            + [Saved(f"{block}.output_linear.weight", weight("down"), e * hidden, expert=e) for e in range(experts)])


def saved_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the loader reads (`checkpoint_mapping`) and its shape as transformers saves it:
    the model's own, but a bias flattened to one axis (the model keeps its head axes), a fused
    projection its blocks' rows stacked, and a tensor of every expert's (GraniteMoE) the experts
    first."""
    skeleton = _skeleton(config)
    shapes: dict[str, tuple[int, ...]] = {}
    experts: dict[str, set[int | None]] = {}
    for saved in checkpoint_mapping(config):
        shape = tuple(saved.where(skeleton).array.shape)[0 if saved.expert is None else 1:]
        if saved.name.endswith(".bias"):
            shape = (math.prod(shape),)
        if saved.name in shapes:  # another block of a fused or stacked tensor: as many rows as its blocks reach
            shape = (max(shapes[saved.name][0], saved.first_row + shape[0]), *shape[1:])
        shapes[saved.name] = shape
        experts.setdefault(saved.name, set()).add(saved.expert)
    for name, seen in experts.items():
        if len(seen) > 1:  # one tensor holds every expert (GraniteMoE's): the experts' axis first, as saved
            rows, *rest = shapes[name]
            shapes[name] = (len(seen), rows // len(seen), *rest)
    return shapes


def check_tensors(path: str, config: LlamaConfig) -> dict[str, checkpoint.Tensor]:
    """The checkpoint's tensors by name, from the files' headers (no weight is read), once every
    tensor the model needs is there with as many values as config.json implies."""
    tensors = checkpoint.read_tensors(path)
    expected = saved_shapes(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise UnsupportedModelError(f"model.path {path}: checkpoint lacks {missing[:3]} ({len(missing)} missing tensors)")
    for name, shape in expected.items():
        tensor = tensors[name]
        if math.prod(tensor.shape) != math.prod(shape):
            raise UnsupportedModelError(
                f"model.path {tensor.url}: tensor {name} has shape {list(tensor.shape)}, config.json implies {shape}"
            )
    return tensors


def abstract_model(config: LlamaConfig, *, dtype, sharding=None) -> LlamaLM:
    """The model `load_checkpoint` reads, as shapes alone: every weight a `jax.ShapeDtypeStruct`
    of its dtype and sharding, nothing allocated. Its programs can be traced and compiled for it
    while the weights are read (`Engine.load`)."""
    skeleton = _skeleton(config)
    sharding_for = _sharding_for(sharding)
    wheres = [group[0].where for group in _weights(config)]
    shapes = [jax.ShapeDtypeStruct(w.array.shape, jnp.dtype(dtype), sharding=sharding_for(w.axes))
              for w in (where(skeleton) for where in wheres)]
    return eqx.tree_at(lambda m: [w(m).array for w in wheres], skeleton, shapes)


def _weights(config: LlamaConfig) -> list[list[Saved]]:
    """`checkpoint_mapping` by weight: one Saved each, a stacked weight its experts' in order."""
    weights: list[list[Saved]] = []
    for saved in checkpoint_mapping(config):
        if saved.expert:
            weights[-1].append(saved)
        else:
            weights.append([saved])
    return weights


def _block_reader(group: list[Saved], tensors: dict[str, checkpoint.Tensor], shape: tuple[int, ...],
                  dtype) -> tuple[Callable[[tuple], np.ndarray], Callable[[], None]]:
    """`jax.make_array_from_callback`'s callback for one weight: a device's block (an index into
    `shape`) read from the weight's tensor, or from each of a stacked weight's experts' tensors,
    as `dtype`; and a function that forgets what was read. Until then devices holding different
    columns of the same rows share one read of those rows."""
    stacked = group[0].expert is not None
    saved_shape = shape[1:] if stacked else shape
    reads = [functools.lru_cache(maxsize=None)(functools.partial(checkpoint.read_rows, tensors[saved.name], saved_shape))
             for saved in group]

    def rows(read, index: tuple, first_row: int) -> np.ndarray:
        first = range(saved_shape[0])[index[0]]
        return read(first_row + first.start, first_row + first.stop)[(slice(None),) + tuple(index[1:])]

    def block(index: tuple) -> np.ndarray:
        if stacked:
            return np.stack([rows(reads[e], index[1:], group[e].first_row).astype(dtype) for e in range(shape[0])[index[0]]])
        return rows(reads[0], index, group[0].first_row).astype(dtype)

    def forget() -> None:
        for read in reads:
            read.cache_clear()

    return block, forget


def _sharding_for(sharding) -> Callable[[tuple], jax.sharding.Sharding]:
    """load_checkpoint's `sharding` as a function of a weight's axes."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return sharding if callable(sharding) else lambda axes: sharding


def load_checkpoint(path: str, config: LlamaConfig, *, dtype, sharding=None,
                    tensors: dict[str, checkpoint.Tensor] | None = None, stop: Callable[[], bool] | None = None) -> LlamaLM:
    """Reads every weight into `dtype`, tensor by tensor, straight into its sharding.

    The files are engine/checkpoint.py's to read; this places each tensor by the mapping above.
    sharding: one `jax.sharding.Sharding` for every weight, a function (weight's axes) ->
    Sharding, or None (the first local device). For each of this host's devices only the rows of
    the tensor's first axis its block spans are read (once per distinct row range), so a host
    reads about its own share of a sharded model (all of it when replicated) and holds at most
    one weight's worth of host memory beyond what is on its devices. Every tensor stays as saved:
    projections (out, in), which `linear` multiplies weight first. tensors: `check_tensors`'
    answer, if the caller has it. stop: asked before each weight; raises LoadStopped once it
    returns True (an 8B model takes minutes to read from a bucket)."""
    tensors = check_tensors(path, config) if tensors is None else tensors
    skeleton = _skeleton(config)
    sharding_for = _sharding_for(sharding)
    wheres, values = [], []
    for group in _weights(config):
        if stop is not None and stop():
            raise LoadStopped(f"stopped reading {path} before {group[0].name}")
        target = group[0].where(skeleton)
        block, forget = _block_reader(group, tensors, tuple(target.array.shape), dtype)
        array = jax.make_array_from_callback(target.array.shape, sharding_for(target.axes), block)
        forget()
        wheres.append(group[0].where)
        values.append(hax.named(array, target.axes))
    return eqx.tree_at(lambda m: [w(m) for w in wheres], skeleton, values)
