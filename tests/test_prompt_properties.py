"""Property tests for the prompt readers (steps/prompt_files.py) and what tokenize makes of bad rows.

Random prompt files - unicode, escaped newlines, whitespace, huge integer ids, path-like ids,
broken JSON, wrong types, blank lines, invalid UTF-8, CRLF, no final newline - must read back
as exactly the rows written, each bad line with its 1-based line number and its reason kind.
Through the tokenize step: `on_invalid: skip` records every bad line in rejected.parquet with
file, line and reason and keeps every good row; `fail` raises one error naming file:line of
the first bad row and writes nothing.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import storage
from pipeline.run.config import PromptsConfig, build_config
from pipeline.errors import StepFailed
from pipeline.run.step import StepOutput
from steps import prompt_files as pf
from steps import tokenize as tk

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])

chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufeff")
texts = st.text(chars, min_size=1, max_size=30).filter(lambda s: s.strip())
ids = (st.text(chars, min_size=1, max_size=12) | st.integers(-2**70, 2**70)
       | st.sampled_from(["../../x", "/etc/passwd", "a/b", "..", "C:\\x", "%2e%2e/x"]))
blank = st.text(st.sampled_from(" \t\x0b\x0c\x85\u2028\u3000"), max_size=3)
"""Whitespace-only text: ASCII and Unicode (Python's str.strip() is what "empty" means everywhere)."""


@st.composite
def jsonl_line(draw) -> tuple[str, object, object, str]:
    """(kind, text, id, line): kind 'good', 'blank' or a reason kind the reader must report."""
    kind = draw(st.sampled_from(["good"] * 5 + ["blank", "invalid JSON", "not a JSON object", "missing text",
                                                 "text not a string", "empty prompt", "missing id", "bad id"]))
    text, prompt_id = draw(texts), draw(ids)
    ascii_only = draw(st.booleans())

    def dump(obj: object) -> str:
        return json.dumps(obj, ensure_ascii=ascii_only)

    line = {
        "good": lambda: dump({"prompt": text, "id": prompt_id}),
        "blank": lambda: draw(blank),
        "invalid JSON": lambda: dump({"prompt": text, "id": prompt_id})[:-1] + draw(st.sampled_from(["", ",", "]", "}}"])),
        "not a JSON object": lambda: dump(draw(st.lists(st.integers(), max_size=2) | st.integers() | texts)),
        "missing text": lambda: dump({"id": prompt_id}),
        "text not a string": lambda: dump({"prompt": draw(st.integers() | st.lists(texts, max_size=2)), "id": prompt_id}),
        "empty prompt": lambda: dump({"prompt": draw(blank), "id": prompt_id}),
        "missing id": lambda: dump({"prompt": text}),
        "bad id": lambda: dump({"prompt": text, "id": draw(st.sampled_from([True, 1.5, "", [], {}]))}),
    }[kind]()
    return kind, text, prompt_id, line


jsonl_files = st.tuples(st.lists(jsonl_line(), min_size=1, max_size=25), st.sampled_from(["\n", "\r\n"]),
                        st.booleans())


def write_jsonl(path, lines, newline: str, final_newline: bool) -> str:
    data = newline.join(line for *_, line in lines) + (newline if final_newline else "")
    path.write_bytes(data.encode("utf-8"))
    return str(path)


def read_all(url: str, options: PromptsConfig) -> list[tuple]:
    return [row for batch in pf.read_rows(url, options) for row in batch]


OPTIONS = PromptsConfig(path="unused", text_field="prompt", id_field="id")


@FAST
@given(jsonl_files)
def test_jsonl_reads_exactly_the_rows_written(tmp_path, case):
    lines, newline, final_newline = case
    url = write_jsonl(tmp_path / "p.jsonl", lines, newline, final_newline)
    rows = read_all(url, OPTIONS)
    if not final_newline and lines[-1][0] == "blank" and not lines[-1][3]:
        lines = lines[:-1]  # an empty last "line" after the final separator is no line at all
    assert [r[0] for r in rows] == list(range(1, len(lines) + 1))
    for (kind, text, prompt_id, line), (number, got_text, got_id, raw, problem) in zip(lines, rows):
        if kind == "good":
            assert (got_text, got_id, problem) == (text, str(prompt_id), None), (number, line)
        elif kind == "blank":
            assert problem == pf.BLANK
        else:
            assert problem is not None and problem[0] == kind, (number, line, problem)


@FAST
@given(st.lists(st.one_of(texts.filter(lambda t: "\n" not in t and "\r" not in t).map(lambda t: ("good", t)),
                          blank.map(lambda t: ("blank", t)),
                          st.just(("invalid UTF-8", b"caf\xe9 \xff"))), min_size=1, max_size=25),
       st.sampled_from([b"\n", b"\r\n"]))
def test_txt_reads_exactly_the_lines_written(tmp_path, lines, newline):
    path = tmp_path / "p.txt"
    path.write_bytes(newline.join(v if isinstance(v, bytes) else v.encode() for _, v in lines) + newline)
    rows = read_all(str(path), PromptsConfig(path="unused"))
    assert len(rows) == len(lines)
    for number, ((kind, value), (got_number, text, prompt_id, raw, problem)) in enumerate(zip(lines, rows), 1):
        assert got_number == number and prompt_id is None
        if kind == "good":
            assert (text, problem) == (value, None)
        elif kind == "blank":
            assert problem == pf.BLANK
        else:
            assert problem[0] == "invalid UTF-8" and "\\xe9" in raw


@FAST
@given(st.lists(st.one_of(texts, st.none(), blank), min_size=1, max_size=30),
       st.sampled_from(["string", "int"]), st.data())
def test_parquet_reads_exactly_the_rows_written(tmp_path, values, id_type, data):
    if id_type == "string":
        id_values = data.draw(st.lists(st.one_of(st.text(chars, min_size=1, max_size=8), st.none()),
                                       min_size=len(values), max_size=len(values)))
        id_array = pa.array(id_values, pa.string())
    else:
        id_values = data.draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=len(values), max_size=len(values)))
        id_array = pa.array(id_values, pa.int64())
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": pa.array(values, pa.string()), "id": id_array}), path,
                   row_group_size=max(1, len(values) // 3))
    rows = read_all(str(path), OPTIONS)
    assert [r[0] for r in rows] == list(range(1, len(values) + 1))
    for value, prompt_id, (_, text, got_id, _, problem) in zip(values, id_values, rows):
        if value is None:
            assert problem[0] == "missing text"
        elif not value.strip():
            assert problem[0] == "empty prompt"
        elif prompt_id is None:
            assert problem[0] == "missing id"
        else:
            assert (text, got_id, problem) == (value, str(prompt_id), None)


# --- through the tokenize step: skip records, fail names file:line -------------------------


def expected_outcome(lines) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """(bad (line, reason kind) in line order, good (text, id) in input order) as tokenize sees them."""
    bad, good, seen = [], [], set()
    for number, (kind, text, prompt_id, _) in enumerate(lines, 1):
        if kind == "blank":
            continue
        if kind != "good":
            bad.append((number, kind))
        elif str(prompt_id) in seen:
            bad.append((number, "duplicate prompt_id"))
        else:
            seen.add(str(prompt_id))
            good.append((text, str(prompt_id)))
    return bad, good


def run_tokenize(tmp_path, demo_model, url: str, on_invalid: str):
    cfg = build_config({"run": {"root": str(tmp_path / "runs"), "name": "t"}, "model": {"path": demo_model},
                        "prompts": {"path": url, "id_field": "id", "max_prompt_tokens": 100_000,
                                    "on_invalid": on_invalid, "num_shards": 2}})
    out = StepOutput("tokenize", "0" * 64, storage.join(str(tmp_path / "runs"), f"tokenize-{on_invalid}"))
    return tk.tokenize(cfg, out), out


@FAST
@given(jsonl_files)
def test_skip_records_every_bad_line_and_keeps_every_good_one(tmp_path_factory, demo_model, case):
    lines, newline, _ = case
    tmp = tmp_path_factory.mktemp("skip")
    url = write_jsonl(tmp / "p.jsonl", lines, newline, True)
    bad, good = expected_outcome(lines)
    if not good:
        with pytest.raises(StepFailed, match="rows were rejected|no prompts"):
            run_tokenize(tmp, demo_model, url, "skip")
        return
    result, out = run_tokenize(tmp, demo_model, url, "skip")
    rows = sorted((r for f in result.files if f["path"].startswith("shard-")
                   for r in storage.read_parquet(out.path(f["path"])).to_pylist()), key=lambda r: r["prompt_index"])
    assert [(r["prompt"], r["prompt_id"]) for r in rows] == good
    assert result.summary.rejected == len(bad)
    if bad:
        rejected = storage.read_parquet(out.path(tk.REJECTED_FILE)).to_pylist()
        assert [(r["file"], r["line"], r["reason"].split(":")[0]) for r in rejected] == [(url, n, k) for n, k in bad]
    # ids are values, never paths: everything tokenize wrote is directly in its own folder
    written = [os.path.relpath(os.path.join(d, f), tmp) for d, _, fs in os.walk(tmp) for f in fs]
    assert all(w == "p.jsonl" or w.startswith(os.path.join("runs", "tokenize-skip") + os.sep) for w in written), written


@FAST
@given(jsonl_files)
def test_fail_names_the_first_bad_line_and_writes_nothing(tmp_path_factory, demo_model, case):
    lines, newline, _ = case
    tmp = tmp_path_factory.mktemp("fail")
    url = write_jsonl(tmp / "p.jsonl", lines, newline, True)
    bad, good = expected_outcome(lines)
    if not bad and good:
        result, _ = run_tokenize(tmp, demo_model, url, "fail")
        assert result.rows == len(good)
        return
    if not bad:
        with pytest.raises(StepFailed, match="no prompts"):
            run_tokenize(tmp, demo_model, url, "fail")
        return
    with pytest.raises(StepFailed) as err:
        run_tokenize(tmp, demo_model, url, "fail")
    first_line, first_kind = bad[0]
    assert str(err.value).startswith(f"prompts file {url} line {first_line}: {first_kind}"), str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp / "runs").exists()
