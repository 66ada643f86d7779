"""Time one projection (x times a weight) the ways XLA's CPU backend can be asked for it, beside torch.

The engine's `llama.linear` multiplies the weight as transformers saves it, (out, in), by
activations held feature first, and asks for a float32 result rounded to the model's dtype;
this script is the measurement behind these choices. For each shape (batch, in, out) it
times, in float32 and bfloat16:

- `(out,in) f32 result`: x times the weight as saved, over its second axis (for bfloat16,
  rounded back to bfloat16 after): what `linear` did while activations were held rows first;
- `(out,in) same-dtype result`: the same contraction with the result in the weights' dtype;
- `(in,out) f32 result`: the same dot from a transposed copy of the weight;
- `weight first`: the weight times x, giving (out, batch), float32 result: how the engine
  computes the LM head and (with x held (in, batch) between layers) every projection;
- `x @ w.T`: jax.numpy's spelling of the first (`jnp.matmul(x, w.T)`, float32 result), which
  XLA's CPU backend runs far slower in bfloat16;
- torch's `nn.functional.linear` on the same values (its weights are (out, in)).

With `--stack`, it times instead one decode step's projections of whole models (each layer's
own q/k/v/o/gate/up/down weights, as the engine reads them: a single repeated weight stays in
the CPU's cache and flatters every layout), at the cpu-125m and cpu-tiny shapes, three ways:
rows first from (out, in) weights, rows first from (in, out) weights (the engine's two earlier
layouts, bfloat16 and float32 on the CPU), and weight first with the activations held (embed,
rows) between layers, so that no layer transposes (what the engine does now); and weight first
with q/k/v fused into one weight and gate/up into another (what the engine does not do: it
saved at most 0.3 ms of a tiny bfloat16 step and was slower at the 125M float32 shape,
docs/performance-notes.md); torch beside them.

With `--peak`, it times large square products (2,048 cubed) and the decode LM heads, in float32
and bfloat16 (float32 result), and prints GFLOP/s for XLA and torch: the ceiling that decode's
compute-bound products are read against (docs/performance-notes.md, Limits).

With `--rows`, it times one weight-first projection of each of the 125M and cpu-mixed models'
layer shapes for 8, 16, 32 and 64 rows, in float32 and bfloat16: what two lanes of half the
batch cost each layer's products (engine/memory.py, `LANES_CPU_MIN_ROWS`).

With `--stream`, it times matrix-vector products over 45 MB and 360 MB of float32 weights, torch
on one thread and on all and XLA, and prints the GB/s they read at: how fast this machine's memory
can feed a decode step.

Run it on a quiet machine (nothing else running; figures taken under load are off by 2-5x):

    python scripts/bench_dots.py
    python scripts/bench_dots.py --stack
    python scripts/bench_dots.py --peak
    python scripts/bench_dots.py --stream
    python scripts/bench_dots.py --rows
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


def _f32_result(order, contract):
    """A projection x, w -> the dot of `order(x, w)` contracting `contract` (lhs, rhs axes), with
    a float32 result rounded to x's dtype, as the engine's `linear` asks XLA for it."""
    import jax
    import jax.numpy as jnp

    return lambda x, w: jax.lax.dot_general(*order(x, w), (contract, ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)


def _product():
    """jnp.dot(a, b) with a float32 result, jitted: the one product --peak, --stream and --rows time."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))


STACKS = [(32, 768, 2048, 12), (64, 256, 688, 4), (16, 256, 688, 4)]
"""(rows, hidden, intermediate, layers): cpu-125m's decode, cpu-tiny's, and cpu-mixed's at batch 16."""


