"""generate: every host makes completions for its tokenize shards and commits Parquet parts.

Owns the per-host work split, the part files and resume. Shards are assigned round-robin
by shard number (shard i -> host i % hosts), and output is keyed by shard, never by host:
`{out}/shard-00003/part-<time>-<rand>-<N>rows-of<K>.parquet`, N its rows (what `status` counts,
with no read of the part) and K the number of tokenize's shards it was made from. On start a
host reads which (prompt_index, sample_index) pairs its shards already
committed and asks the engine only for the missing ones, so a rerun with another host count
resumes the same output. A tokenize rerun (`--force`) that cut the same prompts into another
number of shards leaves parts of K shards beside the new ones: every host reads those parts'
pairs as well (and those of parts named before they said their K), so rows already made are
kept, not made again. A part is one
atomic write of at most `engine.part_rows` rows (or 60 s of work, or fewer rows when the
buffered rows hold many list entries: BUFFER_MAX_VALUES): a hard kill loses at most
the rows not yet committed; SIGTERM stops taking new work, commits what finished, exits 75.
Hosts never wait on each other while generating. The leader's `finish` checks that every
shard is covered (exactly-once is merge's job: retries may leave identical duplicates).

With `engine.mode: global_mesh` the model is sharded over every device of the pod, so all
hosts work on every shard together, in the same order, making the same compiled calls: each
host reads what is committed, they meet at a barrier before anyone writes and check they plan
the same (prompt, sample) pairs; each completion is written by the shard's owner only (shard
i -> host i % hosts) and dropped by the others. A stop signal on any host stops every host at
the same decode chunk (the engine agrees on it with an all-reduce); each commits its rows.

    generate(cfg, out)        # every host
    finish(cfg, out)          # the leader, after every host reported done
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import re
import secrets
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.pod import hosts, preemption
from pipeline.run import status
from pipeline.run.config import Config
from engine.checkpoint import load_tokenizer, read_config
from pipeline.errors import StepFailed, checkpoint_errors, say_unless_ended
from pipeline.run.progress import Progress
from pipeline.run.step import Committed, StepOutput, StepResult
from steps.tokenize import SHARD_FIX, read_shard

PART_MAX_AGE_S = 60.0
"""Commit a shard's finished rows at least this often, so a hard kill loses little work."""
BUFFER_MAX_VALUES = 16_000_000
"""List entries (token ids, log-probabilities) the rows buffered for all shards may hold, about
0.6 GB as Python objects, before the fullest shard's rows are committed early. With
`sampling.top_logprobs` = K a row holds 2K + 2 entries a token (K = 20, 2,048 tokens: 3.2 MB a
row), and `engine.part_rows` rows of each shard in flight would not fit in a host's memory."""

SCHEMA = pa.schema([
    ("prompt_index", pa.int64()),
    ("prompt_id", pa.string()),
    ("sample_index", pa.int32()),
    ("prompt", pa.string()),
    ("completion", pa.string()),
    ("completion_token_ids", pa.list_(pa.int32())),
    ("num_prompt_tokens", pa.int32()),
    ("num_completion_tokens", pa.int32()),
    ("finish_reason", pa.string()),
])
"""The merged output's columns (docs/contract.md, "Result"); parts already hold them."""
LOGPROBS = pa.field("completion_logprobs", pa.list_(pa.float32()))
"""With `sampling.logprobs`, one more column: each completion token's log-probability."""
TOP_TOKEN_IDS = pa.field("completion_top_token_ids", pa.list_(pa.list_(pa.int32())))
TOP_LOGPROBS = pa.field("completion_top_logprobs", pa.list_(pa.list_(pa.float32())))
"""With `sampling.top_logprobs` = k, two more columns: for each completion token, the k most
probable tokens at its position (most probable first) and their log-probabilities."""
PROMPT_TOKEN_IDS = pa.field("prompt_token_ids", pa.list_(pa.int32()))
PROMPT_LOGPROBS = pa.field("prompt_logprobs", pa.list_(pa.float32()))
"""With `sampling.prompt_logprobs`, two more columns last: the prompt's token ids (chat template
and BOS applied) and each one's log-probability given those before it (null for the first)."""


def schema(cfg: Config) -> pa.Schema:
    """The columns of this config's parts and merged files: SCHEMA, then LOGPROBS, the top
    alternatives and the prompt's token ids and PROMPT_LOGPROBS, each where asked for."""
    sampling = cfg.sampling
    fields = [*SCHEMA, *[LOGPROBS] * sampling.logprobs, *[TOP_TOKEN_IDS, TOP_LOGPROBS] * bool(sampling.top_logprobs),
              *[PROMPT_TOKEN_IDS, PROMPT_LOGPROBS] * sampling.prompt_logprobs]
    return pa.schema(fields)

