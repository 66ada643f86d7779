"""Issue 13: a run compiles a small fixed set of programs whatever its prompt lengths, and a
second engine with the same model and shapes loads them all from JAX's persistent compilation
cache instead of compiling (before: one program per prompt bucket and decode window, 24 for 240
mixed prompts, all compiled again on every rerun or resume)."""

from __future__ import annotations

import gc
import threading

import jax
import numpy as np
import pytest

import engine.engine as engine_module
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, compile_cache
from engine.llama import by_pages, cache_pages, pages_covering
from engine_testlib import VOCAB, hf_greedy


def _requests(lengths):
    rng = np.random.RandomState(5)
    return [GenerationRequest(i, rng.randint(0, VOCAB, n).tolist(), [0]) for i, n in enumerate(lengths)]


def _load(path, overlap_prefill, attention="auto", on_compile=None, **engine):
    return Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=5),
                       engine=EngineConfig(batch_size=4, prefill_chunk_tokens=8, prefill_tokens=16, overlap_prefill=overlap_prefill,
                                           decode_attention=attention, **engine),
                       max_prompt_tokens=40, on_compile=on_compile)


def test_every_prompt_length_runs_on_the_same_few_programs(llama, tmp_path, monkeypatch):
    """Prompts of every length from 1 to max_prompt_tokens (several prefill chunks for most),
    then a second generate with other lengths: five programs (init, decode, prefill of first
    chunks, of later chunks, and the move of prefilled rows from the staging cache into the
    lane's: this 2-core CPU prefills beside decoding), four with the CPU kernel (first and later
    chunks in one program), obtained once."""
    path, hf = llama
    previous = jax.config.jax_compilation_cache_dir
    try:
        compile_cache.enable(str(tmp_path / "jax-compile"))
        engine_module._COMPILED.clear()
        collector = []  # gc.isenabled() as each program is traced
        order = []  # the functions traced, in the order their tracing began
        jit = engine_module.Engine._jit

        def traced(self, fn):
            def recording(*args, **kwargs):
                collector.append(gc.isenabled())
                order.append(fn.func.__name__)
                return fn(*args, **kwargs)
            return jit(self, recording)

        monkeypatch.setattr(engine_module.Engine, "_jit", traced)
        threads = {}
        engine = _load(path, overlap_prefill=True, on_compile=lambda kind: threads.setdefault(kind, threading.current_thread().name))
        first = {c.prompt_index: c.token_ids for c in engine.generate(_requests(range(1, 41)))}
        assert sorted(first) == list(range(40)) and all(len(t) == 5 for t in first.values())
        for i in (7, 8, 22, 39):  # one chunk, exactly one, three, five
            assert first[i] == hf_greedy(hf, _requests(range(1, 41))[i].input_ids, 5), i
        # With the CPU kernel (auto here) first chunks run the later chunks' program.
        kinds = ["adopt", "decode", "init", "prefill"] + ([] if engine.attention == "cpu" else ["prefill_fresh"])
        assert engine.max_programs == len(kinds) and sorted(engine.stats.programs) == kinds
        assert engine.stats.compilations == len(kinds) and engine.stats.cache_loads == 0, engine.stats.programs
        # Traced with Python's collector paused (the init program is jitted apart), and on again after.
        assert collector and not any(collector) and gc.isenabled()
        if engine.attention == "cpu":  # one page, read by every call (first chunks' too: their own positions)
            assert engine.stats.prefill_pages_read == engine.stats.prefill_calls > 0, engine.stats
        # Every program was got ahead of its calls, from Engine.load on: the decode program in a
        # thread of its own, beside the others (the calls, in the lane and the prefill thread, got none).
        assert threads.pop("decode").startswith("compile-decode"), threads
        assert sorted(threads) == [k for k in kinds if k != "decode"], threads
        assert all(name.startswith("compile-programs") for name in threads.values()), threads
        # ... the decode program traced only once a prefill program was: the first call waits for that one.
        assert order.index("prefill_chunk") < order.index("decode_chunk"), order
        # generate waited for its programs, but not for longer than they took (the decode compile overlaps).
        waited = engine.stats.compile_wait_s
        assert 0 < waited <= engine.stats.compile_time_s, (waited, engine.stats.programs)
        list(engine.generate(_requests([3, 40, 17])))
        assert engine.stats.compilations == len(kinds), engine.stats.programs
        assert engine.stats.compile_wait_s - waited < 0.05  # nothing left to wait for

        # A new process would find the same programs on disk: forget them in memory, load again.
        engine_module._COMPILED.clear()
        jax.clear_caches()
        again = _load(path, overlap_prefill=True)
        second = {c.prompt_index: c.token_ids for c in again.generate(_requests(range(1, 41)))}
        assert second == first
        assert again.stats.compilations == 0 and again.stats.cache_loads == len(kinds), again.stats.programs
        assert any((tmp_path / "jax-compile").iterdir())
    finally:
        compile_cache.enable(previous)


