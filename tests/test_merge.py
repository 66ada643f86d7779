"""The merge step (issue 7): exactly-once coverage, order, bounded files, errors that say what to run."""

from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.errors import StepFailed
from steps.generate import SCHEMA


def merged_files(run) -> list[str]:
    return storage.list_files(run.url["merge"], suffix=".parquet")


def read_merged(run) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in merged_files(run)])


@pytest.fixture
def expected_rows(generation_row):
    """expected_rows(prompts, n) -> the merged rows of a complete fake run, in order."""
    return lambda prompts, n: [generation_row(p, s) for p in range(prompts) for s in range(n)]


def test_merges_interleaved_shards_in_order_with_a_manifest(fake_run, expected_rows):
    run = fake_run(prompts=10, n=3, shards=3, part_rows=4)
    result = run.run("merge")
    table = read_merged(run)
    assert table.schema == SCHEMA
    assert table.to_pylist() == expected_rows(10, 3)
    assert result.rows == 30
    assert result.summary.prompts == 10 and result.summary.samples_per_prompt == 3
    assert result.summary.completion_tokens == 3 * 30 and result.summary.prompt_tokens == 5 * 30
    assert result.summary.finish_reasons == {"eos": 15, "len": 15}
    assert result.summary.duplicates_dropped == 0
    for entry, path in zip(result.files, merged_files(run), strict=True):
        data = open(path, "rb").read()
        assert entry["path"] == os.path.basename(path) and entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["rows"] == pq.read_metadata(path).num_rows


def test_files_respect_the_row_bound(fake_run, expected_rows):
    run = fake_run(prompts=10, n=2)
    result = run.run("merge", file_rows=7)
    sizes = [pq.read_metadata(f).num_rows for f in merged_files(run)]
    assert sizes == [7, 7, 6] and [f["rows"] for f in result.files] == sizes
    assert [os.path.basename(f) for f in merged_files(run)] == [f"merged-{i:05d}.parquet" for i in range(3)]
    assert read_merged(run).to_pylist() == expected_rows(10, 2)


def test_files_respect_the_byte_bound(fake_run, expected_rows):
    run = fake_run(prompts=30, n=2, part_rows=5)
    row_bytes = pa.Table.from_pylist(expected_rows(30, 2), schema=SCHEMA).nbytes / 60
    bound = int(row_bytes * 9.5)  # every fake row has the same size: 9 rows fit, 10 do not
    run.run("merge", file_bytes=bound)
    tables = [pq.read_table(f) for f in merged_files(run)]
    assert [t.num_rows for t in tables] == [9] * 6 + [6]
    assert all(t.nbytes <= bound for t in tables)
    assert pa.concat_tables(tables).to_pylist() == expected_rows(30, 2)


def test_identical_duplicates_from_a_retry_are_dropped(fake_run, expected_rows, generation_row):
    run = fake_run(prompts=8, n=2, complete=False)
    run.write_all_parts()
    retried = [generation_row(p, s) for p, s in run.shard_keys(1)[:3]]
    run.write_part(1, retried, name="shard-00001/part-retry.parquet")
    run.finish_generate()
    result = run.run("merge")
    assert read_merged(run).to_pylist() == expected_rows(8, 2)
    assert result.summary.duplicates_dropped == 3 and result.summary.parts_read == len(run.parts)


def test_conflicting_duplicates_fail_naming_rows_parts_and_the_command(fake_run, generation_row):
    run = fake_run(prompts=8, n=2, complete=False)
    run.write_all_parts()
    run.write_part(1, [generation_row(1, 0), generation_row(1, 1, completion="something else"),
                       {**generation_row(4, 1), "completion_token_ids": [4, 1, 8]}],
                   name="shard-00001/part-retry.parquet")
    run.finish_generate()
    with pytest.raises(StepFailed) as err:
        run.run("merge")
    message = str(err.value)
    assert "2 (prompt, sample) rows twice with different content" in message
    assert "(prompt_index 1, sample 1)" in message and "(prompt_index 4, sample 1)" in message
    assert "(prompt_index 1, sample 0)" not in message  # an identical copy is no conflict
    assert "shard-00001/part-retry.parquet" in message
    assert "`pipeline run generate --config FILE --force`" in message
    assert merged_files(run) == []


def test_missing_rows_fail_naming_the_first_rows_the_count_and_the_command(fake_run):
    run = fake_run(prompts=10, n=2, complete=False)
    missing = {(0, 1), (3, 0), (4, 1), (5, 0), (6, 1), (7, 0), (9, 1)}
    run.write_all_parts(skip=missing)
    run.finish_generate()
    with pytest.raises(StepFailed) as err:
        run.run("merge")
    message = str(err.value)
    assert "7 of 20 (prompt, sample) rows are missing" in message
    assert "(prompt_index 0, sample 1), (prompt_index 3, sample 0)" in message and "and 2 more" in message
    assert "(prompt_index 9, sample 1)" not in message  # first few only
    assert "`pipeline run generate --config FILE --force`" in message
    assert "`pipeline run merge --config FILE`" in message
    assert merged_files(run) == []


def test_rows_that_do_not_belong_fail_naming_their_part(fake_run, generation_row):
    run = fake_run(prompts=4, n=2, complete=False)
    run.write_all_parts()
    run.write_part(0, [generation_row(0, 2)], name="shard-00000/part-stray.parquet")
    run.finish_generate()
    with pytest.raises(StepFailed) as err:
        run.run("merge")
    assert "1 rows are not wanted" in str(err.value)
    assert "(prompt_index 0, sample 2) in shard-00000/part-stray.parquet" in str(err.value)


def test_rerun_replaces_files_of_an_earlier_attempt(fake_run, expected_rows):
    run = fake_run(prompts=10, n=2)
    run.run("merge", file_rows=3)
    assert len(merged_files(run)) == 7
    result = run.run("merge")
    assert [os.path.basename(f) for f in merged_files(run)] == ["merged-00000.parquet"]
    assert result.summary.files == 1 and read_merged(run).to_pylist() == expected_rows(10, 2)


def test_no_accepted_prompts_gives_one_empty_file_with_the_columns(fake_run):
    run = fake_run(prompts=0, n=2)
    result = run.run("merge")
    assert result.rows == 0 and read_merged(run).schema == SCHEMA and read_merged(run).num_rows == 0


def test_remote_root(fake_run, expected_rows):
    run = fake_run(prompts=6, n=2, root="memory://merge-test/runs")
    try:
        run.run("merge", file_rows=5)
        files = storage.list_files(run.url["merge"], suffix=".parquet")
        table = pa.concat_tables([storage.read_parquet(f) for f in files])
        assert len(files) == 3 and table.to_pylist() == expected_rows(6, 2)
    finally:
        storage.remove("memory://merge-test", recursive=True)
