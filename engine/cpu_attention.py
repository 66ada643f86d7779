"""The engine's CPU decode-attention kernel (`engine.decode_attention: cpu`), an XLA FFI custom call in C++.

Owns: building engine/csrc/decode_attention.cc with the machine's C++ compiler against jaxlib's
own FFI headers (`jax.ffi.include_dir()`), for this CPU (`-march=native`), into a shared library
in `$PIPELINE_KERNEL_DIR` (default `~/.cache/jax-batch-pipeline/kernels`); loading it and
registering its targets with XLA once per process; and calling it on a page of the cache (a
decode step's rows, or a prefill call's prompts' rows read in place by index, causally: a
packed call's pieces of prompts from one row of tokens, written into the page by the same call).

    cpu_attention.unavailable()       # None, or why the kernel cannot run here (no compiler, ...)
    o, l, m = cpu_attention.page_residuals(q, keys, values, lengths, scale)
    o, l, m = cpu_attention.page_residuals(q, keys, values, lengths, scale, rows=cache_rows)  # rows read in place
    o, l, m = cpu_attention.page_residuals(q, keys, values, starts, scale, rows=cache_rows, causal=q_per_kv)  # a prefill chunk
    o, keys, values = cpu_attention.prefill_step(q, keys, values, new_keys, new_values, segments, scale)  # a packed prefill call
    python -m engine.cpu_attention    # builds it now (scripts/setup.sh does; else the first use)

What the kernel computes is `engine.kernels.page_residuals`' contract, for one page: each row
read to its own length, its (row, KV head) pairs spread over XLA's intra-op threads. Why it
exists, and what it changes, is in docs/performance-notes.md ("A CPU kernel for decode
attention").

The library's name holds a hash of what it was built from (the source, the compiler and its
flags, jaxlib's version, the CPU's model and flags), so a changed source, compiler, jaxlib or
machine builds a new one, and hosts of different CPUs sharing the folder each build their own.
Processes building at once each write a file of their own and rename it into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "decode_attention.cc")
DEFAULT_DIR = "~/.cache/jax-batch-pipeline/kernels"
TARGET = "pipeline_decode_attention"
STEP_TARGET = "pipeline_decode_step"
PREFILL_TARGET = "pipeline_prefill_attention"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-fPIC")
"""Compile flags. -ffast-math lets the compiler sum a dot product in vector lanes; the order is
fixed by the build, so a row's result still does not depend on the batch. Infinities stay
defined (which also keeps <cmath> from declaring glibc's vector expf: the source declares it).
The library is linked apart, without -ffast-math: linked with it, a library turns on the CPU's
flush-to-zero mode for the whole process when it is loaded (subnormal numbers read as zero
everywhere, numpy's included)."""

BFLOAT16_BITS = jnp.dtype(jnp.uint16)
"""A KV cache stored in uint16 holds bfloat16 values as their bits: a bfloat16 model's cache on
the CPU, read by this kernel only (`engine.kernels.cache_dtype`). XLA's CPU backend scatters
bfloat16 through float32, converting the whole page there and back at every write (6 ms a page
and layer per decode call at the 125M shape: more than a third of the step); a uint16 view of a
bfloat16 page is a copy too. Scattering uint16 is a plain copy of the written rows."""


def value_dtype(stored) -> jnp.dtype:
    """The dtype of the values a cache page of dtype `stored` holds (bfloat16 for BFLOAT16_BITS)."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(stored) == BFLOAT16_BITS else jnp.dtype(stored)


def as_stored(values: jax.Array, stored) -> jax.Array:
    """values as a cache page of dtype `stored` holds them: rounded to its values' dtype, and as
    their bits for BFLOAT16_BITS."""
    values = values.astype(value_dtype(stored))
    return jax.lax.bitcast_convert_type(values, BFLOAT16_BITS) if jnp.dtype(stored) == BFLOAT16_BITS else values


LIBRARIES = ("-lmvec",)
"""Linked in: glibc's vector math library, whose expf the kernel's loops call (16 at a time)."""

_lock = threading.Lock()


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this machine; the message says why."""


def kernel_dir() -> str:
    return os.path.expanduser(os.environ.get("PIPELINE_KERNEL_DIR") or DEFAULT_DIR)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler found (install g++, or set CXX)")
    return cxx


def _cpu_signature() -> str:
    """The CPU's model name and flags (Linux), what -march=native builds for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def library_path() -> str:
    """Where the library for this source, compiler, jaxlib and CPU is (built or not)."""
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler {cxx} does not run: {e}") from None
    digest = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        source = f.read()
    for part in (source, " ".join(FLAGS + LIBRARIES).encode(), version.encode(), jaxlib.__version__.encode(),
                 _cpu_signature().encode()):
        digest.update(part)
    return os.path.join(kernel_dir(), f"decode_attention-{digest.hexdigest()[:16]}.so")


def build() -> str:
    """The library's path, compiled first if it is not there yet (about 4 s)."""
    path = library_path()
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".partial", dir=os.path.dirname(path))
    os.close(fd)
    cxx, objects = _compiler(), partial + ".o"
    commands = ([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", "-c", SOURCE, "-o", objects],
                [cxx, "-shared", objects, "-o", partial, *LIBRARIES])  # linked without -ffast-math (FLAGS)
    try:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                raise KernelUnavailable(f"building {SOURCE} failed ({' '.join(command[:3])} ...): " + " | ".join(errors[-3:]))
        os.replace(partial, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building {SOURCE} failed: {e}") from None
    finally:
        for leftover in (partial, objects):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path


_failure: str | None = None
"""Why the kernel cannot run in this process, once a try failed (not retried: a failed build takes seconds)."""
_registered = False


def unavailable() -> str | None:
    """None where the kernel runs on this machine (built, loaded and registered with XLA once per
    process, building it first if needed), else why not."""
    global _failure, _registered
    with _lock:
        if not _registered and _failure is None:
            try:
                library = ctypes.cdll.LoadLibrary(build())
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.PipelineDecodeAttention), platform="cpu")
                jax.ffi.register_ffi_target(STEP_TARGET, jax.ffi.pycapsule(library.PipelineDecodeStep), platform="cpu")
                jax.ffi.register_ffi_target(PREFILL_TARGET, jax.ffi.pycapsule(library.PipelinePrefillAttention),
                                            platform="cpu")
                _registered = True
            except (KernelUnavailable, OSError, AttributeError) as e:
                _failure = str(e)
        return _failure


def page_residuals(q: jax.Array, keys: jax.Array, values: jax.Array, lengths: jax.Array, scale: float, *,
                   rows: jax.Array | None = None, causal: int = 0, normalize: bool = False):
    """(o, l, m) of one page, as `engine.kernels.page_residuals`: q [batch, kv_heads, group,
    head_dim], keys/values [batch, kv_heads, positions, head_dim] (float32, or both bfloat16 or its
    bits, `BFLOAT16_BITS`, read as they are: the bits of the same values in float32), lengths [batch]
    (positions of the page each row has written). o [batch, kv_heads, group, head_dim] is the
    unnormalized weighted values, l and m [batch, kv_heads, group] the softmax's sum and
    maximum; a row with nothing written gives o = l = 0 and m = float32 min.

    rows [batch] int32: instead, row b reads cache row rows[b] of keys/values [cache_rows, ...]
    in place (a prefill chunk's prompts); a row out of range reads nothing.

    causal c > 0: query g of a row reads lengths[row] + g // c + 1 positions instead (a prefill
    chunk written into its cache rows: its queries (position, query head), c a position, from
    lengths[row] on).

    normalize: o is the attention itself, o / l (0 where nothing was read), divided in the call
    as XLA would divide it after."""
    _require()
    batch, kv_heads, group, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((batch, kv_heads, group), jnp.float32),
              jax.ShapeDtypeStruct((batch, kv_heads, group), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, shapes)
    if rows is None:
        rows = jnp.arange(batch, dtype=jnp.int32)
    keys, values = _as_read(keys, values)
    return call(q.astype(jnp.float32), keys, values, rows.astype(jnp.int32), lengths.astype(jnp.int32),
                scale=np.float32(scale), causal=np.int64(causal), normalize=np.int64(normalize))


def decode_step(q: jax.Array, keys: jax.Array, values: jax.Array, new_keys: jax.Array, new_values: jax.Array,
                write_at: jax.Array, lengths: jax.Array, scale: float, window: int | None = None):
    """A decode step's attention over a page of the cache whose rows are the batch's, with the
    step's keys/values written into it first, in one call: new_keys/new_values [batch, kv_heads,
    head_dim] go to position write_at [batch] of each row (none out of range: a row that writes
    nothing), then each row attends over its first lengths [batch] positions, as `page_residuals`
    with normalize. Returns (attention [batch, kv_heads, group, head_dim] float32, keys, values):
    the page written in place (XLA aliases it to the call's result; a page still read elsewhere
    is copied first). keys/values are float32 or `BFLOAT16_BITS`, as the engine stores them; the
    new ones are rounded to that (`as_stored`). window: each row reads only its last `window`
    positions (a sliding window; None: all)."""
    return _write_and_attend(STEP_TARGET, "a decode step", q, keys, values, new_keys, new_values,
                             write_at.astype(jnp.int32), lengths.astype(jnp.int32), scale=np.float32(scale),
                             window=np.int64(window or 0))


def prefill_step(q: jax.Array, keys: jax.Array, values: jax.Array, new_keys: jax.Array, new_values: jax.Array,
                 segments, scale: float, rotary: tuple[jax.Array, jax.Array] | None = None,
                 window: int | None = None):
    """A packed prefill call's keys/values written into the page and its attention, normalized, in
    one call. Its tokens are one row of positions holding pieces of prompts, feature first (as the
    engine's activations): q [kv_heads, q_per_kv, head_dim, positions], new_keys/new_values
    [kv_heads, head_dim, positions]. segments (rows [segments, samples], starts, offsets, counts
    [segments]) int32: segment s is the counts[s] positions from offsets[s], its prompt's from
    position starts[s] on; its keys/values go to each of the page's rows rows[s, :] (its prompt's
    samples; none out of range) there, and each of its queries then reads the first of them
    causally, in place (as `page_residuals` with rows and causal; the same bits). A segment whose
    first row is out of range, and a position in no segment, gives zeros. The segments' rows must
    differ (each segment is written and read beside the others, in threads): the pieces of one
    prompt go in separate calls. Returns (attention, q's shape, float32; keys; values): the page
    written in place, as `decode_step`'s.

    rotary (cos, sin), each [head_dim, positions] float32: q and new_keys (float32, over a float32
    page) are not rotated yet, and the call rotates them first as `engine.llama.apply_rotary`
    does, to the same bits, instead of the program's two passes over them a layer. window: each
    query reads only its last `window` positions (a sliding window; None: all)."""
    rows, starts, offsets, counts = (jnp.asarray(x, jnp.int32) for x in segments)
    cos = sin = jnp.zeros((0,), jnp.float32)  # none: q and new_keys come rotated
    if rotary is not None:
        if any(jnp.dtype(x.dtype) != jnp.float32 for x in (q, new_keys, keys, *rotary)):
            raise ValueError("a prefill call rotates float32 queries and keys over a float32 page, with float32 tables")
        cos, sin = rotary
    return _write_and_attend(PREFILL_TARGET, "a prefill call", q, keys, values, new_keys, new_values,
                             rows.reshape(len(starts), -1), starts, offsets, counts, cos, sin, scale=np.float32(scale),
                             window=np.int64(window or 0))


def _write_and_attend(target: str, what: str, q: jax.Array, keys: jax.Array, values: jax.Array, new_keys: jax.Array,
                      new_values: jax.Array, *rest: jax.Array, **attributes):
    """Calls a target that writes new keys/values into the page and attends over it (`decode_step`,
    `prefill_step`): q in float32, the page as the engine stores it (float32 or `BFLOAT16_BITS`;
    `what` names the call in the error otherwise), the new keys/values rounded to that, then the
    target's own arguments. Returns (attention, q's shape; keys; values), the page aliased to
    the arguments: written in place."""
    _require()
    if keys.dtype not in (jnp.float32, BFLOAT16_BITS) or values.dtype != keys.dtype:
        raise ValueError(f"{what}'s page is float32 or bfloat16's bits (uint16), not {keys.dtype}/{values.dtype}")
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(keys.shape, keys.dtype),
              jax.ShapeDtypeStruct(values.shape, values.dtype))
    call = jax.ffi.ffi_call(target, shapes, input_output_aliases={1: 1, 2: 2})
    return call(q.astype(jnp.float32), keys, values, as_stored(new_keys, keys.dtype), as_stored(new_values, keys.dtype),
                *rest, **attributes)


def _as_read(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A page's keys and values as the kernel reads them: a bfloat16 cache (or its bits) as it is,
    widened exactly in the kernel; any other in float32."""
    if value_dtype(keys.dtype) != jnp.bfloat16:
        keys, values = keys.astype(jnp.float32), values.astype(jnp.float32)
    return keys, values.astype(keys.dtype)


def _require() -> None:
    error = unavailable()
    if error:
        raise KernelUnavailable(error)


if __name__ == "__main__":
    try:
        print(f"CPU decode-attention kernel: {build()}")
    except KernelUnavailable as e:
        print(f"CPU decode-attention kernel not built: {e} (the engine uses its XLA attention instead)", file=sys.stderr)
        sys.exit(1)
