"""Every input a user names is checked before any step folder or lease is created (issue 14, item 3).

Each case: exit 2, one `error:` line naming the input, and nothing left behind under run.root (no
step folder, no `.leases/` lock; a run.root that did not exist is not created).
"""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.pod import preemption


def run(*args: str, env: dict | None = None):
    preemption.reset()
    return CliRunner(env=env).invoke(app, list(args))


def refused(result, root) -> str:
    """Exit 2, exactly one `error:` line (returned), and nothing under run.root."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert not os.path.exists(root) or os.listdir(root) == [], os.listdir(root)
    return lines[0]


def test_prompts_path_matching_no_files(config_for, tmp_path):
    """Issue 14: a missing prompts.path started tokenize, exited 1 and left a partial step and a lock."""
    config = config_for(prompts={"path": str(tmp_path / "nope-*.jsonl")})
    line = refused(run("run", "all", "--config", config), tmp_path / "runs")
    assert line == f"error: prompts.path {tmp_path / 'nope-*.jsonl'} matched no files (check the folder and the glob)"


def test_a_folder_with_only_subfolders_says_how_to_read_them(config_for, tmp_path):
    (tmp_path / "prompts" / "part-a").mkdir(parents=True)
    (tmp_path / "prompts" / "part-a" / "p.jsonl").write_text('{"prompt": "hi"}\n')
    config = config_for(prompts={"path": str(tmp_path / "prompts")})
    line = refused(run("run", "all", "--config", config), tmp_path / "runs")
    assert line == (f"error: prompts.path {tmp_path / 'prompts'} matched no files (a folder without files of its own: "
                    f"{tmp_path / 'prompts'}/** reads its subfolders)")


@pytest.mark.parametrize("name", ["_prompts.jsonl", ".prompts.jsonl", "prompts[v2].jsonl"])
def test_a_prompt_file_named_exactly_is_read_whatever_its_name(config_for, tmp_path, name):
    """Folders and globs leave out `_` and `.` names, and `[` reads as a glob: a file named exactly
    was 'matched no files' (exit 2) although it was there."""
    (tmp_path / name).write_text('{"id": "a", "prompt": "Say a."}\n{"id": "b", "prompt": "Say b."}\n')
    config = config_for(prompts={"path": str(tmp_path / name)})
    result = run("run", "tokenize", "--config", config)
    assert result.exit_code == 0, result.output
    assert "[tokenize] complete: 2 rows" in result.output


def test_model_path_that_is_not_a_checkpoint(config_for, tmp_path):
    (tmp_path / "empty-model").mkdir()
    config = config_for(model=str(tmp_path / "empty-model"))
    line = refused(run("run", "all", "--config", config), tmp_path / "runs")
    assert line.startswith(f"error: model.path {tmp_path / 'empty-model'} has no config.json")


def test_prompt_plus_completion_longer_than_the_checkpoints_positions(config_for, tmp_path, demo_model):
    """Issue 14: found only after tokenize, as `error: ValueError: ...` with exit 1."""
    positions = json.loads(open(os.path.join(demo_model, "config.json")).read())["max_position_embeddings"]
    config = config_for(prompts={"max_prompt_tokens": positions - 10}, sampling={"max_new_tokens": 20})
    line = refused(run("run", "all", "--config", config), tmp_path / "runs")
    assert line == (f"error: prompts.max_prompt_tokens + sampling.max_new_tokens = {positions - 10} + 20 = "
                    f"{positions + 10} exceeds the checkpoint's max_position_embeddings {positions} "
                    f"({demo_model}/config.json): lower one of them to fit")


def test_run_root_that_cannot_be_written(config_for, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        config = config_for(run={"root": str(locked / "runs")})
        line = refused(run("run", "all", "--config", config), locked / "runs")
        assert line.startswith(f"error: run.root {locked / 'runs'} is not writable ({locked}: permission denied)")
    finally:
        locked.chmod(0o700)


def test_run_root_under_a_file(config_for, tmp_path):
    (tmp_path / "a-file").write_text("")
    config = config_for(run={"root": str(tmp_path / "a-file" / "runs")})
    line = refused(run("run", "all", "--config", config), tmp_path / "a-file" / "runs")
    assert line == f"error: run.root {tmp_path / 'a-file' / 'runs'}: {tmp_path / 'a-file'} is a file, not a folder"


def test_run_root_under_a_link_to_nowhere(config_for, tmp_path):
    """The nearest folder that exists was writable, so the check passed; the first step then failed
    making its folder, with a traceback and exit 1 (`FileNotFoundError: ... runs`)."""
    (tmp_path / "gone").symlink_to(tmp_path / "unmounted-disk")
    root = tmp_path / "gone" / "runs"
    line = refused(run("run", "all", "--config", config_for(run={"root": str(root)})), root)
    assert line == (f"error: run.root {root}: {tmp_path / 'gone'} is a symbolic link to {tmp_path / 'unmounted-disk'}, "
                    f"which does not exist: make its target, or choose another run.root")
    assert refused(run("preflight", "--config", config_for(run={"root": str(root)})), root) == line


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_run_root_where_no_folder_can_be_made(config_for, tmp_path):
    """/proc lets its owner through the permission check but takes no folders: the check now makes
    the root, so this too is refused before any step, naming it."""
    root = "/proc/no-such-folder/runs"
    line = refused(run("run", "all", "--config", config_for(run={"root": root})), root)
    if os.geteuid() == 0:  # others are refused by the permission check
        assert line == f"error: run.root {root} cannot be made (No such file or directory: {root[:-5]}); choose another run.root"


def test_a_stop_token_the_model_cannot_make(config_for, tmp_path, demo_model):
    """An id at or past the checkpoint's vocabulary never comes out: the setting did nothing, but
    changed every hash after tokenize (a new run of the same rows)."""
    vocab = json.loads(open(os.path.join(demo_model, "config.json")).read())["vocab_size"]
    config = config_for(sampling={"stop_token_ids": [2, vocab + 5]})
    line = refused(run("run", "all", "--config", config), tmp_path / "runs")
    assert line == (f"error: sampling.stop_token_ids [2, {vocab + 5}]: {vocab + 5} is not a token of the checkpoint, "
                    f"whose vocab_size is {vocab} ({demo_model}/config.json): the model never makes it; give ids "
                    f"below {vocab}")
    assert run("run", "all", "--config", config_for(sampling={"stop_token_ids": [vocab - 1]}),
               "--dry-run").exit_code == 0


def test_online_wandb_without_a_key(config_for, tmp_path):
    config = config_for(wandb={"mode": "online"})
    env = {"WANDB_API_KEY": None, "WANDB_BASE_URL": None, "NETRC": str(tmp_path / "no-netrc"),
           "HOME": str(tmp_path)}
    line = refused(run("run", "all", "--config", config, env=env), tmp_path / "runs")
    assert line == ("error: wandb.mode is online but no W&B API key is set (WANDB_API_KEY, or `wandb login`): set "
                    "WANDB_API_KEY, or --set wandb.mode=offline to write a run that `wandb sync` pushes later")


def test_only_the_inputs_of_the_steps_that_run_are_checked(config_for, tmp_path):
    """`pipeline run merge` needs no prompts and no model: it fails for its missing upstream (exit 1)."""
    config = config_for(prompts={"path": str(tmp_path / "nope.jsonl")})
    result = run("run", "merge", "--config", config)
    assert result.exit_code == 1 and "cannot run merge: needs generate" in result.stderr


def test_preflight_checks_the_same_inputs(config_for, tmp_path):
    config = config_for(prompts={"path": str(tmp_path / "nope.jsonl")})
    line = refused(run("preflight", "--config", config), tmp_path / "runs")
    assert line.startswith(f"error: prompts.path {tmp_path / 'nope.jsonl'} matched no files")
    assert run("preflight", "--config", config_for()).exit_code == 0
