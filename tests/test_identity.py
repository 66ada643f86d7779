"""Which edits change which step hashes: semantic ones change a step and its descendants,
runtime knobs change nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pipeline.run.config import apply_override, build_config
from pipeline.run.runner import make_plan
from steps import PIPELINE, STEP_NAMES

ALL = set(STEP_NAMES)
FROM_GENERATE = {"generate", "merge", "upload"}


def hashes(cfg) -> dict[str, str]:
    return {p.name: p.hash for p in make_plan(cfg, PIPELINE)}


@pytest.fixture
def base(tmp_path, demo_model):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    return {"run": {"root": str(tmp_path / "runs"), "name": "t"}, "model": {"path": str(model)},
            "prompts": {"path": str(prompts)}}


@pytest.mark.parametrize("override, changed", [
    ("sampling.temperature=0.7", FROM_GENERATE),
    ("sampling.n=3", FROM_GENERATE),
    ("sampling.stop=['###']", FROM_GENERATE),
    ("model.dtype=float32", FROM_GENERATE),
    ("sampling.logprobs=true", FROM_GENERATE),
    ("sampling.logprobs=false", set()),  # its default: no hash made before the key existed changes
    ("sampling.min_p=0", set()),
    ("sampling.presence_penalty=0.5", FROM_GENERATE),
    ("sampling.frequency_penalty=-0.2", FROM_GENERATE),
    ("sampling.frequency_penalty=0.0", set()),
    ("sampling.repetition_penalty=1.2", FROM_GENERATE),
    ("sampling.repetition_penalty=1", set()),
    ("sampling.min_new_tokens=3", FROM_GENERATE),
    ("sampling.min_new_tokens=0", set()),
    ("sampling.prompt_logprobs=true", FROM_GENERATE),
    ("sampling.prompt_logprobs=false", set()),
    ("sampling.top_logprobs=5", FROM_GENERATE),
    ("sampling.top_logprobs=0", set()),
    ("prompts.max_prompt_tokens=7", ALL),
    ("prompts.chat_template=true", ALL),
    ("prompts.on_invalid=skip", ALL),
    ("wandb.project=other", {"upload"}),
    ("run.name=other", {"upload"}),
    # runtime knobs: never part of a hash
    ("engine.batch_size=3", set()),
    ("engine.part_rows=5", set()),
    ("engine.mode=global_mesh", set()),
    ("prompts.num_shards=5", set()),
    ("run.root=memory://elsewhere", set()),
    ("wandb.mode=disabled", set()),
])
def test_which_edits_change_which_hashes(base, override, changed):
    before = hashes(build_config(base))
    after = hashes(build_config(apply_override(base, override)))
    assert {name for name in STEP_NAMES if before[name] != after[name]} == changed


@pytest.mark.parametrize("override", ["sampling.seed=3", "sampling.top_p=0.9", "sampling.top_k=40", "sampling.min_p=0.05"])
def test_a_sampling_key_changes_a_sampled_runs_hashes_and_not_a_greedy_ones(base, override):
    """A greedy run (sampling.temperature 0, the default) never reads seed, top_p, top_k or min_p."""
    for temperature, changed in (("0", set()), ("0.7", FROM_GENERATE)):
        before = build_config(apply_override(base, f"sampling.temperature={temperature}"))
        after = build_config(apply_override(apply_override(base, f"sampling.temperature={temperature}"), override))
        assert {name for name in STEP_NAMES if hashes(before)[name] != hashes(after)[name]} == changed


def test_what_changed_names_a_key_a_greedy_run_never_read_only_where_it_changed(base):
    """A sampled run after a greedy one of the same seed: the temperature changed, not the seed
    (which the greedy run hashed at 0)."""
    from pipeline.run.identity import what_changed
    from pipeline.run.status import StepRecord

    greedy = build_config(apply_override(base, "sampling.seed=3"))
    then = make_plan(greedy, PIPELINE)[1]
    record = StepRecord(step="generate", hash=then.hash, version=then.step.version, files=[], summary={}, rows=2,
                        started_at="", finished_at="", wall_s=0.0, config=greedy.to_dict(), upstream={}, content=then.content)
    sampled = build_config(apply_override(apply_override(base, "sampling.seed=3"), "sampling.temperature=0.7"))
    assert what_changed("generate", then.step.version, sampled, then.content, {}, record) == (
        "sampling.temperature changed from 0.0 to 0.7")
    reseeded = build_config(apply_override(apply_override(base, "sampling.seed=4"), "sampling.temperature=0.7"))
    assert what_changed("generate", then.step.version, reseeded, then.content, {}, record) == (
        "sampling.temperature changed from 0.0 to 0.7; sampling.seed changed from 3 to 4")


def test_a_key_added_later_is_in_no_hash_at_its_default(base):
    """`sampling.logprobs`, `min_p` and the penalties came after results existed: at their defaults the generate step hashes
    the same values as before it did, so those results are found, not generated again."""
    from pipeline.run.identity import semantic_values

    before = ["model.dtype", "sampling.max_new_tokens", "sampling.temperature", "sampling.top_p", "sampling.top_k",
              "sampling.n", "sampling.seed", "sampling.stop", "sampling.stop_token_ids"]
    assert list(semantic_values("generate", build_config(base))) == before
    assert list(semantic_values("generate", build_config(apply_override(base, "sampling.logprobs=true")))) == [
        *before, "sampling.logprobs"]
    sampled = apply_override(base, "sampling.temperature=0.7")  # a greedy run never reads min_p
    assert list(semantic_values("generate", build_config(apply_override(sampled, "sampling.min_p=0.1")))) == [
        *before, "sampling.min_p"]
    assert list(semantic_values("generate", build_config(apply_override(base, "sampling.presence_penalty=0.3")))) == [
        *before, "sampling.presence_penalty"]


def test_content_not_location_enters_the_hash(base, tmp_path):
    before = hashes(build_config(base))
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(base["prompts"]["path"], moved)
    assert hashes(build_config(apply_override(base, f"prompts.path={moved}"))) == before

    moved.write_text('{"prompt": "hello"}\n{"prompt": "world!"}\n')
    assert set(hashes(build_config(apply_override(base, f"prompts.path={moved}"))).items()) & set(before.items()) == set()


def test_model_weights_change_generate_but_not_tokenize(base):
    before = hashes(build_config(base))
    weights = f"{base['model']['path']}/model.safetensors"
    data = bytearray(open(weights, "rb").read())
    data[-1] ^= 0xFF
    open(weights, "wb").write(bytes(data))
    after = hashes(build_config(base))
    assert {n for n in STEP_NAMES if before[n] != after[n]} == FROM_GENERATE


def test_tokenizer_change_changes_every_hash(base):
    before = hashes(build_config(base))
    path = f"{base['model']['path']}/tokenizer_config.json"
    config = json.load(open(path))
    config["model_max_length"] = 77
    json.dump(config, open(path, "w"))
    after = hashes(build_config(base))
    assert all(before[n] != after[n] for n in STEP_NAMES)


def test_what_changed_since_the_plan_is_named(base, tmp_path):
    """Before tokenize is marked complete its inputs are read again (`changed_input`): the file,
    the file count or the tokenizer file that no longer holds what the plan hashed."""
    from pipeline.run.identity import changed_input

    cfg = build_config(base)
    planned = make_plan(cfg, PIPELINE)[0].content
    assert changed_input("tokenize", cfg, planned) is None
    assert changed_input("generate", cfg, make_plan(cfg, PIPELINE)[1].content) is None  # weights: not read again
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    assert changed_input("tokenize", cfg, planned) == f"prompts file {tmp_path / 'prompts.jsonl'} changed"
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    globbed = build_config({**base, "prompts": {"path": str(tmp_path / "*.jsonl")}})
    planned = make_plan(globbed, PIPELINE)[0].content
    (tmp_path / "more.jsonl").write_text('{"prompt": "again"}\n')
    assert changed_input("tokenize", globbed, planned) == (f"prompts.path {tmp_path / '*.jsonl'} matched 1 file(s) when "
                                                           f"the run began and 2 now")
    (tmp_path / "more.jsonl").unlink()
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    assert changed_input("tokenize", globbed, planned) == (f"the tokenizer file {tmp_path / 'model'}/tokenizer_config.json "
                                                           f"changed")


def test_hashes_are_stable_across_processes(base):
    code = ("import json,sys; from pipeline.run.config import build_config; from pipeline.run.runner import make_plan; from steps import PIPELINE;"
            "print(json.dumps([p.hash for p in make_plan(build_config(json.loads(sys.argv[1])), PIPELINE)]))")
    runs = [subprocess.run([sys.executable, "-c", code, json.dumps(base)], capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout) == [hashes(build_config(base))[n] for n in STEP_NAMES]


def test_a_large_local_file_is_read_for_its_fingerprint_once_until_it_changes(tmp_path, monkeypatch):
    """A local checkpoint of gigabytes was hashed again by every plan (`status`, each `run`):
    its fingerprint is now kept in the machine's cache folder. Any write is seen, even one that
    keeps the size and sets the old mtime back: the write changed the file's ctime."""
    import hashlib
    import os

    from pipeline import storage

    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    reads = []
    md5 = storage._md5
    monkeypatch.setattr(storage, "_md5", lambda fs, path: reads.append(path) or md5(fs, path))
    weights = tmp_path / "model.safetensors"
    content = os.urandom(storage.FINGERPRINTS_CACHED_FROM + 5)
    weights.write_bytes(content)
    want = f"md5:{hashlib.md5(content).hexdigest()}:{len(content)}"
    assert [storage.fingerprint(str(weights)) for _ in range(3)] == [want] * 3
    assert len(reads) == 1 and len(os.listdir(tmp_path / "cache" / "fingerprints")) == 1

    before = os.stat(weights)
    changed = b"x" + content[1:]
    with open(weights, "r+b") as f:  # in place: the same inode and size
        f.write(changed[:1])
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # the old mtime, as `touch -d` would set it
    assert storage.fingerprint(str(weights)) == f"md5:{hashlib.md5(changed).hexdigest()}:{len(changed)}"
    assert len(reads) == 2

    small = tmp_path / "config.json"  # small files are hashed each time, as cheap as a lookup
    small.write_text("{}")
    storage.fingerprint(str(small)), storage.fingerprint(str(small))
    assert len(reads) == 4

    (tmp_path / "cache").rename(tmp_path / "elsewhere")
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    assert storage.fingerprint(str(weights)) == f"md5:{hashlib.md5(changed).hexdigest()}:{len(changed)}"


