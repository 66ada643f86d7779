"""Prompt files: find them, read their rows, and say exactly what is wrong with a bad one.

Owns the input side of tokenize: expanding `prompts.path` (a URL, folder or glob on any
fsspec filesystem) into files in sorted order, telling JSONL, .txt and Parquet apart (the
text formats may be compressed, e.g. .jsonl.gz), and turning each file into rows. It never
tokenizes, numbers prompts or decides what a bad row means for the run: `steps/tokenize.py`
does. Values stay values: a prompt id such as `../../x` is data, never part of a path.

Rows: a row is a JSONL line, a .txt line or a Parquet row. Each is `(line, text, prompt_id,
raw, problem)`: `line` is the 1-based line (Parquet: row) number in its file; `problem` is
None for a good row, `BLANK` for a blank (whitespace-only) text line, which is no row at
all, or `(kind, detail)`. Kinds: invalid UTF-8, invalid JSON, not a JSON object, missing
text, text not a string, empty prompt, bad conversation, missing id, bad id. An id is a
non-empty string or an integer (any size; kept as its decimal string). With
`prompts.chat_template` a JSONL or Parquet text may also be a conversation, a list of
{role, content} messages: its text is then a `Conversation`. Problems with a whole file
(unknown type, unreadable, corrupt, UTF-16 or UTF-32 by its byte order mark) raise StepFailed naming the URL; a .txt file with
`id_field` set is a ConfigError.

Reading: text formats in READ_BYTES blocks of whole lines; a JSONL block is parsed by
Arrow's C++ reader when it is clean, else line by line with `json` so each problem gets its
line; Parquet by record batches of the text and id columns only.

    for url in input_files("gs://b/prompts/*.jsonl"):
        for rows in read_rows(url, cfg.prompts):
            ...
"""

from __future__ import annotations

import contextlib
import io
import json
import lzma
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import fsspec
import fsspec.compression
import fsspec.utils
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.run.checks import prompt_file_format, prompt_files
from pipeline.run.config import PromptsConfig, is_text
from pipeline.errors import ConfigError, StepFailed

BATCH_ROWS = 8192
"""Rows per batch a reader yields (and so per tokenizer call): enough for the Rust tokenizer's threads."""
READ_BYTES = 4 << 20
"""Block size for reading JSONL and .txt files."""

BLANK = ("blank", "")
"""The `problem` of a blank text line: not a row, counted apart."""
_MISSING = object()


# --- input files ------------------------------------------------------------------------


def input_files(pattern: str) -> list[str]:
    """The prompt files, as the runner checked them before the step (pipeline/run/checks.py); gone
    since then, it is this step that fails."""
    try:
        return prompt_files(pattern)
    except ConfigError as err:
        raise StepFailed(str(err)) from err


Row = tuple[int, Any, Any, str, "tuple[str, str] | None"]
"""(line, text, prompt_id, raw, problem): what readers yield; problem is (kind, detail) or None."""


def read_rows(url: str, options: PromptsConfig, on_read: Callable[[float], None] = lambda share: None
              ) -> Iterator[list[Row]]:
    """The file's rows in batches of at most BATCH_ROWS; read errors fail the step. Before each
    batch, `on_read` is told how much of the file (0 to 1; of its bytes as stored) is read."""
    kind = prompt_file_format(url, options)
    try:
        fs, path = storage.filesystem(url)
        with fs.open(path, "rb") as stored:
            if kind == "parquet":
                yield from _parquet_rows(stored, options, on_read)
                return
            size, codec = max(fs.size(path), 1), fsspec.utils.infer_compression(path)
            # As fsspec.open(compression="infer") opens it, the stored file's place kept in view.
            with fsspec.compression.compr[codec](stored, mode="rb") if codec else contextlib.nullcontext(stored) as f:
                for rows in _text_rows(f, options, is_jsonl=kind == "jsonl"):
                    on_read(stored.tell() / size)
                    yield rows
    except (OSError, EOFError, zlib.error, lzma.LZMAError, pa.ArrowException) as err:
        raise StepFailed(f"prompts file {url} could not be read: {type(err).__name__}: {err}") from err
    except _NotUtf8 as err:
        raise StepFailed(f"prompts file {url} is {err} text (it begins with a {err} byte order mark); prompts files "
                         f"must be UTF-8: convert it, e.g. iconv -f {err} -t UTF-8") from err
    except _CrLineEnds as err:
        raise StepFailed(f"prompts file {url} ends its lines with CR alone (classic Mac OS text), so it would be "
                         f"read as one line; lines must end in LF or CRLF: convert it, e.g. tr '\\r' '\\n'") from err


