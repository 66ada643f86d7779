"""The generation engine: load a checkpoint, then turn requests into completions.

Owns: `Engine.load` (config checks, memory plan, weights), the host-side scheduler (sort rows
by prompt length, feed prompts to the fixed-size prefill chunk, refill finished slots from the
queue), stop strings and detokenisation, and the run's statistics (programs compiled or loaded
from the persistent compilation cache, per kind). It does not read prompt files or write
results: the generate step does. Where arrays live is engine/mesh.py's:
`mode="host_dp"` uses this host's devices only; `mode="global_mesh"` shards the weights over
every device of the pod, and then every host must call `generate` with the same requests: the
scheduler is deterministic, so all hosts run the same compiled calls in the same order.

    engine = Engine.load("gs://bucket/llama", dtype="bfloat16", sampling=SamplingParams(n=4),
                         engine=EngineConfig(batch_size="auto"), max_prompt_tokens=512, tokenizer=tok)
    print(engine.describe())
    for c in engine.generate([GenerationRequest(0, ids, sample_indices=range(4))]):
        ...  # Completion(prompt_index, sample_index, token_ids, text, finish_reason, logprobs)

Rows (prompt, sample) are scheduled in order of prompt length. A row's tokens depend only on
(seed, prompt_index, sample_index): see sampler.py. Finished rows free their slot at the end of
a decode chunk; once an eighth of the slots are free (or none is busy) the next prompts take
them and are prefilled, in chunks of `prefill_chunk_tokens` tokens, before decoding goes
on, so finished rows stop costing work after at most a chunk. Every program's shapes come from
the config (slots = batch_size, cache length, prefill rows x chunk, decode steps), so a run
compiles at most four programs whatever its prompts (init, decode, prefill of first chunks and of
later ones, a call reading only the cache's first quarter in the same program as one reading all
of it, see decode.py; three when every prompt fits one chunk, or where the CPU kernel prefills
in place, packing each call's rows with the prompts end to end, and first chunks run the later
ones' program; one more with a staging cache, below),
and JAX's persistent compilation cache (engine/compile_cache.py, on by default) lets a rerun or
resume load them instead. Two threads get them from the shapes alone, from the start of the
first `generate` or, with `engine.compile_during_load` (auto: a checkpoint in remote storage,
or an accelerator), from `Engine.load` on, while it reads the weights; a call whose program is
not ready yet waits for it.

On a CPU host the slots may be split into lanes (`engine.lanes`, host_dp only): each lane is the
loop above over its share of the slots, with its own cache, in a thread of its own, taking rows
from the one queue. XLA's CPU runtime runs the attention's dots of a decode step on one thread,
so a second lane keeps the other core busy; the lanes run the same programs. With one lane the
next prompts are prefilled beside decoding instead (`engine.overlap_prefill`, host_dp only): in a
thread of their own, into a small staging cache, and the lane moves prefilled rows into its free
slots between decode calls (`_Stager`; one more program, adopt), so it no longer stops decoding
to prefill.

A decode step attends through a kernel that reads each row to its own length where one runs
(`engine.decode_attention`, engine/kernels.py): on GPUs in a 16-bit dtype JAX's Pallas
decode-attention kernel, on CPUs the engine's own C++ kernel (engine/cpu_attention.py);
elsewhere through the engine's own XLA operations (engine/llama.py).
"""

from __future__ import annotations

import atexit
import collections
import collections.abc
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import itertools
import numbers
import os
import queue
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Iterable, Iterator, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine import checkpoint, compile_cache, cpu_attention, kernels, llama
from engine.config import EngineConfig, InvalidConfig, SamplingParams, require
from engine.decode import (
    DecodeSpec, DecodeState, HostOut, KVCache, adopt_rows, decode_chunk, new_cache, new_state, prefill_chunk,
)
from engine.llama import LlamaConfig, UnsupportedModelError, abstract_model, check_tensors, load_checkpoint, pages_covering
from engine.memory import GiB, BatchPlan, peak_memory_bytes, plan_batch, plan_staging
from engine.mesh import Layout, mesh_shape
from engine.sampler import marks_prompts, penalizes

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_COMPILED: dict[tuple, Any] = {}
"""Compiled programs by (program, static args, sampling spec, input structure and shapes)."""
_COMPILING: dict[tuple, threading.Lock] = collections.defaultdict(threading.Lock)
"""Held while a program is compiled, so a second thread asking for it waits instead of compiling it again."""
_COMPILING_LOCK = threading.Lock()
_AHEAD = "compile-"
"""The names of the threads that get programs ahead of their calls begin so (`_get_programs_early`)."""


def compiling_ahead() -> bool:
    """Whether a thread is getting a program ahead of its call (`Engine._get_programs_early`). The
    interpreter's exit waits for it (XLA cannot stop a compile it has begun): a process ending on
    an error need not (pipeline/cli.py)."""
    return any(thread.name.startswith(_AHEAD) and thread.is_alive() for thread in threading.enumerate())


_UNFINISHED: "weakref.WeakSet[Iterator[Completion]]" = weakref.WeakSet()
"""`generate`'s generators not yet finished or dropped: closed as the interpreter exits."""
_RUNNING: "weakref.WeakSet[_Pending]" = weakref.WeakSet()
"""The requests of `generate` calls begun and not ended: the exit waits for those that run in
other threads."""


_exiting = False
"""The interpreter is exiting (`_close_unfinished`): generate's threads begin no more jax work."""
_in_jax: collections.Counter[int] = collections.Counter()
"""The threads of generate's (by ident) inside jax work (`_jax_work`), each with how deep, under
`_in_jax_changed`."""
_in_jax_changed = threading.Condition()


class _Exiting(RuntimeError):
    """Raised in a thread of generate's that would begin jax work as the interpreter exits."""


@contextlib.contextmanager
def _jax_work():
    """Around generate's calls into jax (compiles, compiled calls, transfers, memory figures):
    none begins once the interpreter exits (`_Exiting` in that thread), and the exit waits for
    those begun."""
    me = threading.get_ident()
    with _in_jax_changed:
        if _exiting:
            raise _Exiting("Engine.generate stopped: the interpreter is exiting")
        _in_jax[me] += 1
    try:
        yield
    finally:
        with _in_jax_changed:
            _in_jax[me] -= 1
            if not _in_jax[me]:
                del _in_jax[me]  # lanes and prefill threads are new threads each call: keep no trace of them
            _in_jax_changed.notify_all()


@atexit.register  # registered after jax's clean-up (at jax's import), so run before it
def _close_unfinished() -> None:
    """Closes the generators a script left unfinished, as the interpreter exits: closing halts
    their lanes and prefill threads and waits for them. One that runs in another thread (a
    daemon's, which the exit does not wait for) cannot be closed from here: its threads begin no
    more jax work, and the exit waits for the work they are in. Daemon threads still inside an
    XLA call when the interpreter finalizes abort the process (C++ unwinding through a thread it
    ends)."""
    global _exiting
    for completions in list(_UNFINISHED):
        try:
            completions.close()
        except ValueError:  # running in another thread
            pass
    with _in_jax_changed:
        _exiting = True
    # Each call running in another thread raises `_Exiting` at its next jax work and frees its
    # caches on the way out; one reading its requests runs no jax work until they come. This
    # thread's own count is not waited for: it runs this hook, so it is in no jax work (a
    # KeyboardInterrupt between `_jax_work`'s count and its `try` leaves the count behind).
    me = threading.get_ident()
    while (any(thread != me for thread in list(_in_jax))
           or any(not call.reading for call in list(_RUNNING))):
        time.sleep(0.01)


_lowering: set[int] = set()
"""The threads (by ident) lowering a program, under `_paused_lock`."""
_paused_lock = threading.Lock()
_collector_was_enabled = False


@contextlib.contextmanager
def _collector_paused():
    """Python's garbage collector paused while a program is traced and lowered. Tracing makes
    many short-lived objects, and the collections they set off took a quarter to a third of a
    program's lowering (cpu-mixed's decode program 0.43 s instead of 0.59, prefill's 0.34-0.41
    instead of 0.59-0.60). Lowering is on the path of every run, warm or cold: the persistent
    cache is keyed by the lowered program (docs/performance-notes.md, "Lowering without the
    collector"). The collector runs again when the last thread lowering leaves (the decode
    program's early compile lowers beside prefill's), and stays off if it was off. A set of
    threads, not a count: a KeyboardInterrupt between the entry and the `try` leaves this thread
    in it, and its next lowering takes it out again (a count left behind kept the collector off
    for the rest of the process)."""
    global _collector_was_enabled
    me = threading.get_ident()
    with _paused_lock:
        if not _lowering:
            _collector_was_enabled = gc.isenabled()
        _lowering.add(me)
        gc.disable()
    try:
        yield
    finally:
        with _paused_lock:
            _lowering.discard(me)
            if not _lowering and _collector_was_enabled:
                gc.enable()


