"""The tokenize step (issue 4), driven through `pipeline run tokenize` as users run it.

Covers: shards' rows, ids, order and token ids (against transformers' own tokenizer call);
balance (every shard's token total within the longest prompt of every other's); formats
and globs; the chat template and BOS; every bad-input case in both on_invalid modes; whole
input failures; config errors; hashes; gs:// on the emulator; a kill before the marker.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pipeline import storage
from pipeline.pod import preemption
from pipeline.run import status
from pipeline.cli import app
from pipeline.run.config import build_config, is_text, load_config
from pipeline.run.runner import make_plan
from steps import PIPELINE
from steps import prompt_files as pf
from steps import tokenize as tk
from tests.conftest import pipeline as pipeline_process

REPO = Path(__file__).resolve().parent.parent


# --- helpers --------------------------------------------------------------------------------


def write_config(folder: Path, model: str, root: str | None = None, name: str = "config.yaml", **prompts) -> str:
    data = {"run": {"root": root or str(folder / "runs"), "name": "t"}, "model": {"path": model},
            "prompts": {"text_field": "prompt", "max_prompt_tokens": 64, **prompts}}
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def tokenize_step(config: str):
    planned = make_plan(load_config(config), PIPELINE)[0]
    assert planned.name == "tokenize"
    return planned


def run_tokenize(config: str, *extra: str):
    result = cli("run", "tokenize", "--config", config, *extra)
    assert result.exit_code == 0, result.stderr
    planned = tokenize_step(config)
    record = status.read_marker(planned.url)
    assert record is not None
    return planned.url, record


def read_shards(url: str, record) -> list[pa.Table]:
    names = [f["path"] for f in record.files if f["path"].startswith("shard-")]
    assert names == [f"shard-{i:05d}.parquet" for i in range(len(names))]
    return [storage.read_parquet(storage.join(url, name)) for name in names]


def all_rows(url: str, record) -> list[dict]:
    return sorted((r for t in read_shards(url, record) for r in t.to_pylist()), key=lambda r: r["prompt_index"])


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode()) + b"\n" for r in rows)


def output_files(url: str) -> list[str]:
    return sorted(u.rsplit("/", 1)[-1] for u in storage.list_files(url))


@pytest.fixture(scope="module")
def reference(demo_model):
    """transformers' own tokenizer for the demo checkpoint: what the shards must match."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


# --- shards: rows, ids, order, balance ------------------------------------------------------

TEXTS = ["Hello there.", "  leading and trailing spaces  ", "Unicode: café, 東京, emoji 😀",
         'Quotes "double" and \\ backslash', "Two\nlines", "Tab\tinside", "<s> looks special"]


def test_shards_keep_every_prompt_its_id_and_the_tokenizers_ids(tmp_path, demo_model, reference):
    rows = [{"id": f"q-{i}", "prompt": t, "extra": {"nested": [i]}} for i, t in enumerate(TEXTS)]
    (tmp_path / "p.jsonl").write_bytes(jsonl(*rows))
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"), id_field="id"))

    tables = read_shards(url, record)
    assert tables[0].schema == tk.SHARD_SCHEMA
    got = all_rows(url, record)
    assert [(r["prompt_index"], r["prompt_id"], r["prompt"]) for r in got] == \
        [(i, f"q-{i}", t) for i, t in enumerate(TEXTS)]
    expected_ids = reference(TEXTS)["input_ids"]
    assert [r["input_ids"] for r in got] == expected_ids
    # One BOS, added by the tokenizer (a literal "<s>" in a prompt is parsed as BOS, as transformers does).
    assert all(ids[0] == reference.bos_token_id and (ids[1] != reference.bos_token_id) == ("<s>" not in t)
               for t, ids in zip(TEXTS, expected_ids))
    assert [r["num_tokens"] for r in got] == [len(ids) for ids in expected_ids]
    summary = record.summary
    assert (summary["rows_in"], summary["rows"], summary["rejected"]) == (7, 7, 0)
    assert summary["tokens"] == sum(map(len, expected_ids)) == sum(f["tokens"] for f in record.files)
    assert summary["max_tokens"] == max(map(len, expected_ids))
    assert summary["num_shards"] == len(tables) == 7  # auto = 8 per host, never more than prompts
    (info,) = summary["input_files"]
    assert info["url"] == str(tmp_path / "p.jsonl") and info["rows"] == 7
    assert info["bytes"] == (tmp_path / "p.jsonl").stat().st_size and info["fingerprint"].startswith("md5:")
    for entry in record.files:
        data = storage.read_bytes(storage.join(url, entry["path"]))
        assert entry["bytes"] == len(data)
    assert output_files(url) == sorted([status.MARKER, status.CONFIG_FILE] + [f["path"] for f in record.files])


def test_a_pipeline_process_tokenizes_as_transformers_does_without_importing_torch(tmp_path, demo_model, reference):
    """The test tools install PyTorch, and transformers imports it wherever it is installed; the
    `pipeline` command keeps it out of its processes (2-3 s and 240 MB each) and still gets the
    same token ids."""
    (tmp_path / "p.jsonl").write_bytes(jsonl(*({"prompt": t} for t in TEXTS)))
    config = write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"))
    done = pipeline_process("run", "tokenize", "--config", config, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "transformers" in imported and "tokenizers" in imported
    assert not {name for name in imported if name == "torch" or name.startswith("torch.")}
    assert "PyTorch was not found" not in done.stderr + done.stdout
    url = tokenize_step(config).url
    assert [r["input_ids"] for r in all_rows(url, status.read_marker(url))] == reference(TEXTS)["input_ids"]


def test_shards_are_balanced_by_tokens_and_sorted(tmp_path, demo_model, monkeypatch):
    """Online greedy: every shard's token total is within the longest prompt of every other's."""
    monkeypatch.setattr(pf, "BATCH_ROWS", 50)
    monkeypatch.setattr(tk, "BUFFER_BYTES", 1)  # every batch flushes every shard's buffer
    rng = random.Random(1)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x"]) for _ in range(rng.randint(1, 40)))
             for _ in range(300)]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    config = write_config(tmp_path, demo_model, path=str(tmp_path / "p.txt"), num_shards=7, max_prompt_tokens=1024)
    url, record = run_tokenize(config)

    tables = read_shards(url, record)
    assert len(tables) == 7
    totals = [pa.compute.sum(t["num_tokens"]).as_py() for t in tables]
    longest = record.summary["max_tokens"]
    assert max(totals) - min(totals) <= longest, (totals, longest)
    assert [f["tokens"] for f in record.files] == totals
    for t in tables:
        indices = t["prompt_index"].to_pylist()
        assert indices == sorted(indices)
    assert sorted(i for t in tables for i in t["prompt_index"].to_pylist()) == list(range(300))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=300), count=st.integers(1, 12))
