"""generate on real pods of local processes (`pipeline launch`): same rows for any host
count, resume after SIGKILL / SIGTERM without losing or duplicating a (prompt, sample); and its
parts, bounded by rows and by the list entries buffered."""

from __future__ import annotations

import glob
import itertools
import json
import os
import signal
import subprocess
import re
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from steps.generate import per_host
from tests.conftest import generated_rows, pipeline

GREEDY = {"sampling": {"max_new_tokens": 12, "temperature": 0.0, "n": 2}, "engine": {"batch_size": 4, "part_rows": 4}}


def test_a_resumed_steps_tokens_per_second_adds_up_hosts_not_one_hosts_runs(fake_run):
    """A resumed step ran host 0 twice, one run after the other, beside host 1 (and once more with
    nothing left to do): the pod's rate is host 0's tokens over its seconds plus host 1's, not the
    three runs' rates added up (as it was: 2,000 tok/s)."""
    from pipeline import storage
    from steps import generate

    run = fake_run(prompts=10, n=2)
    out = run.out("generate")
    for stamp, host, samples, tokens, wall_s in [("1", 0, 12, 1200, 2.0), ("2", 1, 8, 800, 1.0),
                                                 ("3", 0, 4, 600, 1.0), ("4", 0, 0, 0, 0.1)]:
        storage.write_json(out.path("metrics", f"host-{host:05d}-{stamp}.json"), {
            "host": host, "samples": samples, "generated_tokens": tokens, "wall_s": wall_s, "compile_s": 0.5,
            "tokens_per_s": tokens / wall_s})
    summary = generate.finish(run.cfg, out).summary
    assert summary.tokens_per_s == 1800 / 3.0 + 800 / 1.0
    assert summary.generated_tokens == 2600 and summary.wall_s == 2.0 and len(summary.hosts) == 4
    # What W&B shows per host (upload): host 0's three runs as one, its rate over the runs that generated.
    assert [(h["host"], h["runs"], h["samples"], h["generated_tokens"], h["wall_s"], h["tokens_per_s"])
            for h in generate.per_host(summary.hosts)] == [(0, 3, 16, 1800, 3.1, 600.0), (1, 1, 8, 800, 1.0, 800.0)]


@pytest.fixture
def many_prompts(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Prompt {i}: write about the number {i * 7}."}) + "\n"
                            for i in range(40)))
    return str(path)


@pytest.fixture
def reference(make_config, tmp_path, many_prompts):
    """An uninterrupted single-host run of tokenize + generate."""
    config = make_config("reference.yaml", run={"root": str(tmp_path / "reference")}, prompts={"path": many_prompts},
                         **GREEDY)
    for step in ("tokenize", "generate"):
        result = pipeline("run", step, "--config", config)
        assert result.returncode == 0, result.stderr[-3000:]
    rows = generated_rows(tmp_path / "reference")
    assert len(rows) == 40 * 2
    return rows


@pytest.mark.parametrize("hosts, shards", [(2, "auto"), (3, 2)])
def test_any_host_count_gives_the_same_rows(make_config, tmp_path, many_prompts, reference, hosts, shards):
    """Also with fewer shards than hosts (tokenized on a smaller machine): the hosts without a
    shard are named on the leader's output, and the rows are the same."""
    config = make_config(f"pod{hosts}.yaml", run={"root": str(tmp_path / f"pod{hosts}")},
                         prompts={"path": many_prompts, "num_shards": shards}, **GREEDY)
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    result = pipeline("launch", "--hosts", str(hosts), "--", "run", "generate", "--config", config)
    assert result.returncode == 0, result.stderr[-3000:]
    idle = [line for line in result.stderr.splitlines() if "nothing to generate" in line]
    assert idle == ([] if shards == "auto" else
                    ["[host 0] generate: warning: 3 hosts but 2 tokenize shard(s): host 2 has nothing to generate "
                     "(tokenize cut the shards for the host count it ran with; set prompts.num_shards to at least 3 for "
                     "the next prompts you tokenize)"]), result.stderr[-3000:]
    assert generated_rows(tmp_path / f"pod{hosts}") == reference
    metrics = [json.load(open(path)) for path in glob.glob(f"{tmp_path}/pod{hosts}/generate-*/metrics/host-*.json")]
    assert len(metrics) == hosts
    for m in [m for m in metrics if m["samples"]]:  # every busy host got its few programs, and says what waiting cost it
        got = sum(p["compiled"] + p["loaded"] for p in m["programs"].values())
        # init, decode, prefill of first chunks (and of later ones), staged rows' move (adopt)
        assert got == m["compilations"] + m["cache_loads"] == m["programs_used"] and 3 <= got <= 5, m
        assert 0 < m["compile_wait_s"] <= min(m["wall_s"], m["compile_s"] + 0.05), m