def stack(args) -> None:
    import torch  # before JAX starts, as bench_engine.py does

    import jax
    import jax.numpy as jnp

    def step(linear, silu, x, layers):
        """One decode step's projections: q, k, v and o, then gate, up and down, per layer; with
        fused weights, q/k/v as one product and gate/up as one, each result split (weight first,
        the split is along its leading axis)."""
        for w in layers:
            if "qkv" in w:
                q, k, v = jnp.split(linear(x, w["qkv"]), 3)
                x = x + linear(q + k + v, w["o"])
                gate, up = jnp.split(linear(x, w["gate_up"]), 2)
                x = x + linear(silu(gate) * up, w["down"])
                continue
            h = linear(x, w["q"]) + linear(x, w["k"]) + linear(x, w["v"])
            x = x + linear(h, w["o"])
            x = x + linear(silu(linear(x, w["gate"])) * linear(x, w["up"]), w["down"])
        return x

    def fuse(layer):
        """q/k/v stacked into one (3 hidden, hidden) weight, gate/up into one (2 intermediate, hidden)."""
        rest = {k: w for k, w in layer.items() if k not in ("q", "k", "v", "gate", "up")}
        return dict(rest, qkv=np.concatenate([layer["q"], layer["k"], layer["v"]]),
                    gate_up=np.concatenate([layer["gate"], layer["up"]]))

    weight_first = _f32_result(lambda x, w: (w, x), ((1,), (0,)))
    ways = {  # name: (x as given, each weight (out, in) -> as held, the projection, fused q/k/v and gate/up)
        "rows_first_out_in_ms": (False, lambda w: w, _f32_result(lambda x, w: (x, w), ((1,), (1,))), False),
        "rows_first_in_out_ms": (False, lambda w: w.T.copy(), _f32_result(lambda x, w: (x, w), ((1,), (0,))), False),
        "weight_first_embed_rows_ms": (True, lambda w: w, weight_first, False),
        "weight_first_fused_ms": (True, lambda w: w, weight_first, True),
    }
    rng = np.random.default_rng(0)
    for rows, hidden, mlp, n_layers in STACKS:
        shapes = dict(q=(hidden, hidden), k=(hidden, hidden), v=(hidden, hidden), o=(hidden, hidden),
                      gate=(mlp, hidden), up=(mlp, hidden), down=(hidden, mlp))
        weights = [{k: rng.standard_normal(shape, np.float32) * 0.02 for k, shape in shapes.items()} for _ in range(n_layers)]
        x = rng.standard_normal((rows, hidden), np.float32)
        for dtype in ("float32", "bfloat16"):
            jdt = jnp.dtype(dtype)
            row = {"rows": rows, "hidden": hidden, "intermediate": mlp, "layers": n_layers, "dtype": dtype,
                   "weights_mb": round(sum(w.size for layer in weights for w in layer.values()) * jdt.itemsize / 1e6)}
            for name, (transposed, hold, linear, fused) in ways.items():
                held = [{k: jnp.asarray(hold(w), jdt) for k, w in (fuse(layer) if fused else layer).items()}
                        for layer in weights]
                xj = jnp.asarray(x.T.copy() if transposed else x, jdt)
                row[name] = round(_time(jax.jit(lambda x, ws, linear=linear: step(linear, jax.nn.silu, x, ws)), xj, held, reps=args.reps), 2)
            tdt = getattr(torch, dtype)
            torch_layers = [{k: torch.tensor(w, dtype=tdt) for k, w in layer.items()} for layer in weights]
            silu, linear = torch.nn.functional.silu, torch.nn.functional.linear
            with torch.inference_mode():
                row["torch_ms"] = round(_time(lambda: step(linear, silu, torch.tensor(x, dtype=tdt), torch_layers), reps=args.reps), 2)
            print(json.dumps(row), flush=True)


PEAK_SHAPES = [(2048, 2048, 2048), (32000, 256, 64), (32000, 768, 32)]
"""(m, k, n): a large square product, and the LM heads of a cpu-tiny and a cpu-125m decode step
(vocabulary x hidden times hidden x rows, weight first, as the engine computes them)."""