def test_greedy_bound_holds_for_any_lengths(tmp_path_factory, lengths, count):
    shards = tk._Shards(str(tmp_path_factory.mktemp("shards")), count)
    batch = pa.record_batch([pa.array(range(len(lengths)), pa.int64()), pa.array([""] * len(lengths)),
                             pa.array([""] * len(lengths)), pa.array([[1] * n for n in lengths], pa.list_(pa.int32())),
                             pa.array(lengths, pa.int32())], schema=tk.SHARD_SCHEMA)
    shards.add(batch, lengths)
    used = shards.shard_tokens[:shards.used]
    assert shards.used == min(count, len(lengths)) and all(used) and not any(shards.shard_tokens[shards.used:])
    assert max(used) - min(used) <= max(lengths)


def test_auto_shards_are_8_per_host(tmp_path, demo_model, monkeypatch):
    from pipeline.pod import hosts

    monkeypatch.setattr(hosts, "process_count", lambda: 2)
    (tmp_path / "p.txt").write_text("".join(f"prompt {i}\n" for i in range(40)))
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(tmp_path / "p.txt")))
    assert record.summary["num_shards"] == len(read_shards(url, record)) == 16


def test_reading_streams_in_blocks(monkeypatch):
    """Memory stays bounded: the first rows come out after reading one block, not the file."""
    import io

    monkeypatch.setattr(pf, "READ_BYTES", 1000)
    monkeypatch.setattr(pf, "BATCH_ROWS", 10)
    data = jsonl(*({"prompt": f"prompt number {i}"} for i in range(20_000)))
    f = io.BytesIO(data)
    options = build_config({"run": {"root": "r", "name": "t"}, "model": {"path": "m"}, "prompts": {"path": "p"}}).prompts
    rows = pf._text_rows(f, options, is_jsonl=True)
    first = next(rows)
    assert len(first) == 10 and f.tell() <= 2 * 1000 < len(data)
    assert sum(len(b) for b in rows) + len(first) == 20_000


