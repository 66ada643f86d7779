"""Preemption storms: kill random hosts of a 3-host pod at random moments, rerun until done.

Each round starts `pipeline launch --hosts 3 -- run all`, waits for the leader to announce
the step under attack (tokenize, generate, merge in turn), sleeps a random moment and sends
SIGKILL or SIGTERM to one random host. The pod must exit 75 (rerun to resume) or 0 (it won
the race); then the next round reruns the same command. After the last kill a final rerun
completes, and the merged result must equal an uninterrupted run's row for row (greedy),
with no temp file under a complete step and every manifest file present.

The short storm (3 kills) runs in CI; the long one (24 kills, over as many fresh runs as it
takes) with `pytest -m chaos`.
Set CHAOS_SEED to replay a storm: the seed is printed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import Process, pipeline, write_config, write_prompts

PHASES = ("tokenize", "generate", "merge")


def chaos_config(folder: Path, demo_model: str) -> str:
    prompts = write_prompts(folder / "prompts.jsonl",
                            [f"Question {i}: what follows {'and then ' * (i % 5)}the number {i}?" for i in range(48)])
    return write_config(folder, demo_model, prompts={"path": str(prompts)},
                        sampling={"max_new_tokens": 12, "n": 2}, engine={"batch_size": 8, "part_rows": 8})


def launch(start_pipeline, config: str) -> Process:
    """One `pipeline launch --hosts 3 -- run all`, its output collected line by line."""
    return start_pipeline("launch", "--hosts", "3", "--", "run", "all", "--config", config, "--verbose",
                          env={"PIPELINE_HEARTBEAT_TIMEOUT_S": "5"})


DELAY_S = {"tokenize": 1.5, "generate": 4.0, "merge": 0.5}
"""Upper bound of the random wait between a step's start line and the kill."""


def storm(start_pipeline, config: str, root: Path, kills: int, seed: int) -> tuple[list[str], int]:
    """Kill up to `kills` hosts at random moments of tokenize, generate and merge, until the run
    gets past merge; returns the log and the kills delivered."""
    rng = random.Random(seed)
    log: list[str] = [f"CHAOS_SEED={seed}"]
    done = 0
    while done < kills:
        left = [p for p in PHASES if not list(root.glob(f"{p}-*/_SUCCESS.json"))]
        if not left:
            log.append("every attacked step completed before all kills were used")
            break
        wanted = PHASES[done % len(PHASES)]
        phase = wanted if wanted in left else rng.choice(left)
        pod = launch(start_pipeline, config)
        killed = None  # the host this round's SIGKILL ended
        if pod.wait_for(f"[{phase}]"):
            time.sleep(rng.uniform(0, DELAY_S[phase]))
            victims = pod.hosts()
            how = rng.choice([signal.SIGKILL, signal.SIGTERM])
            if victims:
                victim = rng.randrange(len(victims))
                try:
                    os.kill(victims[victim], how)
                    done += 1
                    log.append(f"kill {done}: {how.name} to host {victim} during {phase}")
                    killed = victim if how == signal.SIGKILL else None
                except ProcessLookupError:
                    log.append(f"{phase}: host {victim} was already gone")
        code = pod.finish()
        log.append(f"  pod exited {code}")
        assert code in (0, 75), "\n".join(log) + "\n" + pod.output[-4000:]
        if killed is not None:  # the survivors name the host killed, no other
            named = set(re.findall(r"host (\d+) stopped responding", pod.output))
            assert named <= {str(killed)}, "\n".join(log) + "\n" + pod.output[-4000:]
    return log, done


def finish_run(start_pipeline, config: str, log: list[str]) -> None:
    for _ in range(3):
        pod = launch(start_pipeline, config)
        code = pod.finish()
        log.append(f"final rerun exited {code}")
        if code == 0:
            return
        assert code == 75, "\n".join(log) + "\n" + pod.output[-4000:]
    raise AssertionError("\n".join(log))


def merged(root: Path) -> list[tuple]:
    rows: list[tuple] = []
    for path in sorted(root.glob("merge-*/merged-*.parquet")):
        t = pq.read_table(path)
        rows += zip(t["prompt_index"].to_pylist(), t["sample_index"].to_pylist(), t["prompt_id"].to_pylist(),
                    t["completion_token_ids"].to_pylist(), t["finish_reason"].to_pylist())
    return rows


def check_complete_steps(root: Path) -> None:
    """No temp file under a complete step; every file its manifest names is there."""
    for marker in root.glob("*/_SUCCESS.json"):
        step = marker.parent
        temps = [str(p) for p in step.rglob("*") if p.name.startswith(".") and ".tmp-" in p.name]
        assert not temps, f"temp files left under complete step {step.name}: {temps}"
        for entry in json.loads(marker.read_text())["files"]:
            assert (step / entry["path"]).is_file(), f"{step.name}: manifest names missing {entry['path']}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_model) -> list[tuple]:
    folder = tmp_path_factory.mktemp("clean")
    config = chaos_config(folder, demo_model)
    result = pipeline("run", "all", "--config", config, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = merged(folder / "runs")
    assert [(p, s) for p, s, *_ in rows] == [(p, s) for p in range(48) for s in range(2)]
    return rows


def run_storm(start_pipeline, tmp_path: Path, demo_model: str, reference: list[tuple], kills: int) -> None:
    """Storms on fresh run roots until `kills` kills were delivered; each run must end exact."""
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 30)))
    delivered, run = 0, 0
    while delivered < kills:
        folder = tmp_path / f"storm-{run}"
        folder.mkdir()
        config = chaos_config(folder, demo_model)
        log, done = storm(start_pipeline, config, folder / "runs", kills - delivered, seed + run)
        finish_run(start_pipeline, config, log)
        print("\n".join(log))
        assert merged(folder / "runs") == reference, "\n".join(log)
        check_complete_steps(folder / "runs")
        states = pipeline("status", "--config", config, "--json")
        assert [s["state"] for s in json.loads(states.stdout)["steps"]] == ["complete"] * 4
        delivered, run = delivered + done, run + 1
        assert run <= kills, "the storm delivers no kills"
    print(f"{delivered} kills over {run} run(s), every result exact")


def test_short_preemption_storm_on_a_3_host_pod(tmp_path, demo_model, reference, start_pipeline):
    run_storm(start_pipeline, tmp_path, demo_model, reference, kills=3)


@pytest.mark.chaos
def test_long_preemption_storm_on_a_3_host_pod(tmp_path, demo_model, reference, start_pipeline):
    run_storm(start_pipeline, tmp_path, demo_model, reference, kills=24)