def test_a_pod_with_its_run_root_in_a_bucket_makes_the_same_rows(make_config, tmp_path, many_prompts, reference, gcs_bucket):
    """The pod's usual setup: every host writes its parts to one gs:// root (here the GCS
    emulator, through gcsfs), the leader merges what all of them wrote, then uploads."""
    from pipeline import storage

    root = f"{gcs_bucket}/runs"
    config = make_config("bucket.yaml", run={"root": root}, prompts={"path": many_prompts}, **GREEDY)
    result = pipeline("launch", "--hosts", "2", "--", "run", "all", "--config", config)
    assert result.returncode == 0, result.stderr[-3000:]
    (merged,) = [line for line in result.stderr.splitlines() if line.startswith("[host 0] result: ")]
    assert result.stdout == ""  # a run's lines are on standard error, the hosts' as the launch's
    assert merged.startswith(f"[host 0] result: {root}/merge-") and merged.endswith("(80 rows in 1 file)")
    rows = storage.read_parquet(merged.split()[3]).to_pylist()
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == sorted(reference)  # each once, in order
    assert {(r["prompt_index"], r["sample_index"]): (r["completion_token_ids"], r["finish_reason"], r["prompt_id"],
                                                     r["num_prompt_tokens"]) for r in rows} == reference
    metrics = [storage.read_json(url) for url in storage.expand(f"{root}/generate-*/metrics/host-*.json")]
    assert sorted(m["host"] for m in metrics if m["samples"]) == [0, 1]  # both hosts generated rows
    # Its prompts deleted since, the result is still found from the bucket's markers.
    os.remove(many_prompts)
    steps = json.loads(pipeline("status", "--config", config, "--json").stdout)["steps"]
    assert [s["state"] for s in steps] == ["complete"] * 4
    assert "which matches no files now" in steps[0]["why"]


PARTS = "generate-*/shard-*/part-*.parquet"


def test_a_pods_second_run_loads_every_hosts_programs_from_the_compile_cache(make_config, tmp_path, many_prompts):
    """JAX writes cache entries from process 0 only, and a program's key holds its devices: the
    other hosts' programs were never written, so every resume compiled them again on every host
    but the first. Now each host writes its own (engine/compile_cache.py)."""
    cache = {"PIPELINE_CACHE_DIR": str(tmp_path / "cache")}  # empty: what this test's runs write
    for root in ("first", "second"):  # same model and shapes, another result folder
        config = make_config(f"{root}.yaml", run={"root": str(tmp_path / root)}, prompts={"path": many_prompts}, **GREEDY)
        assert pipeline("run", "tokenize", "--config", config, env=cache).returncode == 0
        result = pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, env=cache)
        assert result.returncode == 0, result.stderr[-3000:]
    metrics = {path.name.split("-")[1]: json.loads(path.read_text())
               for path in (tmp_path / "second").glob("generate-*/metrics/host-*.json")}
    assert sorted(metrics) == ["00000", "00001"]
    for host, m in metrics.items():
        assert m["compilations"] == 0 and m["cache_loads"] == m["programs_used"] >= 3, (host, m)


