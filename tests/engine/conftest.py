"""Fixtures for the engine tests: tiny random-weight checkpoints built by transformers, and a
word-level tokenizer, all made locally (no network).

Weights are drawn with std 0.3 (not transformers' 0.02) so that logits have real margins and
greedy tokens are not a coin toss between near-ties.
"""

from __future__ import annotations

import os

import pytest

from engine_testlib import VOCAB

# tests/engine/ is named like the package it tests; pyproject's `pythonpath = ["."]` puts the
# repo root on sys.path, so `import engine` finds the real package, not this folder.
_SESSION_ENV = pytest.StashKey[pytest.MonkeyPatch]()


def pytest_configure(config: pytest.Config) -> None:
    # float32 reference comparisons mean float32 matmuls (GPUs default to TF32); no effect on
    # CPU. Set before the engine tests import JAX, which reads it then.
    patch = config.stash[_SESSION_ENV] = pytest.MonkeyPatch()
    if "JAX_DEFAULT_MATMUL_PRECISION" not in os.environ:
        patch.setenv("JAX_DEFAULT_MATMUL_PRECISION", "highest")


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash[_SESSION_ENV].undo()


def _randomize(model, std: float = 0.3) -> None:
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)


def _built(tmp_path_factory, config, model_class=None) -> tuple[str, object]:
    """(path, torch model): a random-weight causal LM of `config`'s architecture, saved with no
    EOS id, so that every row makes exactly its new tokens."""
    from transformers import AutoModelForCausalLM

    model = (model_class(config) if model_class else AutoModelForCausalLM.from_config(config)).eval()
    _randomize(model)
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    path = tmp_path_factory.mktemp(config.model_type) / "ckpt"
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """(path, torch model): Llama with GQA (4 heads, 2 KV heads), llama3 rope scaling, untied head."""
    from transformers import LlamaConfig

    return _built(tmp_path_factory, LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=False,
    ))


@pytest.fixture(scope="session")
def qwen2(tmp_path_factory):
    """(path, torch model): Qwen2 with q/k/v biases (randomized, not zero) and tied embeddings."""
    from transformers import Qwen2Config

    return _built(tmp_path_factory, Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    ))


@pytest.fixture(scope="session")
def qwen2_windowed(tmp_path_factory):
    """(path, torch model): `qwen2` with use_sliding_window: the layers from max_window_layers (1)
    on attend over a window of 8 positions, the first over every earlier one."""
    from transformers import Qwen2Config

    return _built(tmp_path_factory, Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=8, max_window_layers=1,
    ))


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    """(path, torch model): Qwen3 with an RMS norm of each query and key head, and heads of 16
    dimensions where the hidden size over the heads would give 8."""
    from transformers import Qwen3Config

    return _built(tmp_path_factory, Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
    ))


@pytest.fixture(scope="session")
def olmo2(tmp_path_factory):
    """(path, torch model): OLMo 2, whose norms come after attention and the MLP, with a norm of
    all query heads together and of all key heads."""
    from transformers import Olmo2Config

    return _built(tmp_path_factory, Olmo2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=None,
    ))


@pytest.fixture(scope="session")
def phi3(tmp_path_factory):
    """(path, torch model): Phi-3, whose checkpoint holds q/k/v as one `qkv_proj` and gate/up as
    one `gate_up_proj`, with a sliding window (Phi-3-mini-4k's is 2,047) longer than the tests' rows."""
    from transformers import Phi3Config

    return _built(tmp_path_factory, Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=256, tie_word_embeddings=False,
        pad_token_id=None,
    ))


def _longrope(rotary_dim: int, seed: int) -> dict:
    """A longrope of random short factors (Phi-3.5's lie between 1 and 3) over `rotary_dim`
    dimensions, and long ones the rows never reach."""
    import numpy as np

    short = np.random.RandomState(seed).uniform(1.0, 3.0, rotary_dim // 2).round(4).tolist()
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": [8.0] * (rotary_dim // 2)}


@pytest.fixture(scope="session")
def phi3_longrope(tmp_path_factory):
    """(path, torch model): Phi-3.5-mini's rotation, longrope, on `phi3`: 64 original positions of
    512 (so cos and sin scaled by sqrt(1 + ln 8 / ln 64)), each frequency over its short factor."""
    from transformers import Phi3Config

    return _built(tmp_path_factory, Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=64,
        rope_parameters=_longrope(8, seed=1), tie_word_embeddings=False, pad_token_id=None,
    ))


@pytest.fixture(scope="session")
def phi4_mini(tmp_path_factory):
    """(path, torch model): Phi-4-mini's rotation: longrope over the first 3/4 of each head's 16
    dimensions (12), the rest passed through; tied embeddings."""
    from transformers import Phi3Config

    return _built(tmp_path_factory, Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=64,
        rope_parameters={**_longrope(12, seed=2), "partial_rotary_factor": 0.75}, tie_word_embeddings=True,
        pad_token_id=None,
    ))


_GEMMA_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=512, pad_token_id=None,
    bos_token_id=None,
)
"""The Gemma fixtures' shape: query_pre_attn_scalar (24) other than head_dim (16), so the scale is tested."""