_OTHER_UNICODE = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}
"""Byte order marks of the encodings Windows tools write as 'Unicode' (longest first)."""


class _NotUtf8(Exception):
    """A text file in another Unicode encoding (its byte order mark says which)."""


class _CrLineEnds(Exception):
    """A text file whose lines end in CR alone (classic Mac OS)."""


def _blocks(f: Any) -> Iterator[tuple[int, bytes, list[bytes]]]:
    """(number of its first line, bytes, lines) for blocks of whole lines of a binary file."""
    number, pending, first = 1, [], True
    while block := f.read(READ_BYTES):
        if first and block.startswith(b"\xef\xbb\xbf"):
            block = block[3:]  # a UTF-8 byte order mark is not part of the first prompt
        elif first and (encoding := next((e for m, e in _OTHER_UNICODE.items() if block.startswith(m)), None)):
            raise _NotUtf8(encoding)  # its lines would be read as UTF-8 with a NUL in every other byte
        if first and b"\n" not in block and b"\r" in block.rstrip(b"\r"):
            raise _CrLineEnds  # its lines would be read as one prompt
        first = False
        cut = block.rfind(b"\n") + 1
        if not cut:  # no line ends in this block: keep it for the next (no quadratic copying)
            pending.append(block)
            continue
        data = b"".join(pending + [block[:cut]])
        pending = [block[cut:]]
        lines = data.split(b"\n")
        lines.pop()
        yield number, data, lines
        number += len(lines)
    if last := b"".join(pending):
        yield number, last, [last]


def _text_rows(f: Any, options: PromptsConfig, is_jsonl: bool) -> Iterator[list[Row]]:
    id_types = [pa.string(), pa.int64()]
    for number, data, lines in _blocks(f):
        rows = _arrow_rows(data, lines, number, options, id_types) if is_jsonl else None
        if rows is None:
            rows = [_line_row(n, line, options, is_jsonl) for n, line in enumerate(lines, number)]
        for start in range(0, len(rows), BATCH_ROWS):
            yield rows[start:start + BATCH_ROWS]


def _line_row(number: int, line: bytes, options: PromptsConfig, is_jsonl: bool) -> Row:
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line.strip():
        return number, None, None, "", BLANK
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return (number, None, None, line.decode("utf-8", "backslashreplace"),
                ("invalid UTF-8", f"bad byte at offset {err.start}"))
    if not text.strip():  # Unicode whitespace only (e.g. U+3000): blank, as `empty prompt` judges JSON text
        return number, None, None, "", BLANK
    if is_jsonl:
        return _json_row(number, text, options)
    return number, text, None, text, None


