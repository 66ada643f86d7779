"""Every byte the pipeline reads or writes goes through here, by fsspec URL.

Owns: turning (root, step, hash) into an output URL (`step_url`, the only place that does),
atomic writes (a reader sees a whole file or none), checksums and listing. Refuses to build
paths from user data: names passed to `join` must be our own file names.

Atomicity per filesystem:
- local: write `.name.tmp-<pid>-<rand>` in the same folder, fsync, `os.replace`.
- gs://: one `pipe` upload of the whole object; GCS makes an object visible whole or not at
  all (an exception inside `fs.open(..., "wb")` would commit a partial object, so we never
  stream writes to GCS).
- memory://: `pipe` stores the bytes in one assignment.

Transient faults (connection refused, timeouts, HTTP 5xx) are retried with backoff and
final failures become one `StorageError` naming the URL (see retrying.py).

    out = step_url("gs://b/runs/demo", "tokenize", "0123456789abcdef")
    write_bytes(join(out, "shard-00000.parquet"), data)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import shutil
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import StepFailed
from pipeline.storage.retrying import is_transient, storage_call

HASH_CHARS = 12
"""Hex characters of a step hash used in its folder name."""


def normalize(url: str) -> str:
    """A URL fsspec understands; plain paths and `file://` URLs become absolute local paths (so
    a local root is one kind of name everywhere: leases, markers, printed results)."""
    if url.startswith("file://"):
        url = url[len("file://"):] or "/"
    if "://" in url:
        return url.rstrip("/") if not url.endswith("://") else url
    return os.path.abspath(os.path.expanduser(url))


def join(base: str, *names: str) -> str:
    """`base/name/...` for our own file names (never for user data)."""
    url = normalize(base)
    for name in names:
        url = url.rstrip("/") + "/" + name.strip("/")
    return url


def step_url(root: str, step: str, step_hash: str) -> str:
    """Where a step's output lives: `{root}/{step}-{hash12}`."""
    return join(root, f"{step}-{step_hash[:HASH_CHARS]}")


def lease_url(root: str, step: str, step_hash: str) -> str:
    """Where the lease on a step's output lives: `{root}/.leases/{step}-{hash12}.json`."""
    return join(root, ".leases", f"{step}-{step_hash[:HASH_CHARS]}.json")


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for a URL and the path inside it."""
    return fsspec.core.url_to_fs(normalize(url))


def is_local(url: str) -> bool:
    return isinstance(filesystem(url)[0], LocalFileSystem)


def _looked_at_afresh(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """`filesystem(url)`, its listings of `url` and of the folders above it dropped first. gcsfs
    keeps every listing it made for the life of the process and answers `exists`, `isdir`, `ls`
    and `info` from them, so another process's write or delete (another host, another runner
    that finished the step this one waited for) would stay unseen: every question of whether a
    file is there is asked of the storage itself. A file's size and checksum after such a look
    still come from the fresh listing."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    return fs, path


@storage_call("check")
def exists(url: str) -> bool:
    fs, path = _looked_at_afresh(url)
    return fs.exists(path)


@storage_call("check")
def is_dir(url: str) -> bool:
    fs, path = _looked_at_afresh(url)
    return fs.isdir(path)


@storage_call("stat")
def size(url: str) -> int:
    fs, path = filesystem(url)
    return fs.size(path)


@storage_call("read")
def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    return fs.cat_file(path)


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url))