def test_sigkill_of_one_host_then_rerun_with_another_host_count(make_config, tmp_path, many_prompts, reference,
                                                                start_pipeline, slow_parts):
    """A hard kill loses only uncommitted rows; the rerun (now 1 host instead of 2) fills exactly the gaps."""
    root = tmp_path / "killed"
    config = make_config("killed.yaml", run={"root": str(root)}, prompts={"path": many_prompts}, **GREEDY)
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    pod = start_pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config,
                         env=slow_parts(hosts=[1], seconds=0.5))
    # Host 1's own first part (its shards are the odd ones), with its other parts half a second
    # apart: it had sometimes finished its rows before the kill landed.
    pod.wait_for_files(f"{root}/generate-*/shard-0000[1357]/part-*.parquet")
    victim = pod.hosts()
    assert victim, "no host processes found"
    os.kill(victim[-1], signal.SIGKILL)
    started = time.monotonic()
    pod.finish(timeout_s=240)
    output = pod.output
    assert pod.returncode == 75, output[-3000:]  # a killed host is a preemption: rerun to resume
    assert "[launch] host 1 was ended by SIGKILL" in output  # it could not say so itself
    print(f"pod exited {pod.returncode} {time.monotonic() - started:.1f}s after the kill:\n{output[-1500:]}")
    partial = generated_rows(root)
    assert 0 < len(partial) < 80
    # Its figures until its last part are kept: a killed run wrote none, so the step's counted none of its work.
    (killed,) = [json.load(open(m)) for m in glob.glob(f"{root}/generate-*/metrics/host-00001-*.json")]
    assert killed["samples"] > 0 and killed["generated_tokens"] > 0, killed
    steps = json.loads(pipeline("status", "--config", config, "--json").stdout)["steps"]
    assert {s["name"]: s["state"] for s in steps} == {"tokenize": "complete", "generate": "partial", "merge": "missing",
                                                     "upload": "missing"}
    parts = glob.glob(f"{root}/{PARTS}")  # how far it got, from the parts' footers
    assert steps[1]["progress"] == f"{len(partial)} of 80 rows committed in {len(parts)} part(s)"
    assert (steps[1]["committed_rows"], steps[1]["total_rows"]) == (len(partial), 80)  # the same, for scripts

    result = pipeline("run", "all", "--config", config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert generated_rows(root) == reference


def test_a_run_killed_on_a_bucket_leaves_its_step_log_up_to_then(make_config, tmp_path, many_prompts, gcs_bucket,
                                                                 start_pipeline, slow_parts):
    """On a gs:// root a step's log was uploaded when the step ended: a preempted (killed) run's log,
    the one worth reading, was lost, and none of it was in the bucket while the step ran."""
    from pipeline import storage

    root = f"{gcs_bucket}/runs"
    config = make_config("logged.yaml", run={"root": root}, prompts={"path": many_prompts}, **GREEDY)
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    proc = start_pipeline("run", "generate", "--config", config,
                          env={**slow_parts(hosts=[0], seconds=0.5), "STEP_LOG_SAVE_EVERY_S": "0.5"})
    deadline = time.monotonic() + 120
    while not storage.expand(f"{root}/{PARTS}") and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)
    proc.kill()  # SIGKILL: nothing runs after it
    (log,) = storage.expand(f"{root}/generate-*/logs/host-00000.log")
    begin, first, *_ = storage.read_bytes(log).decode().splitlines()
    assert begin.startswith("=== ") and " generate-" in begin and first.startswith("generate: llama "), (begin, first)