def compiler_options() -> dict[str, str]:
    """XLA options every engine program is compiled with. On the CPU: YNNPACK for single
    products only, not for reductions. XLA's CPU backend hands the softmax's max and sum and
    RMSNorm's mean to YNNPACK by default (`xla_cpu_experimental_ynn_fusion_type`: single
    products and reductions; INDIVIDUAL_DOT alone compiles the prefill program to the same
    optimized HLO as XLA_FLAGS' `-reduce`), and there a row's result depended, in its last
    bits, on the values of the other rows in the call: a prefill chunk's first-layer output
    moved by up to 6e-7 (float32) with the chunks sharing its call, and in bfloat16 one
    rounding made that a whole ulp, so a resume, another batch size or two lanes changed a
    row's greedy tokens in places. Without them every row is computed alone (bitwise, float32
    and bfloat16) and the cpu-mixed run takes about as long (docs/performance-notes.md, "Rows
    computed alone"). Other backends: XLA's defaults."""
    if jax.default_backend() != "cpu":
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt to generate for: `prompt_index` (an int in [0, 2**31), part of every sample's
    random key), `input_ids` (its token ids, chat template and BOS already applied: a list or a
    1-D array) and `sample_indices` (which of the n samples to make, e.g. `range(n)`; a resume
    asks only for the missing ones)."""

    prompt_index: int
    """0-based position of the prompt in the input; part of every sample's random key."""
    input_ids: Sequence[int]
    """The prompt's token ids (chat template and BOS already applied)."""
    sample_indices: Sequence[int]
    """Which of the n samples to make (a resume asks only for the missing ones)."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One finished (prompt, sample): `prompt_index`, `sample_index`, `token_ids` (EOS or stop
    token left out, a stop string's tokens cut), `text` (decoded, special tokens left out, cut
    before the stop string), `finish_reason` (eos, stop or length) and, where the sampling
    settings ask for them, `logprobs`, `prompt_logprobs`, `top_token_ids` and `top_logprobs`
    (None otherwise). Compared by value; not hashable (its fields are lists)."""

    __hash__ = None  # type: ignore[assignment]  # frozen made one that raised on the list fields

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    """Generated ids; the EOS/stop token is excluded, and a stop string's tokens are cut."""
    text: str
    """Decoded token_ids, cut before the stop string; '' without a tokenizer."""
    finish_reason: Literal["eos", "stop", "length"]
    """eos: an EOS id of the checkpoint; stop: a stop string or stop token id; length: max_new_tokens."""
    logprobs: list[float] | None = None
    """With `sampling.logprobs`: each of token_ids' log-probability under the model (natural log,
    float32, before temperature, top_k and top_p); else None."""
    prompt_logprobs: list[float | None] | None = None
    """With `sampling.prompt_logprobs`: one per token of the request's input_ids, its
    log-probability given the tokens before it (natural log, float32), None for the first; the
    same list for every sample of a prompt; else None."""
    top_token_ids: list[list[int]] | None = None
    """With `sampling.top_logprobs` = k: for each of token_ids, the k most probable tokens at its
    position under the model, most probable first (the chosen token need not be among them); else None."""
    top_logprobs: list[list[float]] | None = None
    """Their log-probabilities (natural log, float32, as `logprobs`), as top_token_ids."""


@dataclasses.dataclass
class EngineStats:
    batch_size: int
    """Slots decoded together (the plan's batch size)."""
    compilations: int = 0
    """Programs XLA compiled for this engine (neither in this process's memory nor in the
    persistent compilation cache); a run compiles at most `Engine.max_programs`, whatever its prompts."""
    cache_loads: int = 0
    """Programs loaded from JAX's persistent compilation cache instead of compiled."""
    programs_used: int = 0
    """Distinct programs this engine ran, wherever it got them (this process's memory, the
    persistent cache or XLA); a second input shape of one kind counts as another program. At
    most `Engine.max_programs`, whatever the prompts."""
    compile_time_s: float = 0.0
    """Seconds getting programs: compiling, plus loading those found in the persistent cache.
    Summed over threads: the decode program is compiled beside the others (`compile_wait_s`)."""
    compile_wait_s: float = 0.0
    """Seconds `generate` itself waited for programs: the wall time during which a lane or the
    prefill thread waited for one, overlapping waits counted once (at most compile_time_s, as
    the decode program's compile overlaps the prefill)."""
    programs: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Per program kind (init, prefill_fresh, prefill, decode, adopt; no prefill_fresh where the
    CPU kernel prefills in place): compiled, loaded, seconds (getting the programs), run_s
    (running them)."""
    generated_tokens: int = 0
    """Tokens returned in completions plus the EOS/stop tokens they ended on."""
    peak_memory_bytes: int | None = None
    """Largest device peak reported by the allocator; on CPU the process's peak RSS."""
    decode_time_s: float = 0.0
    """Time running compiled prefill and decode programs (compilation excluded), summed over
    threads: with lanes or prefill beside decoding, more than the wall time they took."""
    prompt_tokens: int = 0
    """Prompt tokens prefilled (each prompt once, however many samples share it)."""
    padded_prompt_tokens: int = 0
    """Prompt positions computed, the prefill calls' padding included (R x C a call); / prompt_tokens = overhead."""
    prefill_calls: int = 0
    prefill_pages_read: int = 0
    """Cache pages read by the prefill calls of later chunks, summed over the calls: each reads
    the first pages covering its rows (a call of first chunks reads none). With the CPU kernel
    (`engine.decode_attention: cpu`) the cache is one page, so each call counts one: each row is
    read only to its own length."""
    decode_calls: int = 0

    def count_program(self, kind: str, seconds: float, *, loaded: bool) -> None:
        entry = self.programs.setdefault(kind, {"compiled": 0, "loaded": 0, "seconds": 0.0})
        entry["loaded" if loaded else "compiled"] += 1
        entry["seconds"] += seconds
        self.compile_time_s += seconds
        if loaded:
            self.cache_loads += 1
        else:
            self.compilations += 1




@dataclasses.dataclass
class _Row:
    prompt_index: int
    sample_index: int
    prompt: np.ndarray
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """The tokens' log-probabilities, with `sampling.logprobs` (else empty)."""
    top_ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    top_logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    """Each token's most probable alternatives, with `sampling.top_logprobs` (else empty): one
    [tokens, k] array per program call, made lists only when the row finishes (numpy holds a
    value in 4 bytes, a list in about 40: K = 20 at 2,048 tokens is 3.2 MB a row as lists)."""
    prompt_logprobs: list[float | None] | None = None
    """With `sampling.prompt_logprobs`, its prompt's (`Completion.prompt_logprobs`), once prefilled."""
    decoding: bool = False
    """False while its prompt is being prefilled into its slot."""

    def add(self, got: HostOut, s: int) -> None:
        """Appends slot s's new tokens from a program's `got` (a prefill call's one, or a decode
        chunk's, -1 where none) and what the sampling asks of them."""
        tokens = got.tokens[s].reshape(-1)
        new = tokens >= 0
        self.tokens += tokens[new].tolist()
        if got.logprobs is not None:
            self.logprobs += got.logprobs[s].reshape(-1)[new].tolist()
        if got.top_ids is not None:
            k = got.top_ids.shape[-1]
            self.top_ids.append(got.top_ids[s].reshape(-1, k)[new])
            self.top_logprobs.append(got.top_logprobs[s].reshape(-1, k)[new])


READ_AHEAD_ROWS_PER_SLOT = 32
"""Rows taken from the requests ahead of the slots, per slot: enough that each read-ahead, sorted
by prompt length, fills batches with prompts of like length (cpu-mixed at batch 16: 86 prefill
calls at 1.38x padding with 32 per slot, 98 calls at 1.57x with 8: fewer prompts end early in a
call, and more decode chunks fit the cache's first page); bounded, so the engine holds the
same few rows whether it is given ten thousand requests or ten million (issue 13)."""


class _Pending:
    """The rows not started yet: read lazily from the requests, a window at a time, each window
    sorted by (prompt length, prompt, sample) so samples of a prompt stay together. Every host of
    a global mesh reads the same requests, so every host sees the same order."""

    def __init__(self, requests: Iterable[GenerationRequest], rows_of: Callable[[GenerationRequest], list[_Row]],
                 window_rows: int):
        self._requests = iter(requests)
        self._rows_of = rows_of
        self._window_rows = window_rows
        self._rows: collections.deque[_Row] = collections.deque()
        self._exhausted = False
        self.stopped = False
        """The call's `stop` asked (any lane saw it): `generate` returns there, its error not raised."""
        self.error: ValueError | None = None
        """A bad request's (`Engine._rows`): no request after it is read, and `generate` raises it
        once the rows before it are done and yielded."""
        self.lock = threading.RLock()
        """Held to read or take rows: lanes share the queue (`_admit` holds it across its takes)."""
        self.reading = False
        """A thread is inside the requests' iterator."""

    def _read_ahead(self) -> None:
        """Once half the window is used up, read the next window's worth of requests."""
        if self._exhausted or len(self._rows) > self._window_rows // 2:
            return
        window: list[_Row] = []
        while len(window) < self._window_rows:
            self.reading = True  # in the caller's code, which may wait: the exit does not wait for it
            try:
                request = next(self._requests, None)
            finally:
                self.reading = False
            if request is None:
                self._exhausted = True
                break
            try:
                window += self._rows_of(request)
            except ValueError as error:
                self.error, self._exhausted = error, True
                break
        window.sort(key=lambda row: (len(row.prompt), row.prompt_index, row.sample_index))
        self._rows.extend(window)

    def __bool__(self) -> bool:
        with self.lock:
            self._read_ahead()
            return bool(self._rows)

    def maybe_left(self) -> bool:
        """Rows are left or may come, asked without reading or waiting for the lock: a lane whose
        prefill thread reads the requests asks this, so that it decodes on while a read waits."""
        return bool(self._rows) or not self._exhausted

    def popleft(self) -> _Row:
        with self.lock:
            self._read_ahead()
            return self._rows.popleft()

    def peek(self) -> _Row:
        with self.lock:
            self._read_ahead()
            return self._rows[0]

    def leading(self, limit: int) -> int:
        """How many of the next rows (at most `limit`) are samples of the next row's prompt (a
        window holds every requested sample of its prompts)."""
        with self.lock:
            first = self.peek().prompt
            return sum(1 for _ in itertools.takewhile(lambda row: row.prompt is first, itertools.islice(self._rows, limit)))


