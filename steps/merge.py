"""merge: check that every (prompt, sample) is there exactly once, order the rows, write the result.

Owns the merged output of docs/contract.md ("Result"): `merged-00000.parquet`, ... ordered by
(prompt_index, sample_index), each file at most `file_rows` rows and about `file_bytes` bytes of
in-memory (Arrow) data. Refuses to write anything when a row is missing, unexpected, or present
twice with different content: the error names the first rows, their count and the command that
repairs them. Identical duplicates (a retried part) are dropped.

Memory: row contents are held about one output file at a time, whatever the result's size. A first
pass reads only the key columns of every generate part and keeps one 8-byte slot per row, its place
in the output (about 26 bytes per row at peak while checking: ~260 MB for 10M rows; no sort, slots
index the output). The second pass writes the files in order, holding one file's rows plus the parts
that also hold rows of later files. Duplicates are compared before anything is written, reading only
the parts that hold them.

    result = merge(cfg, out)   # out.upstream["generate"] complete; on the leader or any one machine
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from pipeline import storage
from pipeline.pod import preemption
from pipeline.run import status
from pipeline.run.config import Config
from pipeline.errors import StepFailed
from pipeline.run.progress import Progress
from pipeline.run.result import missing_files
from pipeline.run.step import StepOutput, StepResult
from steps.generate import LOGPROBS, PART_FIX, PROMPT_LOGPROBS, check_part_keys, schema
from steps.tokenize import read_shard

FILE_ROWS = 1_000_000
"""Most rows in one merged file."""
FILE_BYTES = 256 << 20
"""About the most in-memory (Arrow) bytes of one merged file; the Parquet file is smaller."""
FILE_PREFIX = "merged-"
KEYS = ["prompt_index", "sample_index"]
EXAMPLES = 5
"""Rows named in an error message; the count covers the rest."""


@dataclass(frozen=True)
class MergeSummary:
    rows: int
    """Rows written: one per (prompt, sample)."""
    files: int
    prompts: int
    samples_per_prompt: int
    parts_read: int
    """generate parts read."""
    duplicates_dropped: int
    """Identical copies of a row (a retried part) dropped; differing copies fail the step instead."""
    bytes: int
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: dict[str, int]
    """Rows by finish_reason (eos, stop, length)."""
    completion_logprob_mean: float | None = None
    """With `sampling.logprobs`: the mean log-probability of every completion token of the result."""
    completion_perplexity: float | None = None
    """exp(-completion_logprob_mean)."""
    prompt_logprob_mean: float | None = None
    """With `sampling.prompt_logprobs`: the mean log-probability of every prompt token that has
    one (all but each prompt's first), each prompt counted once whatever `sampling.n`."""
    prompt_perplexity: float | None = None
    """exp(-prompt_logprob_mean): the prompt set's perplexity under the model."""


class _LogprobTotals:
    """The sums and counts of the result's log-probabilities, file by file (`MergeSummary`)."""

    def __init__(self):
        self.sums: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()

    def add(self, table: pa.Table) -> None:
        if LOGPROBS.name in table.column_names:
            self._add("completion", table[LOGPROBS.name])
        if PROMPT_LOGPROBS.name in table.column_names:  # a prompt's samples share its list: its first sample's
            self._add("prompt", table.filter(pc.equal(table["sample_index"], 0))[PROMPT_LOGPROBS.name])

    def _add(self, name: str, lists: pa.ChunkedArray) -> None:
        values = pc.list_flatten(lists).cast(pa.float64())
        self.sums[name] += float(pc.sum(values, min_count=0).as_py())  # nulls (a prompt's first token) left out
        self.counts[name] += len(values) - values.null_count

    def summary(self) -> dict[str, float]:
        """{name}_logprob_mean and {name}_perplexity for each kind the result has."""
        means = {name: self.sums[name] / count for name, count in self.counts.items() if count}
        return {**{f"{name}_logprob_mean": mean for name, mean in means.items()},
                **{f"{name}_perplexity": math.exp(-mean) for name, mean in means.items()}}


def merge(cfg: Config, out: StepOutput, *, file_rows: int = FILE_ROWS, file_bytes: int = FILE_BYTES) -> StepResult:
    """Verify exactly-once coverage of generate's parts and write them merged and ordered."""
    generate_url = out.upstream["generate"].url
    generate = status.read_marker(generate_url)
    if generate is None:
        raise StepFailed(f"generate output {generate_url} is not complete: run `pipeline run generate --config FILE`")
    n = cfg.sampling.n
    accepted = _accepted_prompts(out.upstream["tokenize"].url)
    parts = _Parts.of(generate_url, generate, schema(cfg))
    keys = _read_keys(parts, accepted, n)
    first = _check_coverage(keys, accepted, n, generate_url)
    _check_duplicates(keys, first, accepted, n, parts, generate_url, file_rows)

    # Each file replaces the one of its name, and the earlier files this run did not rewrite (an
    # attempt cut into more files) go last: a stop before the first write, in a forced rerun of a
    # complete merge, leaves its result as it was (removing them first lost it to a Ctrl-C).
    earlier = {url.rsplit("/", 1)[-1]: url for url in storage.list_files(out.url, suffix=".parquet")
               if url.rsplit("/", 1)[-1].startswith(FILE_PREFIX)}
    files, finish_reasons, logprobs = _write_merged(out, parts, keys, first, file_rows, file_bytes)
    for name in earlier.keys() - {_file_name(i) for i in range(len(files))}:
        storage.remove(earlier[name])
    rows = sum(f["rows"] for f in files)
    if rows != len(accepted) * n:  # the rows in must be the rows out, whatever happened above
        raise StepFailed(f"merge wrote {rows} rows to {out.url}, expected {len(accepted) * n} (a bug)")
    return StepResult(rows=rows, files=files, summary=MergeSummary(
        rows=rows, files=len(files), prompts=len(accepted), samples_per_prompt=n, parts_read=len(parts.paths),
        duplicates_dropped=keys.rows - len(first), bytes=sum(f["bytes"] for f in files),
        prompt_tokens=sum(f["prompt_tokens"] for f in files),
        completion_tokens=sum(f["completion_tokens"] for f in files),
        finish_reasons=dict(sorted(finish_reasons.items())),
        **logprobs.summary(),
    ))


def redo(cfg: Config, record: status.StepRecord, url: str) -> str | None:
    """The merged files are the result users read and scripts list (`status --json`): one that is
    gone is written again (the same rows, the same bytes) rather than named as the result."""
    gone = missing_files(url, [f["path"] for f in record.files])
    if gone:
        more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
        return f"complete, but its file {gone[0]}{more} is gone: write the merged files again"
    return None


# --- inputs ------------------------------------------------------------------------------------


def _accepted_prompts(tokenize_url: str) -> np.ndarray:
    """Sorted prompt_index of every prompt tokenize accepted (the rows generate had to cover)."""
    tokenize = status.read_marker(tokenize_url)
    if tokenize is None:
        raise StepFailed(f"tokenize output {tokenize_url} (generate's input) is not complete: "
                         f"run `pipeline run tokenize --config FILE`")
    shards = sorted(f["path"] for f in tokenize.files if f["path"].startswith("shard-"))
    arrays = [read_shard(storage.join(tokenize_url, s), columns=["prompt_index"])["prompt_index"] for s in shards]
    accepted = np.sort(np.concatenate([a.to_numpy() for a in arrays]) if arrays else np.zeros(0, np.int64))
    if len(accepted) and np.any(accepted[1:] == accepted[:-1]):
        raise StepFailed(f"tokenize output {tokenize_url} lists a prompt_index twice: "
                         f"rerun `pipeline run tokenize --config FILE --force`")
    return accepted


@dataclass(frozen=True)
class _Parts:
    """The generate parts listed in generate's marker, opened through one filesystem."""

    url: str
    fs: fsspec.AbstractFileSystem
    names: list[str]
    """Paths relative to the generate folder, e.g. `shard-00003/part-...parquet`."""
    paths: list[str]
    schema: pa.Schema
    """The columns every part holds, and the merged files (generate.schema)."""
    checksums: list[str | None]
    """Each part's fingerprint as generate's marker records it (`storage.fingerprint`)."""

    @classmethod
    def of(cls, generate_url: str, generate: status.StepRecord, schema: pa.Schema) -> "_Parts":
        # The marker, not a listing, says which parts belong to the output (STYLE: trust the marker).
        recorded = {f["path"]: f.get("checksum") for f in generate.files if f["path"].endswith(".parquet")}
        names = sorted(recorded)
        fs, root = storage.filesystem(generate_url)
        return cls(generate_url, fs, names, [f"{root.rstrip('/')}/{name}" for name in names], schema,
                   [recorded[name] for name in names])

    def read(self, i: int, columns: list[str] | None = None, verify: bool = False) -> tuple[pa.Table, pq.FileMetaData]:
        """Part i's `columns`; with `verify`, its bytes are first checked against generate's record."""
        # pq.ParquetFile on a local path is ~3x faster than pq.read_table through fsspec for
        # generate's small parts (measured: 1.1 s against 3.7 s for the key columns of 3,920 parts).
        url = f"{self.url}/{self.names[i]}"
        with storage.unreadable("generate part", url, PART_FIX):
            if verify or not isinstance(self.fs, LocalFileSystem):
                # The whole part (small), read with retries as every other file.
                data = storage.read_bytes(url)
                if verify:
                    self._check(i, data)
                source = pa.BufferReader(data)
            else:
                source = self.paths[i]
            parquet = pq.ParquetFile(source)
            table = parquet.read(columns=columns, use_threads=False)
        return table, parquet.metadata

    def _check(self, i: int, data: bytes) -> None:
        """A part whose bytes are not the ones generate recorded was changed since: a flipped bit
        can still parse, as other token ids or counts, and would be merged and uploaded as data."""
        recorded = self.checksums[i]
        if not recorded or not recorded.startswith("md5:"):  # older markers; a GCS composite object's crc32c
            return
        got = f"md5:{hashlib.md5(data, usedforsecurity=False).hexdigest()}:{len(data)}"
        if got != recorded:
            change = "another size" if got.rsplit(":", 1)[1] != recorded.rsplit(":", 1)[1] else "other bytes"
            raise StepFailed(f"generate part {self.url}/{self.names[i]} is not the file generate wrote ({change} than its "
                             f"marker records: it was changed since): {PART_FIX}")

    def read_rows(self, i: int) -> pa.Table:
        table = self.read(i)[0].replace_schema_metadata(None)
        if table.schema != self.schema:
            try:
                table = table.select(self.schema.names).cast(self.schema)
            except (KeyError, pa.ArrowException) as err:
                raise StepFailed(f"generate part {self.url}/{self.names[i]} does not have the merged columns "
                                 f"({err}); expected {self.schema}: {PART_FIX}") from err
        return table


@dataclass(frozen=True)
class _Keys:
    """Where each row of every part goes: rows are numbered in part order, 0 .. rows-1."""

    slot: np.ndarray
    """Per row: its place in the output, rank of its prompt among the accepted ones x n + sample_index
    (so slots sort like (prompt_index, sample_index)); -1 for a row that is not wanted."""
    part_start: np.ndarray
    """Per part: the number of its first row; one more entry at the end, the total."""
    encoded_bytes_per_row: np.ndarray
    """Per part: a row's encoded size from the Parquet metadata (a first estimate of its size)."""
    unwanted: int
    unwanted_examples: list[str]

    @property
    def rows(self) -> int:
        return len(self.slot)

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part, row within the part) of row numbers."""
        part = np.searchsorted(self.part_start, rows, side="right") - 1
        return part, rows - self.part_start[part]


def _read_keys(parts: _Parts, accepted: np.ndarray, n: int) -> _Keys:
    """The key columns of every part, reduced to one slot per row (8 bytes per row)."""
    slots, counts, encoded, unwanted, examples = [], [], [], 0, []
    for i in range(len(parts.paths)):
        table, meta = parts.read(i, columns=KEYS, verify=True)
        check_part_keys(table, f"{parts.url}/{parts.names[i]}")
        prompt = table["prompt_index"].to_numpy()
        sample = table["sample_index"].to_numpy().astype(np.int64)
        rank = np.searchsorted(accepted, prompt)
        wanted = (rank < len(accepted)) & (sample >= 0) & (sample < n)
        wanted[wanted] = accepted[rank[wanted]] == prompt[wanted]
        slots.append(np.where(wanted, rank * n + sample, -1))
        for j in np.flatnonzero(~wanted)[:EXAMPLES - len(examples)]:
            examples.append(f"(prompt_index {prompt[j]}, sample {sample[j]}) in {parts.names[i]}")
        unwanted += int(np.count_nonzero(~wanted))
        counts.append(table.num_rows)
        encoded.append(sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
                       / max(table.num_rows, 1))
    return _Keys(np.concatenate(slots) if slots else np.zeros(0, np.int64),
                 np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]),
                 np.array(encoded, np.float64), unwanted, examples)


# --- checks ------------------------------------------------------------------------------------


def _check_coverage(keys: _Keys, accepted: np.ndarray, n: int, generate_url: str) -> np.ndarray:
    """The output in order: for each wanted (prompt, sample), the first row that holds it.

    Raises when a wanted row is missing or a row is not wanted (a prompt tokenize did not accept, or
    sample_index outside 0..n-1). No sort: slots index the output directly.
    """
    first = np.full(len(accepted) * n, keys.rows, np.int64)  # keys.rows: no row holds it
    if keys.unwanted:
        wanted = np.flatnonzero(keys.slot >= 0)
        np.minimum.at(first, keys.slot[wanted], wanted)
    else:
        np.minimum.at(first, keys.slot, np.arange(keys.rows))
    missing = np.flatnonzero(first == keys.rows)
    problems = []
    if len(missing):
        shown = ", ".join(f"(prompt_index {accepted[m // n]}, sample {m % n})" for m in missing[:EXAMPLES])
        problems.append(f"{len(missing)} of {len(first)} (prompt, sample) rows are missing: {shown}"
                        f"{_more(len(missing))}")
    if keys.unwanted:
        problems.append(f"{keys.unwanted} rows are not wanted (prompt not accepted by tokenize, or sample_index "
                        f"outside 0..{n - 1}): {', '.join(keys.unwanted_examples)}{_more(keys.unwanted)}")
    if problems:
        fix = ("make the missing rows with `pipeline run generate --config FILE --force` (it keeps the finished "
               "parts and generates only what is missing), then `pipeline run merge --config FILE`")
        if keys.unwanted:
            fix = ("the parts named hold rows of another run: delete them, then run "
                   "`pipeline run generate --config FILE --force` and `pipeline run merge --config FILE`")
        raise StepFailed(f"merge: generate output {generate_url} is not exactly the accepted prompts x "
                         f"sampling.n={n}: {'; '.join(problems)}. To repair: {fix}")
    return first


def _check_duplicates(keys: _Keys, first: np.ndarray, accepted: np.ndarray, n: int, parts: _Parts,
                      generate_url: str, batch_rows: int) -> None:
    """Raise if a (prompt, sample) is held by two rows with different content; identical copies are fine."""
    block = 1 << 20  # bounded temporaries for 10M+ rows
    copies = np.concatenate([np.zeros(0, np.int64)] + [
        b + np.flatnonzero(first[keys.slot[b:b + block]] != np.arange(b, min(b + block, keys.rows)))
        for b in range(0, keys.rows, block)])
    if not len(copies):
        return
    copies = copies[np.argsort(keys.slot[copies], kind="stable")]
    originals = first[keys.slot[copies]]
    conflicts: list[tuple[int, int]] = []  # (copy, original) row numbers
    for b in range(0, len(copies), batch_rows):
        (cp, cr), (op, orow) = keys.locate(copies[b:b + batch_rows]), keys.locate(originals[b:b + batch_rows])
        loaded = {int(p): parts.read_rows(int(p)) for p in np.unique(np.concatenate([cp, op]))}
        same = _rows_equal(_gather(loaded, cp, cr), _gather(loaded, op, orow))
        conflicts.extend(zip(copies[b:b + batch_rows][~same].tolist(), originals[b:b + batch_rows][~same].tolist()))
    if conflicts:
        def name(r: int) -> str:
            return parts.names[int(keys.locate(np.array([r]))[0][0])]

        shown = "; ".join(
            f"(prompt_index {accepted[keys.slot[c] // n]}, sample {keys.slot[c] % n}) in {name(o)} and {name(c)}"
            for c, o in conflicts[:EXAMPLES])
        raise StepFailed(
            f"merge: generate output {generate_url} holds {len(conflicts)} (prompt, sample) rows twice with "
            f"different content: {shown}{_more(len(conflicts))}. Generation is deterministic, so one copy comes "
            f"from another run or a changed engine: delete the parts you do not trust, then run "
            f"`pipeline run generate --config FILE --force` (it regenerates only the rows that are then missing) "
            f"and `pipeline run merge --config FILE`")


def _rows_equal(a: pa.Table, b: pa.Table) -> np.ndarray:
    """Per row: do the two aligned tables hold the same values in every column?"""
    same = np.ones(a.num_rows, bool)
    for name in a.column_names:
        x, y = a[name].combine_chunks(), b[name].combine_chunks()
        if pa.types.is_list(x.type):
            same &= _lists_equal(x, y)
        else:
            eq = pc.fill_null(pc.equal(x, y), False)
            both_null = pc.and_(pc.is_null(x), pc.is_null(y))
            same &= pc.or_(eq, both_null).to_numpy(zero_copy_only=False)
    return same


def _lists_equal(x: pa.ListArray, y: pa.ListArray) -> np.ndarray:
    same = pc.fill_null(pc.equal(pc.list_value_length(x), pc.list_value_length(y)), False)
    same = same.to_numpy(zero_copy_only=False).copy()
    rows = np.flatnonzero(same)
    xs, ys = x.take(pa.array(rows)), y.take(pa.array(rows))
    differs = pc.not_equal(pc.list_flatten(xs), pc.list_flatten(ys)).to_numpy(zero_copy_only=False)
    same[rows[np.unique(pc.list_parent_indices(xs).to_numpy()[differs])]] = False
    return same


def _more(count: int) -> str:
    return f" and {count - EXAMPLES} more" if count > EXAMPLES else ""


# --- writing -----------------------------------------------------------------------------------


def _write_merged(out: StepOutput, parts: _Parts, keys: _Keys, first: np.ndarray, file_rows: int,
                  file_bytes: int) -> tuple[list[dict[str, Any]], Counter[str], _LogprobTotals]:
    """Write the rows `first` names (row numbers, in output order) into files of bounded size.

    A part is read when the first file that needs it is planned and dropped after the last one.
    Returns the files' manifest entries, how many rows end for each finish_reason, and the
    log-probabilities' totals.
    """
    total = len(first)
    last_use = np.full(len(parts.paths), -1, np.int64)
    for b in range(0, total, 1 << 20):
        np.maximum.at(last_use, keys.locate(first[b:b + (1 << 20)])[0], np.arange(b, min(b + (1 << 20), total)))
    sizes = _RowBytes(keys.encoded_bytes_per_row)
    loaded: dict[int, pa.Table] = {}
    files: list[dict[str, Any]] = []
    finish_reasons: Counter[str] = Counter()
    logprobs = _LogprobTotals()
    start = 0
    with Progress(total=total, desc="merge", unit="row") as bar:
        while start < total or not files:  # an empty result still gets one (empty) file
            preemption.check()
            part, row = keys.locate(first[start:start + file_rows])
            while True:  # plan the file; read the parts it needs; replan with their measured sizes
                end = _file_end(sizes.of(part), file_bytes)
                unread = [p for p in np.unique(part[:end]).tolist() if p not in loaded]
                if not unread:
                    break
                for p in unread if sizes.calibrated else unread[:1]:  # one part first: no wild estimate
                    loaded[p] = parts.read_rows(p)
                    sizes.measure(p, loaded[p])
            table = _gather(loaded, part[:end], row[:end]) if end else parts.schema.empty_table()
            files.append(_write_file(out, len(files), table))
            for count in pc.value_counts(table["finish_reason"]).to_pylist():
                finish_reasons[count["values"]] += count["counts"]
            logprobs.add(table)
            bar.update(end)
            start += end
            for p in [p for p in loaded if last_use[p] < start]:
                del loaded[p]
    return files, finish_reasons, logprobs


class _RowBytes:
    """In-memory bytes per row of each part: measured once a part is read, estimated before.

    The estimate is the Parquet metadata's encoded size, scaled by how Arrow sizes compared with it
    for the parts read so far (dictionary-encoded text is much smaller encoded than in memory).
    """

    def __init__(self, encoded_per_row: np.ndarray):
        self.encoded = encoded_per_row
        self.actual = np.full(len(encoded_per_row), np.nan)
        self.sum_actual = self.sum_encoded = 0.0

    @property
    def calibrated(self) -> bool:
        return self.sum_encoded > 0

    def measure(self, p: int, table: pa.Table) -> None:
        if np.isnan(self.actual[p]) and table.num_rows:
            self.actual[p] = table.nbytes / table.num_rows
            self.sum_actual += table.nbytes
            self.sum_encoded += self.encoded[p] * table.num_rows

    def of(self, parts: np.ndarray) -> np.ndarray:
        scale = self.sum_actual / self.sum_encoded if self.sum_encoded else 1.0
        actual = self.actual[parts]
        return np.where(np.isnan(actual), self.encoded[parts] * scale, actual)


def _file_end(row_bytes: np.ndarray, file_bytes: int) -> int:
    """How many of the next rows go in one file: as many as fit in file_bytes, at least one."""
    fit = int(np.searchsorted(np.cumsum(row_bytes), file_bytes, side="right"))
    return min(max(fit, 1), len(row_bytes))


def _gather(loaded: dict[int, pa.Table], part: np.ndarray, row: np.ndarray) -> pa.Table:
    """The rows (part[i], row[i]) of the loaded parts, in that order."""
    ids = np.unique(part)
    tables = [loaded[int(p)] for p in ids]
    starts = np.cumsum([0] + [t.num_rows for t in tables[:-1]])
    index = starts[np.searchsorted(ids, part)] + row
    # take() on one combined table: 3.2 s for 1M rows, against 6.7 s on the 3,920 chunks of the parts.
    return pa.concat_tables(tables).combine_chunks().take(pa.array(index))


def _file_name(index: int) -> str:
    return f"{FILE_PREFIX}{index:05d}.parquet"


def _write_file(out: StepOutput, index: int, table: pa.Table) -> dict[str, Any]:
    entry = storage.write_parquet(out.path(_file_name(index)), table)
    return {
        **entry,
        "prompt_tokens": int(pc.sum(table["num_prompt_tokens"]).as_py() or 0),
        "completion_tokens": int(pc.sum(table["num_completion_tokens"]).as_py() or 0),
    }
