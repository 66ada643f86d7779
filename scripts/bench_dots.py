"""Time one projection (x times a weight) the ways XLA's CPU backend can be asked for it, beside torch.

The engine's `llama.linear` contracts x with the weight as transformers saves it, (out, in),
over its second axis, and asks for a float32 result rounded to the model's dtype; this script
is the measurement behind both choices. For each shape (batch, in, out) it times, in float32
and bfloat16:

- `(out,in) f32 result`: what `linear` does (a dot_general over the weight's second axis;
  for bfloat16, rounded back to bfloat16 after);
- `(out,in) same-dtype result`: the same contraction with the result in the weights' dtype;
- `(in,out) f32 result`: the same dot from a transposed copy of the weight;
- `weight first`: the weight times x, giving (out, batch), float32 result: how `LlamaLM.logits`
  computes the LM head;
- `x @ w.T`: jax.numpy's spelling of the first (`jnp.matmul(x, w.T)`, float32 result), which
  XLA's CPU backend runs far slower in bfloat16;
- torch's `nn.functional.linear` on the same values (its weights are (out, in)).

Run it on a quiet machine (nothing else running; figures taken under load are off by 2-5x):

    python scripts/bench_dots.py
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SHAPES = [(32, 768, 2048), (32, 768, 32000), (16, 256, 32000), (64, 256, 32000)]


def _time(fn, *args, reps: int = 30) -> float:
    """Mean time of `reps` calls after one warm-up, in milliseconds."""
    out = fn(*args)
    getattr(out, "block_until_ready", lambda: None)()
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    getattr(out, "block_until_ready", lambda: None)()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()

    import torch  # before JAX starts, as bench_engine.py does

    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    for batch, d_in, d_out in SHAPES:
        x = rng.standard_normal((batch, d_in), np.float32)
        w = rng.standard_normal((d_in, d_out), np.float32) * 0.02
        for dtype in ("float32", "bfloat16"):
            jdt = jnp.dtype(dtype)
            xj, w_in_out = jnp.asarray(x, jdt), jnp.asarray(w, jdt)
            w_out_in = jnp.asarray(w.T.copy(), jdt)
            contract = (((1,), (1,)), ((), ()))  # x's second axis with the (out, in) weight's second
            f32_result = jax.jit(lambda x, w: jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.float32).astype(x.dtype))
            same_dtype = jax.jit(lambda x, w: jax.lax.dot_general(x, w, contract))
            weight_first = jax.jit(lambda x, w: jax.lax.dot_general(w, x, contract, preferred_element_type=jnp.float32).astype(x.dtype))
            in_out = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
            matmul_t = jax.jit(lambda x, w: jnp.matmul(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype))
            xt = torch.tensor(x, dtype=getattr(torch, dtype))
            wt = torch.tensor(w.T.copy(), dtype=getattr(torch, dtype))
            with torch.inference_mode():
                torch_ms = _time(lambda: torch.nn.functional.linear(xt, wt), reps=args.reps)
            row = {
                "shape": [batch, d_in, d_out], "dtype": dtype,
                "out_in_f32_result_ms": round(_time(f32_result, xj, w_out_in, reps=args.reps), 3),
                "out_in_same_dtype_ms": round(_time(same_dtype, xj, w_out_in, reps=args.reps), 3),
                "in_out_f32_result_ms": round(_time(in_out, xj, w_in_out, reps=args.reps), 3),
                "weight_first_ms": round(_time(weight_first, xj, w_out_in, reps=args.reps), 3),
                "matmul_w_T_ms": round(_time(matmul_t, xj, w_out_in, reps=args.reps), 3),
                "torch_ms": round(torch_ms, 3),
            }
            row["torch_over_ours"] = round(row["torch_ms"] / row["out_in_f32_result_ms"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