def _shapes(tree, sharding):
    """`tree` as `jax.ShapeDtypeStruct`s placed by `sharding`: a program's arguments before any exists."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _on_host(got: HostOut) -> HostOut:
    """A program's `HostOut` as numpy arrays (waits for the call)."""
    return HostOut(*(None if a is None else np.asarray(a) for a in got))


class _PrefillInputs(NamedTuple):
    """A prefill call's inputs beside the model, cache and state (decode.prefill_chunk): R rows of
    C tokens, each row's piece at most, and n samples a prompt."""

    tokens: np.ndarray  # [R, C]
    slot_ids: np.ndarray  # [R, n], the cache slots of each piece's prompt's samples (out of range: none)
    starts: np.ndarray  # [R], where each piece starts in its prompt
    offsets: np.ndarray  # [R], where in the call's tokens
    lengths: np.ndarray  # [R]
    is_last: np.ndarray  # [R], the piece ends its prompt
    prompt_index: np.ndarray  # [R]
    sample_index: np.ndarray  # [R, n]
    targets: np.ndarray | None = None  # [R, C], with sampling.prompt_logprobs: each token's next in its prompt, -1: none


def _short(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _LaneFailed(NamedTuple):
    error: BaseException


_LANE_DONE = object()
"""What a lane's thread sends last (`Engine._side_by_side`)."""


@dataclasses.dataclass
class _Prompt:
    """A prompt being prefilled, chunk by chunk, into the slots of its samples."""

    index: int
    ids: np.ndarray
    rows: list[_Row]
    slots: list[int]
    written: int = 0
    """Prompt tokens already in the cache."""
    logprobs: list[float | None] | None = None
    """With `sampling.prompt_logprobs`: its tokens' log-probabilities so far, None for the first."""


class _Stager:
    """A lane's next prompts, prefilled in a thread of their own into a staging cache while the
    lane decodes (`engine.overlap_prefill`): on a CPU host the decode step leaves a core mostly
    idle, and the lane no longer stops decoding to prefill. Where the staging cache has as many
    rows as the lane (the same programs), the lane prefills its first rows itself and starts the
    thread once it has taken them (a job that fits its slots never waits for it). The lane moves
    prefilled rows into its free slots between its decode calls (`adopt`: one compiled call
    copies their whole cache rows and decode state). The staging cache is used by one call at a
    time, the lane's first; a row that finishes on its first token never leaves it, its
    completion waits in `finished`. Which rows share a call depends on timing, not a row's tokens
    (rows are computed alone: `compiler_options`)."""

    def __init__(self, engine: "Engine", pending: "_Pending", cache, state):
        self._engine = engine
        self._pending = pending
        self._cache, self._state = cache, state
        self._rows: list[_Row | None] = [None] * cache.slots
        """A staging slot's row, from when it is taken until the lane adopts it or it finishes."""
        self._ready: collections.deque[int] = collections.deque()
        """Staging slots whose row has its first token, in the order they got it."""
        self._finished: list[Completion] = []
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        """Guards everything above; notified whenever any of it changes."""
        self._calling = False
        """A prefill call holds the staging cache (donated to it)."""
        self._adopting = False
        """The lane waits for the staging cache, or copies from it: no new prefill call starts."""
        self._closing = False
        self._taking = False
        """The thread takes rows from the queue, outside `_cond`: a read of the requests may wait,
        and the lane asks `_cond` between its decode calls. Rows it holds count as busy."""
        self._thread = threading.Thread(target=self._loop, name="engine-prefill", daemon=True)

    def start(self) -> None:
        """Starts the thread; called once the lane holds the stager, so that its `close` always
        comes (a Ctrl-C inside `Thread.start` left the thread waiting forever)."""
        self._thread.start()

    def _loop(self) -> None:
        engine, prefilling = self._engine, collections.deque()
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    free = [s for s, row in enumerate(self._rows) if row is None]
                    self._taking = True
                # Into free slots only: the lane's `adopt` touches prefilled ones. (An error leaves
                # `_taking` set: `busy` holds with `_error` anyway, and the lane raises it.)
                if free:
                    engine._admit(self._pending, free, self._rows, prefilling, whole=True)
                left = bool(prefilling) or bool(self._pending)
                with self._cond:
                    self._taking = False
                    if not left:  # nothing left to prefill
                        self._cond.notify_all()
                        return
                    if not prefilling:
                        if free == [s for s, row in enumerate(self._rows) if row is None]:
                            self._cond.wait()  # until the lane adopts rows and frees staging slots
                        continue
                    while self._adopting and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        return
                    self._calling = True
                cache, state, got = engine._prefill(self._cache, self._state, prefilling)  # read back
                with self._cond:
                    self._cache, self._state, self._calling = cache, state, False
                    for s in np.flatnonzero(got.tokens >= 0):
                        completion = engine._first_token(self._rows[s], got, s)
                        if completion is None:
                            self._ready.append(s)
                        else:
                            self._finished.append(completion)
                            self._rows[s] = None
                    self._cond.notify_all()
        except BaseException as error:  # raised in the lane's thread (`finished`, `adopt`)
            with self._cond:
                self._error, self._calling = error, False
                self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def busy(self) -> bool:
        """Rows are being taken from the requests, prefilled or wait for a slot, or completions or
        an error for the lane."""
        with self._cond:
            return (self._taking or any(row is not None for row in self._rows) or bool(self._finished)
                    or self._error is not None)

    def finished(self) -> list[Completion]:
        """Completions of rows that finished on their first token, since the last ask; raises
        what the prefill thread raised."""
        with self._cond:
            self._raise()
            done, self._finished = self._finished, []
        return done

    def wait(self) -> None:
        """Until rows are prefilled or finish (or a second passes: the lane checks `stop`)."""
        with self._cond:
            if not (self._ready or self._finished or self._error):
                self._cond.wait(timeout=1.0)

    def adopt(self, cache, state, free: list[int], live: list, kill: np.ndarray, *, wait: bool):
        """Moves prefilled rows into the lane's `free` slots, earliest prefilled first, in one
        call; returns the lane's (cache, state). wait: if a prefill call holds the staging cache,
        wait for it (else adopt nothing now)."""
        with self._cond:
            if not self._ready or (self._calling and not wait):
                return cache, state
            self._adopting = True
            try:
                while self._calling:
                    self._cond.wait()
                self._raise()
                to = np.full(len(self._rows), len(live), np.int32)  # out of range: stays
                for slot in free[: len(self._ready)]:
                    staged = self._ready.popleft()
                    to[staged] = slot
                    row, self._rows[staged] = self._rows[staged], None
                    row.decoding, live[slot], kill[slot] = True, row, False
                return self._engine._adopt(cache, state, self._cache, self._state, to)
            finally:
                self._adopting = False
                self._cond.notify_all()

    def close(self) -> None:
        """Stops the prefill thread after its current call and waits for it (one not started yet
        sees `_closing` first and returns)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()


def _checked_arguments(model_path: Any, sampling: Any, engine: Any) -> str:
    """`Engine.load`'s and `check`'s arguments of the wrong kind, named (an AttributeError deep in
    the load before); the model path as a string (a pathlib.Path is welcome)."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"Engine.load: sampling must be a SamplingParams, got {type(sampling).__name__} "
                        f"(SamplingParams(**values) from a dict)")
    if not isinstance(engine, EngineConfig):
        raise TypeError(f"Engine.load: engine must be an EngineConfig, got {type(engine).__name__} "
                        f"(EngineConfig(**values) from a dict)")
    return os.fspath(model_path) if isinstance(model_path, os.PathLike) else model_path


class _Setup(NamedTuple):
    """What `Engine.load` decides before reading a weight (`Engine._setup`)."""

    config: LlamaConfig
    eos_token_ids: tuple[int, ...]
    layout: Layout
    attention: str
    cache_dtype: Any
    plan: BatchPlan