def test_the_leader_killed_ends_every_host_with_exit_75_and_an_error_line(make_config, tmp_path, many_prompts,
                                                                          start_pipeline, slow_parts):
    """JAX's distributed runtime ends the other hosts natively when the pod's coordinator (on the
    leader) goes away: a C++ stack trace and exit 134, no `error:` line. Each host's command runs
    under a small parent (pipeline/pod/supervise.py) that says what happened, exit 75."""
    root = tmp_path / "leaderless"
    config = make_config("leaderless.yaml", run={"root": str(root)}, prompts={"path": many_prompts}, **GREEDY)
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    pod = start_pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config,
                         env=slow_parts(hosts=[0, 1], seconds=0.5))  # work left on both when the kill lands
    pod.wait_for_files(f"{root}/{PARTS}")
    leader = pod.hosts()[0]  # host 0's parent; its child runs the command and serves the coordinator
    (command,) = subprocess.run(["ps", "-o", "pid=", "--ppid", str(leader)], capture_output=True, text=True).stdout.split()
    os.kill(int(command), signal.SIGKILL)
    pod.finish(timeout_s=240)
    assert pod.returncode == 75, pod.output[-3000:]
    last = {host: [line for line in pod.output.splitlines() if line.startswith(f"[host {host}] ")][-1] for host in (0, 1)}
    assert last[0] == ("[host 0] error: host 0: it was ended by SIGKILL; rows it had not committed are generated "
                       "again: rerun the same command to resume"), pod.output[-3000:]
    assert last[1] == ("[host 1] error: host 1: JAX's distributed runtime ended it (SIGABRT): the pod's coordinator, on "
                       "the leader (host 0), is gone (killed or preempted); rows it had not committed are generated "
                       "again: rerun the same command to resume"), pod.output[-3000:]