def test_formats_and_sorted_file_order_give_prompt_index(tmp_path, demo_model, reference):
    """JSONL, .txt (blank lines are no rows), Parquet and .jsonl.gz, numbered in sorted file order."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "b.txt").write_bytes(b"txt one\r\n\n   \ntxt two")  # CRLF, blank lines, no final newline
    pq.write_table(pa.table({"prompt": ["pq one", "pq two"], "other": [1, 2]}), folder / "c.parquet")
    (folder / "a.jsonl").write_bytes(jsonl({"prompt": "json one"}, {"prompt": "json two"}) + b"\n")
    with gzip.open(folder / "d.jsonl.gz", "wb") as f:
        f.write(jsonl({"prompt": "gz one"}, {"prompt": "gz two"}))
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(folder)))

    texts = ["json one", "json two", "txt one", "txt two", "pq one", "pq two", "gz one", "gz two"]
    got = all_rows(url, record)
    assert [(r["prompt_index"], r["prompt_id"], r["prompt"]) for r in got] == [(i, str(i), t) for i, t in enumerate(texts)]
    assert [r["input_ids"] for r in got] == reference(texts)["input_ids"]
    assert record.summary["blank_lines"] == 3
    assert [(f["url"].rsplit("/", 1)[-1], f["rows"]) for f in record.summary["input_files"]] == \
        [("a.jsonl", 2), ("b.txt", 2), ("c.parquet", 2), ("d.jsonl.gz", 2)]


def test_parquet_ids_and_a_glob(tmp_path, demo_model):
    pq.write_table(pa.table({"text": ["first", "second"], "key": pa.array([10, 11], pa.int64())}), tmp_path / "x-1.parquet")
    pq.write_table(pa.table({"text": ["third"], "key": pa.array([12], pa.int64())}), tmp_path / "x-2.parquet")
    (tmp_path / "x-3.csv").write_text("not matched by the glob")
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(tmp_path / "x-*.parquet"),
                                            text_field="text", id_field="key"))
    assert [(r["prompt_index"], r["prompt_id"], r["prompt"]) for r in all_rows(url, record)] == \
        [(0, "10", "first"), (1, "11", "second"), (2, "12", "third")]


# --- chat template and BOS ------------------------------------------------------------------


def test_chat_template_with_system_prompt_and_one_bos(tmp_path, demo_model, reference):
    texts = ["What is a reef?", "  Spaces kept  "]
    (tmp_path / "p.jsonl").write_bytes(jsonl(*({"prompt": t} for t in texts)))
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"),
                                            chat_template=True, system_prompt="Be brief."))
    rendered = [reference.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": t}],
                                              tokenize=False, add_generation_prompt=True) for t in texts]
    assert rendered[0].startswith("<|system|>\nBe brief.\n<|user|>\nWhat is a reef?\n<|assistant|>")
    got = all_rows(url, record)
    assert [r["prompt"] for r in got] == texts  # the prompt as given, not the rendered text
    # The demo template has no BOS: the tokenizer adds the model's one BOS, as for plain prompts.
    assert [r["input_ids"] for r in got] == reference(rendered)["input_ids"]
    assert all(r["input_ids"][0] == 1 and r["input_ids"][1] != 1 for r in got)
    assert record.summary["add_special_tokens"] is True


def test_template_that_starts_with_bos_gets_no_second_bos(tmp_path, demo_model, reference):
    from demo.checkpoint import CHAT_TEMPLATE

    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    (model / "chat_template.jinja").write_text("{{ bos_token }}" + CHAT_TEMPLATE)
    (tmp_path / "p.jsonl").write_bytes(jsonl({"prompt": "hi"}))
    url, record = run_tokenize(write_config(tmp_path, str(model), path=str(tmp_path / "p.jsonl"), chat_template=True))
    (row,) = all_rows(url, record)
    assert row["input_ids"] == reference("<s><|user|>\nhi\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    assert row["input_ids"][0] == 1 and row["input_ids"][1] != 1
    assert record.summary["add_special_tokens"] is False


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=30).filter(lambda t: t.strip()), min_size=1, max_size=5))
def test_fast_chat_formatting_equals_rendering_each_prompt(reference, texts):
    """The prefix+text+suffix shortcut must give exactly what the template renders."""
    texts = [t for t in texts if is_text(t)]
    for system in (None, "sys"):
        fmt, _ = tk._chat_formatter(reference, system, "demo")
        messages = [[{"role": "system", "content": system}] if system else [] for _ in texts]
        expected = [reference.apply_chat_template(m + [{"role": "user", "content": t}], tokenize=False,
                                                  add_generation_prompt=True) for m, t in zip(messages, texts)]
        assert fmt(texts) == expected


def test_template_that_trims_content_is_rendered_per_prompt(demo_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model)
    tok.chat_template = "{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}"
    fmt, _ = tk._chat_formatter(tok, None, "demo")
    assert fmt(["  padded  ", "x"]) == ["[padded]", "[x]"]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Tell me a joke"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    "A plain prompt beside them.",
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_conversations_are_rendered_whole_by_the_chat_template(tmp_path, demo_model, reference, kind):
    """With the chat template, a prompt may be a conversation (a list of role/content messages,
    as chat datasets hold them): rendered whole, with the generation prompt after it, the system
    prompt first unless it has its own. The prompt column keeps it as compact JSON."""
    if kind == "jsonl":
        path = tmp_path / "p.jsonl"
        path.write_bytes(jsonl(*({"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS))))
    else:  # a column of messages beside one of strings: a Parquet column holds one type
        path = tmp_path / "p.parquet"
        pq.write_table(pa.table({"id": ["c0", "c1"], "messages": CONVERSATIONS[:2]}), path)
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(path), text_field="messages", id_field="id",
                                            chat_template=True, system_prompt="Be kind.", max_prompt_tokens=128))
    given = CONVERSATIONS if kind == "jsonl" else CONVERSATIONS[:2]
    whole = [[{"role": "system", "content": "Be kind."}, *m] if m[0]["role"] != "system" else m
             for m in ([{"role": "user", "content": c}] if isinstance(c, str) else c for c in given)]
    rendered = [reference.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in whole]
    assert rendered[0] == ("<|system|>\nBe kind.\n<|user|>\nHi there\n<|assistant|>\nHello!\n<|user|>\n"
                           "Tell me a joke\n<|assistant|>\n")
    got = all_rows(url, record)
    assert [r["input_ids"] for r in got] == reference(rendered)["input_ids"]
    assert [r["prompt"] if isinstance(c, str) else json.loads(r["prompt"]) for r, c in zip(got, given)] == given
    assert got[1]["prompt"] == '[{"role":"system","content":"Be terse."},{"role":"user","content":"Why is the sky blue?"}]'
    assert record.summary["rejected"] == 0 and record.summary["conversations"] == 2


BAD_CONVERSATIONS = {
    "empty": ([], "bad conversation: 'messages' is an empty array"),
    "a string message": (["hi"], "bad conversation: message 1 of 'messages' is a string, expected an object with role and "
                                 "content"),
    "no content": ([{"role": "user"}], "bad conversation: message 1 of 'messages' has no content"),
    "content parts": ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                      "bad conversation: message 1 of 'messages': its content is an array, expected a string"),
    "empty role": ([{"role": "", "content": "x"}], "bad conversation: message 1 of 'messages': its role is '', expected "
                                                   "a non-empty string"),
    "all blank": ([{"role": "user", "content": " "}], "bad conversation: every message of 'messages' is empty"),
    "template refuses": ([{"role": "assistant", "content": "I speak first"}],
                         "chat template failed: TemplateError: a conversation starts with the user"),
}


def test_bad_conversations_are_rejected_naming_the_message(tmp_path, demo_model):
    from demo.checkpoint import CHAT_TEMPLATE

    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    refusing = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a conversation starts with the user') }}{% endif %}"
    (model / "chat_template.jinja").write_text(refusing + CHAT_TEMPLATE)
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl({"messages": CONVERSATIONS[0]}, *({"messages": m} for m, _ in BAD_CONVERSATIONS.values())))
    url, record = run_tokenize(write_config(tmp_path, str(model), path=str(path), text_field="messages",
                                            chat_template=True, on_invalid="skip"))
    assert [r["prompt_index"] for r in all_rows(url, record)] == [0] and record.summary["conversations"] == 1
    rejected = storage.read_parquet(storage.join(url, "rejected.parquet")).to_pylist()
    assert [r["reason"] for r in rejected] == [reason for _, reason in BAD_CONVERSATIONS.values()]
    assert [r["line"] for r in rejected] == list(range(2, 2 + len(BAD_CONVERSATIONS)))

    # Without the chat template a conversation is no prompt, and the message says what would make it one.
    result = cli("run", "tokenize", "--config", write_config(tmp_path, str(model), name="plain.yaml", path=str(path),
                                                             text_field="messages"))
    assert result.exit_code == 1
    assert error_line(result).startswith(
        f"error: prompts file {path} line 1: text not a string: 'messages' is an array (a conversation, a list of "
        "messages, needs prompts.chat_template: true)")


def test_truncation_in_tokenizer_json_never_cuts_a_prompt(tmp_path, demo_model):
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "p.jsonl").write_bytes(jsonl({"prompt": "short"}, {"prompt": "a much longer prompt " * 5}))
    config = write_config(tmp_path, str(model), path=str(tmp_path / "p.jsonl"), max_prompt_tokens=10, on_invalid="skip")
    url, record = run_tokenize(config)
    assert [r["prompt"] for r in all_rows(url, record)] == ["short"]
    (rejected,) = storage.read_parquet(storage.join(url, "rejected.parquet")).to_pylist()
    assert rejected["reason"].startswith("too long: ") and rejected["prompt_index"] == 1


# --- bad rows, both modes -------------------------------------------------------------------

GOOD_1 = {"id": "a", "prompt": "A good prompt."}
GOOD_3 = {"id": "c", "prompt": "Another good one."}
BAD_ROWS = {
    "invalid JSON": (b'{"id": "b", "prompt": "unterminated}', "invalid JSON"),
    "not an object": (b'["a", "list"]', "not a JSON object"),
    "missing text field": (b'{"id": "b", "text": "wrong field"}', "missing text"),
    "null text": (b'{"id": "b", "prompt": null}', "missing text"),
    "number as text": (b'{"id": "b", "prompt": 42}', "text not a string"),
    "invalid UTF-8": (b'{"id": "b", "prompt": "caf\xe9"}', "invalid UTF-8"),
    "lone surrogate": (b'{"id": "b", "prompt": "bad \\ud800 text"}', "invalid UTF-8"),
    "empty prompt": (b'{"id": "b", "prompt": ""}', "empty prompt"),
    "whitespace prompt": (b'{"id": "b", "prompt": "  \\n "}', "empty prompt"),
    "duplicate id": (b'{"id": "a", "prompt": "Same id as line 1."}', "duplicate prompt_id"),
    "too long": (json.dumps({"id": "b", "prompt": "many words " * 100}).encode(), "too long"),
    "missing id": (b'{"prompt": "No id."}', "missing id"),
    "float id": (b'{"id": 1.5, "prompt": "A float id."}', "bad id"),
    "empty id": (b'{"id": "", "prompt": "An empty id."}', "bad id"),
    # An id no Parquet string holds: a traceback before, at the shards' or rejected.parquet's write.
    "lone surrogate in the id": (b'{"id": "b\\ud800", "prompt": "A good prompt, a bad id."}', "invalid UTF-8"),
    "lone surrogate in the id, empty prompt": (b'{"id": "b\\ud800", "prompt": " "}', "empty prompt"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_fails_the_step_naming_file_line_and_reason(tmp_path, demo_model, case):
    line, kind = BAD_ROWS[case]
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl(GOOD_1, line, GOOD_3))
    config = write_config(tmp_path, demo_model, path=str(path), id_field="id", on_invalid="fail")
    result = cli("run", "tokenize", "--config", config)
    assert result.exit_code == 1
    message = error_line(result)
    assert message.startswith(f"error: prompts file {path} line 2: {kind}")
    if case == "empty id":  # it said "'id' is a string, expected a non-empty string"
        assert message.startswith(f"error: prompts file {path} line 2: bad id: 'id' is an empty string, expected"), message
    assert "more bad rows" not in message and "prompts.on_invalid=skip" in message
    planned = tokenize_step(config)
    assert [f for f in output_files(planned.url) if f.endswith(".parquet")] == []
    assert planned.state == "partial"  # the runner's config.yaml; no marker, no shards


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_is_recorded_and_skipped(tmp_path, demo_model, case):
    line, kind = BAD_ROWS[case]
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl(GOOD_1, line, GOOD_3))
    config = write_config(tmp_path, demo_model, path=str(path), id_field="id", on_invalid="skip")
    printed = cli("run", "tokenize", "--config", config).output
    url, record = run_tokenize(config)  # complete: skipped
    assert f"tokenize: 1 row(s) rejected (first: {path} line 2: {kind}" in printed  # where they are, not only how many
    assert f"each with its file, line and reason in {url}/rejected.parquet\n" in printed
    assert [(r["prompt_index"], r["prompt_id"]) for r in all_rows(url, record)] == [(0, "a"), (2, "c")]
    (rejected,) = storage.read_parquet(storage.join(url, "rejected.parquet")).to_pylist()
    assert (rejected["file"], rejected["line"], rejected["prompt_index"]) == (str(path), 2, 1)
    assert rejected["reason"].split(":")[0] == kind
    assert rejected["prompt_id"] in (None, "a", "b")
    # What the row held, so it can be fixed: the line as read, or the prompt text where the row was
    # read and then refused (too long, a repeated id, a text the tokenizer cannot take).
    if case in ("duplicate id", "too long", "lone surrogate"):
        held = json.loads(line)["prompt"].encode("utf-8", "backslashreplace").decode()
    else:
        held = line.decode(errors="backslashreplace")
    assert rejected["raw"] == held[:1000] + (f"... [{len(held) - 1000} more characters]" if len(held) > 1000 else "")
    assert (record.summary["rows_in"], record.summary["rows"], record.summary["rejected"]) == (3, 2, 1)
    assert record.summary["rejected_reasons"] == {kind: 1}
    assert {"path": "rejected.parquet", "rows": 1}.items() <= next(
        f for f in record.files if f["path"] == "rejected.parquet").items()
    shown = json.loads(cli("status", "--config", write_config(tmp_path, demo_model, name="c2.yaml", path=str(path),
                                                              id_field="id", on_invalid="skip"), "--json").stdout)
    assert shown["steps"][0]["state"] == "complete" and shown["steps"][0]["rejected"] == 1


def test_fail_counts_every_bad_row_by_reason(tmp_path, demo_model):
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl(GOOD_1, b"{oops", {"id": "x", "prompt": "word " * 200}, {"id": "a", "prompt": "dup"},
                           b"", {"id": "y", "prompt": "word " * 300}))
    result = cli("run", "tokenize", "--config", write_config(tmp_path, demo_model, path=str(path), id_field="id"))
    assert result.exit_code == 1
    assert error_line(result).startswith(
        f"error: prompts file {path} line 2: invalid JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1); 3 more bad rows (2 too long, first at line 3: too long: 602 tokens > "
        "prompts.max_prompt_tokens=64; 1 duplicate prompt_id, first at line 4: duplicate prompt_id: 'a' is already used "
        "by an earlier row); nothing written")


def test_long_raw_text_is_truncated_in_rejected_parquet_only(tmp_path, demo_model):
    long_text = "z" * 5000
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl(GOOD_1, {"id": "b", "prompt": long_text}))
    url, _ = run_tokenize(write_config(tmp_path, demo_model, path=str(path), id_field="id", on_invalid="skip",
                                       max_prompt_tokens=100))
    (rejected,) = storage.read_parquet(storage.join(url, "rejected.parquet")).to_pylist()
    assert rejected["raw"] == "z" * 1000 + "... [4000 more characters]"


def test_a_field_no_row_has_is_named_with_the_setting_and_the_fields_there_are(tmp_path, demo_model):
    """A dataset without the configured id (or text) field: every row says which setting to
    change and to what, so that the fix is in the message, not in on_invalid=skip."""
    path = put(tmp_path / "p.jsonl", jsonl({"instruction": "Say hi.", "output": "hi"}, {"instruction": "Go.", "output": "ok"}))
    expected = {("prompt", None): "missing text: no 'prompt' field (set prompts.text_field to one of the line's fields: "
                                  "instruction, output); 1 more bad rows (1 missing text)",
                ("instruction", "id"): "missing id: no 'id' field (set prompts.id_field to one of the line's fields: "
                                       "instruction, output, or to null to number the prompts); 1 more bad rows"}
    for (text_field, id_field), message in expected.items():
        config = write_config(tmp_path, demo_model, path=path, text_field=text_field, id_field=id_field)
        result = cli("run", "tokenize", "--config", config)
        assert result.exit_code == 1
        assert error_line(result).startswith(f"error: prompts file {path} line 1: {message}")
        result = cli("run", "tokenize", "--config", config, "--set", "prompts.on_invalid=skip")
        assert result.exit_code == 1
        assert error_line(result).startswith(f"error: prompts.path {path}: all 2 rows were rejected; first: {path} line 1: "
                                             f"{message.split(';')[0]}")


def test_each_kind_of_bad_row_is_shown_by_its_first_row(tmp_path, demo_model):
    """pandas writes integer ids with a null among them as floats: the null row comes first, and
    the float rows' hint still reaches the message."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "id": pa.array([None, 1.0, 2.0])}), path)
    result = cli("run", "tokenize", "--config", write_config(tmp_path, demo_model, path=str(path), id_field="id"))
    assert result.exit_code == 1
    assert error_line(result).startswith(
        f"error: prompts file {path} row 1: missing id: 'id' is null; 2 more bad rows (2 bad id, first at row 2: bad id: "
        "'id' is 1.0, a float, expected a non-empty string or an integer (integer ids with nulls become floats in pandas: "
        "store them as Int64 or as strings)); nothing written")