def _gemma3_text(sliding_window: int, **values):
    """Gemma 3's text model in `_GEMMA_SHAPE`, its first and last of three layers windowed."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_GEMMA_SHAPE, sliding_window=sliding_window,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"], **values)


def _gemma3(tmp_path_factory, sliding_window: int):
    return _built(tmp_path_factory, _gemma3_text(sliding_window))


@pytest.fixture(scope="session")
def gemma2(tmp_path_factory):
    """(path, torch model): Gemma 2: Gemma 3's norms, embeddings and GELU without its query and
    key norms, every other layer over a window of 8 positions, one rotary base, and attention
    scores and logits capped (cap * tanh(x / cap); here 5 and 10, low enough to bend them)."""
    from transformers import Gemma2Config

    return _built(tmp_path_factory, Gemma2Config(**_GEMMA_SHAPE, sliding_window=8, attn_logit_softcapping=5.0,
                                                 final_logit_softcapping=10.0))


@pytest.fixture(scope="session")
def gemma3_image_text(tmp_path_factory):
    """(path, torch model): Gemma 3 4B's layout, an image-and-text Gemma3ForConditionalGeneration
    (a tiny SigLIP image tower beside the text model, its tensors under `language_model.`), whose
    global layers scale their rotation linearly (factor 8); the engine runs its text model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = _gemma3_text(sliding_window=8, rope_scaling={"rope_type": "linear", "factor": 8.0})
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB + 2,
                          boi_token_index=VOCAB, eoi_token_index=VOCAB + 1)
    return _built(tmp_path_factory, config, Gemma3ForConditionalGeneration)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory):
    """(path, torch model): Gemma 3 (text): four norms a layer scaling by 1 + weight, scaled
    embeddings, a tanh GELU, per-head query and key norms, attention scaled by
    query_pre_attn_scalar (24, not head_dim's 16), tied embeddings, and two layers of three
    attending over a window of 8 positions with their own rotary base (10,000 against 1,000,000)."""
    return _gemma3(tmp_path_factory, sliding_window=8)


@pytest.fixture(scope="session")
def gemma3_wide(tmp_path_factory):
    """(path, torch model): `gemma3` with a window longer than the tests' rows: the engine's
    kernels run it (a row's window changes nothing), each layer with its own rotary tables."""
    return _gemma3(tmp_path_factory, sliding_window=256)


@pytest.fixture(scope="session")
def mistral(tmp_path_factory):
    """(path, torch model): Mistral with a sliding window of 8 positions (v0.1's is 4,096), shorter
    than the tests' rows: each query attends to its last 8 positions only."""
    from transformers import MistralConfig

    return _built(tmp_path_factory, MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=8, tie_word_embeddings=False,
    ))


@pytest.fixture(scope="session")
def mixtral(tmp_path_factory):
    """(path, torch model): Mixtral, each layer's MLP a mixture of 4 experts, 2 a token (the
    checkpoint holds each expert's w1, w2 and w3 apart, as the Hub's do)."""
    from transformers import MixtralConfig

    return _built(tmp_path_factory, MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    ))


@pytest.fixture(scope="session")
def qwen3_moe(tmp_path_factory):
    """(path, torch model): Qwen3-MoE, 8 experts of width 24, 3 a token, their weights not
    renormalized (norm_topk_prob false); its middle layer an MLP of width 64 (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig

    return _built(tmp_path_factory, Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
    ))


@pytest.fixture(scope="session")
def qwen2_moe(tmp_path_factory):
    """(path, torch model): Qwen2-MoE, 8 experts of width 24, 2 a token, renormalized, and a shared
    expert of width 40 behind its sigmoid gate; q/k/v biases; its first layer an MLP of width 64."""
    from transformers import Qwen2MoeConfig

    return _built(tmp_path_factory, Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False,
    ))


@pytest.fixture(scope="session")
def granite(tmp_path_factory):
    """(path, torch model): Granite, Llama with four scales (the embeddings', the residual
    branches', attention's in place of 1 / sqrt(head_dim), and the logits' divisor), its head
    tied to the embeddings as Granite 3's."""
    from transformers import GraniteConfig

    return _built(tmp_path_factory, GraniteConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, embedding_multiplier=3.0, residual_multiplier=0.8,
        attention_multiplier=0.3, logits_scaling=0.5, tie_word_embeddings=True, pad_token_id=None, eos_token_id=None,
    ))


@pytest.fixture(scope="session")
def granitemoe(tmp_path_factory):
    """(path, torch model): GraniteMoE, Granite's four scales and in every layer 8 experts of width
    24, 2 a token, saved as transformers saves them: each layer's experts two stacked tensors,
    gate and up fused in one."""
    from transformers import GraniteMoeConfig

    return _built(tmp_path_factory, GraniteMoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, num_local_experts=8, num_experts_per_tok=2,
        embedding_multiplier=3.0, residual_multiplier=0.8, attention_multiplier=0.3, logits_scaling=0.5,
        tie_word_embeddings=True, pad_token_id=None, eos_token_id=None,
    ))


@pytest.fixture(scope="session")
def olmoe(tmp_path_factory):
    """(path, torch model): OLMoE, every layer's MLP 8 experts of width 24, 3 a token, their
    weights not renormalized; its queries and keys normed over all heads together, as OLMo 2's."""
    from transformers import OlmoeConfig

    return _built(tmp_path_factory, OlmoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=False, tie_word_embeddings=False, pad_token_id=None, eos_token_id=None,
    ))


@pytest.fixture(scope="session")
def phi3_windowed(tmp_path_factory):
    """(path, torch model): `phi3` with a sliding window of 11 positions, shorter than the tests' rows."""
    from transformers import Phi3Config

    return _built(tmp_path_factory, Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=11, tie_word_embeddings=False,
        pad_token_id=None,
    ))


@pytest.fixture(scope="session")
def tokenizer():
    """Word-level tokenizer: id i <-> word 'x{i}y' (no word is a prefix of another), space-joined."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"x{i}y": i for i in range(VOCAB)}, unk_token="x0y"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