def peak(args) -> None:
    import torch  # before JAX starts, as bench_engine.py does

    import jax.numpy as jnp

    product = _product()
    rng = np.random.default_rng(0)
    for m, k, n in PEAK_SHAPES:
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        for dtype in ("float32", "bfloat16"):
            aj, bj = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
            at, bt = torch.tensor(a, dtype=getattr(torch, dtype)), torch.tensor(b, dtype=getattr(torch, dtype))
            with torch.inference_mode():
                torch_ms = _time(lambda: at @ bt, reps=args.reps)
            xla_ms = _time(product, aj, bj, reps=args.reps)
            gflop = 2 * m * k * n / 1e9
            print(json.dumps({"shape": [m, k, n], "dtype": dtype, "xla_ms": round(xla_ms, 3), "torch_ms": round(torch_ms, 3),
                              "xla_gflop_s": round(gflop / xla_ms * 1e3), "torch_gflop_s": round(gflop / torch_ms * 1e3)}),
                  flush=True)


STREAM_MB = (45, 360)
"""Float32 weights read by one matrix-vector product: about a cpu-mixed decode step's (which
this CPU's shared cache can hold) and eight times that (which it cannot)."""


def stream(args) -> None:
    """GB/s at which one matrix-vector product reads its float32 weights, torch on one thread
    and on all, and XLA (its own threads): what this machine's memory lets a decode step stream,
    to read the step's bytes against (docs/performance-notes.md, "What bounds the decode step")."""
    import torch  # before JAX starts, as bench_engine.py does

    import jax.numpy as jnp

    product = _product()
    threads = torch.get_num_threads()
    for mb in STREAM_MB:
        side = int((mb * 1e6 / 4) ** 0.5)
        w = np.random.default_rng(0).standard_normal((side, side), np.float32)
        x = np.ones((side, 1), np.float32)
        row = {"weights_mb": round(w.nbytes / 1e6)}
        wt, xt = torch.from_numpy(w), torch.from_numpy(x)
        with torch.inference_mode():
            for n in sorted({1, threads}):
                torch.set_num_threads(n)
                row[f"torch_{n}_threads_gb_s"] = round(w.nbytes / _time(lambda: wt @ xt, reps=args.reps) / 1e6, 1)
        torch.set_num_threads(threads)
        row["xla_gb_s"] = round(w.nbytes / _time(product, jnp.asarray(w), jnp.asarray(x), reps=args.reps) / 1e6, 1)
        print(json.dumps(row), flush=True)


ROWS = (8, 16, 32, 64)
ROWS_WEIGHTS = ((2048, 768), (768, 2048), (768, 768), (688, 256))
"""(out, in) weights of the 125M and cpu-mixed models' layers."""


def rows(args) -> None:
    """Microseconds of one weight-first projection (as the engine's `linear` computes it: the
    weight times activations held (in, rows), float32 result) for 8 to 64 rows: what splitting a
    batch into two lanes costs each layer's products (`engine.lanes`, engine/memory.py)."""
    import jax.numpy as jnp

    product = _product()
    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16"):
        for out, inp in ROWS_WEIGHTS:
            w = jnp.asarray(rng.standard_normal((out, inp), np.float32), dtype)
            row = {"weight": [out, inp], "dtype": dtype}
            for n in ROWS:
                x = jnp.asarray(rng.standard_normal((inp, n), np.float32), dtype)
                row[f"rows_{n}_us"] = round(_time(product, w, x, reps=args.reps) * 1e3)
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--stack", action="store_true", help="time whole models' projections per decode step (see above)")
    parser.add_argument("--peak", action="store_true", help="GFLOP/s of large products and the LM heads (see above)")
    parser.add_argument("--stream", action="store_true", help="GB/s of matrix-vector products over large weights (see above)")
    parser.add_argument("--rows", action="store_true", help="one layer's projections for 8 to 64 rows (see above)")
    args = parser.parse_args()
    if args.rows:
        rows(args)
        return
    if args.stream:
        stream(args)
        return
    if args.stack:
        stack(args)
        return
    if args.peak:
        peak(args)
        return

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
            contract = ((1,), (1,))  # x's second axis with the (out, in) weight's second
            f32_result = jax.jit(_f32_result(lambda x, w: (x, w), contract))
            same_dtype = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (contract, ((), ()))))
            weight_first = jax.jit(_f32_result(lambda x, w: (w, x), contract))
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