@pytest.mark.parametrize("overlap_prefill", [False, True])
def test_programs_got_while_the_weights_load_run_the_same_rows(llama, monkeypatch, overlap_prefill):
    """engine.compile_during_load: Engine.load starts getting every program from the model's
    shapes alone, before it reads the weights (here the read waits until the decode program's
    getting has begun: without the option it would wait in vain), and generate runs them: the
    same rows as an engine that got its programs from generate, no program got twice, none by
    generate's own threads."""
    path, _ = llama
    prompts = _requests([3, 9, 17, 30, 40, 1])
    expected = {c.prompt_index: c.token_ids for c in _load(path, overlap_prefill).generate(prompts)}

    engine_module._COMPILED.clear()
    decode_asked, threads = threading.Event(), {}
    read = engine_module.load_checkpoint

    def read_after_decode_began(*args, **kwargs):
        assert decode_asked.wait(60), "no program was being got before the weights were read"
        return read(*args, **kwargs)

    def asked(kind):
        threads[kind] = threading.current_thread().name
        if kind == "decode":
            decode_asked.set()

    monkeypatch.setattr(engine_module, "load_checkpoint", read_after_decode_began)
    engine = _load(path, overlap_prefill, on_compile=asked, compile_during_load=True)
    assert {c.prompt_index: c.token_ids for c in engine.generate(prompts)} == expected
    got = {kind: p["compiled"] + p["loaded"] for kind, p in engine.stats.programs.items()}
    assert sorted(got) == sorted(threads) and set(got.values()) == {1}, engine.stats.programs
    assert len(got) == engine.max_programs == engine.stats.programs_used, engine.stats.programs
    assert all(name.startswith("compile-") for name in threads.values()), threads