PART_FIX = ("delete it, then run `pipeline run generate --config FILE --force`: it makes that part's rows again "
            "and keeps the other parts")
"""What to do about a part that cannot be read (here, in merge): parts are never rewritten in place."""


@dataclass(frozen=True)
class HostMetrics:
    host: int
    hosts: int
    shards: int
    prompts: int
    samples: int
    generated_tokens: int
    wall_s: float
    compile_s: float
    """Seconds getting programs (compiling, or loading them from the persistent cache), summed
    over the engine's threads: the decode program compiles beside the prefill."""
    tokens_per_s: float
    peak_memory_bytes: int | None
    batch_size: int | None
    compilations: int
    mode: str
    """host_dp, or global_mesh (then samples, prompts and tokens count the rows this host wrote)."""
    cache_loads: int = 0
    """Programs loaded from JAX's persistent compilation cache instead of compiled."""
    programs_used: int = 0
    """Distinct programs the engine ran (compiled, loaded or already in memory; a second shape of
    one kind counts again): at most 5, whatever the prompts."""
    programs: dict | None = None
    """Per program kind: compiled, loaded, seconds getting it, run_s running it (engine.EngineStats)."""
    compile_wait_s: float = 0.0
    """Seconds the host waited for programs: what getting them added to wall_s."""


@dataclass(frozen=True)
class GenerateSummary:
    rows: int
    """(prompt, sample) rows committed, over every shard."""
    prompts: int
    """Prompts with a committed row (the hosts' `prompts` add up a prompt once per run it was in)."""
    parts: int
    hosts: list[dict[str, Any]]
    """Each host's HostMetrics of each run of the step (a resumed step has a host's earlier runs too)."""
    generated_tokens: int
    """Over every run of the step: what the engine made, with each row's ending EOS or stop token
    and a stop string's tokens (more than the rows' num_completion_tokens where rows end early)."""
    wall_s: float
    """The longest of the hosts' runs."""
    compile_s: float
    """The slowest host's compile time."""
    tokens_per_s: float
    """Each host's generated tokens over its wall time, over its runs that generated anything,
    summed over the hosts (`_pod_rate`)."""


def generate(cfg: Config, out: StepOutput) -> None:
    """Generate every missing (prompt, sample) of this host's shards (global_mesh: of every shard,
    with every host); commit parts of the shards this host owns as they fill."""
    started = time.monotonic()
    lockstep = cfg.engine.mode == "global_mesh"
    sha256 = _shard_names(out)
    every = list(sha256)
    mine = every[hosts.process_index()::hosts.process_count()]  # shard i goes to host i mod N
    shards = every if lockstep else mine
    if not lockstep and hosts.is_leader():
        _say_idle_hosts(len(every), hosts.process_count())
    made = _Made.read(out, len(every), cfg.sampling.n)
    todo = [_ShardTodo.read(out, name, sha256[name], made) for name in shards]
    if lockstep:
        _agree_on_todo(out, todo)
    n_missing = sum(t.missing for t in todo)
    engine = None
    stats = None
    samples = tokens = 0
    prompts = 0
    metrics_url = out.path("metrics", f"host-{hosts.process_index():05d}-{_stamp()}.json")  # this run's

    def save_metrics(stats: Any) -> None:
        storage.write_json(metrics_url, _host_metrics(cfg, started, len(mine), prompts, samples, tokens, stats,
                                                      lockstep).__dict__)

    if n_missing:
        engine = _load_engine(cfg, todo)
        # Before each part, this run's figures so far: a run killed (a preemption) keeps them.
        writer = _PartWriter(out, cfg.engine.part_rows, owned=set(mine), schema=schema(cfg), shards=len(every),
                             before_commit=lambda: save_metrics(engine.stats))
        watch = hosts.watchdog("generating on the global mesh") if lockstep else contextlib.nullcontext()
        n_total = sum(t.wanted.size for t in todo)  # every (prompt, sample) of these shards
        try:
            with watch, Progress(total=n_total, desc=f"generate {hosts.describe()}", unit="sample",
                                 resumed=n_total - n_missing) as bar:
                try:
                    for c, source in _completions(engine, todo, _StopGenerating(watch_pod=not lockstep)):
                        if writer.add(source.shard, _row(source, c)):
                            samples += 1
                            tokens += len(c.token_ids)
                            if not source.counted:  # a count, not a set of every prompt: memory stays flat
                                prompts, source.counted = prompts + 1, True
                        bar.update(1, tokens=len(c.token_ids))
                except Exception as err:
                    if lockstep:  # a collective failed because a peer died (any error type): exit 75
                        hosts.blame_peer(err, "generating on the global mesh")
                    raise
                finally:
                    writer.flush_all()  # commit what is finished, also on errors and signals
            if engine.stopped and not lockstep:
                hosts.raise_if_aborted(GENERATING)  # another host failed or was stopped: its error, ours committed
            if engine.stopped and not preemption.stop_requested():  # global_mesh: the hosts agreed to stop
                preemption.request_stop("a stop signal on another host")
            preemption.check()
        except BaseException:
            if samples:  # the rows this run committed before it ended count in the step's figures too
                with contextlib.suppress(Exception):  # never in the way of the run's own error
                    save_metrics(engine.stats)
            raise
        stats = engine.stats
    save_metrics(stats)


