"""tokenize: prompt files in, token-balanced Parquet shards out (runs on the leader).

Owns numbering and checking the rows that `steps/prompt_files.py` reads (JSONL, Parquet or
.txt, local or remote, maybe compressed), chat formatting with the tokenizer's own template,
tokenizing with the checkpoint's fast tokenizer, and writing `shard-00000.parquet`, ... (+ `rejected.parquet`). Refuses to
truncate a prompt, to drop a row without a record, and to write any shard once
`on_invalid: fail` has met a bad row.

Rules:
- prompt_index: a row is a JSONL line, a .txt line or a Parquet row, numbered from 0 across
  the files in sorted URL order. Blank (whitespace-only) lines are not rows: they get no
  index and are counted in the summary as `blank_lines`. Rejected rows keep their index, so
  an index always names the same input row whatever `on_invalid` says, and the indices of
  accepted rows may have gaps.
- prompt_id: the `id_field` value (a string, or an integer written as a string), else
  str(prompt_index). A repeated id is rejected; the first accepted row keeps it.
- BOS: plain prompts get the tokenizer's own special tokens (the BOS its post-processor
  adds). With `chat_template`, the rendered text is tokenized without special tokens when
  the template already starts with bos_token, else with them: one BOS either way when the
  model uses one. A `truncation` setting in tokenizer.json is switched off: a prompt longer
  than `max_prompt_tokens` (counted after template and BOS) is rejected, never cut.
- Bad rows (reason kinds): invalid UTF-8, invalid JSON, not a JSON object, missing text,
  text not a string, empty prompt (whitespace only), missing id, bad id, duplicate
  prompt_id, too long, no tokens. `fail`: the whole input is still read (to count them),
  nothing is written, and StepFailed names the first one (file, line, reason) and counts
  the rest by kind. `skip`: each goes to `rejected.parquet` (file, line, prompt_index,
  prompt_id, reason, raw) and the count to the summary; for Parquet input `line` is the
  1-based row number. `raw` (its first 1000 characters) is the row as read: a JSONL or .txt
  line, a Parquet row's text and id columns as a JSON object; for a row refused after it was
  read (too long, no tokens, a repeated id, a text the tokenizer cannot take), its prompt text. Problems with a whole input (no files,
  an unknown file type, a file that cannot be read, no prompts, every row rejected) fail
  in both modes.

Design: one pass; memory holds one batch and at most BUFFER_BYTES of shard rows. Read rows
(prompt_files.py: blocks of text, Arrow's JSONL parser where clean, Parquet record batches),
check them, and tokenize a batch (BATCH_ROWS) at a time (batched calls into the Rust tokenizer, which uses every core).
Each accepted row goes to the shard with the fewest tokens so far (ties: the lowest shard
number) and is appended to that shard's local Parquet file. This online greedy keeps every
shard's token total within one prompt's length (<= max_prompt_tokens) of every other
shard's - the same absolute bound as longest-first greedy - without keeping every prompt's
length, spilling tokenized batches and reading them back. Rows reach each shard in input
order, so shards are sorted by prompt_index for free, and the first N prompts open shards
0..N-1, so a small input just gets fewer shards (never an empty one). Only the set of
prompt_ids seen grows with the input (with `id_field`; roughly 100 bytes per prompt).
Shards are written in a local temp folder ($TMPDIR needs room for one copy of the output)
and moved into the output folder, each atomically, only after the whole input was read;
the runner writes the success marker last. A stopped run starts over: tokenizing is one
pass.

    result = tokenize(cfg, out)   # what `pipeline run tokenize` runs on the leader
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.checkpoint import load_tokenizer
from pipeline import storage
from pipeline.pod import hosts, preemption
from pipeline.run.checks import prompt_file_format
from pipeline.run.config import Config, PromptsConfig, is_text
from pipeline.errors import ConfigError, StepFailed, checkpoint_errors
from pipeline.run.progress import Progress
from pipeline.run.step import StepOutput, StepResult
from steps.prompt_files import BATCH_ROWS, BLANK, Conversation, Row, input_files, read_rows

SHARD_FIX = ("rerun `pipeline run tokenize --config FILE --force` to write the shards again (the same rows: "
             "the steps after it keep their work)")
"""What to do about a shard that cannot be read (in generate, in merge)."""


def read_shard(url: str, columns: list[str]) -> pa.Table:
    """Columns of a shard this step wrote (for generate and merge); one that cannot be read is a
    StepFailed naming it and SHARD_FIX."""
    with storage.unreadable("tokenize shard", url, SHARD_FIX):
        return storage.read_parquet(url, columns=columns)


SHARD_SCHEMA = pa.schema([
    ("prompt_index", pa.int64()),
    ("prompt_id", pa.string()),
    ("prompt", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("num_tokens", pa.int32()),
])
REJECTED_SCHEMA = pa.schema([
    ("file", pa.string()),
    ("line", pa.int64()),
    ("prompt_index", pa.int64()),
    ("prompt_id", pa.string()),
    ("reason", pa.string()),
    ("raw", pa.string()),
])
REJECTED_FILE = "rejected.parquet"
SHARDS_PER_HOST = 8
"""num_shards: auto gives this many shards per host, so a slow shard does not hold up a host."""
FLUSH_ROWS = 65536
"""A shard's buffered rows become one Parquet row group at this many rows."""
BUFFER_BYTES = 128 << 20
"""All shards' buffers are flushed once together they hold this many bytes."""
RAW_CHARS = 1000
"""Characters of a rejected row's raw text kept in rejected.parquet."""