@pytest.mark.parametrize("where", ["local", "gs"])
def test_auto_gets_programs_during_load_only_from_remote_storage(llama, request, monkeypatch, where):
    """engine.compile_during_load: auto on this CPU: the getting starts in Engine.load for a
    checkpoint in remote storage (the GCS emulator through gcsfs: the read waits for the first
    program's getting to begin), at the first generate for a local folder (none has begun when
    the read starts)."""
    import os

    import fsspec

    path, _ = llama
    if where == "gs":
        path, local = f"{request.getfixturevalue('gcs_bucket')}/llama", path
        for name in os.listdir(local):
            fsspec.filesystem("gs").put(f"{local}/{name}", f"{path}/{name}")
    engine_module._COMPILED.clear()
    asked, at_read = threading.Event(), []
    read = engine_module.load_checkpoint

    def read_weights(*args, **kwargs):
        if where == "gs":
            assert asked.wait(60), "no program was being got while the weights were read"
        at_read.append(asked.is_set())
        return read(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_checkpoint", read_weights)
    engine = _load(path, overlap_prefill=False, on_compile=lambda kind: asked.set())
    assert at_read == [where == "gs"]
    assert len(list(engine.generate(_requests([4, 12])))) == 2 and asked.is_set()


def _join_compile_threads():
    """Waits for the threads getting programs ahead of their calls to end; fails if one does not."""
    for thread in threading.enumerate():
        if thread.name.startswith("compile-"):
            thread.join(120)
            assert not thread.is_alive(), f"{thread.name} is still running"


@pytest.mark.parametrize("failing", ["prefill", "init"])
def test_a_program_that_fails_leaves_no_thread_waiting(llama, monkeypatch, failing):
    """The decode program's early getting waits for a prefill program to be lowered. When getting
    that one, or the init program before it, fails in Engine.load's thread, the decode thread goes
    on and ends (a thread left waiting would keep the process from exiting), and generate, asking
    for the program again, raises its error."""
    path, _ = llama
    engine_module._COMPILED.clear()  # so the engine gets its programs, and calls on_compile
    decode_asked = threading.Event()
    refused = []
    program = engine_module.Engine._program

    def decode_waits(self, kind, *args, after=None, **kwargs):
        if after is not None:
            decode_asked.set()  # the early decode thread waits for a prefill program from here on
        return program(self, kind, *args, after=after, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "_program", decode_waits)

    def refuse(kind):  # called as each program's getting begins, in its thread
        if kind.startswith(failing):
            decode_asked.wait(60)
            refused.append(threading.current_thread().name)
            raise RuntimeError(f"no {failing} program today")

    engine = _load(path, overlap_prefill=False, on_compile=refuse)
    with pytest.raises(RuntimeError, match=f"no {failing} program today"):
        list(engine.generate(_requests([5, 9])))
    _join_compile_threads()
    decode = engine.stats.programs["decode"]
    assert decode_asked.is_set() and decode["compiled"] + decode["loaded"] == 1, engine.stats.programs
    # Refused in the early thread, then again in generate's lane.
    assert len(refused) == 2 and refused[0].startswith("compile-programs") and refused[1] == "MainThread", refused


@pytest.mark.parametrize("abandoned", ["closed", "unreadable weights"])
def test_an_abandoned_run_compiles_no_program_it_had_not_started(llama, monkeypatch, abandoned):
    """A run abandoned while its programs are got ahead of their calls (engine.compile_during_load):
    closed by its caller (the generate step, on an error or a stop signal), or failing to read its
    weights in Engine.load. The thread compiling the init program finishes it and begins no other,
    and the decode thread, waiting for a prefill program, gives up: the interpreter, which waits
    for those threads, exits after one program instead of all (on an accelerator with an 8B model,
    minutes of compiling). A generate after close gets its programs itself."""
    path, _ = llama
    engine_module._COMPILED.clear()  # so that the engine gets its programs, and calls on_compile
    compiling, go, asked = threading.Event(), threading.Event(), []
    options = engine_module.compiler_options

    def hold_the_first_compile():  # XLA's compile of the first program (init) waits for `go`
        if not compiling.is_set():
            compiling.set()
            assert go.wait(60)
        return options()

    monkeypatch.setattr(engine_module, "compiler_options", hold_the_first_compile)
    if abandoned == "unreadable weights":
        def unreadable(*args, **kwargs):
            assert compiling.wait(60)
            raise OSError("the weights are unreadable")

        monkeypatch.setattr(engine_module, "load_checkpoint", unreadable)
        with pytest.raises(OSError, match="unreadable"):
            _load(path, overlap_prefill=False, on_compile=asked.append, compile_during_load=True)
    else:
        engine = _load(path, overlap_prefill=False, on_compile=asked.append, compile_during_load=True)
        assert compiling.wait(60)
        engine.close()
    go.set()
    _join_compile_threads()
    # Announced: the one program compiled, not decode, which gave up waiting (it was announced and
    # never compiled, then announced again by generate's own call).
    assert asked == ["init"], asked
    assert [key[0] for key in engine_module._COMPILED] == ["init"]
    if abandoned == "closed":
        rows = {c.prompt_index: c.token_ids for c in engine.generate(_requests([4, 13]))}
        assert sorted(rows) == [0, 1] and all(len(t) == 5 for t in rows.values())
        assert sorted(key[0] for key in engine_module._COMPILED) == ["decode", "init", "prefill"]
        assert sorted(asked) == ["decode", "init", "prefill"], asked  # each once


def test_the_collector_is_paused_until_the_last_thread_lowering_leaves():
    """Engine._program lowers inside `_collector_paused`; the decode program's early compile
    lowers in a thread beside prefill's, so the collector comes back only when both are done,
    and stays off if it was off before."""
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def lower_in_a_thread():
        with engine_module._collector_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=lower_in_a_thread)
    thread.start()
    inside.wait(10)
    with engine_module._collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the thread is still lowering
    leave.set()
    thread.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with engine_module._collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_entry_left_by_a_keyboard_interrupt_does_not_keep_the_collector_off():
    """A KeyboardInterrupt between `_collector_paused`'s entry and its `try` leaves the thread
    counted as lowering: the collector stayed off for the rest of the process. The thread's next
    lowering takes the entry out again."""
    assert gc.isenabled()
    left = engine_module._collector_paused()
    left.__enter__()  # and no exit: what the interrupt leaves
    try:
        with engine_module._collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        with engine_module._paused_lock:
            engine_module._lowering.clear()
        gc.enable()