def test_bad_parquet_rows(tmp_path, demo_model):
    table = pa.table({"prompt": ["ok", None, "", "fine"], "id": pa.array(["a", "b", "c", None])})
    pq.write_table(table, tmp_path / "p.parquet")
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(tmp_path / "p.parquet"),
                                            id_field="id", on_invalid="skip"))
    assert [r["prompt_id"] for r in all_rows(url, record)] == ["a"]
    rejected = storage.read_parquet(storage.join(url, "rejected.parquet")).to_pylist()
    assert [(r["line"], r["prompt_index"], r["reason"].split(":")[0], r["raw"]) for r in rejected] == [
        (2, 1, "missing text", '{"prompt": null, "id": "b"}'), (3, 2, "empty prompt", '{"prompt": "", "id": "c"}'),
        (4, 3, "missing id", '{"prompt": "fine", "id": null}')]  # the columns read, as a JSONL line would hold them

    pq.write_table(pa.table({"other": ["x", "y"]}), tmp_path / "q.parquet")
    result = cli("run", "tokenize", "--config", write_config(tmp_path, demo_model, path=str(tmp_path / "q.parquet")))
    assert result.exit_code == 1
    assert error_line(result).startswith(f"error: prompts file {tmp_path / 'q.parquet'} row 1: missing text: "
                                         "no 'prompt' field (set prompts.text_field to one of the file's columns: other); "
                                         "1 more bad rows (1 missing text)")