def _host_metrics(cfg: Config, started: float, shards: int, prompts: int, samples: int, tokens: int,
                  stats: Any, lockstep: bool) -> HostMetrics:
    """This host's figures of this run of the step (`stats`: the engine's, None where it generated
    nothing)."""
    # On a global mesh every host computed every row: count only what it wrote, so per-host
    # figures add up in `finish`.
    generated = (tokens if lockstep else stats.generated_tokens) if stats else 0
    wall_s = time.monotonic() - started
    return HostMetrics(
        host=hosts.process_index(), hosts=hosts.process_count(), shards=shards, prompts=prompts,
        samples=samples, generated_tokens=generated, wall_s=round(wall_s, 3),
        compile_s=round(stats.compile_time_s, 3) if stats else 0.0,
        tokens_per_s=round(generated / wall_s, 1) if wall_s > 0 else 0.0,
        peak_memory_bytes=stats.peak_memory_bytes if stats else None,
        batch_size=stats.batch_size if stats else None, compilations=stats.compilations if stats else 0,
        mode=cfg.engine.mode, cache_loads=stats.cache_loads if stats else 0,
        programs_used=stats.programs_used if stats else 0,
        programs=stats.programs if stats else None, compile_wait_s=round(stats.compile_wait_s, 3) if stats else 0.0,
    )


def finish(cfg: Config, out: StepOutput) -> StepResult:
    """Leader: check every shard holds every (prompt, sample); sum per-host metrics."""
    n = cfg.sampling.n
    names = list(_shard_names(out))  # in order
    made = _Made.read(out, len(names), n)
    missing_total, rows_total, prompts, examples = 0, 0, 0, []
    for shard in names:
        done = made.done(shard, read_shard(_shard_url(out, shard), columns=["prompt_index"])["prompt_index"].to_numpy())
        got, expected = int(done.sum()), done.size
        rows_total, prompts = rows_total + got, prompts + int(done.any(axis=1).sum())
        if got < expected:
            missing_total += expected - got
            examples.append(f"{shard}: {expected - got} of {expected}")
    files = [{"path": url[len(out.url) + 1:], "bytes": storage.size(url), "checksum": storage.fingerprint(url)}
             for url in made.parts]  # every part: merge reads those of another cut too
    if missing_total:
        raise StepFailed(
            f"generate output {out.url} is missing {missing_total} (prompt, sample) rows ({'; '.join(examples[:3])}"
            f"{'; ...' if len(examples) > 3 else ''}): rerun `pipeline run generate` to make them")
    host_metrics = [_read_metrics(u) for u in storage.list_files(out.path("metrics"), suffix=".json")]
    tokens = sum(m["generated_tokens"] for m in host_metrics)
    wall_s = max((m["wall_s"] for m in host_metrics), default=0.0)
    return StepResult(rows=rows_total, files=files, summary=GenerateSummary(
        rows=rows_total, prompts=prompts, parts=len(files), hosts=host_metrics, generated_tokens=tokens, wall_s=wall_s,
        compile_s=max((m["compile_s"] for m in host_metrics), default=0.0), tokens_per_s=_pod_rate(host_metrics),
    ))


def _read_metrics(url: str) -> dict[str, Any]:
    try:
        return storage.read_json(url)
    except ValueError as err:  # written whole: damaged since
        raise StepFailed(f"generate metrics {url} cannot be read ({err}): delete it (it holds only a host's figures), "
                         f"then run `pipeline run generate --config FILE`") from err


