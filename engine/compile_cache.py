"""JAX's persistent compilation cache, on by default: a rerun or a resume of the same model and shapes loads its programs from disk instead of compiling them.

Owns: where the cache lives (`$PIPELINE_CACHE_DIR/jax-compile`, default
`~/.cache/jax-batch-pipeline/jax-compile`), turning JAX's own cache on there, and counting
programs JAX loaded from it (JAX's `/jax/compilation_cache/cache_hits` monitoring event). It
writes no entries itself: JAX does, for every program (`jax_persistent_cache_min_compile_time_secs
= 0`; a tiny 3-layer model's programs compile in ~1 s each, all worth keeping).

    compile_cache.enable()            # Engine.load calls this; a no-op if the dir is already set
    compile_cache.enable("/tmp/cc")   # somewhere else
    compile_cache.hits()              # programs this thread loaded from the cache so far

Sharing: several local processes (the hosts of `pipeline launch`) may use one folder. jax 0.10.2
writes an entry with a plain `write_bytes` unless eviction is on, when reads and writes take a
file lock in the folder; we set a size bound (`jax_compilation_cache_max_size`, 8 GiB) to get
that lock, so no process reads an entry half written. A corrupt or unreadable entry makes JAX
warn and compile instead (`jax_raise_persistent_cache_errors` is off by default).
Turn the cache off with JAX's own switch: `JAX_ENABLE_COMPILATION_CACHE=false`.

Every host writes: JAX writes entries from process 0 only (against contention on a shared
bucket), and a program's key holds its devices, so on a pod the other hosts' programs (their own
devices, `host_dp`) were never written by anyone, and every resume compiled them again on every
host but the first (seen on a 2- and 3-host `pipeline launch`). `enable` lets every process write
its entries where the folder is local (each host's disk, or one machine's processes under the
file lock above); a folder on remote storage keeps JAX's rule. The one reach into JAX's
private compiler (`_cache_write`), checked against its signature: another JAX keeps its own rule.
"""

from __future__ import annotations

import os
import threading
import warnings

import jax

DEFAULT_ROOT = "~/.cache/jax-batch-pipeline"
SUBFOLDER = "jax-compile"
MAX_SIZE_BYTES = 8 << 30
"""Bound on the folder (least recently used entries go first); also what turns JAX's file lock on."""

_lock = threading.Lock()
_hits = threading.local()
"""Per thread: JAX reports a hit in the thread that compiles, and the engine compiles its decode
program in a thread of its own while the main one compiles the others."""
_listening = False


def default_path() -> str:
    """`$PIPELINE_CACHE_DIR/jax-compile`, or under ~/.cache/jax-batch-pipeline."""
    root = os.environ.get("PIPELINE_CACHE_DIR") or DEFAULT_ROOT
    return os.path.join(os.path.expanduser(root), SUBFOLDER)


def enable(path: str | None = None) -> str | None:
    """Turns the persistent compilation cache on in `path` (default: `default_path()`) and
    returns the folder in use. Without a path, a folder the user already gave JAX
    (`JAX_COMPILATION_CACHE_DIR` or `jax.config`) is kept. Returns None when the cache is off
    (`JAX_ENABLE_COMPILATION_CACHE=false`)."""
    _listen()
    _write_on_every_host()
    if not jax.config.jax_enable_compilation_cache:
        return None
    current = jax.config.jax_compilation_cache_dir
    if path is None and current:
        return current
    path = os.path.abspath(os.path.expanduser(path or default_path()))
    if current != path:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        if jax.config.jax_compilation_cache_max_size == -1:
            jax.config.update("jax_compilation_cache_max_size", MAX_SIZE_BYTES)
        # JAX opens its cache once per process, at the first compile after a folder is set; a
        # new folder needs that state reset (no public API in jax 0.10.2).
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    return path


_WRITE_PARAMETERS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks")


def _write_on_every_host() -> None:
    """Wrap JAX's cache write so a process other than 0 writes its own entries to a local folder."""
    import inspect

    from jax._src import compilation_cache, compiler, distributed

    original = compiler._cache_write
    if getattr(original, "writes_on_every_host", False):
        return
    if (tuple(inspect.signature(original).parameters) != _WRITE_PARAMETERS
            or not hasattr(compiler, "_should_raise_persistent_cache_error")):
        return  # another JAX: its own rule stands (process 0 writes)

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        folder = jax.config.jax_compilation_cache_dir or ""
        if (distributed.global_state.process_id == 0 or "://" in folder or host_callbacks
                or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs):
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as err:  # noqa: BLE001 - as JAX's own write: a warning, unless JAX is told to raise
            if compiler._should_raise_persistent_cache_error(err):
                raise
            warnings.warn(f"the compile cache could not keep {module_name} ({type(err).__name__}: {err}); "
                          f"it compiles again next time")

    write.writes_on_every_host = True
    compiler._cache_write = write


def hits() -> int:
    """Programs this thread loaded from the persistent cache (instead of compiling them) so far."""
    return getattr(_hits, "count", 0)


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.count = hits() + 1


def _listen() -> None:
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