# --- whole-input problems: both modes -------------------------------------------------------


def put(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _zipped(files: dict[str, dict]) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, row in files.items():
            archive.writestr(name, jsonl(row))
    return buffer.getvalue()


WHOLE_INPUT = {
    "empty file": (lambda d: put(d / "p.jsonl", b""), "no prompts in 1 file(s)"),
    "blank lines only": (lambda d: put(d / "p.txt", b"\n \n\t\n"), "no prompts in 1 file(s) (3 blank lines"),
    "glob matches nothing": (lambda d: str(d / "nothing-*.jsonl"), "matched no files (check the folder and the glob)"),
    "no such file": (lambda d: str(d / "missing.jsonl"), "matched no files (no such file, or an empty folder)"),
    "corrupt parquet": (lambda d: put(d / "p.parquet", b"PAR1 not really"), "could not be read: "),
    "corrupt gzip": (lambda d: put(d / "p.jsonl.gz", gzip.compress(jsonl(GOOD_1))[:-12] + b"garbage!"),
                     "could not be read: "),
    "unsupported type": (lambda d: put(d / "p.csv", b"prompt\nhi\n"), "unsupported file type"),
    # fsspec opens a zip's first file as if it were the whole zip: the others were left out, silently
    "zip of files": (lambda d: put(d / "p.jsonl.zip", _zipped({"a.jsonl": GOOD_1, "b.jsonl": GOOD_1})),
                     "unsupported file type (expected .jsonl, .ndjson, .txt or .parquet; text files may be compressed: "
                     "bz2, gz, lzma, xz; a .zip holds files: unpack it)"),
    "every row bad": (lambda d: put(d / "p.jsonl", b"{x\n[1]\n"), "all 2 rows were rejected"),
    # Notepad's and PowerShell 5's 'Unicode': its lines had been read as UTF-8, a NUL in every other byte
    "UTF-16 text": (lambda d: put(d / "p.txt", "alpha\r\nbeta\r\n".encode("utf-16")),
                    "is UTF-16 text (it begins with a UTF-16 byte order mark); prompts files must be UTF-8"),
    "UTF-32 JSONL": (lambda d: put(d / "p.jsonl", jsonl(GOOD_1).decode().encode("utf-32")),
                     "is UTF-32 text (it begins with a UTF-32 byte order mark)"),
    # classic Mac OS's line ends: the whole file had been one prompt
    "CR-only line ends": (lambda d: put(d / "p.txt", b"alpha\rbeta\rgamma\r"),
                          "ends its lines with CR alone (classic Mac OS text), so it would be read as one line"),
    # found while hashing the inputs, before the step starts:
    "unreachable host": (lambda d: "http://127.0.0.1:1/p.jsonl",
                         "could not be read: storage: could not list http://127.0.0.1:1/p.jsonl (ClientConnectorError"),
}


@pytest.mark.parametrize("on_invalid", ["fail", "skip"])
@pytest.mark.parametrize("case", list(WHOLE_INPUT))
def test_whole_input_problems_fail_in_both_modes_naming_the_url(tmp_path, demo_model, case, on_invalid):
    make, expected = WHOLE_INPUT[case]
    url = make(tmp_path)
    config = write_config(tmp_path, demo_model, path=url, on_invalid=on_invalid)
    result = cli("run", "tokenize", "--config", config)
    # A path matching no files, or a file of a type tokenize does not read, is a config error found
    # before tokenize starts (issue 14): exit 2.
    assert result.exit_code == (2 if "matched no files" in expected or "unsupported" in expected else 1), result.stderr
    if case == "every row bad" and on_invalid == "fail":
        expected = "line 1: invalid JSON"  # fail mode names the first bad row
    message = error_line(result)
    assert url in message and expected in message, message
    if "://" not in url:  # nothing written (a file of a refused type has no plan to look up)
        assert not list((tmp_path / "runs").rglob("*.parquet"))


@pytest.mark.parametrize("setting, expected", [
    ("prompts.on_invalid=maybe", "prompts.on_invalid must be fail or skip, got 'maybe'"),
    ("prompts.num_shards=0", "prompts.num_shards must be an integer > 0 or auto"),
    ("prompts.system_prompt=Be brief.", "prompts.system_prompt must be null while prompts.chat_template is false"),
    ("prompts.path={txt}", "prompts.id_field is 'id' but"),
    ("prompts.path=nosuch://bucket/p.jsonl", "prompts.path must be a local path or a URL of a storage fsspec can "
                                             "open (gs://, file://, memory://, ...): Protocol not known: nosuch"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_config_errors_exit_2_naming_the_key_before_any_step_folder(tmp_path, demo_model, setting, expected, dry_run):
    """Found before the plan's steps begin, so `--dry-run` finds them too, and nothing is written
    (before, the first two were found by the step: a tokenize folder and lease were left, which
    `status` called partial, and `--dry-run` passed)."""
    (tmp_path / "p.jsonl").write_bytes(jsonl(GOOD_1))
    (tmp_path / "p.txt").write_text("hello\n")
    config = write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"), id_field="id")
    result = cli("run", "tokenize", "--config", config, "--set", setting.format(txt=tmp_path / "p.txt"),
                 *["--dry-run"] * dry_run)
    assert result.exit_code == 2, result.stderr
    assert expected in error_line(result)
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")


def test_chat_template_without_a_template_is_a_config_error(tmp_path, demo_model):
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    (model / "chat_template.jinja").unlink()
    (tmp_path / "p.jsonl").write_bytes(jsonl(GOOD_1))
    config = write_config(tmp_path, str(model), path=str(tmp_path / "p.jsonl"), chat_template=True)
    for dry_run in ([], ["--dry-run"]):  # found before any step folder, so by a dry run too
        result = cli("run", "tokenize", "--config", config, *dry_run)
        assert result.exit_code == 2
        assert f"prompts.chat_template is true but the tokenizer at model.path {model} has no chat template" in error_line(result)
        assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_tokenizer_rewritten_at_the_same_url_is_loaded_again(tmp_path, demo_model, where):
    # One process (a notebook, or a session of in-process runs): the first load is cached, a
    # rewrite of the folder's tokenizer files must not keep serving the old tokenizer.
    from engine.checkpoint import TOKENIZER_FILES, load_tokenizer

    template = (Path(demo_model) / "chat_template.jinja").read_text()
    if where == "local":
        shutil.copytree(demo_model, tmp_path / "model")
        url = str(tmp_path / "model")
        write = lambda name, text: (tmp_path / "model" / name).write_text(text)  # noqa: E731
        remove = lambda name: (tmp_path / "model" / name).unlink()  # noqa: E731
    else:
        url = f"memory://tokenizer-rewrite-{tmp_path.name}"
        write = lambda name, text: storage.write_text(f"{url}/{name}", text)  # noqa: E731
        remove = lambda name: storage.filesystem(url)[0].rm(f"{url}/{name}")  # noqa: E731
        for name in TOKENIZER_FILES:
            if (Path(demo_model) / name).exists():
                write(name, (Path(demo_model) / name).read_text())
    remove("chat_template.jinja")
    assert load_tokenizer(url).chat_template is None
    assert load_tokenizer(url) is load_tokenizer(url)  # unchanged files: the cached one

    write("chat_template.jinja", template)
    assert load_tokenizer(url).chat_template == template


# --- reading: the Arrow fast path and block boundaries --------------------------------------

json_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=12), st.lists(st.integers(), max_size=2))
clean_line = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=20).filter(str.strip),
     "id": st.one_of(st.text(min_size=1, max_size=6), st.integers(-2**63, 2**63 - 1))},
    optional={"meta": json_values})
