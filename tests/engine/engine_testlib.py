"""Helpers shared by the engine tests (a plain module: conftest.py is not imported by name)."""

from __future__ import annotations

import json
from pathlib import Path

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


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, greedy, no EOS; the explicit mask keeps token 0 from being read as padding."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()
