"""Global-mesh mode on one process with four forced CPU devices: weights sharded data 2 x model 2
(FSDP and tensor parallel at once) give the same tokens as one device, greedy and sampled; and
`generate(stop=...)` ends every host's loop at the same point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from engine_testlib import VOCAB

import numpy as np

PROMPTS = [np.random.RandomState(20 + i).randint(0, VOCAB, n).tolist() for i, n in enumerate([5, 12, 3, 9])]
SAMPLINGS = {"greedy": dict(max_new_tokens=6, n=2), "sampled": dict(max_new_tokens=6, temperature=0.9, top_k=20, n=2, seed=3)}


def _tokens(engine) -> dict[str, list[int]]:
    return {f"{c.prompt_index},{c.sample_index}": c.token_ids
            for c in engine.generate(GenerationRequest(i, p, [0, 1]) for i, p in enumerate(PROMPTS))}


def test_sharded_weights_give_the_tokens_of_one_device(llama):
    path, _ = llama
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.getcwd()!r})
        import jax
        from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
        assert jax.device_count() == 4
        out = {{}}
        for name, sampling in {SAMPLINGS!r}.items():
            engine = Engine.load({path!r}, dtype="float32", sampling=SamplingParams(**sampling), engine=EngineConfig(batch_size=4, mode="global_mesh", mesh="auto"),
                                 max_prompt_tokens=16)
            attn = engine.model.layers[0].self_attn
            out["layout"] = [str(attn.q_proj.array.sharding.spec), str(engine.model.layers[0].input_layernorm.weight.array.sharding.spec)]
            out["describe"] = engine.describe()
            out[name] = {{f"{{c.prompt_index}},{{c.sample_index}}": c.token_ids for c in engine.generate(
                GenerationRequest(i, p, [0, 1]) for i, p in enumerate({PROMPTS!r}))}}
        print(json.dumps(out))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = json.loads(done.stdout.strip().splitlines()[-1])
    assert sharded["layout"] == ["P('model', 'data')", "P('data',)"]
    assert "global mesh data 2 x model 2 over 4 cpu devices of 1 host(s)" in sharded["describe"]
    for name, sampling in SAMPLINGS.items():
        one = Engine.load(path, dtype="float32", sampling=SamplingParams(**sampling), engine=EngineConfig(batch_size=4), max_prompt_tokens=16)
        assert sharded[name] == _tokens(one), name


def test_stop_ends_generation_between_compiled_calls(llama):
    path, _ = llama
    engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=12), engine=EngineConfig(batch_size=2, decode_chunk_steps=4),
                         max_prompt_tokens=16)
    calls = []
    stopped = list(engine.generate([GenerationRequest(i, p, [0]) for i, p in enumerate(PROMPTS)],
                                   stop=lambda: calls.append(1) or len(calls) > 3))
    assert engine.stopped and len(stopped) < len(PROMPTS)
    everything = list(engine.generate([GenerationRequest(i, p, [0]) for i, p in enumerate(PROMPTS)], stop=lambda: False))
    assert not engine.stopped and len(everything) == len(PROMPTS)