class Engine:
    """A checkpoint loaded for generation with one set of sampling settings: `Engine.load`, then
    `generate` as often as needed. Another temperature or n is another `Engine.load` (the settings
    are compiled into the programs; the persistent compilation cache makes the second load's
    programs cheap, not its weights). `describe()` says what was planned; `stats` counts the work."""

    def __init__(self, model, config: LlamaConfig, *, dtype: str, engine_config: EngineConfig, sampling: SamplingParams,
                 max_prompt_tokens: int, plan: BatchPlan, eos_token_ids: tuple[int, ...], tokenizer, layout: Layout,
                 source: str, cache_dtype, attention: str = "xla"):
        self.model = model
        self.config = config
        self.dtype = dtype
        self.engine_config = engine_config
        self.max_prompt_tokens = max_prompt_tokens
        self.sampling = sampling
        self.plan = plan
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.layout = layout
        self.devices = layout.local_devices
        self.source = source
        self.vocab_size = config.vocab_size
        self.stats = EngineStats(batch_size=plan.batch_size)
        self.stopped = False
        """The latest `generate` (the last one begun) ended early because its `stop` callback asked
        (on any host); an earlier one that ends after it leaves this as it is."""
        self._generate_calls = 0
        self.on_compile: Callable[[str], None] | None = None
        """Called with the program's kind ('init', 'prefill_fresh', 'prefill', 'decode') before a
        program is compiled or loaded from the persistent cache: a caller's progress line."""
        self._batch_sharding = layout.batch_sharding
        # Only what the programs compute with: engines differing in n or stop strings share them.
        compiled_sampling = dataclasses.replace(sampling, n=1, stop=(), stop_token_ids=())
        stop_ids = tuple(sorted(set(eos_token_ids) | set(sampling.stop_token_ids)))
        self._spec = DecodeSpec(compiled_sampling, stop_ids, layout.batch_sharding, layout.cache_sharding, layout.host_sharding,
                                attention, kernels.TUNING)
        self._seq_len = max_prompt_tokens + sampling.max_new_tokens
        self._cache_dtype = cache_dtype
        """What the KV cache holds: the one `plan` was made for (Engine.load)."""
        n_dev = layout.data_size
        rows = max(1, plan.prefill_tokens // engine_config.prefill_chunk_tokens)
        self._lanes = plan.lanes
        self._lane_slots = plan.batch_size // plan.lanes
        """Slots of each lane: its programs' batch."""
        self._prefill_rows = min(-(-rows // n_dev) * n_dev, self._lane_slots)
        """Rows of a prefill call, of C tokens each (a multiple of the data-parallel devices), and the
        most prompts' pieces it holds (`_pieces`)."""
        self._staged = plan.staged
        """Slots of each lane's staging cache (`engine.overlap_prefill`; 0: prompts are prefilled
        into the lane's own cache, between its decode calls)."""
        self._group = min(sampling.n, self._lane_slots)
        """Samples of one prompt that share one prefill (each needs a slot)."""
        self._stats_lock = threading.Lock()
        self._used_programs: set[tuple] = set()
        """Keys (`_program`) of the programs this engine ran: stats.programs_used."""
        self._prefill_lowered = threading.Event()
        """Set once a prefill program is lowered, found or failed: the decode program's early
        getting waits for it (`_get_programs_early`)."""
        self._getting_ahead = False
        """`_get_programs_early` has started its threads (in Engine.load, or at the first generate)."""
        self._closed = threading.Event()
        """Set by `close`: those threads start getting no more programs."""
        self._by_call: dict[tuple, Any] = {}
        """The programs of this engine's calls by `_call_key`: a call finds its program without
        flattening the model and the cache again (each of a run's 70-odd calls spent about 0.6 ms
        building a jit wrapper and the full key; the full lookup runs once per program)."""
        self._waiters = 0
        self._waits_began = 0.0
        """Threads in `_waiting` now, and since when one has been (under _stats_lock)."""

    @staticmethod
    def load(
        model_path: str,
        *,
        dtype: str = "bfloat16",
        sampling: SamplingParams = SamplingParams(),
        engine: EngineConfig = EngineConfig(),
        max_prompt_tokens: int = 512,
        tokenizer=None,
        on_compile: Callable[[str], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> "Engine":
        """Checks the checkpoint's config and the batch plan, then reads the weights; with
        engine.compile_during_load, while two threads get the programs a run calls
        (`_get_programs_early`; else the first `generate` starts them).

        dtype: float32 or bfloat16 weights. max_prompt_tokens: the longest prompt `generate` will
        be given (it sizes the KV cache). engine.mode host_dp: this host's devices, weights
        replicated on each. global_mesh: every device of the pod, weights sharded by engine.mesh
        (engine/mesh.py); every host must make the same calls, and batch_size counts rows of the
        whole pod.

        tokenizer: anything with `decode(ids, skip_special_tokens=True)` (the checkpoint's:
        `engine.checkpoint.load_tokenizer(model_path)`); it makes Completion.text and stop strings
        work, and without it text is ''. Prompts go in as token ids with the BOS and chat template
        already applied (the tokenizer's own `encode` / `apply_chat_template` do).

        Changes one process-wide JAX setting: JAX's persistent compilation cache is turned on
        (engine/compile_cache.py) unless the caller already chose a folder for it. A float32
        engine's programs ask for the highest matmul precision (GPUs would otherwise run float32
        products as TF32), its own programs only: `jax_default_matmul_precision` is left as it is.

        on_compile: `Engine.on_compile`, from the first program on.
        stop: asked before each tensor is read; once it returns True, raises `LoadStopped` (this
        host's answer alone: no host waits for another while loading)."""
        model_path = _checked_arguments(model_path, sampling, engine)
        if sampling.stop and tokenizer is None:
            raise ValueError("sampling.stop needs a tokenizer: pass Engine.load(..., tokenizer=...)")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"Engine.load: tokenizer must have decode(ids, skip_special_tokens=True) (a transformers "
                            f"tokenizer: engine.checkpoint.load_tokenizer(model_path)), got {type(tokenizer).__name__}")
        compile_cache.enable()
        setup = Engine._setup(model_path, dtype=dtype, sampling=sampling, engine=engine, max_prompt_tokens=max_prompt_tokens)
        config, layout, attention, cache_dtype, plan = setup.config, setup.layout, setup.attention, setup.cache_dtype, setup.plan
        devices = layout.local_devices
        tensors = check_tensors(model_path, config)  # a checkpoint that does not fit fails before any program
        loaded = Engine(abstract_model(config, dtype=DTYPES[dtype], sharding=layout.param_sharding), config, dtype=dtype,
                        engine_config=engine, sampling=sampling, max_prompt_tokens=max_prompt_tokens, plan=plan,
                        eos_token_ids=setup.eos_token_ids, tokenizer=tokenizer, layout=layout, source=model_path,
                        attention=attention, cache_dtype=cache_dtype)
        loaded.on_compile = on_compile
        during_load = engine.compile_during_load
        if during_load is True or during_load == "auto" and (devices[0].platform != "cpu" or not checkpoint.is_local(model_path)):
            loaded._get_programs_early()
        try:
            loaded.model = load_checkpoint(model_path, config, dtype=DTYPES[dtype], sharding=layout.param_sharding,
                                           tensors=tensors, stop=stop)
        except BaseException:
            loaded.close()  # a read that fails or is stopped: the programs not begun are not needed
            raise
        return loaded

    @staticmethod
    def check(model_path: str, *, dtype: str = "bfloat16", sampling: SamplingParams = SamplingParams(),
              engine: EngineConfig = EngineConfig()) -> None:
        """What `load` checks before it reads a weight, for prompts of one token: the model's
        config.json, and the settings on this host's devices (engine.mode and mesh, lanes,
        decode_attention, batch_size against their memory). Raises what `load` would: InvalidConfig
        for a setting, UnsupportedModelError for a model. Reads config.json only; compiles nothing.
        A setting that passes can still fail `load` for longer prompts (more KV cache a row)."""
        Engine._setup(_checked_arguments(model_path, sampling, engine), dtype=dtype, sampling=sampling, engine=engine,
                      max_prompt_tokens=1)

    @staticmethod
    def _setup(model_path: str, *, dtype: str, sampling: SamplingParams, engine: EngineConfig,
               max_prompt_tokens: int) -> "_Setup":
        """The model's config and the batch plan on this host's devices (`load`, `check`)."""
        if dtype not in DTYPES:
            raise InvalidConfig(f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        require(isinstance(max_prompt_tokens, numbers.Integral) and not isinstance(max_prompt_tokens, bool)
                and max_prompt_tokens > 0, "prompts.max_prompt_tokens", max_prompt_tokens, "an integer > 0")
        config_path = f"{model_path.rstrip('/')}/config.json"
        hf_config = checkpoint.read_config(model_path)
        config = LlamaConfig.from_hf(hf_config, source=config_path)
        eos = checkpoint.eos_token_ids(model_path, hf_config)

        seq_len = max_prompt_tokens + sampling.max_new_tokens
        if seq_len > config.max_position_embeddings:
            raise ValueError(
                f"prompts.max_prompt_tokens + sampling.max_new_tokens = {seq_len} exceeds max_position_embeddings"
                f" {config.max_position_embeddings} in {config_path}"
            )
        if config.longrope_rows is not None and seq_len > config.longrope_rows:
            raise UnsupportedModelError(
                f"model.path {config_path}: prompts.max_prompt_tokens + sampling.max_new_tokens = {seq_len} exceeds its"
                f" longrope rotation's original_max_position_embeddings {config.longrope_rows}; past it transformers"
                f" turns every position to the long factors, which the engine does not implement")
        if config.sliding_window is not None and seq_len <= config.sliding_window:
            config = dataclasses.replace(config, sliding_window=None)  # no row reaches past it: it changes nothing
        capped = None  # why the scores are capped, which neither kernel does
        if config.attn_logit_softcapping is not None:
            capped = f"{config_path} caps them (attn_logit_softcapping {config.attn_logit_softcapping})"

        if engine.mode == "global_mesh":
            layout = Layout.pod(mesh_shape(engine.mesh, num_devices=jax.device_count(), kv_heads=config.num_key_value_heads))
        else:
            layout = Layout.local(jax.local_devices())
        devices = layout.local_devices
        attention = kernels.resolve(engine.decode_attention, platform=devices[0].platform, head_dim=config.head_dim,
                                    dtype=dtype, capped=capped)
        cache_dtype = kernels.cache_dtype(attention, platform=devices[0].platform, dtype=DTYPES[dtype],
                                          devices=len(layout.cache_sharding.device_set))
        plan = plan_batch(
            config,
            dtype=DTYPES[dtype],
            cache_dtype=cache_dtype,
            batch_size=engine.batch_size,
            max_prompt_tokens=max_prompt_tokens,
            max_new_tokens=sampling.max_new_tokens,
            devices=devices,
            memory_fraction=engine.memory_fraction,
            batch_shards=layout.data_size,
            weight_shards=layout.mesh.size if layout.is_global else 1,
            row_shards=layout.model_size,
            decode_chunk_steps=engine.decode_chunk_steps,
            prefill_tokens=engine.prefill_tokens,
            prefill_chunk_tokens=engine.prefill_chunk_tokens,
            lanes=engine.lanes if engine.mode == "host_dp" else 1,
            token_counts=penalizes(sampling),
            prompt_tokens=marks_prompts(sampling),
            prompt_logprobs=sampling.prompt_logprobs,
        )
        plan = plan_staging(plan, engine.overlap_prefill if engine.mode == "host_dp" else False, platform=devices[0].platform,
                            prefill_chunk_tokens=engine.prefill_chunk_tokens, samples=sampling.n, batch_shards=layout.data_size)
        return _Setup(config, tuple(eos), layout, attention, cache_dtype, plan)

    def close(self) -> None:
        """Stops getting programs ahead of their calls, for a run being abandoned (an error, a stop
        signal): a thread of `_get_programs_early` finishes the program it is compiling (XLA
        cannot stop a compile it has begun) and begins no other. The interpreter waits for those
        threads at exit, so a process that ends after a close waits for the programs being
        compiled, not for every program (on an accelerator with an 8B model, minutes); Engine.load
        closes when the weights fail to read. The engine stays usable: a later `generate` gets each
        program it calls itself."""
        self._closed.set()

    @property
    def attention(self) -> str:
        """Decode attention, `engine.decode_attention` resolved: xla, pallas or cpu (engine/kernels.py)."""
        return self._spec.attention

    @property
    def max_programs(self) -> int:
        """The most programs a run compiles: init, decode, first prefill chunks and later ones
        (one fewer when every prompt fits one chunk; one program for both where the CPU kernel
        reads the prompts' cache rows in place, `DecodeSpec.prefill_in_place`), and with a
        staging cache the move of its rows into the lane's (adopt)."""
        return 3 + (not self._spec.prefill_in_place) + bool(self._staged)

    def describe(self) -> str:
        """One line: the model, dtype and devices, the batch and its memory plan, the prompt and
        completion lengths it was sized for, the prefill and decode attention, the programs at most."""
        c, p, layout = self.config, self.plan, self.layout
        need = p.need_bytes(p.batch_size, layout.data_size)
        platform = self.devices[0].platform
        where = (f"a global mesh data {layout.data_size} x model {layout.model_size} over {layout.mesh.size} {platform}"
                 f" devices of {jax.process_count()} host(s)" if layout.is_global else f"{len(self.devices)} {platform} device(s)")
        return (
            f"{c.model_type} {c.num_hidden_layers}x{c.hidden_size} (vocab {c.vocab_size}) from {self.source},"
            f" {self.dtype} on {where};"
            f" batch_size {p.batch_size} ({p.reason}){f' in {p.lanes} lanes' if p.lanes > 1 else ''}; memory ~{need / GiB:.2f} GiB per device"
            f" (weights {p.weights_bytes / GiB:.2f} GiB + {p.row_bytes / 2**20:.1f} MiB/row + prefill"
            f" {p.working_bytes / 2**20:.0f} MiB) of {p.limit_bytes / GiB:.2f} GiB allowed;"
            f" prompts <= {self.max_prompt_tokens} tokens, {self.sampling.max_new_tokens} new;"
            f" prefill {self._prefill_rows} rows x {self.engine_config.prefill_chunk_tokens} tokens per call"
            f"{f' beside decode, into {self._staged} staging rows' if self._staged else ''};"
            f" decode attention {self.attention} over a {cpu_attention.value_dtype(self._cache_dtype).name} KV cache;"
            f" at most {self.max_programs} programs"
        )

    # ------------------------------------------------------------------ compiled programs

    def _program(self, kind: str, static: tuple, jitted, args: tuple, *, after: threading.Event | None = None,
                 used: bool = True):
        """The compiled program for these input shapes: from this process's memory (shared by
        engines: a reload with the same shapes compiles nothing), else compiled by XLA or loaded
        from JAX's persistent cache (counted apart in the stats). after: waited for before
        tracing, where the program is not in memory. used: a call runs it (stats.programs_used;
        not for the programs got ahead of their calls, `_get_programs_early`, which get None
        instead of a program not in memory once the engine is closed)."""
        try:
            return self._find_or_get(kind, static, jitted, args, after, used)
        finally:
            if kind.startswith("prefill"):
                self._prefill_lowered.set()  # found, got or failed: a decode compile waiting goes on

    def _find_or_get(self, kind: str, static: tuple, jitted, args: tuple, after: threading.Event | None, used: bool):
        leaves, treedef = jax.tree.flatten(args)
        # The model's config too: the init program takes no model, yet makes a cache of its shapes,
        # and two models of one process (a notebook comparing checkpoints) must not share it. The
        # activations' order is read as the program is traced (`llama.rows_first`; the tests force it).
        key = (kind, static, self.config, self._spec, self.layout.is_global, llama.rows_first(), treedef,
               tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        if used and key not in self._used_programs:  # once per program: calls after it take no lock here
            with self._stats_lock:
                self._used_programs.add(key)
                self.stats.programs_used = len(self._used_programs)
        compiled = _COMPILED.get(key)
        if compiled is not None:
            return compiled
        with _COMPILING_LOCK:
            lock = _COMPILING[key]
        with lock:
            compiled = _COMPILED.get(key)
            if compiled is None:
                if after is not None:
                    after.wait()
                if not used and self._closed.is_set():
                    return None  # got ahead of its call, but the run was abandoned (`close`)
                if self.on_compile is not None:  # announced once it is sure to compile (here or from the cache)
                    self.on_compile(kind)
                hits = compile_cache.hits()  # this thread's
                start = time.perf_counter()
                with self.layout.tracing():
                    with _collector_paused(), self._precision():
                        lowered = jitted.lower(*args)
                    if kind.startswith("prefill"):
                        self._prefill_lowered.set()  # XLA compiles (or loads) with the GIL released
                    compiled = lowered.compile(compiler_options())
                with _COMPILING_LOCK:
                    self.stats.count_program(kind, time.perf_counter() - start, loaded=compile_cache.hits() > hits)
                _COMPILED[key] = compiled
        return compiled

    def _precision(self) -> contextlib.AbstractContextManager:
        """For tracing this engine's programs: float32 products at the highest precision (GPUs run
        float32 matmuls as TF32 by default, logits off by ~3e-2: float32 means float32), as a
        context of the tracing thread, not a process-wide setting; other dtypes as the caller set."""
        return jax.default_matmul_precision("highest") if self.dtype == "float32" else contextlib.nullcontext()

    def _call_key(self, kind: str, static: tuple, args: tuple) -> tuple:
        """What tells this engine's calls' programs apart, cheaply: the model is the engine's own,
        a cache's and a state's shapes follow from their slots, the other arguments are arrays
        (`_program` keys a program by every leaf's shape, dtype and sharding), or None (an input
        the sampling does not need, e.g. a prefill call's targets without prompt_logprobs); and the
        activations' order (`llama.rows_first`: a test may change it for a live engine)."""
        assert args[0] is self.model, "a call runs the engine's own model"

        def shape(arg) -> tuple | None:
            if arg is None:
                return None
            if isinstance(arg, KVCache):
                return ("cache", arg.slots)
            if isinstance(arg, DecodeState):
                return ("state", arg.done.shape)
            return (arg.shape, arg.dtype)

        return (kind, static, llama.rows_first(), *map(shape, args[1:]))

    def _jit(self, fn):
        """fn(model, cache, state, ...) jitted with the cache and state donated (updated in place)."""
        # Explicit output shardings: XLA would otherwise simplify them (P('data') on one device
        # comes back as P()), and the next call's inputs would key another compile.
        out_shardings = (self.layout.cache_sharding, self._batch_sharding, self.layout.host_sharding)
        return jax.jit(fn, donate_argnums=(1, 2), out_shardings=out_shardings)

    def _decode_program(self) -> tuple[str, tuple, Callable]:
        """(kind, static args, function) of the decode chunk: one definition for its early
        getting and its calls, so both find the same program (and so for the others below)."""
        steps = self.engine_config.decode_chunk_steps
        return "decode", (steps,), functools.partial(decode_chunk, spec=self._spec, steps=steps)

    def _prefill_program(self, fresh: bool) -> tuple[str, tuple, Callable]:
        """A prefill call's: of first chunks alone (fresh), or of any pieces."""
        return "prefill_fresh" if fresh else "prefill", (fresh,), functools.partial(prefill_chunk, spec=self._spec, fresh=fresh)

    def _adopt_program(self) -> tuple[str, tuple, Callable]:
        """The move of staged rows into a lane's slots."""
        return "adopt", (), functools.partial(adopt_rows, spec=self._spec)

    def _init_program(self, slots: tuple[int, ...]) -> tuple[str, tuple, Callable, tuple]:
        """(kind, static args, jitted function, its outputs' shardings) of the init program: per
        entry of `slots`, a zero cache of that many slots and an all-empty decode state."""

        def make():
            ends = self._spec.cache_ends(self._seq_len)
            vocab = self.config.vocab_size  # the penalties' token counts, if any
            return tuple((new_cache(self.config, n, ends, self._cache_dtype), new_state(n, vocab, self.sampling)) for n in slots)

        shardings = tuple((self.layout.cache_sharding, self._batch_sharding) for _ in slots)
        return "init", (slots, self._seq_len, jnp.dtype(self._cache_dtype).name), jax.jit(make, out_shardings=shardings), shardings

    def _prefill_inputs(self, slots: int) -> "_PrefillInputs":
        """A prefill call's inputs with no piece in them (`_prefill` fills them), over a cache of
        `slots` slots."""
        R, C, n = self._prefill_rows, self.engine_config.prefill_chunk_tokens, self._group
        zeros = functools.partial(np.zeros, R, np.int32)
        return _PrefillInputs(tokens=np.zeros((R, C), np.int32), slot_ids=np.full((R, n), slots, np.int32),
                              starts=zeros(), offsets=zeros(), lengths=zeros(), is_last=np.zeros(R, bool),
                              prompt_index=zeros(), sample_index=np.zeros((R, n), np.int32),
                              targets=np.full((R, C), -1, np.int32) if self.sampling.prompt_logprobs else None)

    def _get_programs_early(self) -> None:
        """Starts getting every program a run calls (compiling it, or loading it from JAX's
        persistent cache) from the shapes alone, in two threads: init, prefill and adopt in one,
        in the order a run needs them; decode, the largest, in the other, traced once a prefill
        program is lowered (`_prefill_lowered`). Both trace and lower under the GIL; XLA
        compiles, or loads, with it released, so the two compiles overlap.

        Called by `Engine.load` before it reads the weights (engine.compile_during_load: on a pod
        an 8B model's read from storage takes minutes, and its compiles can hide behind it), else
        by the first `generate`. A call whose program is still being got waits for it (the
        program's lock in `_find_or_get`; counted in stats.compile_wait_s). A getting that fails
        here is tried again by the call that needs the program, which raises its error."""
        slots, staged = self._lane_slots, self._staged
        kind, static, init, shardings = self._init_program((slots, staged) if staged else (slots,))
        with self.layout.tracing():
            made = jax.eval_shape(init)
        # Each cache and state placed by its output sharding (`shardings` is a prefix of `made`).
        shapes = jax.tree.map(lambda sharding, tree: _shapes(tree, sharding), shardings, made)
        (cache, state), staging = shapes[0], shapes[1:]
        # A staging cache of another size than the lane's takes every prefill call (`_lane`).
        prefilled = staging[0] if staging and staged != slots else (cache, state)
        inputs = _shapes(self._prefill_inputs(prefilled[0].slots), self._batch_sharding)
        if self._spec.prefill_in_place:
            fresh = (False,)  # first chunks run the later ones' program
        else:
            fresh = (True, False) if self.max_prompt_tokens > self.engine_config.prefill_chunk_tokens else (True,)
        programs = [(kind, static, init, ())]
        for kind, static, fn in map(self._prefill_program, fresh):
            programs.append((kind, static, self._jit(fn), (self.model, *prefilled, *inputs)))
        decodes = self.sampling.max_new_tokens > 1  # else every row finishes on its first token
        if staging and decodes:  # a row that does not decode is never moved
            kind, static, fn = self._adopt_program()
            to = jax.ShapeDtypeStruct((staged,), jnp.int32, sharding=self._batch_sharding)
            programs.append((kind, static, self._jit(fn), (self.model, cache, state, *staging[0], to)))

        def get_in_order() -> None:
            try:
                for program in programs:
                    if self._closed.is_set():
                        break  # the run was abandoned (`close`): its calls get what they need
                    self._program(*program, used=False)
            finally:
                self._prefill_lowered.set()  # also where the init program failed: decode goes on

        self._getting_ahead = True
        self._in_thread(f"{_AHEAD}programs", get_in_order)
        if decodes:
            kind, static, fn = self._decode_program()
            kill = jax.ShapeDtypeStruct((slots,), jnp.bool_, sharding=self._batch_sharding)
            self._in_thread(f"{_AHEAD}decode", self._program, kind, static, self._jit(fn), (self.model, cache, state, kill),
                            after=self._prefill_lowered, used=False)

    @staticmethod
    def _in_thread(name: str, fn, *args, **kwargs) -> None:
        """fn(*args, **kwargs) in a thread of its own, which the interpreter waits for at exit
        (not a daemon: XLA must not be compiling as the process ends). What it raises is left:
        the call that needs the program gets it again and raises there."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        pool.submit(fn, *args, **kwargs)
        pool.shutdown(wait=False)

    def _run(self, kind: str, fn, static: tuple, *args):
        """Runs fn(model, cache, state, ...) compiled, the cache and state donated (updated in place).
        `kind` and `static` name fn: one function for each pair in an engine. Callers hold
        `_jax_work` around it and the transfers of its inputs and outputs."""
        call = self._call_key(kind, static, args)
        compiled = self._by_call.get(call)
        if compiled is None:
            with self._waiting():
                compiled = self._program(kind, static, self._jit(fn), args)
            self._by_call[call] = compiled
        start = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        with self._stats_lock:
            self.stats.decode_time_s += seconds
            entry = self.stats.programs.setdefault(kind, {"compiled": 0, "loaded": 0, "seconds": 0.0})
            entry["run_s"] = entry.get("run_s", 0.0) + seconds
        return out

    def _init(self, *slots: int):
        """Per entry of `slots`, a zero cache of that many slots and an all-empty decode state
        (the lane's, then its staging cache's), made by one compiled program with their output
        shardings, so each device (of every host on a global mesh) allocates only its own block."""
        kind, static, jitted, _ = self._init_program(slots)
        with _jax_work():
            with self._waiting():
                program = self._program(kind, static, jitted, ())
            return jax.block_until_ready(program())

    @contextlib.contextmanager
    def _waiting(self):
        """Counts the time inside as generate waiting for programs (stats.compile_wait_s), once
        however many threads wait at the same time: the lanes wait for the same programs, and
        the prefill thread for its own while a lane waits for the decode program. Each wait lies
        within some program's getting, so the sum stays within compile_time_s."""
        with self._stats_lock:
            if self._waiters == 0:
                self._waits_began = time.perf_counter()
            self._waiters += 1
        try:
            yield
        finally:
            with self._stats_lock:
                self._waiters -= 1
                if self._waiters == 0:
                    self.stats.compile_wait_s += time.perf_counter() - self._waits_began

    # ---------------------------------------------------------------------------- generate

    def _rows(self, request: GenerationRequest) -> list[_Row]:
        """One row per requested sample of a checked prompt (a ValueError naming the request's
        prompt_index and what is wrong: the engine's own state stays as it was)."""
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"generate takes GenerationRequests, got a {type(request).__name__}: {_short(request)}")
        index = request.prompt_index
        if not (isinstance(index, numbers.Integral) and not isinstance(index, bool) and 0 <= index < 2**31):
            raise ValueError(f"GenerationRequest.prompt_index must be an integer in [0, 2**31), got {index!r}")
        index = int(index)  # a numpy integer comes back as the int it is
        given = np.asarray(request.input_ids)
        if given.ndim != 1 or given.size and given.dtype.kind not in "iu":
            raise ValueError(f"prompt {index}: input_ids must be one list of integer token ids, got an array of shape "
                             f"{given.shape} and dtype {given.dtype} (a tokenizer's batch of one: take its row 0)")
        if not 1 <= len(given) <= self.max_prompt_tokens:
            raise ValueError(
                f"prompt {index} has {len(given)} tokens; the engine accepts 1 to"
                f" prompts.max_prompt_tokens={self.max_prompt_tokens}"
            )
        outside = np.flatnonzero((given < 0) | (given >= self.vocab_size))
        if outside.size:
            raise ValueError(f"prompt {index} has token ids outside [0, {self.vocab_size}): {int(given[outside[0]])} at "
                             f"position {int(outside[0])}" + (f" and {outside.size - 1} more" if outside.size > 1 else ""))
        given_samples = request.sample_indices
        try:
            samples = (list(given_samples) if isinstance(given_samples, collections.abc.Iterable)
                       and not isinstance(given_samples, (str, bytes)) else None)
        except TypeError:  # iterable in name only: a 0-d numpy array
            samples = None
        if (samples is None or any(not isinstance(s, numbers.Integral) or isinstance(s, bool) for s in samples)
                or len(set(samples)) != len(samples) or not all(0 <= s < self.sampling.n for s in samples)):
            raise ValueError(f"prompt {index}: sample_indices must be a list of distinct samples in [0, sampling.n = "
                             f"{self.sampling.n}), got {_short(given_samples)}")
        samples = [int(s) for s in samples]
        ids = given.astype(np.int32)
        return [_Row(index, s, ids) for s in samples]

    def generate(self, requests: Iterable[GenerationRequest], stop: Callable[[], bool] | None = None) -> Iterator[Completion]:
        """Yields one Completion per (prompt, sample) requested, in the order rows finish.
        Safe to abandon part way: closing the generator (or dropping it) halts the work at its
        next compiled call. Between yields one lane runs nothing; several lanes run on until
        2 x batch_size completions (and one a lane) wait to be taken, then wait too (on a global mesh every
        host must abandon at the same point: use `stop`). Each request is one prompt: two
        requests of one prompt_index are two prompts that share their samples' random draws.

        stop: asked before every compiled call (by each lane's thread, so it must be safe to call
        from several); once it returns True on any host, every host's generate returns there,
        together, and sets `self.stopped` (if no generate of the engine began after this one).

        With several lanes (`engine.lanes`, host_dp only) each lane runs in a thread of its own,
        taking rows from the same queue, and their completions come back here in the order they
        finish; a row's tokens do not depend on its lane.

        Requests are read as rows are needed (a generator of a million is never held whole), so
        a bad one (`GenerationRequest`'s checks: a ValueError naming its prompt_index) is raised
        when it is reached, after the completions of the requests before it were yielded; no
        request after it is read. A generator left unfinished when the interpreter exits is
        closed then (`_close_unfinished`); one running then in another thread (a daemon's) raises
        a RuntimeError there at its next call into jax, and the exit waits for it to end."""
        completions = self._generate(requests, stop)
        _UNFINISHED.add(completions)
        return completions

    def _generate(self, requests: Iterable[GenerationRequest], stop: Callable[[], bool] | None) -> Iterator[Completion]:
        with self._stats_lock:  # generators may be driven from several threads
            self._generate_calls += 1
            call = self._generate_calls
        self.stopped = False
        if isinstance(requests, GenerationRequest):
            raise TypeError("Engine.generate takes an iterable of GenerationRequests (a list of one for one prompt), "
                            "got one GenerationRequest")
        if not self._getting_ahead:  # engine.compile_during_load off: from the first generate
            self._get_programs_early()
        pending = _Pending(requests, self._rows, window_rows=READ_AHEAD_ROWS_PER_SLOT * self.plan.batch_size)
        _RUNNING.add(pending)
        try:
            if pending:
                try:
                    if self._lanes == 1:
                        yield from self._lane(pending, stop, threading.Event())
                    else:
                        yield from self._side_by_side(pending, stop)
                finally:
                    if call == self._generate_calls:  # a later call's outcome is not overwritten
                        self.stopped = pending.stopped
                    with contextlib.suppress(_Exiting), _jax_work():
                        self.stats.peak_memory_bytes = peak_memory_bytes(self.devices)
            if pending.error is not None and not pending.stopped:
                raise pending.error
        except _Exiting as exiting:
            # The frames it passed hold the caches: freed here, before the exit goes on (not in
            # the caller's thread as the interpreter finalizes).
            traceback.clear_frames(exiting.__traceback__)
            raise
        finally:
            _RUNNING.discard(pending)  # its threads have ended, its caches are freed

    def _side_by_side(self, pending: "_Pending", stop: Callable[[], bool] | None) -> Iterator[Completion]:
        """Every lane in a thread of its own; their completions, and the first error, through a
        bounded queue. Leaving (done, an error, or the caller abandoning the generator) halts the
        lanes at their next compiled call and waits for them, so nothing runs on after it."""
        # Bounded: a caller that stops taking completions (a generator set aside in a notebook)
        # blocks the lanes once it is full, where they computed on into a queue that only grew.
        results: queue.Queue = queue.Queue(maxsize=2 * self.plan.batch_size)
        halt = threading.Event()
        left = threading.Event()  # the caller's side has returned: nothing more is taken
        # A lane passes the gate, before its first call, only while nothing has halted; the ones
        # that did are joined on leaving, and one that comes later returns there. (A Ctrl-C inside
        # a thread's start can leave it running but not yet marked started: not one to join.)
        gate = threading.Lock()
        entered: list[threading.Thread] = []

        def put(item: Any) -> None:
            while not left.is_set():
                try:
                    results.put(item, timeout=0.1)
                    return
                except queue.Full:
                    pass

        def lane() -> None:
            try:
                with gate:
                    if halt.is_set():
                        return
                    entered.append(threading.current_thread())
                for completion in self._lane(pending, stop, halt):
                    put(completion)
            except BaseException as error:  # handed to the caller's thread, raised there
                halt.set()
                put(_LaneFailed(error))
            finally:
                put(_LANE_DONE)

        threads = [threading.Thread(target=lane, name=f"engine-lane-{i}", daemon=True) for i in range(self._lanes)]
        try:
            for thread in threads:  # a Ctrl-C inside a start still halts the lanes started (finally)
                thread.start()
            running = len(threads)
            while running:
                try:
                    item = results.get(timeout=1.0)  # wakes up for signal handlers (a preemption notice)
                except queue.Empty:
                    continue
                if item is _LANE_DONE:
                    running -= 1
                elif isinstance(item, _LaneFailed):
                    raise item.error
                else:
                    yield item
        finally:
            with gate:
                halt.set()
            left.set()
            for thread in entered:
                thread.join()

    def _lane(self, pending: "_Pending", stop: Callable[[], bool] | None, halt: threading.Event) -> Iterator[Completion]:
        """One lane's loop: its own slots, cache and calls, rows taken from `pending`; returns at
        its next compiled call once `halt` is set or `stop` asks."""
        # Always every slot of the lane, even for a small job: the shapes, hence the programs,
        # stay the same for a resume of a few rows (compiling costs more than idle slots).
        slots = self._lane_slots
        refill_min = max(1, slots // 8)
        stager = staging = None
        if self._staged:
            (cache, state), staging = self._init(slots, self._staged)
            if self._staged != slots:
                # The lane's cache has another shape than the staging cache: prefill calls over it
                # would compile two more programs, so the thread prefills every row from the start
                # (only with engine.overlap_prefill: true; auto stages as many rows as the lane's).
                stager, staging = _Stager(self, pending, *staging), None  # started in the try below
            # Else the lane prefills its first rows itself and then starts the thread (below): a
            # job that fits the lane waits for no thread and no adopt.
        else:
            ((cache, state),) = self._init(slots)
        live: list[_Row | None] = [None] * slots
        """A slot's row, from when it is taken (prefill) until the row finishes."""
        prefilling: collections.deque[_Prompt] = collections.deque()
        kill = np.zeros(slots, bool)

        def decoding_slots() -> list[int]:
            return [s for s in range(slots) if live[s] is not None and live[s].decoding]

        try:
            if stager is not None:
                stager.start()
            # With a prefill thread, the lane does not read the requests itself (the thread does,
            # and the lane decodes on while a read waits).
            while prefilling or any(live) or (pending if stager is None else stager.busy() or pending.maybe_left()):
                if stop is not None and self.layout.any_host(stop()):
                    pending.stopped = True
                    halt.set()
                if halt.is_set():
                    return
                if stager is not None:
                    yield from stager.finished()
                decoding = decoding_slots()
                free = [s for s in range(slots) if live[s] is None]
                if free and stager is not None:
                    # Waits for the staging cache's current call only when enough slots are idle.
                    cache, state = stager.adopt(cache, state, free, live, kill, wait=len(free) >= refill_min or not decoding)
                    decoding = decoding_slots()  # and the rows it moved in
                elif free and (len(free) >= refill_min or not decoding):
                    self._admit(pending, free, live, prefilling, whole=staging is not None)
                if staging is not None:
                    # The lane prefilled its first rows itself (see above); the thread takes the next.
                    stager, staging = _Stager(self, pending, *staging), None
                    stager.start()
                if prefilling:
                    # Prefill first: every taken slot joins the next decode chunk.
                    cache, state, got = self._prefill(cache, state, prefilling)  # read back
                    for s in np.flatnonzero(got.tokens >= 0):
                        row = live[s]
                        row.decoding, kill[s] = True, False
                        completion = self._first_token(row, got, s)
                        if completion is not None:
                            live[s], kill[s] = None, not got.done[s]
                            yield completion
                    continue
                if not decoding:
                    if stager is not None:
                        stager.wait()  # for prefilled rows
                    continue  # else the queue emptied in another lane's hands
                kind, static, fn = self._decode_program()
                with _jax_work():
                    cache, state, got = self._run(
                        kind, fn, static, self.model, cache, state, jax.device_put(kill, self._batch_sharding),
                    )
                    got = _on_host(got)
                self._count(decode_calls=1)
                kill[:] = False
                for s in decoding:
                    row = live[s]
                    row.add(got, s)
                    completion = self._maybe_finish(row, device_done=bool(got.done[s]))
                    if completion is not None:
                        live[s], kill[s] = None, not got.done[s]
                        yield completion
            if stager is not None:
                yield from stager.finished()
        finally:
            if stager is not None:
                stager.close()

    def _first_token(self, row: _Row, got: HostOut, s: int) -> Completion | None:
        """Adds a row's first token, from its prefill call's `got` at slot s; its Completion if
        that finished it."""
        row.add(got, s)
        return self._maybe_finish(row, device_done=bool(got.done[s]))

    def _adopt(self, cache, state, staged_cache, staged_state, to: np.ndarray):
        """One call moving staging slot i's row into the lane's slot to[i] (out of range: none)."""
        kind, static, fn = self._adopt_program()
        with _jax_work():
            cache, state, _ = self._run(kind, fn, static, self.model, cache, state, staged_cache, staged_state,
                                        jax.device_put(to, self._batch_sharding))
        return cache, state

    def _count(self, **amounts: float) -> None:
        """Adds to the run's statistics; lanes add from their own threads."""
        with self._stats_lock:
            for name, amount in amounts.items():
                setattr(self.stats, name, getattr(self.stats, name) + amount)

    def _admit(self, pending: "_Pending", free: list[int], live: list, prefilling: collections.deque, *,
               whole: bool = False) -> None:
        """The next rows take free slots; samples of one prompt taken together share its prefill.
        whole: a prompt starts only if all its samples (up to a prefill's) fit in the slots left,
        else it waits for more free slots instead of being prefilled twice."""
        with pending.lock:
            for i, s in enumerate(free):
                if not pending:
                    break
                job = prefilling[-1] if prefilling else None
                # Rows of one request share its ids array: two requests of one prompt_index (the
                # caller's to avoid) joined one prefill, and the second got the first's prompt.
                joins = (job is not None and job.rows[0].prompt is pending.peek().prompt and job.written == 0
                         and len(job.rows) < self._group)
                if not joins and whole and pending.leading(self._group) > len(free) - i:
                    break
                row = pending.popleft()
                if joins:
                    job.rows.append(row)
                    job.slots.append(s)
                else:
                    prefilling.append(_Prompt(row.prompt_index, row.prompt, [row], [s]))
                    self._count(prompt_tokens=len(row.prompt))
                live[s] = row

    def _prefill(self, cache, state, prefilling: collections.deque):
        """One prefill call of `_prefill_rows` rows of C tokens (`_pieces`), each piece's keys and
        values written into its prompt's cache rows, and the first tokens of the prompts it ends.
        A piece's keys and values are the same bits whichever pieces share its call
        (`compiler_options`), and the CPU kernel's queries whichever piece they came in, so the
        packing changes no token. Waits for the call: returns (cache, state, HostOut on the host);
        with `sampling.prompt_logprobs` the pieces' prompts have their tokens' log-probabilities."""
        R, C = self._prefill_rows, self.engine_config.prefill_chunk_tokens
        packed = self._spec.prefill_in_place
        pieces = self._pieces(prefilling, R, C, packed)
        fresh = not packed and all(start == 0 for _, start, _ in pieces)
        inputs = self._prefill_inputs(cache.slots)  # a slot id out of range: none
        tokens = inputs.tokens.reshape(-1)  # a view: the pieces' tokens in a row
        targets = None if inputs.targets is None else inputs.targets.reshape(-1)
        offset = 0
        for s, (job, start, length) in enumerate(pieces):
            offset = offset if packed else s * C  # packed: end to end; else a row each
            tokens[offset : offset + length] = job.ids[start : start + length]
            if targets is not None:  # each token's next: none after the prompt's last
                after = job.ids[start + 1 : start + length + 1]
                targets[offset : offset + len(after)] = after
            inputs.starts[s], inputs.offsets[s], inputs.lengths[s] = start, offset, length
            offset += length
            job.written = start + length
            inputs.is_last[s] = job.written == len(job.ids)
            inputs.slot_ids[s, : len(job.slots)] = job.slots
            inputs.prompt_index[s] = job.index
            inputs.sample_index[s, : len(job.rows)] = [row.sample_index for row in job.rows]
        for job in [job for job in prefilling if job.written == len(job.ids)]:
            prefilling.remove(job)
        pages = 0 if fresh else pages_covering(int(np.max(inputs.starts + inputs.lengths)), cache.ends)
        self._count(padded_prompt_tokens=R * C, prefill_calls=1, prefill_pages_read=pages)
        kind, static, fn = self._prefill_program(fresh)
        # One transfer call for the inputs.
        with _jax_work():
            cache, state, got = self._run(kind, fn, static, self.model, cache, state,
                                          *jax.device_put(inputs, self._batch_sharding))
            got = _on_host(got)
        if got.prompt_logprobs is not None:
            self._take_prompt_logprobs(pieces, inputs, got.prompt_logprobs)
        return cache, state, got

    @staticmethod
    def _take_prompt_logprobs(pieces: list[tuple["_Prompt", int, int]], inputs: "_PrefillInputs", got: np.ndarray) -> None:
        """Adds each piece's tokens' log-probabilities (`got` [R x C], at the position before each
        token) to its prompt's; a prompt's rows get the whole list once its last piece is in."""
        for s, (job, start, length) in enumerate(pieces):
            if start == 0:
                job.logprobs = [None]  # the first token has no context
            offset = int(inputs.offsets[s])
            # Every position scores the token after it, but a prompt's last position (no target).
            job.logprobs += got[offset : offset + length - int(inputs.is_last[s])].tolist()
            if inputs.is_last[s]:
                for row in job.rows:
                    row.prompt_logprobs = job.logprobs

    @staticmethod
    def _pieces(prefilling: collections.deque, R: int, C: int, packed: bool) -> list[tuple["_Prompt", int, int]]:
        """What the next prefill call takes of the prompts being prefilled: (prompt, start,
        length) pieces, at most R.

        packed (the CPU kernel reads every piece's cache row in place, each query up to itself):
        the prompts in order, each as much of its rest as the call's R x C tokens have room for,
        end to end. A short prompt no longer takes a row of C to itself, nor a prompt's last
        chunk a padded row: cpu-mixed-prefill's 300 prompts had 22 % padding in 76 calls.

        Else a row of at most C tokens a piece: the first chunk of up to R prompts not started
        yet, or else the started ones' next chunks, earliest positions first across the prompts,
        several for one prompt when fewer prompts than rows are left (a chunk attends to what the
        rows before it in the same call wrote: each layer writes every row's keys/values before
        it attends). A call of later chunks reads the first cache pages covering its rows, so
        taking one prompt's chunks to its end first made more calls read the whole cache
        (cpu-mixed: 138 pages a run instead of 100). First and later chunks never share a call:
        a call of first chunks attends to the chunk alone (prefill_fresh, no cache read: about a
        quarter of a cpu-mixed prefill's work was attention over the mostly empty cache row)."""
        if packed:
            pieces, room = [], R * C
            for job in itertools.islice(prefilling, R):
                if room == 0:
                    break
                length = min(len(job.ids) - job.written, room)
                pieces.append((job, job.written, length))
                room -= length
            return pieces
        first = [(job, 0, min(C, len(job.ids))) for job in itertools.islice((j for j in prefilling if j.written == 0), R)]
        if first:
            return first
        nexts = sorted((start, i) for i, job in enumerate(prefilling) for start in range(job.written, len(job.ids), C))
        return [(prefilling[i], start, min(C, len(prefilling[i].ids) - start)) for start, i in nexts[:R]]

    # ------------------------------------------------------------------------- finishing

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _maybe_finish(self, row: _Row, *, device_done: bool) -> Completion | None:
        """The row's Completion if it has finished (device stop rule or a stop string), else None."""
        tokens = row.tokens
        body, reason = tokens, None
        if device_done:
            if tokens[-1] in self.eos_token_ids:
                body, reason = tokens[:-1], "eos"
            elif tokens[-1] in self.sampling.stop_token_ids:
                body, reason = tokens[:-1], "stop"
            else:
                reason = "length"
        cut = self._find_stop_string(body, whole=device_done)
        if cut is not None:
            body, text, reason = cut[0], cut[1], "stop"
        elif reason is None:
            return None
        else:
            text = self._decode(body)
        self._count(generated_tokens=len(tokens))
        kept = len(body)
        logprobs = row.logprobs[:kept] if self.sampling.logprobs else None
        top = ((np.concatenate(row.top_ids)[:kept].tolist(), np.concatenate(row.top_logprobs)[:kept].tolist())
               if self.sampling.top_logprobs else (None, None))
        return Completion(row.prompt_index, row.sample_index, list(body), text, reason, logprobs, row.prompt_logprobs, *top)

    def _find_stop_string(self, tokens: list[int], *, whole: bool) -> tuple[list[int], str] | None:
        """(tokens fully before the stop string, text cut before it), or None.

        The row stops at its first token whose text holds a whole stop string, as if checked after
        every token (vLLM, transformers): of stop strings that overlap, the one completed first
        wins, and among those that token completes the cut is before the earliest. A character
        whose bytes are not all there yet decodes as U+FFFD: until the row is done (`whole`), a
        text's trailing U+FFFDs are held back, as vLLM's detokenizer holds them, so they match a
        stop string only once a later token shows them to stay. It is checked once per decode
        chunk, and the cut does not depend on the chunk's size (engine.* settings change no row):
        it did where the chunk's text ended in a character's first byte, and with overlapping
        stop strings ("ExSumive" over "Sum" cut before "Ex" at 16 steps a chunk, after it at 1).
        That holds where a prefix's text is a prefix of the longer text's, as byte-level BPE
        decodes (GPT-2, Llama 3, Qwen); a byte-fallback tokenizer (SentencePiece: Llama 2,
        Mistral, Gemma) decodes a character followed by a stray byte of the same run as U+FFFDs
        only, so a stop string in such text can still be found at one chunk size and not another."""
        stops = self.sampling.stop
        if not stops or not tokens:
            return None
        if not whole:
            # Cheap look at the tail first: a stop string ending in the newest chunk (or held back at
            # the last one's end) lies within it, a token holding at least one of its bytes.
            longest = max(len(stop.encode("utf-8")) for stop in stops)
            tail = tokens[-(self.engine_config.decode_chunk_steps + 2 * longest + 8):]
            tail_text = self._decode(tail)
            if not any(stop in tail_text for stop in stops):
                return None

        def seen(k: int) -> str:
            """The text of the first k tokens as a check after token k sees it."""
            text = self._decode(tokens[:k])
            return text if whole and k == len(tokens) else text.rstrip("\ufffd")

        def found(text: str) -> dict[str, int]:
            """Where each stop string the text holds first begins."""
            return {stop: i for stop in stops if (i := text.find(stop)) >= 0}

        text = seen(len(tokens))
        starts = found(text)
        if not starts:
            return None
        ends = [i + len(stop) for stop, i in starts.items()]
        # The first token whose text reaches the earliest end (decoded length grows with the tokens).
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(seen(mid)) >= min(ends):
                hi = mid
            else:
                lo = mid + 1
        then = seen(lo)
        hits = found(then).values()
        if hits and text.startswith(then[:min(hits)]):
            cut = min(hits)
        else:  # a prefix's text that is no prefix of the whole's (bytes of one character apart)
            cut = min(starts.values())
        # The most tokens whose text lies wholly before the cut, from the token that completed the
        # stop string down: a few tokens. A binary search here assumed the text grows with the
        # tokens, which byte-fallback tokenizers break (a character cut part-way decodes as one
        # U+FFFD per byte): it dropped tokens whose text `completion` kept, differently per schedule.
        keep = lo
        while keep > 0 and not (len(piece := self._decode(tokens[:keep])) <= cut and text.startswith(piece)):
            keep -= 1
        return tokens[:keep], text[:cut]