def test_a_call_reads_the_fewest_pages_that_hold_its_rows():
    """The cache is split in quarters (multiples of 16 positions), and a call whose rows hold
    `reach` positions runs the branch of the fewest pages covering them."""
    assert cache_pages(45) == (16, 32, 45)
    assert cache_pages(192) == (48, 96, 144, 192)
    assert cache_pages(2176) == (544, 1088, 1632, 2176)
    assert cache_pages(10) == (10,)
    assert cache_pages(2176, 128) == (640, 1280, 1920, 2176)  # the same cache, bigger blocks for a kernel

    def pages_read(reach):
        return int(by_pages(jax.numpy.int32(reach), (16, 32, 45), lambda k: jax.numpy.int32(k)))

    assert [pages_read(r) for r in (0, 1, 16, 17, 32, 33, 45)] == [1, 1, 1, 2, 2, 3, 3]
    # The host's twin of the rule (the benchmarks' byte counts) picks the same pages.
    assert [pages_covering(r, (16, 32, 45)) for r in (0, 1, 16, 17, 32, 33, 45)] == [1, 1, 1, 2, 2, 3, 3]


def test_later_prefill_chunks_go_earliest_first_and_read_the_fewest_pages(llama):
    """Two 40-token prompts, chunks of 8, two rows a call, pages ending at 16, 32 and 45: after
    the call of first chunks, each call takes both prompts' next chunk (reaching 16, 24, 32, 40
    positions: 1, 2, 2 and 3 pages, counted on the host by the rule `by_pages` applies on the
    device, above), not one prompt's next two (24 and 40 positions, each twice: 10 pages); the
    tokens are transformers'. Prompts are prefilled between decode calls here (no staging cache):
    beside them, which prompts share a call depends on timing. The engine's XLA attention: the
    CPU kernel's cache is one page, each row read to its own length."""
    path, hf = llama
    engine = _load(path, overlap_prefill=False, attention="xla")
    requests = _requests([40, 40])
    out = {c.prompt_index: c.token_ids for c in engine.generate(requests)}
    assert engine.stats.prefill_calls == 5 and engine.stats.prefill_pages_read == 8, engine.stats
    for r in requests:
        assert out[r.prompt_index] == hf_greedy(hf, r.input_ids, 5), r.prompt_index


def test_a_cpu_prefill_call_packs_its_prompts_end_to_end(llama):
    """With the CPU kernel a prefill call's 4 rows of 8 tokens hold pieces of up to 4 prompts end
    to end, one running on across rows: prompts of 3, 5, 21 and 3 tokens take one call, no token
    padded, where the XLA way (a row a chunk, first and later chunks apart) takes two calls of 32.
    Both give transformers' tokens."""
    path, hf = llama
    requests = _requests([3, 5, 21, 3])
    runs = {}
    for attention in ("cpu", "xla"):
        engine = Engine.load(path, dtype="float32", sampling=SamplingParams(max_new_tokens=5), max_prompt_tokens=40,
                             engine=EngineConfig(batch_size=4, prefill_chunk_tokens=8, prefill_tokens=32,
                                                 overlap_prefill=False, decode_attention=attention))
        assert engine.attention == attention
        runs[attention] = {c.prompt_index: c.token_ids for c in engine.generate(requests)}, engine.stats
    (packed, stats), (rows, xla_stats) = runs["cpu"], runs["xla"]
    assert (stats.prefill_calls, stats.padded_prompt_tokens, stats.prompt_tokens) == (1, 32, 32), stats
    assert (xla_stats.prefill_calls, xla_stats.padded_prompt_tokens) == (2, 64), xla_stats
    for r in requests:
        assert packed[r.prompt_index] == rows[r.prompt_index] == hf_greedy(hf, r.input_ids, 5), r.prompt_index