json_lines = st.one_of(
    clean_line, clean_line, clean_line, clean_line, st.just(""),  # mostly clean: the fast path's case
    st.fixed_dictionaries({"prompt": st.text(max_size=20), "id": st.one_of(st.text(max_size=6), st.integers(-5, 10**12))}),
    st.dictionaries(st.sampled_from(["prompt", "id", "meta"]), json_values, max_size=3),
    st.sampled_from(["", "   ", "{", "[1]", '{"prompt": "a", "prompt": "b", "id": "d"}', '{"prompt": "x\\ud800"}',
                     '{"prompt": "a", "id": "b"} {"prompt": "c", "id": "d"}', '{"prompt": NaN}']),
)


@settings(max_examples=150, deadline=None)
@given(lines=st.one_of(st.lists(st.one_of(clean_line, st.just(""), st.just(" \r")), min_size=1, max_size=12),
                       st.lists(json_lines, min_size=1, max_size=12)),
       id_field=st.sampled_from([None, "id"]))
def test_arrow_fast_path_reads_exactly_what_the_json_parser_reads(lines, id_field):
    """Where Arrow's reading is used at all, it equals the per-line `json` reading."""
    data = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode() + b"\n"
    options = build_config({"run": {"root": "memory://x", "name": "t"}, "model": {"path": "m"},
                            "prompts": {"path": "p", "id_field": id_field}}).prompts
    split = data.split(b"\n")[:-1]
    fast = pf._arrow_rows(data, split, 1, options, [pa.string(), pa.int64()])
    if fast is not None:
        careful = [pf._line_row(n, line, options, is_jsonl=True) for n, line in enumerate(split, 1)]
        assert [r[:3] + r[4:] for r in fast] == [r[:3] + r[4:] for r in careful]