def _pod_rate(host_metrics: list[dict[str, Any]]) -> float:
    """Tokens a second of the pod: each host's tokens over its seconds, summed over the hosts."""
    return round(sum(h["tokens_per_s"] for h in per_host(host_metrics)), 1)


SUMMED = ("prompts", "samples", "generated_tokens", "wall_s", "compile_s", "compile_wait_s", "compilations", "cache_loads")
"""Per-host figures that add up over a host's runs; the others' largest (or last) value stands."""


def per_host(host_metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per host from the metrics of every run of the step (`GenerateSummary.hosts`, one
    per host and run: a resumed step ran a host more than once, one run after the other), by host:
    SUMMED figures added up, tokens_per_s its tokens over its seconds in the runs that generated
    (not the runs' rates added up, as if they had run side by side; runs that generated nothing,
    a host whose rows were all done, do not count), `runs` how many."""
    by_host: dict[int, dict[str, Any]] = {}
    busy: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
    for m in sorted(host_metrics, key=lambda m: m.get("host", 0)):
        host = m.get("host", 0)
        if m.get("samples"):
            busy[host][0] += m.get("generated_tokens", 0)
            busy[host][1] += m.get("wall_s", 0.0)
        if host not in by_host:
            by_host[host] = {**m, "runs": 1}
            continue
        seen = by_host[host]
        for key, value in m.items():
            if key in SUMMED:
                seen[key] = seen.get(key, 0) + value
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(seen.get(key), (int, float)):
                seen[key] = max(seen[key], value)
            elif value is not None:
                seen[key] = value
        seen["runs"] += 1
    for host, seen in by_host.items():
        tokens, seconds = busy[host]
        if seen["runs"] > 1:  # one run's rate stands as the host measured it (the same quotient)
            seen["tokens_per_s"] = round(tokens / seconds, 1) if seconds > 0 else 0.0
    return list(by_host.values())


# --- work split and resume ----------------------------------------------------------------


def _shard_names(out: StepOutput) -> dict[str, str | None]:
    """Tokenize's shards, by name in order, with the sha256 its marker records of each."""
    record = status.read_marker(out.upstream["tokenize"].url)
    if record is None:
        raise StepFailed(f"tokenize output {out.upstream['tokenize'].url} is not complete: run `pipeline run tokenize`")
    return dict(sorted((f["path"].removesuffix(".parquet"), f.get("sha256")) for f in record.files
                       if f["path"].startswith("shard-")))


def progress(cfg: Config, url: str, upstream: dict[str, str]) -> Committed | None:
    """What `status` says of a partial generate: rows committed so far, of how many (tokenize's
    rows times sampling.n), from the parts' names (`-<N>rows`; the footers of parts named before
    names said so), never their rows (a row a stalled writer committed twice counts twice);
    None where tokenize is not complete."""
    record = status.read_marker(upstream["tokenize"])
    if record is None:
        return None
    parts = _part_urls(url)

    def rows(part: str) -> int:
        if (named := _rows_of(part)) is not None:
            return named
        fs, path = storage.filesystem(part)  # a part named before parts said their rows
        try:
            with fs.open(path, "rb") as f:
                return pq.read_metadata(f).num_rows
        except (OSError, pa.ArrowException):
            return 0  # being written, or damaged: generate names it when it reads it

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # old names: one small read a part, on a bucket too
        committed = sum(pool.map(rows, parts))
    return Committed(committed, record.rows * cfg.sampling.n, len(parts))


def _say_idle_hosts(shards: int, count: int) -> None:
    """A pod of more hosts than tokenize cut shards leaves the rest without work: say so (a tokenize
    made on one machine, then a generate on a pod, gave no sign of it)."""
    if shards < count:
        idle = f"host {shards} has" if shards == count - 1 else f"hosts {shards}-{count - 1} have"
        print(f"generate: warning: {count} hosts but {shards} tokenize shard(s): {idle} "
              f"nothing to generate (tokenize cut the shards for the host count it ran with; set prompts.num_shards "
              f"to at least {count} for the next prompts you tokenize)", file=sys.stderr, flush=True)


def _shard_url(out: StepOutput, shard: str) -> str:
    return storage.join(out.upstream["tokenize"].url, f"{shard}.parquet")


READ_BATCH_ROWS = 1024
"""Shard rows turned into requests at a time: the step holds about this many prompts besides
those in flight in the engine, however large the shard (issue 13: host memory must not grow with
the prompt count)."""


@dataclass(frozen=True)
class _ShardTodo:
    """What is left of one tokenize shard, as arrays rather than rows: row i of the shard file
    still wants sample s where wanted[i, s]."""

    name: str
    url: str
    prompt_index: np.ndarray
    """[rows] int64, in file order."""
    num_tokens: np.ndarray
    """[rows] prompt lengths."""
    wanted: np.ndarray
    """[rows, n] bool."""
    sha256: str | None = None
    """The shard's, as tokenize's marker records it: the bytes generated from are checked (`_batches`)."""
    footer: pq.FileMetaData | None = None
    """Its Parquet footer, read with the columns above (`max_token_id` needs its statistics)."""

    @classmethod
    def read(cls, out: StepOutput, name: str, sha256: str | None, made: "_Made") -> "_ShardTodo":
        url = _shard_url(out, name)
        with storage.unreadable("tokenize shard", url, SHARD_FIX):
            table, footer = storage.read_parquet_with_footer(url, columns=["prompt_index", "num_tokens"])
        prompt_index = table["prompt_index"].to_numpy()
        return cls(name, url, prompt_index, table["num_tokens"].to_numpy(), ~made.done(name, prompt_index), sha256,
                   footer)

    @property
    def missing(self) -> int:
        return int(self.wanted.sum())

    def longest_prompt(self) -> int:
        """Of every row, done or not: it sizes the KV cache, hence the compiled programs, so a
        resume of the same shards reuses the programs it compiled before (compile cache)."""
        return int(self.num_tokens.max(initial=0))

    def max_token_id(self) -> int:
        """The largest token id of the shard's prompts, from the column statistics in its footer
        (pyarrow writes them; `read` keeps the footer): not the token ids, which are about the
        whole input once more before the first token. A shard whose footer lacks them is read."""
        footer = self.footer
        leaves = [footer.schema.column(j).path for j in range(footer.num_columns)] if footer else []
        if "input_ids.list.element" in leaves:
            leaf = leaves.index("input_ids.list.element")
            stats = [footer.row_group(g).column(leaf).statistics for g in range(footer.num_row_groups)]
            if all(s is not None and s.has_min_max for s in stats):
                return max((s.max for s in stats), default=0)
        ids = read_shard(self.url, columns=["input_ids"])["input_ids"]  # names what is wrong, if anything
        return pc.max(pc.list_flatten(ids)).as_py() or 0

    def read_in_thread(self) -> concurrent.futures.Future:
        """The shard's bytes, read in a thread of their own (`_requests` reads the next shard
        while the engine works on this one): the file whole (compressed, so small next to its
        rows), with retries like every other file. A daemon thread: a read that hangs does not hold
        the exit, and a stop signal ends its retries (`preemption.pause`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def read() -> None:
            try:
                future.set_result(storage.read_bytes(self.url))
            except BaseException as error:  # raised where the bytes are used (`_batches`)
                future.set_exception(error)

        threading.Thread(target=read, name=f"read-{self.name}", daemon=True).start()
        return future

    def _batches(self, read: concurrent.futures.Future, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """The shard's rows READ_BATCH_ROWS at a time, from the bytes `read` brings, checked against
        `sha256`, its rows decoded a batch at a time."""
        with storage.unreadable("tokenize shard", self.url, SHARD_FIX):
            data = read.result()
            if self.sha256 and hashlib.sha256(data).hexdigest() != self.sha256:
                # Changed since tokenize wrote it: a flipped bit can still parse, as other prompt tokens.
                raise StepFailed(f"tokenize shard {self.url} is not the file tokenize wrote (its sha256 is not the one "
                                 f"tokenize's marker records: it was changed since): {SHARD_FIX}")
            yield from pq.ParquetFile(pa.BufferReader(data)).iter_batches(batch_size=READ_BATCH_ROWS, columns=columns)

    def requests(self, read: concurrent.futures.Future, sources: dict[int, "_Source"]) -> Iterator[Any]:
        """GenerationRequests of the rows still wanted, from the shard's bytes `read` brings
        (`read_in_thread`), READ_BATCH_ROWS rows decoded at a time; registers each in `sources`
        until its last sample completes."""
        from engine import GenerationRequest

        start = 0
        for batch in self._batches(read, ["prompt_index", "prompt_id", "prompt", "input_ids", "num_tokens"]):
            wanted = self.wanted[start:start + batch.num_rows]
            start += batch.num_rows
            rows = np.flatnonzero(wanted.any(axis=1))
            if not len(rows):
                continue
            batch = batch.take(pa.array(rows))
            ids = batch.column("input_ids")
            prompt_index, prompt_id, prompt, num_tokens = (
                batch.column(name).to_pylist() for name in ("prompt_index", "prompt_id", "prompt", "num_tokens"))
            for j, i in enumerate(rows):
                samples = np.flatnonzero(wanted[i]).tolist()
                input_ids = ids[j].values.to_numpy()
                sources[prompt_index[j]] = _Source(self.name, prompt_id[j], prompt[j], num_tokens[j], len(samples), input_ids)
                yield GenerationRequest(prompt_index[j], input_ids, samples)


@dataclass
class _Source:
    """What a completion's row needs from its prompt, kept while any of its samples is in flight."""

    shard: str
    prompt_id: str
    prompt: str
    num_tokens: int
    samples_left: int
    input_ids: np.ndarray
    """Its token ids, as the engine got them (the `prompt_token_ids` column)."""
    counted: bool = False
    """This host wrote a row of the prompt (HostMetrics.prompts counts it once)."""


def check_part_keys(table: pa.Table, url: str) -> None:
    """A part's prompt_index and sample_index are set in every row (here to resume, in merge)."""
    if table["prompt_index"].null_count or table["sample_index"].null_count:
        raise StepFailed(f"generate part {url} has rows with no prompt_index or sample_index: {PART_FIX}")


def _committed_keys(part_urls: list[str], n: int) -> np.ndarray:
    """prompt_index * n + sample_index of every row already committed in these parts."""
    keys = [np.zeros(0, np.int64)]
    for url in part_urls:
        with storage.unreadable("generate part", url, PART_FIX):
            t = storage.read_parquet(url, columns=["prompt_index", "sample_index"])
        check_part_keys(t, url)
        keys.append(t["prompt_index"].to_numpy() * n + t["sample_index"].to_numpy())
    return np.unique(np.concatenate(keys))


@dataclass(frozen=True)
class _Made:
    """The rows committed so far, from one listing of every part: a shard folder's parts made from
    the present cut of the prompts are read shard by shard (`done`); the others, made from another
    cut (a tokenize `--force` into another number of shards) or named before parts said theirs
    (`_cut_of`), can hold any shard's rows, and their keys are read once."""

    n: int
    own: dict[str, list[str]]
    """Shard name -> its parts of the present cut."""
    elsewhere: np.ndarray
    """prompt_index * n + sample_index of every row of the other parts."""
    parts: list[str]

    @classmethod
    def read(cls, out: StepOutput, shards: int, n: int) -> "_Made":
        parts = _part_urls(out.url)
        own: dict[str, list[str]] = defaultdict(list)
        for url in parts:
            if _cut_of(url) == shards:
                own[url.rsplit("/", 2)[-2]].append(url)
        present = {url for urls in own.values() for url in urls}
        return cls(n, dict(own), _committed_keys([url for url in parts if url not in present], n), parts)

    def done(self, shard: str, prompt_index: np.ndarray) -> np.ndarray:
        """[rows, n] bool: which samples of the shard's prompts are committed."""
        every = prompt_index[:, None] * self.n + np.arange(self.n)[None, :]
        return np.isin(every, _committed_keys(self.own.get(shard, []), self.n)) | np.isin(every, self.elsewhere)


def _part_urls(step_url: str) -> list[str]:
    """Every part of a generate output, of every shard folder."""
    return storage.expand(storage.join(step_url, "shard-*", "part-*.parquet"))


_PART_NAME = re.compile(r"part-\d{8}T\d{6}-[0-9a-f]{8}(?:-(?P<rows>\d+)rows)?(?:-of(?P<cut>\d+))?\.parquet")
"""A part's name (`_PartWriter.flush`); parts made before 2026-11-30 said neither their rows nor
their cut, and until 2026-12-01 not their rows."""


def _name_says(part_url: str, field: str) -> int | None:
    match = _PART_NAME.fullmatch(part_url.rsplit("/", 1)[-1])
    return int(match[field]) if match and match[field] is not None else None


def _cut_of(part_url: str) -> int | None:
    """How many shards tokenize had cut the prompts into when this part was made: its name's
    `-of<K>`; None for a part named before parts said so."""
    return _name_says(part_url, "cut")


def _rows_of(part_url: str) -> int | None:
    """The rows a part holds, as its name says (`-<N>rows`); None for a part named before names said so."""
    return _name_says(part_url, "rows")


def _agree_on_todo(out: StepOutput, todo: list[_ShardTodo]) -> None:
    """global_mesh: every host must plan the same work, or their compiled calls diverge and the
    pod hangs. Each host has read the committed parts; nobody writes before every host has read
    (barrier), and each host's plan must match the leader's (a digest of every missing pair)."""
    digest = hashlib.sha256()
    for t in todo:
        digest.update(t.name.encode())
        digest.update(t.prompt_index.astype("<i8").tobytes())
        digest.update(np.packbits(t.wanted).tobytes())
    tag = f"generate-{out.hash[:12]}"
    hosts.barrier(f"{tag}/read-parts", "every host to read the committed parts")
    hosts.agree(f"{tag}/todo", digest.hexdigest(), "the (prompt, sample) pairs left to generate")


def _load_engine(cfg: Config, todo: list[_ShardTodo]):
    from engine import Engine, LoadStopped
    from engine.config import InvalidConfig

    with checkpoint_errors(cfg.model.path):
        tokenizer = load_tokenizer(cfg.model.path)
        config = read_config(cfg.model.path)
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")  # or Gemma 3's text model's
    if isinstance(vocab, int):  # else Engine.load names what config.json lacks
        for t in todo:  # before Engine.load starts compiling: a run that cannot start compiles nothing
            top = t.max_token_id()
            if top >= vocab:
                raise StepFailed(
                    f"tokenize shard {t.url} holds token id {top}, but model.path {cfg.model.path} "
                    f"has a vocabulary of {vocab}: the checkpoint does not match the tokenizer used in tokenize")
    longest = max(max(t.longest_prompt() for t in todo), 1)
    prints = hosts.is_leader() or hosts.process_count() == 1
    try:
        with checkpoint_errors(cfg.model.path):
            engine = Engine.load(cfg.model.path, dtype=cfg.model.dtype, sampling=cfg.sampling, engine=cfg.engine,
                                 max_prompt_tokens=longest, tokenizer=tokenizer,
                                 on_compile=_announcer() if prints else None, stop=_stop_reading)
    except LoadStopped:  # minutes for an 8B model from a bucket, and a preemption notice gives about 30 s
        preemption.check()
        hosts.raise_if_aborted(READING)
        raise
    except InvalidConfig as err:  # a setting that does not fit these devices (lanes, mesh, memory): one line
        raise StepFailed(f"generate: {err} (found when the engine planned for this host's devices; change the "
                         f"setting and rerun the same command)") from err
    if prints:
        print(f"generate: {engine.describe()}", file=sys.stderr, flush=True)
    return engine


READING = "stopped reading the model's weights"


def _stop_reading() -> bool:
    """Engine.load's question before each tensor: stop on a stop signal here, or once another host of
    the pod has failed or been stopped (its `abort`: one non-blocking look-up), rather than read the
    whole model first and find out at the first collective. Not `check_peers`: its list of live
    hosts comes only once every host asks for it, so while the others read it would cost a tensor
    up to `hosts.LIVE_ANSWER_S`."""
    return preemption.stop_requested() or hosts.aborted() is not None


GENERATING = "stopped generating"


class _StopGenerating:
    """Engine.generate's question before each program call: stop on a stop signal here, or, with
    `watch_pod` (host_dp), once another host of the pod has failed or been stopped (its `abort`),
    so that a host does not generate its shards to the end for a run that has already failed (on
    a pod started by `pipeline launch`, only to be killed). The look-up is a call to the
    coordinator: it is made at most every `hosts.POLL_S`. On a global mesh the hosts agree on
    stopping in the engine, and a host whose peer is gone is ended by `hosts.watchdog`."""

    def __init__(self, watch_pod: bool) -> None:
        self.watch_pod = watch_pod
        self.looked_at = float("-inf")

    def __call__(self) -> bool:
        if preemption.stop_requested():
            return True
        if not self.watch_pod or time.monotonic() - self.looked_at < hosts.POLL_S:
            return False
        self.looked_at = time.monotonic()
        return hosts.aborted() is not None


def _announcer() -> Callable[[str], None]:
    """A line per program the engine gets, from its threads (`Engine.load` on, or `generate`)."""
    programs, printing = itertools.count(1), threading.Lock()

    def announce(kind: str) -> None:
        with printing:  # not after the command's error line (a failing run's threads still get programs)
            say_unless_ended(f"generate: program {next(programs)} ({kind}): compiling, or loading it from the "
                             f"compile cache")

    return announce


def _completions(engine, todo: list[_ShardTodo], stop: Callable[[], bool]) -> Iterator[tuple[Any, "_Source"]]:
    """Every completion with its prompt's source; requests are read lazily, shard by shard."""
    sources: dict[int, _Source] = {}
    for c in engine.generate(_requests(todo, sources), stop=stop):
        source = sources[c.prompt_index]
        source.samples_left -= 1
        if not source.samples_left:
            del sources[c.prompt_index]
        yield c, source


def _requests(todo: list[_ShardTodo], sources: dict[int, "_Source"]) -> Iterator[Any]:
    """The requests of every shard with rows missing, in order (a shard already done is not read
    again). The next shard's bytes are read while the engine takes this one's requests: the engine
    waits for a request (its decoding too) while the iterator reads, and a shard on a bucket takes
    seconds to read. At most two shards' bytes are held at a time."""
    left = [t for t in todo if t.missing]
    following = left[0].read_in_thread() if left else None
    for i, t in enumerate(left):
        read, following = following, left[i + 1].read_in_thread() if i + 1 < len(left) else None
        yield from t.requests(read, sources)


def _row(source: _Source, c: Any) -> dict[str, Any]:
    row = {
        "prompt_index": c.prompt_index, "prompt_id": source.prompt_id, "sample_index": c.sample_index,
        "prompt": source.prompt, "completion": c.text, "completion_token_ids": list(c.token_ids),
        "num_prompt_tokens": source.num_tokens, "num_completion_tokens": len(c.token_ids),
        "finish_reason": c.finish_reason,
    }
    if c.logprobs is not None:
        row[LOGPROBS.name] = c.logprobs
    if c.top_token_ids is not None:
        row[TOP_TOKEN_IDS.name], row[TOP_LOGPROBS.name] = c.top_token_ids, c.top_logprobs
    if c.prompt_logprobs is not None:
        row[PROMPT_TOKEN_IDS.name], row[PROMPT_LOGPROBS.name] = source.input_ids.tolist(), c.prompt_logprobs
    return row


class _PartWriter:
    """Buffers finished rows per shard and commits each buffer as one atomic part; rows of shards
    this host does not own are dropped (global_mesh: their owner writes the same rows)."""

    def __init__(self, out: StepOutput, part_rows: int, owned: set[str], schema: pa.Schema, shards: int,
                 clock: Callable[[], float] = time.monotonic, before_commit: Callable[[], None] = lambda: None):
        self.out = out
        self.shards = shards
        """How many shards tokenize cut (each part's name says it: `_cut_of`)."""
        self.schema = schema
        self.part_rows = part_rows
        self.owned = owned
        self.clock = clock
        self.before_commit = before_commit
        self.rows: dict[str, list[dict]] = defaultdict(list)
        self.since: dict[str, float] = {}
        self.values: dict[str, int] = defaultdict(int)
        """List entries buffered per shard (BUFFER_MAX_VALUES)."""

    def add(self, shard: str, row: dict) -> bool:
        """Buffer the row if this host writes `shard`; True if it does. Commits the shard's rows
        once they are `part_rows`, and every shard's whose first buffered row is PART_MAX_AGE_S old:
        a shard whose last rows are done gets no more rows to trigger its own commit."""
        if shard not in self.owned:
            return False
        self.rows[shard].append(row)
        now = self.clock()
        self.since.setdefault(shard, now)
        self.values[shard] += sum(len(v) * (len(v[0]) if v and isinstance(v[0], list) else 1)
                                  for v in row.values() if isinstance(v, list))
        if len(self.rows[shard]) >= self.part_rows:
            self.flush(shard)
        for old in [s for s, since in self.since.items() if now - since >= PART_MAX_AGE_S]:
            self.flush(old)
        if sum(self.values.values()) > BUFFER_MAX_VALUES:
            self.flush(max(self.values, key=self.values.__getitem__))
        return True

    def flush(self, shard: str) -> None:
        rows = self.rows.pop(shard, [])
        self.since.pop(shard, None)
        self.values.pop(shard, None)
        if rows:
            rows.sort(key=lambda r: (r["prompt_index"], r["sample_index"]))
            table = pa.Table.from_pylist(rows, schema=self.schema)
            self.out.check_lease()  # a runner that lost its lease must not add parts
            self.before_commit()
            storage.write_parquet(self.out.path(shard, f"part-{_stamp()}-{len(rows)}rows-of{self.shards}.parquet"),
                                  table)

    def flush_all(self) -> None:
        for shard in list(self.rows):
            self.flush(shard)


def _stamp() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