def test_prompt_files_renamed_into_another_order_are_said_to_be(base, tmp_path):
    """A rename that changes the files' order renumbers the prompts (a rerun is right), but was
    reported as `prompts file .../0b.jsonl changed`: neither file had."""
    from pipeline.run.identity import what_changed
    from pipeline.run.status import StepRecord

    folder = tmp_path / "pdir"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "first"}\n')
    (folder / "b.jsonl").write_text('{"prompt": "second"}\n')
    cfg = build_config({**base, "prompts": {"path": str(folder)}})
    before = make_plan(cfg, PIPELINE)[0]
    (folder / "b.jsonl").rename(folder / "0b.jsonl")
    after = make_plan(cfg, PIPELINE)[0]
    assert after.hash != before.hash
    record = StepRecord(step="tokenize", hash=before.hash, version=before.step.version, files=[], summary={}, rows=2,
                        started_at="", finished_at="", wall_s=0.0, config=cfg.to_dict(), upstream={}, content=before.content)
    assert what_changed("tokenize", before.step.version, cfg, after.content, {}, record) == (
        f"the files prompts.path {folder} matches are the same but in another order (by name: it numbers the prompts)")
    # a.jsonl replaced by c.jsonl: the files are compared by place, and 0b.jsonl's (which moved up
    # one) was named as the one that changed.
    (folder / "a.jsonl").rename(folder / "c.jsonl")
    (folder / "c.jsonl").write_text('{"prompt": "third"}\n')
    assert what_changed("tokenize", before.step.version, cfg, make_plan(cfg, PIPELINE)[0].content, {}, record) == (
        f"prompts file {folder / 'c.jsonl'} is new or changed")