@dataclass(frozen=True)
class TokenizeSummary:
    rows_in: int
    """Prompt rows read (blank lines of JSONL/.txt files excluded)."""
    rows: int
    """Prompts accepted into the shards."""
    rejected: int
    """Rows refused (on_invalid: skip), each in rejected.parquet with its source and reason."""
    tokens: int
    """Prompt tokens in the shards (after chat template and BOS)."""
    max_tokens: int
    """The longest accepted prompt, in tokens."""
    num_shards: int
    blank_lines: int
    rejected_reasons: dict[str, int]
    """Rejected rows counted by reason."""
    chat_template: bool
    conversations: int
    """Accepted prompts given as conversations (lists of messages, with the chat template)."""
    add_special_tokens: bool
    """Whether the tokenizer added BOS (false when the chat template already holds it)."""
    input_files: list[dict[str, Any]]
    """Per prompt file: url, bytes, fingerprint, rows."""


def tokenize(cfg: Config, out: StepOutput) -> StepResult:
    """Read, check and tokenize every prompt; write balanced shards (+ rejected rows)."""
    options = cfg.prompts
    urls = input_files(options.path)
    for url in urls:
        prompt_file_format(url, options)
    encode = _Encoder(cfg)
    num_shards = options.num_shards if options.num_shards != "auto" else SHARDS_PER_HOST * hosts.process_count()
    with tempfile.TemporaryDirectory(prefix="pipeline-tokenize-") as tmp:
        rejects = _Rejects(os.path.join(tmp, REJECTED_FILE), keep=options.on_invalid == "skip")
        shards = _Shards(tmp, num_shards)
        reader = _Reader(options, encode, shards, rejects)
        inputs = []
        sizes = [storage.size(url) for url in urls]
        total, before = max(sum(sizes), 1), 0  # the ETA: the prompts' count is known only at the end
        with Progress(total=None, desc="tokenize", unit="prompt") as progress:
            for url, size in zip(urls, sizes):
                rows_before = reader.rows_in
                for rows in read_rows(url, options, on_read=lambda share: progress.read((before + share * size) / total)):
                    preemption.check()
                    batch = reader.take(url, rows)
                    progress.update(batch.taken, tokens=reader.finish(batch))
                before += size
                # The size read before it: a file that changed since is found before the step is
                # marked complete (`identity.changed_input`), so a complete step's record holds.
                inputs.append({"url": url, "bytes": size, "fingerprint": storage.fingerprint(url),
                               "rows": reader.rows_in - rows_before})
        if rejects.count and options.on_invalid == "fail":
            raise StepFailed(rejects.failure_message())
        if reader.rows_in == 0:
            raise StepFailed(f"prompts.path {options.path}: no prompts in {len(urls)} file(s) "
                             f"({reader.blank_lines} blank lines; check the files)")
        if shards.rows == 0:
            raise StepFailed(f"prompts.path {options.path}: all {reader.rows_in} rows were rejected; "
                             f"{rejects.first_and_counts()}")
        if shards.rows + rejects.count != reader.rows_in:
            raise StepFailed(f"tokenize lost rows: {reader.rows_in} in, {shards.rows} accepted + "
                             f"{rejects.count} rejected (a bug)")
        files = shards.commit(out) + rejects.commit(out)
    if rejects.count:  # skipped rows are the user's data: say where they are, not only how many
        print(f"tokenize: {rejects.count} row(s) rejected ({rejects.first_and_counts()}); each with its file, line "
              f"and reason in {out.path(REJECTED_FILE)}", file=sys.stderr, flush=True)
    _remove_stale(out, keep={f["path"] for f in files})
    return StepResult(rows=shards.rows, files=files, summary=TokenizeSummary(
        rows_in=reader.rows_in, rows=shards.rows, rejected=rejects.count, tokens=shards.tokens,
        max_tokens=shards.max_tokens, num_shards=shards.used, blank_lines=reader.blank_lines,
        rejected_reasons=dict(rejects.kinds), chat_template=options.chat_template, conversations=reader.conversations,
        add_special_tokens=encode.add_special_tokens, input_files=inputs,
    ))


