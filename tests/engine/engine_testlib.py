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


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, greedy, no EOS; the explicit mask keeps token 0 from being read as padding."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()
