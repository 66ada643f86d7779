"""Where the result is and its first rows (issue 14, item 7): `pipeline status` and `pipeline show`.

A run with two sampling settings under one root has two merged results; `status` and `show`
name the one of the config given. The end-to-end test checks both on a real run.
"""

from __future__ import annotations

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.run.result import MergedResult, _table, first_rows, merged_result


def test_show_before_any_run_exits_1_naming_the_command(make_config):
    """The command named is this config's, its --set arguments included (without them it made
    another result, or the file's run root's)."""
    config = make_config()
    result = CliRunner().invoke(app, ["show", "--config", config])
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: no result for this config yet: ") and "/merge-" in last
    assert last.endswith(f"is missing; run `pipeline run all --config {config}` first")
    result = CliRunner().invoke(app, ["show", "--config", config, "--set", "sampling.temperature=0.5",
                                      "--set", "run.name=my run"])
    assert result.output.strip().splitlines()[-1].endswith(
        f"run `pipeline run all --config {config} --set sampling.temperature=0.5 --set 'run.name=my run'` first")


def test_show_with_prompt_files_moved_names_them_not_a_run_that_would_fail(make_config, tmp_path):
    """A result's hash needs its prompt files' content: moved away, `show` finds no result, and it
    named `pipeline run all`, which then stopped with exit 2 on the missing files."""
    config = make_config()
    (tmp_path / "prompts.jsonl").rename(tmp_path / "prompts.moved")
    result = CliRunner().invoke(app, ["show", "--config", config])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"error: no result for this config: prompts.path {tmp_path / 'prompts.jsonl'} matched no files (no such file, "
        f"or an empty folder)")


def test_first_rows_read_across_files_in_order(fake_run):
    run = fake_run(prompts=10, n=2)
    run.run("merge", file_rows=7)  # 20 rows in 3 files
    merged = merged_result(run.url["merge"])
    assert merged.rows == 20 and [f.rsplit("/", 1)[1] for f in merged.files] == [
        f"merged-{i:05d}.parquet" for i in range(3)]
    assert merged.describe() == f"{run.url['merge']}/merged-*.parquet (20 rows in 3 files)"
    rows = first_rows(merged, 9)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(5) for s in range(2)][:9]
    text = _table(rows[:2], merged.rows)
    assert "prompt 00000" in text and "completion 00000.001" in text and "2 of 20 rows" in text
    assert merged_result(run.url["upload"]) is None  # no marker: no result


def test_show_prints_ids_and_texts_that_look_like_markup_as_they_are(fake_run):
    """rich reads `[...]` in a cell as markup: the id `wiki[en]` was shown as `wiki`, and `run[/1]`
    ended `pipeline show` with a MarkupError."""
    run = fake_run(prompts=2, n=1)
    run.run("merge")
    rows = first_rows(merged_result(run.url["merge"]), 2)
    rows[0].update(prompt_id="wiki[en]", prompt="say [bold]hi[/bold]", completion="[/1] done")
    rows[1].update(prompt_id="run[/1]")
    text = _table(rows, 2)
    assert "(wiki[en], 0)" in text and "(run[/1], 0)" in text
    assert "say [bold]hi[/bold]" in text and "[/1] done" in text


def test_the_result_lines_row_count_is_a_plain_integer():
    """`result: URL (N rows in K files)` is read by scripts: 2,400 did not parse as N."""
    merged = MergedResult(folder="gs://b/runs/merge-0123456789ab", rows=1_234_567,
                          files=["gs://b/runs/merge-0123456789ab/merged-00000.parquet"])
    assert merged.describe() == "gs://b/runs/merge-0123456789ab/merged-00000.parquet (1234567 rows in 1 file)"