# --- tokenizer --------------------------------------------------------------------------


class _Encoder:
    """Chat formatting + batched fast tokenization, with the model's BOS rule."""

    def __init__(self, cfg: Config):
        with checkpoint_errors(cfg.model.path):
            self.tokenizer = load_tokenizer(cfg.model.path)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            # A copy: the loaded tokenizer is shared (cached); ours must never truncate or pad.
            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        self.backend = backend
        self.format: Callable[[list[str]], list[str]] = list
        self.add_special_tokens = True
        self.system_prompt = cfg.prompts.system_prompt
        if cfg.prompts.chat_template:
            self.format, first = _chat_formatter(self.tokenizer, cfg.prompts.system_prompt, cfg.model.path)
            bos = self.tokenizer.bos_token
            self.add_special_tokens = not (bos and first.startswith(bos))

    def render(self, conversation: Conversation) -> None:
        """Renders a conversation with the chat template into `conversation.rendered`, the
        system prompt first unless it has its own; the template's error, if any, is raised."""
        messages = conversation.messages
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        conversation.rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        formatted = self.format(texts)
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch_fast(formatted, add_special_tokens=self.add_special_tokens)]
        return self.tokenizer(formatted, add_special_tokens=self.add_special_tokens,
                              return_attention_mask=False)["input_ids"]


_TEMPLATE_PROBES = ("x", "  spaced words \n", "{{ a }} {% b %} <s> & \"q\" 'a' \\n ü 😀", "line 1\nline 2\t")
"""Contents that show whether a template inserts content verbatim (no trim, no escaping)."""