def test_arrow_fast_path_is_taken_for_clean_input(monkeypatch):
    import io

    options = build_config({"run": {"root": "r", "name": "t"}, "model": {"path": "m"},
                            "prompts": {"path": "p", "id_field": "id"}}).prompts
    data = jsonl({"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}) + b"\n" + jsonl({"prompt": "c", "id": 3})
    calls = []
    original = pf._arrow_rows
    monkeypatch.setattr(pf, "_arrow_rows", lambda *a: calls.append(r := original(*a)) or r)
    rows = [r for b in pf._text_rows(io.BytesIO(data), options, is_jsonl=True) for r in b]
    assert calls and all(c is not None for c in calls)
    assert [(n, t, i) for n, t, i, _, p in rows if p is None] == [(1, "a", "1"), (2, "b", "2"), (4, "c", "3")]


def test_lines_across_read_blocks(tmp_path, demo_model, monkeypatch):
    """Tiny read blocks split lines and multibyte characters anywhere: same rows."""
    texts = [f"prompt {i} ünïcödé {'x' * (i % 7)}" for i in range(40)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "p.jsonl").write_bytes(jsonl(*({"prompt": t} for t in texts)))
    (tmp_path / "in" / "q.txt").write_text("\n".join(texts))
    monkeypatch.setattr(pf, "READ_BYTES", 7)
    monkeypatch.setattr(pf, "BATCH_ROWS", 3)
    monkeypatch.setattr(tk, "FLUSH_ROWS", 2)  # many row groups per shard, flushed one by one
    url, record = run_tokenize(write_config(tmp_path, demo_model, path=str(tmp_path / "in" / "*"), num_shards=2))
    assert [r["prompt"] for r in all_rows(url, record)] == texts + texts
    shard = pq.ParquetFile(storage.join(url, "shard-00000.parquet"))
    assert shard.metadata.num_row_groups > 5
    assert shard.read()["prompt_index"].to_pylist() == sorted(shard.read()["prompt_index"].to_pylist())


# --- identity: what changes the tokenize hash -----------------------------------------------


@pytest.fixture
def ident(tmp_path, demo_model):
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    (tmp_path / "p.jsonl").write_bytes(jsonl(GOOD_1, GOOD_3))
    return {"run": {"root": str(tmp_path / "runs"), "name": "t"}, "model": {"path": str(model)},
            "prompts": {"path": str(tmp_path / "p.jsonl"), "id_field": "id"}}


def _hash(data: dict) -> str:
    return make_plan(build_config(data), PIPELINE)[0].hash


@pytest.mark.parametrize("edit, changes", [
    (("run", "root", "memory://elsewhere/runs"), False),
    (("prompts", "num_shards", 3), False),
    (("prompts", "max_prompt_tokens", 7), True),
    (("prompts", "chat_template", True), True),
    (("prompts", "text_field", "text"), True),
    (("prompts", "id_field", None), True),
    (("prompts", "on_invalid", "skip"), True),
])
def test_tokenize_hash_table(ident, edit, changes):
    section, key, value = edit
    edited = {**ident, section: {**ident[section], key: value}}
    assert (_hash(edited) != _hash(ident)) is changes


def test_tokenize_hash_takes_the_system_prompt(ident):
    chat = {**ident, "prompts": {**ident["prompts"], "chat_template": True}}
    assert _hash({**chat, "prompts": {**chat["prompts"], "system_prompt": "x"}}) != _hash(chat)


def test_tokenize_hash_follows_content_not_location(ident, tmp_path):
    before = _hash(ident)
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(ident["prompts"]["path"], moved)
    model = tmp_path / "model-copy"
    shutil.copytree(ident["model"]["path"], model)
    assert _hash({**ident, "prompts": {**ident["prompts"], "path": str(moved)},
                  "model": {"path": str(model)}}) == before
    moved.write_bytes(jsonl(GOOD_1, {"id": "c", "prompt": "Changed."}))
    assert _hash({**ident, "prompts": {**ident["prompts"], "path": str(moved)}}) != before
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["added_tokens"][0]["content"] = "<unknown>"
    (model / "tokenizer.json").write_text(json.dumps(spec))
    assert _hash({**ident, "model": {"path": str(model)}}) != before


def test_the_same_bytes_as_txt_and_as_jsonl_hash_apart(ident, tmp_path):
    """A .txt file's lines are its prompts; the same bytes named .jsonl are parsed. Before, both
    had one tokenize hash: renamed, the file's run skipped tokenize and kept the raw JSON lines as
    prompts. A JSONL file's hash is the one it had before (a result made then is kept)."""
    jsonl_hash = _hash(ident)
    assert jsonl_hash == _hash({**ident, "prompts": {**ident["prompts"], "path": str(tmp_path / "p.jsonl")}})
    as_text = tmp_path / "as-text" / "p.txt"
    as_text.parent.mkdir()
    shutil.copy(ident["prompts"]["path"], as_text)
    txt_hash = _hash({**ident, "prompts": {**ident["prompts"], "path": str(as_text), "id_field": None}})
    no_id = _hash({**ident, "prompts": {**ident["prompts"], "id_field": None}})
    assert txt_hash != no_id
    gzipped = tmp_path / "gz"
    gzipped.mkdir()
    data = gzip.compress((tmp_path / "p.jsonl").read_bytes(), mtime=0)
    for name in ("p.txt.gz", "p.jsonl.gz"):
        (gzipped / name).write_bytes(data)
    assert (_hash({**ident, "prompts": {**ident["prompts"], "path": str(gzipped / "p.txt.gz"), "id_field": None}})
            != _hash({**ident, "prompts": {**ident["prompts"], "path": str(gzipped / "p.jsonl.gz"), "id_field": None}}))


def test_a_finished_input_renamed_to_a_refused_type_is_refused_not_complete(tmp_path, demo_model):
    """The same bytes named .csv hashed as the .jsonl tokenize had finished: `run` skipped it as
    complete (exit 0) and `status` said so, where a fresh run refuses the type."""
    (tmp_path / "p.jsonl").write_bytes(jsonl(GOOD_1))
    config = write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"), id_field="id")
    run_tokenize(config)
    renamed = tmp_path / "renamed" / "p.csv"
    renamed.parent.mkdir()
    shutil.copy(tmp_path / "p.jsonl", renamed)
    for command in ("run", "status"):
        result = cli(command, *(["tokenize"] if command == "run" else []), "--config", config,
                     "--set", f"prompts.path={renamed}")
        assert result.exit_code == 2, result.stderr
        assert f"prompts file {renamed}: unsupported file type" in error_line(result), result.stderr


def test_reading_a_prompt_file_tells_how_much_of_it_is_read(tmp_path):
    """tokenize's ETA: before each batch, the share of the file's stored bytes read (a compressed
    file's too), rising to the whole file."""
    from pipeline.run.config import PromptsConfig

    rows = [{"id": i, "prompt": random.Random(i).randbytes(40).hex()} for i in range(60_000)]  # 2 blocks of 4 MiB
    put(tmp_path / "p.jsonl", jsonl(*rows))
    put(tmp_path / "p.jsonl.gz", gzip.compress(jsonl(*rows)))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet", row_group_size=10_000)
    for name in ("p.jsonl", "p.jsonl.gz", "p.parquet"):
        shares = []
        read = [row[0] for batch in pf.read_rows(str(tmp_path / name), PromptsConfig(path="unused", id_field="id"),
                                                  on_read=shares.append) for row in batch]
        assert read == list(range(1, 60_001)), name
        assert shares == sorted(shares) and 0 < shares[0] < 0.75 and shares[-1] == 1.0, (name, shares)


def test_rerun_skips_and_another_root_gives_the_same_hash_and_bytes(tmp_path, demo_model):
    (tmp_path / "p.jsonl").write_bytes(jsonl(*({"id": f"i{i}", "prompt": f"prompt {i}"} for i in range(20))))
    first = write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"), id_field="id", num_shards=3)
    url, record = run_tokenize(first)
    mtimes = {p: os.stat(p).st_mtime_ns for p in Path(url).iterdir()}
    result = cli("run", "tokenize", "--config", first)
    assert result.exit_code == 0 and "skip    complete (20 rows)" in result.stderr
    assert {p: os.stat(p).st_mtime_ns for p in Path(url).iterdir()} == mtimes

    other = write_config(tmp_path, demo_model, root=str(tmp_path / "other-root"), name="other.yaml",
                         path=str(tmp_path / "p.jsonl"), id_field="id", num_shards=3)
    other_url, other_record = run_tokenize(other)
    assert other_url.rsplit("/", 1)[-1] == url.rsplit("/", 1)[-1] and other_record.hash == record.hash
    assert [(f["path"], f["sha256"]) for f in other_record.files] == [(f["path"], f["sha256"]) for f in record.files]


def test_force_with_fewer_shards_leaves_no_stale_shards(tmp_path, demo_model):
    """num_shards is no part of the hash: a forced rerun with fewer shards reuses the folder."""
    (tmp_path / "p.jsonl").write_bytes(jsonl(*({"prompt": f"prompt {i}"} for i in range(10))) + b"{bad\n")
    config = write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"), num_shards=4, on_invalid="skip")
    url, _ = run_tokenize(config)
    assert output_files(url) == [status.MARKER, status.CONFIG_FILE, "rejected.parquet"] + \
        [f"shard-0000{i}.parquet" for i in range(4)]
    url2, record = run_tokenize(config, "--force", "--set", "prompts.num_shards=2")
    assert url2 == url and [f["path"] for f in record.files] == ["shard-00000.parquet", "shard-00001.parquet",
                                                                  "rejected.parquet"]
    assert output_files(url) == [status.MARKER, status.CONFIG_FILE, "rejected.parquet", "shard-00000.parquet",
                                 "shard-00001.parquet"]


# --- stops and kills ------------------------------------------------------------------------


def test_kill_between_shards_and_marker_leaves_the_step_partial(tmp_path, demo_model):
    (tmp_path / "p.jsonl").write_bytes(jsonl(*({"prompt": f"prompt {i}"} for i in range(9))))
    config = write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"), num_shards=3)
    killer = ("import os, sys; from pipeline.run import status; "
              "status.write_marker = lambda *a, **k: os._exit(137); "
              "from pipeline.cli import main; sys.argv = ['pipeline', 'run', 'tokenize', '--config', sys.argv[1]]; main()")
    proc = subprocess.run([sys.executable, "-c", killer, config], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 137, proc.stderr
    url = tokenize_step(config).url
    assert output_files(url) == [status.CONFIG_FILE, "shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    shown = json.loads(cli("status", "--config", config, "--json").stdout)
    assert (shown["steps"][0]["state"], shown["steps"][0]["rows"]) == ("partial", None)
    url, record = run_tokenize(config)  # the rerun redoes it and completes
    assert record.rows == 9 and json.loads(cli("status", "--config", config, "--json").stdout)["steps"][0]["state"] == "complete"


def test_stop_signal_between_batches_exits_75_and_writes_no_shard(tmp_path, demo_model, monkeypatch):
    (tmp_path / "p.jsonl").write_bytes(jsonl(*({"prompt": f"prompt {i}"} for i in range(10))))
    config = write_config(tmp_path, demo_model, path=str(tmp_path / "p.jsonl"))
    monkeypatch.setattr(pf, "BATCH_ROWS", 2)
    take = tk._Reader.take
    calls = []

    def take_then_stop(self, url, rows):
        calls.append(1)
        if len(calls) == 2:
            preemption.request_stop("SIGTERM")
        return take(self, url, rows)

    monkeypatch.setattr(tk._Reader, "take", take_then_stop)
    try:
        result = cli("run", "tokenize", "--config", config)
    finally:
        preemption.reset()
    assert result.exit_code == 75 and "rerun the same command to resume" in error_line(result)
    assert len(calls) == 2
    assert output_files(tokenize_step(config).url) == [status.CONFIG_FILE]
    monkeypatch.setattr(tk._Reader, "take", take)
    assert run_tokenize(config)[1].rows == 10


# --- gs:// on the emulator ------------------------------------------------------------------


def test_gcs_round_trip_prompts_model_and_output_on_gs(tmp_path, demo_model, gcs_bucket, reference):
    model = f"{gcs_bucket}/models/demo"
    for f in Path(demo_model).iterdir():
        storage.write_bytes(f"{model}/{f.name}", f.read_bytes())
    storage.write_bytes(f"{gcs_bucket}/prompts/part-1.jsonl", jsonl({"id": "c", "prompt": "third"}, b"{bad"))
    storage.write_bytes(f"{gcs_bucket}/prompts/part-0.jsonl", jsonl({"id": "a", "prompt": "first"},
                                                                     {"id": "b", "prompt": "second"}))
    config = write_config(tmp_path, model, root=f"{gcs_bucket}/runs", path=f"{gcs_bucket}/prompts/*.jsonl",
                          id_field="id", on_invalid="skip")
    url, record = run_tokenize(config)
    assert url.startswith(f"{gcs_bucket}/runs/tokenize-")
    rows = all_rows(url, record)
    assert [(r["prompt_index"], r["prompt_id"], r["prompt"]) for r in rows] == [(0, "a", "first"), (1, "b", "second"), (2, "c", "third")]
    assert [r["input_ids"] for r in rows] == reference(["first", "second", "third"])["input_ids"]
    (rejected,) = storage.read_parquet(f"{url}/rejected.parquet").to_pylist()
    assert (rejected["file"], rejected["line"], rejected["prompt_index"]) == (f"{gcs_bucket}/prompts/part-1.jsonl", 2, 3)
    assert [f["fingerprint"].split(":")[0] for f in record.summary["input_files"]] == ["md5", "md5"]
    # The same prompts and model on local disk hash the same: moving inputs to GCS reruns nothing.
    local = tmp_path / "local-prompts"
    local.mkdir()
    for name in ("part-0.jsonl", "part-1.jsonl"):
        (local / name).write_bytes(storage.read_bytes(f"{gcs_bucket}/prompts/{name}"))
    moved = write_config(tmp_path, demo_model, root=f"{gcs_bucket}/runs", path=f"{local}/*.jsonl", id_field="id",
                         on_invalid="skip", name="local.yaml")
    assert tokenize_step(moved).url == url

    shown = json.loads(cli("status", "--config", config, "--json").stdout)["steps"][0]
    assert (shown["state"], shown["rows"], shown["rejected"], shown["output"]) == ("complete", 3, 1, url)
    again = cli("run", "tokenize", "--config", config)
    assert again.exit_code == 0 and "skip    complete (3 rows)" in again.stderr

    nothing = write_config(tmp_path, model, root=f"{gcs_bucket}/runs", name="nothing.yaml",
                           path=f"{gcs_bucket}/nowhere/*.jsonl")
    result = cli("run", "tokenize", "--config", nothing)
    assert result.exit_code == 2  # checked before tokenize starts (issue 14)
    assert error_line(result) == (f"error: prompts.path {gcs_bucket}/nowhere/*.jsonl matched no files "
                                  "(check the bucket and the glob)")


def test_a_prompt_file_edited_while_tokenize_runs_is_not_marked_complete(tmp_path, demo_model, monkeypatch):
    """The plan hashes the files; tokenize reads them later (on a big input, minutes later). A
    file edited in between made a folder named for the old content holding the new rows, complete:
    every later run used those rows for a file that no longer held them."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about topic {i}."}) + "\n" for i in range(6)))
    config = write_config(tmp_path, demo_model, path=str(prompts))
    read_rows = tk.read_rows

    def edited_before_the_read(url, options, **kwargs):
        prompts.write_text(prompts.read_text().replace("topic", "EDITED topic"))  # the user's edit lands now
        yield from read_rows(url, options, **kwargs)

    monkeypatch.setattr(tk, "read_rows", edited_before_the_read)
    first = tokenize_step(config)
    result = cli("run", "tokenize", "--config", config)
    assert result.exit_code == 1
    assert error_line(result) == (f"error: prompts file {prompts} changed while tokenize ran: its output is not what "
                                  f"its hash says, so it is not marked complete; rerun the same command to tokenize "
                                  f"the files as they are now")
    assert status.output_state(first.url) == "partial"

    monkeypatch.undo()  # the rerun reads the file as it is now, under that content's hash
    run_tokenize(config)
    again = tokenize_step(config)
    assert again.hash != first.hash and again.state == "complete"
    texts = [text for shard in sorted(Path(again.url).glob("shard-*.parquet"))
             for text in pq.read_table(shard, columns=["prompt"]).column("prompt").to_pylist()]
    assert sorted(texts) == [f"Tell me about EDITED topic {i}." for i in range(6)]


def test_a_prompt_file_in_a_bucket_folder_edited_while_tokenize_runs_is_seen(tmp_path, demo_model, gcs_bucket, monkeypatch):
    """The same on gs:// with a folder as prompts.path: gcsfs keeps the folder's listing, md5s
    and all, so the recheck saw the files as the plan had and marked the edited input complete."""
    import gcsfs

    folder = f"{gcs_bucket}/prompts"
    storage.write_bytes(f"{folder}/part-0.jsonl", jsonl(*({"prompt": f"Tell me about topic {i}."} for i in range(4))))
    config = write_config(tmp_path, demo_model, path=folder)
    read_rows = tk.read_rows

    def edited_before_the_read(url, options, **kwargs):  # by another writer: not through this process's gcsfs
        gcsfs.GCSFileSystem(skip_instance_cache=True).pipe(
            url.removeprefix("gs://"), jsonl(*({"prompt": f"EDITED topic {i}."} for i in range(4))))
        yield from read_rows(url, options, **kwargs)

    monkeypatch.setattr(tk, "read_rows", edited_before_the_read)
    first = tokenize_step(config)
    result = cli("run", "tokenize", "--config", config)
    assert result.exit_code == 1
    assert error_line(result).startswith(f"error: prompts file {folder}/part-0.jsonl changed while tokenize ran: ")
    assert status.output_state(first.url) == "partial"


def test_a_parquet_id_column_of_floats_says_why_it_may_be_floats(tmp_path, demo_model):
    """pandas writes integer ids with a null among them as float64: the refusal said only that the
    id was 'a number', which an id column of 1, 2, 3 seemed to be."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": pa.array([1.0, 2.0, None]), "prompt": ["one", "two", "three"]}), path)
    result = cli("run", "tokenize", "--config", write_config(tmp_path, demo_model, path=str(path), id_field="id"))
    assert result.exit_code == 1
    assert error_line(result).startswith(
        f"error: prompts file {path} row 1: bad id: 'id' is 1.0, a float, expected a non-empty string or an integer "
        f"(integer ids with nulls become floats in pandas: store them as Int64 or as strings)"), error_line(result)