def test_sigterm_commits_finished_rows_and_exits_75(make_config, tmp_path, many_prompts, reference, start_pipeline,
                                                   slow_parts):
    root = tmp_path / "termed"
    config = make_config("termed.yaml", run={"root": str(root)}, prompts={"path": many_prompts}, **GREEDY)
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    # A pause after each part: a fast CPU finished all 80 rows before the signal landed (CI, 2026-12-02).
    proc = start_pipeline("run", "generate", "--config", config, env=slow_parts(hosts=[0], seconds=0.5))
    proc.wait_for_files(f"{root}/{PARTS}")
    proc.send_signal(signal.SIGTERM)
    proc.finish(timeout_s=120)
    output = proc.output
    assert proc.returncode == 75, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("error: stopped by SIGTERM")
    committed = generated_rows(root)
    assert 0 < len(committed) < 80
    assert committed.items() <= reference.items()

    result = pipeline("run", "generate", "--config", config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert generated_rows(root) == reference
    # Issue 14: the resumed bar counts what was committed before (it started at 0 of what was left).
    assert f": 80/80 samples ({len(committed)} resumed), " in result.stderr, result.stderr[-2000:]
    # The stopped run's rows count in the step's figures too (they had counted only the last run's).
    summary = json.loads(pipeline("status", "--config", config, "--json").stdout)
    (generate,) = [s for s in summary["steps"] if s["name"] == "generate"]
    record = json.loads(open(os.path.join(generate["output"], "_SUCCESS.json")).read())["summary"]
    assert [h["runs"] for h in per_host(record["hosts"])] == [2]
    assert sum(h["samples"] for h in record["hosts"]) == 80, record["hosts"]



def test_token_ids_beyond_the_checkpoints_vocabulary(make_config, tmp_path, demo_model):
    """A checkpoint whose vocabulary is smaller than its tokenizer's: generate exits 1 with one
    line naming the shard, the token id and model.path, before loading the engine (no program is
    compiled for a run that cannot start), and marks nothing complete."""
    import shutil

    from demo.checkpoint import build_checkpoint

    model = tmp_path / "small-vocab"
    build_checkpoint(model, vocab_size=100)  # weights of a 100-token vocabulary...
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ... beside the demo's 512-token tokenizer
        shutil.copy(os.path.join(demo_model, name), model / name)
    path = make_config(model={"path": str(model)}, engine={"batch_size": 8, "compile_during_load": True})
    assert pipeline("run", "tokenize", "--config", path).returncode == 0
    result = pipeline("run", "generate", "--config", path)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds token id" in errors[0], result.stderr[-3000:]
    assert f"but model.path {model} has a vocabulary of 100" in errors[0], errors
    assert "program 1" not in result.stderr and not glob.glob(f"{tmp_path}/runs/generate-*/_SUCCESS"), result.stderr


@pytest.mark.parametrize("statistics", [True, False])
def test_the_vocabulary_check_reads_a_shards_footer_not_its_token_ids(tmp_path, monkeypatch, statistics):
    """generate checks the largest token id of every shard against the checkpoint's vocabulary
    before it loads: from the footer's column statistics (tokenize's shards have them), which on
    a big input is not reading its token ids once more before the first token; a shard written
    without them is read."""
    import numpy as np
    import pyarrow as pa

    from steps import generate, tokenize

    ids = [[5, 17], [3], [900, 2, 41], [7, 8]]
    shard = tmp_path / "shard-00000.parquet"
    with pq.ParquetWriter(shard, tokenize.SHARD_SCHEMA, write_statistics=statistics) as writer:
        for rows in (ids[:2], ids[2:]):  # two row groups: the largest id is in the second
            writer.write_table(pa.table({"prompt_index": range(len(rows)), "prompt_id": ["p"] * len(rows),
                                         "prompt": ["x"] * len(rows), "input_ids": rows,
                                         "num_tokens": [len(r) for r in rows]}, schema=tokenize.SHARD_SCHEMA))
    read = []
    real_read = generate.read_shard
    monkeypatch.setattr(generate, "read_shard", lambda url, columns: read.append(columns) or real_read(url, columns))
    todo = generate._ShardTodo("shard-00000", str(shard), np.arange(4), np.array([2, 1, 3, 2]), np.ones((4, 1), bool),
                               footer=pq.read_metadata(shard))  # as `_ShardTodo.read` keeps it
    assert todo.max_token_id() == 900
    assert read == ([] if statistics else [["input_ids"]])


def test_a_shard_that_lacks_a_column_generate_reads_is_named(tmp_path):
    """A file in tokenize's folder without the columns generate reads (another program's, an old
    version's) is one error naming it and the command that writes it again, not a KeyError."""
    from types import SimpleNamespace

    import numpy as np
    import pyarrow as pa

    from pipeline.errors import StepFailed
    from steps import generate

    pq.write_table(pa.table({"prompt_index": [0, 1]}), tmp_path / "shard-00000.parquet")
    out = SimpleNamespace(upstream={"tokenize": SimpleNamespace(url=str(tmp_path))})
    nothing_made = generate._Made(1, {}, np.zeros(0, np.int64), [])
    with pytest.raises(StepFailed, match=r"^tokenize shard \S*shard-00000\.parquet cannot be read \(it has no column "
                                         r"'num_tokens'\): rerun `pipeline run tokenize --config FILE --force`"):
        generate._ShardTodo.read(out, "shard-00000", None, nothing_made)


FAILS_AFTER_LOAD = """
import threading
import engine.engine as engine_module
from pipeline.cli import main

options, never = engine_module.compiler_options, threading.Event()

def hold_the_first_compile():  # the init program's compile, in its thread, takes 10 minutes
    if not hold_the_first_compile.done:
        hold_the_first_compile.done = True
        never.wait(600)
    return options()

def fail(self, requests, stop=None):
    raise RuntimeError("the engine failed at its first call")
    yield

hold_the_first_compile.done = False
engine_module.compiler_options = hold_the_first_compile
engine_module.Engine.generate = fail
main()
"""


def test_a_step_failing_after_load_does_not_wait_for_compiles(make_config, tmp_path):
    """engine.compile_during_load gets the programs in threads, which the interpreter waits for at
    exit. A generate step that fails after Engine.load exits with its error at once, not after
    XLA has compiled programs no call will run (minutes on an accelerator; here the init
    program's compile is held for 10 minutes)."""
    path = make_config(engine={"batch_size": 8, "compile_during_load": True})
    assert pipeline("run", "tokenize", "--config", path).returncode == 0
    result = subprocess.run([sys.executable, "-c", FAILS_AFTER_LOAD, "run", "generate", "--config", path],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == "error: RuntimeError: the engine failed at its first call", result.stderr[-3000:]
    begun = sorted(line.split("(")[1].split(")")[0] for line in result.stderr.splitlines() if ": program " in line)
    assert begun == ["init"], result.stderr  # decode's thread, waiting for a prefill program, gave up unannounced
    assert not glob.glob(f"{tmp_path}/runs/generate-*/_SUCCESS")


FAILS_IN_PROCESS = """
import threading
import engine.engine as engine_module
from typer.testing import CliRunner
from pipeline.cli import app

held = threading.Event()
compiling = threading.Thread(target=held.wait, name=engine_module._AHEAD + "held")
compiling.start()  # a program being got ahead of its call, left by an earlier run of this process
assert engine_module.compiling_ahead()
codes = [CliRunner().invoke(app, ["run", "all", "--config", "no-such-config.yaml"]).exit_code for _ in range(2)]
print("still here after exits", codes, flush=True)
held.set()
"""


def test_a_command_failing_in_a_process_that_goes_on_returns_its_code(tmp_path):
    """The exit at once of a failing step while programs are got ahead (above) is the `pipeline`
    process's: `app` called in a process that goes on (a test runner, a notebook) returns the
    exit code. It ended that whole process: a pytest worker, when an engine test of the same
    worker had left a compile thread running."""
    result = subprocess.run([sys.executable, "-c", FAILS_IN_PROCESS], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert result.returncode == 0 and result.stdout == "still here after exits [2, 2]\n", result.stderr[-3000:]


def test_a_stop_signal_on_the_leader_while_it_waits_for_the_others(make_config, tmp_path, many_prompts, start_pipeline,
                                                                   slow_read):
    """The leader has finished its shards and waits for host 1's (still reading the weights, three
    seconds a tensor): Ctrl-C or SIGTERM on the leader alone ends it within seconds, and host 1
    stops at its next tensor, instead of both waiting for host 1 to finish its shards."""
    root = tmp_path / "waiting"
    config = make_config("waiting.yaml", run={"root": str(root)}, prompts={"path": many_prompts}, **GREEDY)
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    pod = start_pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config, env=slow_read(hosts=[1], seconds=3))
    pod.wait_for_files(f"{root}/generate-*/metrics/host-00000-*.json", timeout_s=120)  # the leader's shards are done
    assert "host 1 reading tensor 21" not in pod.output, "host 1 read the whole model before the leader finished"
    stopped_at = time.monotonic()
    os.kill(pod.hosts()[0], signal.SIGTERM)
    assert pod.wait_for("[host 0] error: stopped by SIGTERM", timeout_s=120), pod.output[-3000:]
    assert time.monotonic() - stopped_at < 10, pod.output[-3000:]
    assert pod.finish(timeout_s=120) == 75, pod.output[-3000:]
    assert len(re.findall(r"host 1 reading tensor \d+", pod.output)) < 21, pod.output[-3000:]
    assert not glob.glob(f"{root}/generate-*/_SUCCESS.json")


def test_a_host_stopped_alone_stops_the_others_within_seconds_keeping_their_rows(make_config, tmp_path, many_prompts,
                                                                                start_pipeline):
    """SIGTERM on host 1 alone (a maintenance event on one worker) while the leader has most of its
    shards still to generate: the leader commits the rows it finished and exits 75 naming host 1
    within seconds, instead of generating its shards to the end for a run that must be rerun
    anyway (and, under `pipeline launch`, being killed 90 s after host 1 left)."""
    root = tmp_path / "one-stopped"
    config = make_config("one-stopped.yaml", run={"root": str(root)}, prompts={"path": many_prompts},
                         sampling={"max_new_tokens": 512, "temperature": 0.0, "n": 16},
                         engine={"batch_size": 4, "part_rows": 4})
    assert pipeline("run", "tokenize", "--config", config).returncode == 0
    leaders_shards = sorted(glob.glob(f"{root}/tokenize-*/shard-*.parquet"))[0::2]  # shard i is host i % 2's
    leaders_rows = 16 * sum(pq.read_metadata(path).num_rows for path in leaders_shards)
    pod = start_pipeline("launch", "--hosts", "2", "--", "run", "generate", "--config", config)
    pod.wait_for_files(f"{root}/generate-*/shard-00001/part-*.parquet", timeout_s=300)  # both hosts generate
    stopped_at = time.monotonic()
    os.kill(pod.hosts()[1], signal.SIGTERM)
    assert pod.wait_for("[host 0] error: host 0/2: stopped generating: host 1 was stopped: stopped by SIGTERM",
                        timeout_s=120), pod.output[-3000:]
    assert time.monotonic() - stopped_at < 15, pod.output[-3000:]
    assert pod.finish(timeout_s=120) == 75, pod.output[-3000:]
    assert "[launch]" not in pod.output  # nobody had to be killed
    assert generated_rows(root)  # and none twice
    committed = sum(pq.read_metadata(part).num_rows for shard in leaders_shards
                    for part in glob.glob(f"{root}/generate-*/{Path(shard).stem}/part-*.parquet"))
    assert committed < leaders_rows / 2, (committed, leaders_rows)
    assert not glob.glob(f"{root}/generate-*/_SUCCESS.json")


def test_a_stop_signal_while_the_weights_are_read(make_config, tmp_path, slow_read):
    """SIGTERM while Engine.load reads the weights (minutes for an 8B model from a bucket, and a
    preemption notice gives about 30 s): the read stops before the next tensor and generate exits
    75 with the stop's line, nothing marked complete; the demo model's other tensors are not read."""
    path = make_config(engine={"batch_size": 8})
    assert pipeline("run", "tokenize", "--config", path).returncode == 0
    result = pipeline("run", "generate", "--config", path, env=slow_read(hosts=[0], sigterm=0), timeout=300)
    assert result.returncode == 75, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith("error: stopped by SIGTERM"), result.stderr[-3000:]
    assert re.findall(r"host 0 reading tensor \d+", result.stdout) == ["host 0 reading tensor 1"], result.stdout
    assert not glob.glob(f"{tmp_path}/runs/generate-*/_SUCCESS")


def test_rows_holding_many_values_are_committed_in_smaller_parts(make_config, tmp_path, monkeypatch):
    """With `sampling.top_logprobs` a row holds 2K + 2 list entries a token: once the rows buffered
    for all shards hold more than BUFFER_MAX_VALUES, the fullest shard is committed before it has
    `engine.part_rows` rows. Every row is still there once, with K alternatives a token."""
    import steps.generate

    monkeypatch.setattr(steps.generate, "BUFFER_MAX_VALUES", 100)  # about 3 rows of 4 tokens, K = 3
    config = make_config(sampling={"n": 2, "max_new_tokens": 4, "top_logprobs": 3}, engine={"part_rows": 1000},
                         prompts={"num_shards": 1})
    result = CliRunner().invoke(app, ["run", "all", "--config", config], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    parts = glob.glob(str(tmp_path / "runs" / PARTS))
    rows = [pq.read_table(p).num_rows for p in parts]
    assert len(parts) >= 6 and max(rows) <= 4, rows  # one shard: without the bound, one part
    (merged,) = glob.glob(str(tmp_path / "runs" / "merge-*" / "merged-*.parquet"))
    table = pq.read_table(merged)
    assert sum(rows) == table.num_rows == 2 * len(set(table["prompt_index"].to_pylist()))
    for ids, top in zip(table["completion_token_ids"].to_pylist(), table["completion_top_token_ids"].to_pylist()):
        assert len(top) == len(ids) and all(len(alternatives) == 3 for alternatives in top)


def test_a_shards_last_rows_are_committed_within_the_part_age_while_other_shards_generate(tmp_path):
    """A shard whose last rows are done gets no more rows: its buffered rows are committed once
    they are PART_MAX_AGE_S old, while the host generates another shard's rows, not at the end of
    the host's work (a hard kill before it would lose them). Before, only a shard's own next row
    could commit it."""
    from pipeline import storage
    from pipeline.run.step import StepOutput
    from steps.generate import PART_MAX_AGE_S, SCHEMA, _PartWriter

    now = [0.0]
    out = StepOutput("generate", "0" * 64, storage.join(str(tmp_path), "generate-0"))
    writer = _PartWriter(out, part_rows=100, owned={"shard-00000", "shard-00001"}, schema=SCHEMA, shards=2,
                         clock=lambda: now[0])

    def row(prompt_index: int) -> dict:
        return {"prompt_index": prompt_index, "prompt_id": str(prompt_index), "sample_index": 0, "prompt": "p",
                "completion": "c", "completion_token_ids": [1, 2], "num_prompt_tokens": 3,
                "num_completion_tokens": 2, "finish_reason": "length"}

    def committed(shard: str) -> list[int]:
        return sorted(i for part in glob.glob(str(tmp_path / "generate-0" / shard / "*.parquet"))
                      for i in pq.read_table(part)["prompt_index"].to_pylist())

    for i in range(3):  # shard 0's last rows
        writer.add("shard-00000", row(i))
    now[0] = PART_MAX_AGE_S / 2
    writer.add("shard-00001", row(10))
    assert committed("shard-00000") == [] and committed("shard-00001") == []
    now[0] = PART_MAX_AGE_S + 1
    writer.add("shard-00001", row(11))
    assert committed("shard-00000") == [0, 1, 2]
    assert committed("shard-00001") == []  # its first row is half the age: it waits for more rows
    writer.flush_all()
    assert committed("shard-00001") == [10, 11]


def test_the_next_shard_is_read_while_the_engine_takes_this_ones_requests(tmp_path, monkeypatch):
    """The engine waits (its decoding too) while the request iterator reads a shard, and a shard on
    a bucket takes seconds: the next shard's bytes are read while this shard's requests are taken.
    A shard already done is not read; a shard that cannot be read fails the step once the requests
    before it are taken, naming it."""
    import threading

    import numpy as np
    import pyarrow as pa
    from pipeline import storage
    from pipeline.errors import StepFailed
    from steps.generate import _requests, _ShardTodo
    from steps.tokenize import SHARD_SCHEMA

    def shard(name: str, first: int, rows: int, done: bool = False) -> _ShardTodo:
        url = str(tmp_path / f"{name}.parquet")
        index = list(range(first, first + rows))
        pq.write_table(pa.table({"prompt_index": index, "prompt_id": [f"p{i}" for i in index],
                                 "prompt": [f"prompt {i}" for i in index], "input_ids": [[1, 2, i] for i in index],
                                 "num_tokens": [3] * rows}, schema=SHARD_SCHEMA), url)
        return _ShardTodo(name, url, np.array(index), np.full(rows, 3), np.full((rows, 1), not done))

    todo = [shard("shard-00000", 0, 3), shard("shard-00001", 3, 2, done=True), shard("shard-00002", 5, 2),
            shard("shard-00003", 7, 2)]
    os.remove(todo[3].url)
    begun = {name: threading.Event() for name in ("shard-00000", "shard-00002", "shard-00003")}
    read = storage.read_bytes

    def read_bytes(url: str) -> bytes:
        begun[Path(url).stem].set()  # a KeyError for a shard that should not be read (the thread's, raised below)
        return read(url)

    monkeypatch.setattr(storage, "read_bytes", read_bytes)
    sources: dict = {}
    requests = _requests(todo, sources)
    taken = [next(requests).prompt_index]
    assert begun["shard-00002"].wait(10), "the next shard was not read while the first one's requests were taken"
    assert not begun["shard-00003"].is_set()  # two shards' bytes at a time, not every shard's
    taken += [r.prompt_index for r in itertools.islice(requests, 4)]
    assert taken == [0, 1, 2, 5, 6] and sorted(sources) == taken
    assert begun["shard-00003"].wait(10)
    with pytest.raises(StepFailed, match=r"tokenize shard .*shard-00003\.parquet cannot be read"):
        next(requests)