def _chat_formatter(tokenizer: Any, system_prompt: str | None, model_path: str) -> tuple[Callable[[list[str]], list[str]], str]:
    """A batch formatter for the tokenizer's chat template, and one rendered example.

    Rendering Jinja per prompt costs about as much as tokenizing it. When the template puts
    the user's content in verbatim (checked on probes with edge-case whitespace and
    characters), every prompt is `prefix + text + suffix`; otherwise each is rendered.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"prompts.chat_template is true but the tokenizer at model.path {model_path} has no "
                          f"chat template (set prompts.chat_template=false, or add chat_template.jinja)")

    def render(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    marker = "\x00PROMPT\x00"
    try:
        probe = render(marker)
    except Exception as err:  # noqa: BLE001 - Jinja raises its own errors (e.g. no system role)
        raise ConfigError(f"prompts.chat_template: the chat template of {model_path} fails"
                          f"{' with prompts.system_prompt set' if system_prompt is not None else ''}: "
                          f"{type(err).__name__}: {err}") from err
    if probe.count(marker) == 1:
        prefix, suffix = probe.split(marker)
        if all(render(text) == prefix + text + suffix for text in _TEMPLATE_PROBES):
            return (lambda texts: [t.rendered if isinstance(t, Conversation) else prefix + t + suffix for t in texts]), probe
    return (lambda texts: [t.rendered if isinstance(t, Conversation) else render(t) for t in texts]), probe


# --- rows -> shards ---------------------------------------------------------------------


@dataclass
class _Batch:
    """Checked rows of one file waiting for their tokens (parallel lists), and bad rows so far."""

    url: str
    numbers: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    bad: list[tuple] = field(default_factory=list)
    """(prompt_index, line, prompt_id, (kind, detail), raw), in any order."""
    taken: int = 0


class _Reader:
    """Numbers rows, checks them, and hands the tokenized good ones to the shards.

    Tokenizing runs inline: a worker thread overlapping it with checking and writing was
    slower on 2 cores (the Rust tokenizer already uses every core) and cannot help where
    many cores make the per-row Python work the bottleneck.
    """

    def __init__(self, options: PromptsConfig, encode: _Encoder, shards: "_Shards", rejects: "_Rejects"):
        self.options, self.encode, self.shards, self.rejects = options, encode, shards, rejects
        self.rows_in = 0
        self.blank_lines = 0
        self.conversations = 0
        self.seen_ids: set[str] | None = set() if options.id_field else None

    def take(self, url: str, rows: list[Row]) -> _Batch:
        """Give each row its prompt_index; set aside the rows bad before tokenizing."""
        batch = _Batch(url)
        for number, text, prompt_id, raw, problem in rows:
            if problem is BLANK:
                self.blank_lines += 1
                continue
            index = self.rows_in
            self.rows_in += 1
            batch.taken += 1
            if problem is None and isinstance(text, Conversation):
                problem = self._render(text)
            if problem is not None:
                batch.bad.append((index, number, prompt_id, problem, raw))
                continue
            batch.numbers.append(number)
            batch.indices.append(index)
            batch.texts.append(text)
            batch.ids.append(prompt_id if prompt_id is not None else str(index))
        return batch

    def _render(self, conversation: Conversation) -> tuple[str, str] | None:
        """Renders a conversation (`_Encoder.render`); the template's refusal is the row's problem."""
        try:
            self.encode.render(conversation)
        except Exception as err:  # noqa: BLE001 - Jinja raises its own errors (e.g. roles out of order)
            return "chat template failed", f"{type(err).__name__}: {err}"
        return None

    def finish(self, batch: _Batch) -> int:
        """Tokenize, check lengths and ids, send good rows to the shards, record bad ones; tokens kept."""
        token_ids = self._token_ids(batch)
        limit, seen, ids = self.options.max_prompt_tokens, self.seen_ids, batch.ids
        lengths = list(map(len, token_ids))
        keep = range(len(token_ids))
        if lengths and 0 < min(lengths) and max(lengths) <= limit and (
                seen is None or (len(fresh := set(ids)) == len(ids) and seen.isdisjoint(fresh))):
            if seen is not None:
                seen |= fresh  # the usual batch: every row good, checked without a Python loop
        else:
            keep, lengths = self._check_each(batch, token_ids, lengths)
        for index, number, prompt_id, problem, raw in sorted(batch.bad, key=lambda b: b[0]):
            self.rejects.add(batch.url, number, index, prompt_id, problem, raw)
        if keep and not self.rejects.failing:
            columns = (batch.indices, ids, batch.texts, token_ids)
            if len(keep) < len(token_ids):
                columns = tuple([col[i] for i in keep] for col in columns)
            indices, ids, texts, token_ids = columns
            self.conversations += sum(isinstance(text, Conversation) for text in texts)
            self.shards.add(pa.record_batch([
                pa.array(indices, pa.int64()), pa.array(ids, pa.string()), pa.array(texts, pa.string()),
                _int32_lists(token_ids, lengths), pa.array(lengths, pa.int32()),
            ], schema=SHARD_SCHEMA), lengths)
        return sum(lengths)

    def _check_each(self, batch: _Batch, token_ids: list[list[int]], all_lengths: list[int]) -> tuple[list[int], list[int]]:
        """Row by row: which rows to keep and their lengths; the others go to `batch.bad`."""
        has_ids = self.seen_ids is not None
        keep, lengths = [], []
        limit, seen, ids = self.options.max_prompt_tokens, self.seen_ids, batch.ids
        for i, n in enumerate(all_lengths):
            problem = None
            if n > limit:
                problem = ("too long", f"{n} tokens > prompts.max_prompt_tokens={limit}")
            elif n == 0:
                problem = ("no tokens", "the tokenizer made no tokens of it")
            elif seen is not None:
                if ids[i] in seen:
                    problem = ("duplicate prompt_id", f"{ids[i]!r} is already used by an earlier row")
                else:
                    seen.add(ids[i])
            if problem is None:
                keep.append(i)
                lengths.append(n)
            else:
                batch.bad.append((batch.indices[i], batch.numbers[i], ids[i] if has_ids else None, problem,
                                  batch.texts[i]))
        return keep, lengths

    def _token_ids(self, batch: _Batch) -> list[list[int]]:
        if not batch.texts:
            return []
        try:
            return self.encode(batch.texts)
        except TypeError:
            # Lone surrogates (e.g. "\ud800" escapes in JSON) are not encodable text: find them.
            bad = [i for i, t in enumerate(batch.texts) if not is_text(t)]
            if not bad:
                raise
            for i in reversed(bad):
                batch.bad.append((batch.indices[i], batch.numbers[i],
                                  batch.ids[i] if self.seen_ids is not None else None,
                                  ("invalid UTF-8", "text holds a lone surrogate"),
                                  batch.texts[i].encode("utf-8", "backslashreplace").decode()))
                for col in (batch.numbers, batch.indices, batch.texts, batch.ids):
                    del col[i]
            return self.encode(batch.texts) if batch.texts else []


def _int32_lists(values: list[list[int]], lengths: list[int]) -> pa.Array:
    """list<int32> from Python lists, via one flat numpy array (~25% faster than pa.array)."""
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(values), np.int32, int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


class _Shards:
    """Online greedy into the lightest shard; each shard streams to a local Parquet file."""

    def __init__(self, folder: str, count: int):
        self.folder, self.count = folder, count
        self.heap = [(0, s) for s in range(count)]  # (tokens, shard): already a valid heap
        self.shard_rows = [0] * count
        self.shard_tokens = [0] * count
        self.buffers: list[list[pa.RecordBatch]] = [[] for _ in range(count)]
        self.buffered_rows = [0] * count
        self.buffered_bytes = 0
        self.writers: dict[int, pq.ParquetWriter] = {}
        self.max_tokens = 0

    @property
    def rows(self) -> int:
        return sum(self.shard_rows)

    @property
    def tokens(self) -> int:
        return sum(self.shard_tokens)

    @property
    def used(self) -> int:
        return sum(1 for r in self.shard_rows if r)

    def add(self, batch: pa.RecordBatch, lengths: list[int]) -> None:
        heap = self.heap
        shard_of = np.empty(len(lengths), np.int64)
        for i, n in enumerate(lengths):
            total, s = heap[0]
            heapq.heapreplace(heap, (total + n, s))
            shard_of[i] = s
            self.shard_tokens[s] += n
        self.max_tokens = max(self.max_tokens, max(lengths))
        order = np.argsort(shard_of, kind="stable")  # stable: rows stay in prompt_index order
        bounds = np.searchsorted(shard_of[order], np.arange(self.count + 1))
        grouped = batch.take(pa.array(order))
        for s in np.flatnonzero(np.diff(bounds)):
            part = grouped.slice(bounds[s], bounds[s + 1] - bounds[s])
            self.buffers[s].append(part)
            self.buffered_rows[s] += part.num_rows
            self.shard_rows[s] += part.num_rows
            self.buffered_bytes += part.nbytes
            if self.buffered_rows[s] >= FLUSH_ROWS:
                self._flush(s)
        if self.buffered_bytes >= BUFFER_BYTES:
            for s in range(self.count):
                self._flush(s)

    def _flush(self, s: int) -> None:
        if not self.buffers[s]:
            return
        if s not in self.writers:
            self.writers[s] = pq.ParquetWriter(self._path(s), SHARD_SCHEMA, compression="zstd")
        table = pa.Table.from_batches(self.buffers[s], schema=SHARD_SCHEMA)
        self.writers[s].write_table(table, row_group_size=table.num_rows)
        self.buffered_bytes -= sum(b.nbytes for b in self.buffers[s])
        self.buffers[s], self.buffered_rows[s] = [], 0

    def _path(self, s: int) -> str:
        return os.path.join(self.folder, _shard_name(s))

    def commit(self, out: StepOutput) -> list[dict[str, Any]]:
        """Move every shard into the output folder; return their manifest entries."""
        used = self.used
        if not all(self.shard_rows[:used]):
            raise StepFailed("tokenize: shards are not numbered contiguously (a bug)")
        entries = []
        for s in range(used):
            self._flush(s)
            self.writers.pop(s).close()
            entries.append({**_move(self._path(s), out.path(_shard_name(s))), "rows": self.shard_rows[s],
                            "tokens": self.shard_tokens[s]})
        return entries


def _shard_name(s: int) -> str:
    return f"shard-{s:05d}.parquet"


class _Rejects:
    """Counts bad rows by kind; with `keep`, streams them to a local rejected.parquet."""

    def __init__(self, path: str, keep: bool):
        self.path, self.keep = path, keep
        self.count = 0
        self.kinds: Counter[str] = Counter()
        self.firsts: dict[str, tuple[str, int, str]] = {}
        """Each kind's first bad row: (url, line, reason), in the order the kinds came."""
        self.rows: list[tuple] = []
        self.writer: pq.ParquetWriter | None = None

    @property
    def failing(self) -> bool:
        """With on_invalid=fail one bad row means no output: stop building shards."""
        return self.count > 0 and not self.keep

    def add(self, url: str, line: int, index: int, prompt_id: str | None, problem: tuple[str, str], raw: str) -> None:
        kind, detail = problem
        reason = f"{kind}: {detail}" if detail else kind
        self.count += 1
        self.kinds[kind] += 1
        self.firsts.setdefault(kind, (url, line, reason))
        if self.keep:
            if len(raw) > RAW_CHARS:
                raw = raw[:RAW_CHARS] + f"... [{len(raw) - RAW_CHARS} more characters]"
            self.rows.append((url, line, index, prompt_id, reason, raw))
            if len(self.rows) >= BATCH_ROWS:
                self._flush()

    def _flush(self) -> None:
        if not self.rows:
            return
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, REJECTED_SCHEMA, compression="zstd")
        columns = list(zip(*self.rows))
        self.writer.write_table(pa.table([pa.array(c, f.type) for c, f in zip(columns, REJECTED_SCHEMA)],
                                         schema=REJECTED_SCHEMA))
        self.rows = []

    def first_and_counts(self) -> str:
        kind = next(iter(self.firsts))
        return f"first: {self._where(kind)}: {self.firsts[kind][2]}; by reason: {self._counts(self.kinds, kind)}"

    def failure_message(self) -> str:
        kind = next(iter(self.firsts))
        more = ""
        if self.count > 1:
            rest = self.kinds.copy()
            rest[kind] -= 1
            more = f"; {self.count - 1} more bad rows ({self._counts(rest, kind)})"
        return (f"prompts file {self._where(kind)}: {self.firsts[kind][2]}{more}; nothing written "
                f"(fix the input, or set prompts.on_invalid=skip to record bad rows in {REJECTED_FILE} and go on)")

    def _where(self, kind: str, named: str | None = None) -> str:
        """"F line 3" ("line 3" where F is `named`, the file already in the message)."""
        url, line, _ = self.firsts[kind]
        return f"{'' if url == named else url + ' '}{'row' if url.lower().endswith('.parquet') else 'line'} {line}"

    def _counts(self, counts: Counter[str], shown: str) -> str:
        """'N kind' for each kind; the first row of each kind but `shown` (already named) with
        where and why, as its hint may be the one that helps (pandas' float ids after a null)."""
        named = self.firsts[shown][0]
        return "; ".join(f"{n} {kind}" if kind == shown else
                         f"{n} {kind}, first at {self._where(kind, named)}: {self.firsts[kind][2]}"
                         for kind, n in counts.most_common() if n)

    def commit(self, out: StepOutput) -> list[dict[str, Any]]:
        if not self.keep or not self.count:
            return []
        self._flush()
        self.writer.close()
        return [{**_move(self.path, out.path(REJECTED_FILE)), "rows": self.count}]


# --- output -----------------------------------------------------------------------------


def _move(local_path: str, url: str) -> dict[str, Any]:
    """Move a finished local file to `url` atomically; its manifest entry (without rows)."""
    digest = hashlib.sha256()
    with open(local_path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    size = os.path.getsize(local_path)
    storage.put_file(local_path, url)
    return {"path": url.rsplit("/", 1)[-1], "bytes": size, "sha256": digest.hexdigest()}


def _remove_stale(out: StepOutput, keep: set[str]) -> None:
    """Drop shards (or rejected rows) an earlier attempt with other settings left behind."""
    for url in storage.list_files(out.url, suffix=".parquet"):
        name = url.rsplit("/", 1)[-1]
        if (name.startswith("shard-") or name == REJECTED_FILE) and name not in keep:
            storage.remove(url)