def test_bfloat16_programs_neither_copy_nor_convert_a_weight(tmp_path):
    """Given bfloat16 weights, XLA's CPU backend copied every (out, in) projection to (in, out)
    and turned the whole embedding table to float32 at the start of each call, hoisted out of the
    decode loop: on the 125M model 266 ms of each 1.2 s decode call. No compiled program of a
    bfloat16 engine holds a copy or a conversion shaped like one of its weights, but for the
    table's uint16 view (`llama.embed`: the same bits, a plain copy)."""
    import re

    from transformers import LlamaConfig, LlamaForCausalLM

    # Sizes no activation of this run shares: a match can only be a weight.
    config = LlamaConfig(vocab_size=136, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = tmp_path / "ckpt"
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    engine_module._COMPILED.clear()  # only this engine's programs below
    engine = Engine.load(str(path), dtype="bfloat16", sampling=SamplingParams(max_new_tokens=4),
                         engine=EngineConfig(batch_size=4, prefill_chunk_tokens=8, prefill_tokens=16, overlap_prefill=True),
                         max_prompt_tokens=40)
    completions = list(engine.generate(_requests([3, 20, 30])))
    assert len(completions) == 3 and engine.stats.programs_used == engine.max_programs, engine.stats.programs

    weights = {tuple(leaf.shape) for leaf in jax.tree.leaves(engine.model) if leaf.ndim == 2}
    assert {(136, 48), (48, 48), (24, 48), (80, 48), (48, 80)} <= weights
    shaped = re.compile(r"%(\S+) = \w+\[(\d+),(\d+)\]\{[\d,]*\} (\w+)\(")
    for key, compiled in engine_module._COMPILED.items():
        offending = [line.strip()[:120] for line in compiled.as_text().splitlines()
                     if (m := shaped.search(line)) and {(int(m[2]), int(m[3])), (int(m[3]), int(m[2]))} & weights
                     and any(op in m[1] or op == m[4] for op in ("copy", "convert")) and "bitcast-convert" not in line]
        assert not offending, (key[0], offending[:4])
        # Greedy: no program hashes a row's key (sampler.draws), kept in the decode state or not.
        assert "threefry" not in compiled.as_text(), key[0]


def test_float32_programs_ask_for_full_precision_and_leave_jaxs_setting_alone(llama):
    """float32 means float32 on a GPU too, whose default runs float32 products as TF32 (logits
    off by ~3e-2): every product in a float32 engine's programs asks for the highest precision,
    traced in the caller's thread or in those that get programs ahead, while JAX's process-wide
    default stays as the caller has it, for the caller's own JAX code (until 2026-12-02
    Engine.load set it for the whole process)."""
    import re

    tests_setting = jax.config.jax_default_matmul_precision  # "highest" (tests/engine/conftest.py)
    jax.config.update("jax_default_matmul_precision", None)  # a caller that set nothing
    try:
        engine_module._COMPILED.clear()  # only this engine's programs below
        engine = _load(llama[0], overlap_prefill=True)
        assert len(list(engine.generate(_requests([3, 20, 30])))) == 3
        assert jax.config.jax_default_matmul_precision is None
    finally:
        jax.config.update("jax_default_matmul_precision", tests_setting)
    precisions = {}
    for (kind, *_), compiled in engine_module._COMPILED.items():
        precisions.setdefault(kind, set()).update(re.findall(r"operand_precision=\{([^}]*)\}", compiled.as_text()))
    assert precisions["prefill"] == precisions["decode"] == {"highest,highest"}, precisions


def test_compile_during_load_is_checked():
    from engine.config import InvalidConfig

    with pytest.raises(InvalidConfig, match="engine.compile_during_load must be true, false or auto, got 'yes'"):
        EngineConfig(compile_during_load="yes")