def _arrow_rows(data: bytes, lines: list[bytes], first: int, options: PromptsConfig,
                id_types: list[pa.DataType]) -> list[Row] | None:
    """A JSONL block's rows read by Arrow's C++ parser (~3x faster than `json` here), or None.

    None sends the block to the per-line parser, which names each problem: Arrow is used
    only when every non-blank line is an object with a non-empty string text and (with
    id_field) a non-empty string or int64 id. Arrow is at least as strict as `json` (see
    the tests), and nulls or a row count that differs from the number of lines (two objects
    on one line) also fall back. id_types: the id type to try first is remembered per file.
    """
    is_row = [bool(line.strip()) for line in lines]
    if not any(is_row):
        return None
    table = None
    for _ in range(2 if options.id_field else 1):
        fields = [(options.text_field, pa.string())] + ([(options.id_field, id_types[0])] if options.id_field else [])
        try:
            table = pa_json.read_json(
                io.BytesIO(data), read_options=pa_json.ReadOptions(block_size=1 << 20),
                parse_options=pa_json.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore"))
            break
        except Exception:  # noqa: BLE001 - any parse error: the per-line parser finds and names it
            id_types.reverse()
    if table is None or table.num_rows != sum(is_row) or any(c.null_count for c in table.columns):
        return None
    try:
        table.validate(full=True)  # Arrow passes invalid UTF-8 through instead of failing
    except pa.ArrowInvalid:
        return None
    texts = table.column(0).to_pylist()
    ids = [None] * len(texts)
    if options.id_field:
        ids = table.column(1).to_pylist()
        if pa.types.is_integer(table.schema.field(1).type):
            ids = [str(i) for i in ids]
        elif not all(ids):
            return None
    if not all(t.strip() for t in texts):
        return None
    values = zip(texts, ids)
    return [(n, *next(values), "", None) if row else (n, None, None, "", BLANK)
            for n, row in enumerate(is_row, first)]


def _json_row(number: int, line: str, options: PromptsConfig) -> Row:
    try:
        obj = json.loads(line)
    except ValueError as err:
        return number, None, None, line, ("invalid JSON", str(err))
    if not isinstance(obj, dict):
        return number, None, None, line, ("not a JSON object", f"got {_type_name(obj)}")
    id_field = options.id_field
    return _fields(number, obj.get(options.text_field, _MISSING), obj.get(id_field, _MISSING) if id_field else None,
                   line, options, fields=("the line's fields", obj))  # its keys, listed only for a message


def _fields(number: int, text: Any, raw_id: Any, raw: str, options: PromptsConfig,
            fields: tuple[str, Iterable[str]]) -> Row:
    """A row from its text and id values, checked: missing/null/non-string, empty, a conversation
    (with the chat template), bad id. fields: the row's field names and whose they are, for a
    missing field's message ("the line's fields", "the file's columns")."""
    text_field, id_field = options.text_field, options.id_field
    prompt_id, id_problem = None, None
    if id_field is not None:
        if raw_id is _MISSING:
            id_problem = ("missing id", _no_field(id_field, "prompts.id_field", fields, ", or to null to number the prompts"))
        elif raw_id is None:
            id_problem = ("missing id", f"{id_field!r} is null")
        elif isinstance(raw_id, str) and raw_id:
            if is_text(raw_id):
                prompt_id = raw_id
            else:
                id_problem = ("invalid UTF-8", f"{id_field!r} holds a lone surrogate")
        elif isinstance(raw_id, int) and not isinstance(raw_id, bool):
            prompt_id = str(raw_id)
        elif isinstance(raw_id, float):  # pandas writes a column of integer ids with a null in it as floats
            hint = " (integer ids with nulls become floats in pandas: store them as Int64 or as strings)" \
                if raw_id.is_integer() else ""
            id_problem = ("bad id", f"{id_field!r} is {raw_id!r}, a float, expected a non-empty string or an integer{hint}")
        elif raw_id == "":
            id_problem = ("bad id", f"{id_field!r} is an empty string, expected a non-empty string or an integer")
        else:
            id_problem = ("bad id", f"{id_field!r} is {_type_name(raw_id)}, expected a non-empty string or an integer")
    if text is _MISSING or text is None:
        detail = _no_field(text_field, "prompts.text_field", fields) if text is _MISSING else f"{text_field!r} is null"
        return number, None, prompt_id, raw, ("missing text", detail)
    if isinstance(text, list) and options.chat_template:
        problem = _conversation_problem(text, text_field)
        if problem is not None:
            return number, None, prompt_id, raw, ("bad conversation", problem)
        return number, Conversation.of(text), prompt_id, raw, id_problem
    if not isinstance(text, str):
        hint = " (a conversation, a list of messages, needs prompts.chat_template: true)" if isinstance(text, list) else ""
        return number, None, prompt_id, raw, ("text not a string", f"{text_field!r} is {_type_name(text)}{hint}")
    if not text.strip():
        return number, None, prompt_id, raw, ("empty prompt", f"{text_field!r} is {text!r}")
    return number, text, prompt_id, raw, id_problem


def _no_field(name: str, key: str, fields: tuple[str, Iterable[str]], alternative: str = "") -> str:
    """"no 'id' field (set prompts.id_field to one of the line's fields: text, label, or to null
    to number the prompts)": the setting to change, and what to. fields: (whose, names)."""
    whose, names = fields[0], list(fields[1])
    if not names:
        return f"no {name!r} field ({whose}: none)"
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return f"no {name!r} field (set {key} to one of {whose}: {shown}{alternative})"


def _parquet_rows(f: Any, options: PromptsConfig, on_read: Callable[[float], None]) -> Iterator[list[Row]]:
    pf = pq.ParquetFile(f)
    total = max(pf.metadata.num_rows, 1)
    columns = ("the file's columns", [c for c in pf.schema_arrow.names if c != "__index_level_0__"])  # pandas' index
    wanted = [c for c in (options.text_field, options.id_field) if c and c in pf.schema_arrow.names]
    number = 0
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
        texts = _column(batch, options.text_field)
        ids = _column(batch, options.id_field) if options.id_field else [None] * batch.num_rows
        rows: list[Row] = []
        for text, raw_id in zip(texts, ids):
            number += 1
            if isinstance(text, _BadUtf8):
                rows.append((number, None, None, _parquet_raw(options, text.raw, raw_id), ("invalid UTF-8", f"in {options.text_field!r}")))
                continue
            if isinstance(raw_id, _BadUtf8):
                raw_id = raw_id.raw.encode()  # a bytes id is reported as a bad id
            raw = text if isinstance(text, str) else "" if text is _MISSING else \
                json.dumps(text, default=repr, ensure_ascii=False)  # a conversation's, if its template fails it
            row = _fields(number, text, raw_id, raw, options, fields=columns)
            if row[4] is not None:  # a bad row: what it held, as a JSONL line would show it
                row = (*row[:3], _parquet_raw(options, text, raw_id), row[4])
            rows.append(row)
        on_read(number / total)
        yield rows


def _parquet_raw(options: PromptsConfig, text: Any, raw_id: Any) -> str:
    """A Parquet row's text and id columns as one JSON object (an absent column left out): a
    rejected row's `raw`, as a JSONL row's is its line."""
    values = {options.text_field: text, **({options.id_field: raw_id} if options.id_field else {})}
    return json.dumps({k: v for k, v in values.items() if v is not _MISSING}, default=repr, ensure_ascii=False)


class Conversation(str):
    """A prompt given as chat messages (with `prompts.chat_template`): the text is the messages
    as compact JSON, what the `prompt` column shows; `messages` is what the chat template renders
    (tokenize sets `rendered`)."""

    messages: list[dict[str, Any]]
    rendered: str

    @classmethod
    def of(cls, messages: list[dict[str, Any]]) -> "Conversation":
        # A null key is an absent one: a Parquet column of messages gives every message every key.
        messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
        text = cls(json.dumps(messages, ensure_ascii=False, separators=(",", ":")))
        text.messages = messages
        return text


def _conversation_problem(messages: list, text_field: str) -> str | None:
    """What is wrong with a conversation, or None: a non-empty list of objects, each with a
    non-empty string role and a string content (other keys go to the template as they are),
    not every content blank."""
    if not messages:
        return f"{text_field!r} is an empty array"
    for i, message in enumerate(messages, 1):
        where = f"message {i} of {text_field!r}"
        if not isinstance(message, dict):
            return f"{where} is {_type_name(message)}, expected an object with role and content"
        role, content = message.get("role"), message.get("content")
        if role is None or content is None:
            return f"{where} has no {'role' if role is None else 'content'}"
        if not isinstance(role, str) or not role:
            return f"{where}: its role is {role!r}, expected a non-empty string"
        if not isinstance(content, str):
            return f"{where}: its content is {_type_name(content)}, expected a string"
    if not any(m["content"].strip() for m in messages):
        return f"every message of {text_field!r} is empty"
    return None


@dataclass(frozen=True)
class _BadUtf8:
    raw: str


def _column(batch: pa.RecordBatch, name: str) -> list[Any]:
    """A column's Python values; _MISSING for an absent column, _BadUtf8 for invalid strings."""
    if name not in batch.schema.names:
        return [_MISSING] * batch.num_rows
    column = batch.column(name)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            return [_decode_or_bad(v) for v in column.cast(pa.large_binary()).to_pylist()]
    return column.to_pylist()


def _decode_or_bad(value: bytes | None) -> Any:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return _BadUtf8(value.decode("utf-8", "backslashreplace"))


def _type_name(value: Any) -> str:
    names = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number",
             bytes: "binary", str: "a string"}
    return names.get(type(value), type(value).__name__)

