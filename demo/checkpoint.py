"""Tiny Hugging Face checkpoints built locally, for the demo, the tests and benchmarks.

Owns a byte-level BPE tokenizer trained on bundled text (saved as a transformers fast
tokenizer with a chat template) and random-weight Llama/Qwen2 checkpoints written with
numpy + safetensors in the exact layout transformers saves, so no download and no torch
are needed. It refuses to pretend to be a trained model: weights are random.

    build_checkpoint("demo/model", layers=2, hidden=64, vocab_size=512)
    python demo/checkpoint.py demo/model     # what scripts/setup.sh runs
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (UNK, BOS, EOS)
"""Ids 0, 1, 2, as in Llama 2."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

DEMO_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"


def corpus() -> list[str]:
    """Text the demo tokenizer is trained on: the bundled prompts plus a little prose."""
    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "Write a short story about a robot who learns to paint.",
        "Explain how a transformer language model generates text, one token at a time.",
        "Once upon a time, in a land far away, there lived a curious engineer.",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } - _ / \\ ' \"",
    ]
    if DEMO_PROMPTS.exists():
        lines += [json.loads(line)["prompt"] for line in DEMO_PROMPTS.read_text().splitlines() if line.strip()]
    return lines


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512) -> None:
    """Train a byte-level BPE on `corpus()` and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_checkpoint(
    out_dir: str | os.PathLike,
    *,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
    arch: str = "llama",
    tie_embeddings: bool = False,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=vocab_size)
    intermediate = intermediate or 4 * hidden
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "attention_bias": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n")
    save_file(_random_weights(config, arch, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _random_weights(config: dict, arch: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(config["vocab_size"], hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * hd, hidden),
            p + "self_attn.k_proj.weight": w(kv * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv * hd, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        })
        if arch == "qwen2":
            tensors.update({
                p + "self_attn.q_proj.bias": w(heads * hd),
                p + "self_attn.k_proj.bias": w(kv * hd),
                p + "self_attn.v_proj.bias": w(kv * hd),
            })
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(config["vocab_size"], hidden)
    return tensors


def main(argv: list[str]) -> None:
    out = argv[0] if argv else "demo/model"
    if (Path(out) / "config.json").exists():
        print(f"demo checkpoint already at {out}")
        return
    build_checkpoint(out, layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=512)
    print(f"built a random-weight Llama (2 layers, width 64, vocab 512) at {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