@storage_call("write")
def write_bytes(url: str, data: bytes) -> None:
    """Write a whole file atomically: readers see the old file, the new one, or nothing."""
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        with _local_temp_for(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    else:
        fs.pipe_file(path, data)


@contextlib.contextmanager
def _local_temp_for(path: str) -> Iterator[str]:
    """A temp name beside `path`; renamed onto `path` if the block succeeds, removed if not."""
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def remove_temp_files(url: str) -> list[str]:
    """Delete the temp files a killed writer left under a local folder; returns their paths.

    Only `_local_temp_for` names (`.name.tmp-<pid>-<rand>`) are touched; on object stores
    there are none (one-shot uploads). Call only while holding the folder's lease.
    """
    fs, path = filesystem(url)
    if not isinstance(fs, LocalFileSystem) or not os.path.isdir(path):
        return []
    stale = [os.path.join(folder, name) for folder, _, names in os.walk(path)
             for name in names if name.startswith(".") and ".tmp-" in name]
    for name in stale:
        os.remove(name)
    return stale


def write_json(url: str, value: Any) -> None:
    write_bytes(url, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode())


@storage_call("upload", url_arg=1)
def put_file(local_path: str, url: str) -> None:
    """Move a finished local file to `url` atomically, like `write_bytes`; `local_path` is consumed.

    For files too big to hold in memory (tokenize streams its shards to local files first):
    local targets get a same-folder temp name then `os.replace`; gs:// gets one upload.
    """
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        with _local_temp_for(path) as tmp:
            shutil.move(local_path, tmp)  # a rename on the same filesystem, else a copy
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
    else:
        fs.put_file(local_path, path)
        os.remove(local_path)


def parquet_bytes(table: pa.Table) -> bytes:
    """Serialize a table to Parquet in memory (zstd), ready for an atomic `write_bytes`."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def write_parquet(url: str, table: pa.Table) -> dict[str, Any]:
    """Write a Parquet file atomically; return its manifest entry."""
    data = parquet_bytes(table)
    write_bytes(url, data)
    return {"path": url.rsplit("/", 1)[-1], "rows": table.num_rows, "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


@storage_call("read")
def read_parquet(url: str, columns: list[str] | None = None) -> pa.Table:
    fs, path = filesystem(url)
    return pq.read_table(path, filesystem=fs, columns=columns)


@storage_call("read")
def read_parquet_with_footer(url: str, columns: list[str]) -> tuple[pa.Table, pq.FileMetaData]:
    """A Parquet file's `columns` and its footer (row groups, column statistics), from one open:
    the footer is read once, for both."""
    fs, path = filesystem(url)
    with fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        table = parquet.read(columns=columns, use_threads=False)
    if missing := [c for c in columns if c not in table.column_names]:  # ParquetFile.read leaves them out
        raise pa.ArrowInvalid(f"it has no column {', '.join(map(repr, missing))}")
    return table, parquet.metadata


@contextlib.contextmanager
def unreadable(what: str, url: str, fix: str) -> Iterator[None]:
    """A Parquet file of ours that does not parse (cut short, overwritten, not Parquet at all) or
    is gone as one StepFailed naming it, `what` it is and `fix`: the command that makes it again.
    Written atomically, such a file was damaged after its step, so retrying the read cannot help.
    (pyarrow raises ArrowInvalid for a bad footer and a bare OSError for a bad page or header;
    a disk full or permission denied is already a StorageError of its own.)

        with storage.unreadable("generate part", url, PART_FIX):
            table = storage.read_parquet(url)
    """
    try:
        yield
    except (pa.ArrowException, OSError) as err:
        if is_transient(err):  # a connection reset while reading says nothing about the file
            raise
        reason = re.sub(r"^Could not open Parquet input source '[^']*': ", "", str(err))  # the path once is enough
        raise StepFailed(f"{what} {url} cannot be read ({reason}): {fix}") from err


@storage_call("list")
def list_files(url: str, suffix: str = "") -> list[str]:
    """URLs of the files directly under a folder (sorted), as the storage holds them now; hidden
    and temp files excluded."""
    fs, path = _looked_at_afresh(url)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    names = sorted(
        e["name"] for e in entries
        if e.get("type") == "file" and e["name"].endswith(suffix)
        and not e["name"].rsplit("/", 1)[-1].startswith(".")
    )
    return [_url_of(url, fs, name) for name in names]


_VERSION_KEYS = ("size", "mtime", "ino", "generation", "created")
"""What a listing says of a file that changes when it is written again: its size, and the local
file's mtime and inode (`os.replace` gives a new one), a GCS object's generation, a memory file's time."""


@storage_call("list")
def files_under(url: str) -> dict[str, tuple[str, ...]]:
    """Every file under a folder, its subfolders' included, as {its path under the folder: what
    changes when it is written again (`_VERSION_KEYS`)}, from one listing; {} where there is none."""
    fs, path = _looked_at_afresh(url)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    folder = path.rstrip("/") + "/"
    return {name[len(folder):]: tuple(str(info.get(key)) for key in _VERSION_KEYS)
            for name, info in found.items() if name.startswith(folder)}


@storage_call("remove")
def remove(url: str, recursive: bool = False) -> None:
    fs, path = _looked_at_afresh(url)
    if fs.exists(path):
        try:
            fs.rm(path, recursive=recursive)
        except FileNotFoundError:  # a delete whose answer was lost, retried by gcsfs: the first one did it
            pass


@storage_call("read")
def sha256(url: str) -> str:
    """sha256 of a file's content, streamed in 8 MiB blocks."""
    fs, path = filesystem(url)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


@storage_call("stat")
def fingerprint(url: str) -> str:
    """A content fingerprint that does not depend on where the file is, its path or mtime.

    `md5:<hex>:<size>`: on GCS read from the object's metadata (no download), elsewhere
    computed from the bytes, so the same input on local disk, in another bucket or on GCS
    gives the same step hashes. GCS objects without an md5 (composite uploads) fall back to
    their crc32c, which only other GCS copies share.
    """
    fs, path = filesystem(url)
    if fs.protocol and ("gs" in fs.protocol or "gcs" in fs.protocol):
        info = fs.info(path)
        if info.get("md5Hash"):
            return f"md5:{base64.b64decode(info['md5Hash']).hex()}:{info.get('size')}"
        if info.get("crc32c"):
            return f"crc32c:{info['crc32c']}:{info.get('size')}"
    if isinstance(fs, LocalFileSystem):
        return _local_fingerprint(fs, path)
    return _md5(fs, path)


def _md5(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest, size = hashlib.md5(usedforsecurity=False), 0
    with fs.open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
            size += len(block)
    return f"md5:{digest.hexdigest()}:{size}"


FINGERPRINTS_CACHED_FROM = 1 << 20
"""Local files of at least this many bytes keep their fingerprint in `local_cache("fingerprints")`:
a local checkpoint of 16 GB took about 20 s to hash, on every plan (`status`, each `run`)."""


def _local_fingerprint(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A local file's md5, read again only when the file may have changed: the answer is kept
    under a key of its path, device, inode, size, mtime and ctime. Any write to a file changes its
    ctime, which no tool sets back (`cp -p` and `touch -d` set only mtime), so an edit is never
    missed; a move or chmod only costs one hash again. A cache that cannot be written is skipped."""
    before = _version_of(path)
    if before[2] < FINGERPRINTS_CACHED_FROM:
        return _md5(fs, path)
    key = "\0".join(map(str, (os.path.realpath(path), *before)))
    entry = local_cache("fingerprints", hashlib.sha256(key.encode()).hexdigest())
    with contextlib.suppress(OSError), open(entry) as f:
        if (cached := f.read()).startswith("md5:"):
            return cached
    value = _md5(fs, path)
    if _version_of(path) == before:  # not written to while it was read
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            temp = f"{entry}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            with open(temp, "w") as f:
                f.write(value)
            os.replace(temp, entry)  # whole or absent, for the other hosts of a pod sharing the folder
    return value


def _version_of(path: str) -> tuple[int, ...]:
    """(device, inode, size, mtime, ctime): what changes when a local file may have."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def local_cache(*names: str) -> str:
    """A path under this machine's cache folder: `$PIPELINE_CACHE_DIR`, default
    `~/.cache/jax-batch-pipeline` (as engine/compile_cache.py's, which the engine keeps itself)."""
    return os.path.join(os.path.expanduser(os.environ.get("PIPELINE_CACHE_DIR") or "~/.cache/jax-batch-pipeline"), *names)


def _url_of(like: str, fs: fsspec.AbstractFileSystem, name: str) -> str:
    """The URL of a path `fs` returned, in the same protocol as `like`."""
    if isinstance(fs, LocalFileSystem):
        return name
    return f"{like.split('://', 1)[0]}://{name.lstrip('/')}"


@storage_call("list")
def expand(pattern: str) -> list[str]:
    """The files a path, folder or glob names (sorted); empty if it matches nothing. A folder is
    its own files (not its subfolders': `DIR/**` for those); a folder or glob leaves out names
    starting with `.` or `_` (`_SUCCESS.json`, `.cache`), a file named exactly is itself (a `[`
    in its name is no glob). Listed afresh (`_looked_at_afresh`): the runner's recheck of the
    prompt files before tokenize's marker must see the files, and their md5s (`fingerprint`), as
    they are now, not as the plan saw them."""
    fs, path = filesystem(pattern)
    glob_at = min((path.index(ch) for ch in "*?[" if ch in path), default=len(path))
    fs.invalidate_cache(path if glob_at == len(path) else path[:glob_at].rsplit("/", 1)[0])
    if fs.isfile(path):
        return [_url_of(normalize(pattern), fs, path)]
    if any(ch in path for ch in "*?["):
        names = fs.glob(path)
    elif fs.isdir(path):
        names = [e["name"] for e in fs.ls(path, detail=True) if e.get("type") == "file"]
    elif fs.exists(path):
        names = [path]
    else:
        names = []
    names = [n for n in names if not n.rsplit("/", 1)[-1].startswith((".", "_")) and fs.isfile(n)]
    return [_url_of(normalize(pattern), fs, n) for n in sorted(names)]
