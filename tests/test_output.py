"""What a user sees on the terminal (issue 14, items 5 and 6): quiet by default, and progress that
counts what was already done."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys

import pytest

from pipeline.run.progress import Progress


def test_no_pytorch_advice_from_transformers():
    """Issue 14: `[transformers] PyTorch was not found` appeared in every normal run (torch is not installed
    for users; we use transformers for tokenizers and configs only)."""
    script = """
import importlib.util
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else real(name, *a, **k)
if WITH_PIPELINE:
    import pipeline.cli
import transformers
"""
    env_free = {k: v for k, v in __import__("os").environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    plain = subprocess.run([sys.executable, "-c", "WITH_PIPELINE = False" + script], capture_output=True, text=True,
                           env=env_free)
    assert "PyTorch was not found" in plain.stderr  # what transformers says on its own: the check is real
    ours = subprocess.run([sys.executable, "-c", "WITH_PIPELINE = True" + script], capture_output=True, text=True,
                          env=env_free)
    assert ours.returncode == 0 and "PyTorch was not found" not in ours.stderr


def test_a_resumed_progress_counts_what_was_already_done():
    """Issue 14: after 21,504 rows were committed a resumed bar read `4,353/178,496`; it now counts from
    what was done: `25,857/200,000 (21,504 resumed)`."""
    out = io.StringIO()
    bar = Progress(total=200_000, desc="generate", unit="sample", file=out, resumed=21_504)
    bar.update(4_353)
    bar.close()
    line = out.getvalue().strip().splitlines()[-1]
    assert line.startswith("generate: 25,857/200,000 samples (21,504 resumed), ")


def test_a_progress_without_a_total_gives_an_eta_from_the_share_of_the_input_read(monkeypatch):
    """tokenize knows its prompts' count only at the end: its line had a count and a rate, no ETA."""
    import types

    from pipeline.run import progress

    clock = [100.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    out = io.StringIO()
    bar = Progress(total=None, desc="tokenize", unit="prompt", file=out)
    clock[0] += 30.0
    bar.read(0.25)
    bar.update(12_000, tokens=480_000)
    assert out.getvalue().splitlines()[-1] == ("tokenize: 12,000 prompts, 400.0/s, tokens 480,000 (16,000.0/s), "
                                               "25% of the input read, ETA 90s")
    bar.read(1.0)
    bar.close()
    assert out.getvalue().splitlines()[-1].endswith(", 100% of the input read")


def test_a_step_log_keeps_clean_whole_lines_of_this_host(tmp_path, capsys):
    from pipeline.run import steplog

    step = str(tmp_path / "generate-abc")
    with steplog.step_log(step, host=1):
        print("generate: loading")
        sys.stderr.write("\rbar 1/3\rbar 2/3\rbar 3/3\n\x1b[31mwarning\x1b[0m\npartial")
    assert "generate: loading" in capsys.readouterr().out  # the terminal still sees everything
    assert steplog.log_urls(step) == [f"{step}/logs/host-00001.log"]
    begin, *lines, end = open(f"{step}/logs/host-00001.log").read().splitlines()
    assert lines == ["generate: loading", "bar 3/3", "warning", "partial"]
    # When and where the attempt ran: an operator reading a preempted run's log needs both.
    assert re.fullmatch(rf"=== 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC: generate-abc began on host 1 "
                        rf"\({re.escape(socket.gethostname())}, pid {os.getpid()}\) ===", begin), begin
    assert re.fullmatch(r"=== 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC: ended after \d+\.\d s ===", end), end

    with steplog.step_log(str(tmp_path / "merge-abc"), host=1):
        pass  # a host with nothing to say that does none of the step's work leaves no log (and no folder)
    assert not (tmp_path / "merge-abc").exists()
    with steplog.step_log(str(tmp_path / "merge-abc"), host=0, works=True):
        pass  # the one doing the work: its attempt is logged whether or not it prints
    assert [line.split(": ")[1].split(" ")[0] for line in open(f"{tmp_path}/merge-abc/logs/host-00000.log")] == [
        "merge-abc", "ended"]


def test_a_bar_redrawn_for_hours_is_held_as_its_last_state_only(tmp_path):
    """On a terminal the bar is redrawn about ten times a second with a carriage return and no
    newline until it closes: the log's tee held every redraw and split them all again on each one
    (6.6 ms a write after an hour, 77 ms after ten, in the generating process)."""
    from pipeline.run import steplog

    with steplog.step_log(str(tmp_path / "generate-abc"), host=0):
        tee = sys.stderr
        for i in range(3_600):  # six minutes of redraws
            tee.write(f"\rgenerate host 0/1: {i:,}/3,600 samples [{'#' * 80}]")
        assert len(tee.pending) < 200
        tee.write("\n")
    assert open(f"{tmp_path}/generate-abc/logs/host-00000.log").read().splitlines()[1:-1] == [
        f"generate host 0/1: 3,599/3,600 samples [{'#' * 80}]"]
    assert not (tmp_path / "merge-abc").exists()


def test_a_failed_steps_log_ends_with_its_error_line(make_config, tmp_path):
    """On a pod the step logs are where a host's reason is read: a tokenize refused for a bad row
    left a log ending at its progress line, and the `error:` line only on the terminal."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "prompt": "one"}\n{"id": "a", "prompt": "two"}\n')
    config = make_config()
    result = CliRunner().invoke(app, ["run", "tokenize", "--config", config])
    assert result.exit_code == 1
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    (log,) = (tmp_path / "runs").glob("tokenize-*/logs/host-00000.log")
    assert log.read_text().splitlines()[-1] == error[-1], log.read_text()
    assert "duplicate" in error[-1]


def test_an_error_of_several_lines_ends_the_log_on_one_line_that_status_reads(tmp_path):
    """Arrow's messages hold newlines: the log ended on the message's last line, not an `error:`
    line, so `status` had no error to show for the step."""
    import pytest

    from pipeline.run import steplog

    step = str(tmp_path / "merge-abc")
    with pytest.raises(OSError), steplog.step_log(step, host=0):
        print("merge: 0/600 rows")
        raise OSError("Couldn't deserialize thrift.\nDeserializing page header failed.\n")
    assert open(f"{step}/logs/host-00000.log").read().splitlines()[-1] == (
        "error: OSError: Couldn't deserialize thrift. Deserializing page header failed.")
    assert steplog.last_error(step) == "OSError: Couldn't deserialize thrift. Deserializing page header failed."

    # An attempt that fails before printing anything says it stopped too: no end line reads as a host killed.
    step = str(tmp_path / "tokenize-abc")
    with pytest.raises(OSError), steplog.step_log(step, host=1):
        raise OSError("No space left on device")
    begin, end, error = open(f"{step}/logs/host-00001.log").read().splitlines()
    assert begin.startswith("=== ") and re.fullmatch(r"=== .* UTC: stopped after \d+\.\d s ===", end), end
    assert error == "error: OSError: No space left on device"


def test_a_step_log_on_remote_storage_is_uploaded_when_the_step_ends():
    from pipeline import storage
    from pipeline.run import steplog

    step = "memory://steplog-test/runs/tokenize-abc"
    try:
        for attempt in (1, 2):
            with steplog.step_log(step, host=0):
                print(f"attempt {attempt}")
        lines = storage.read_bytes(f"{step}/logs/host-00000.log").decode().splitlines()
        assert [line for line in lines if not line.startswith("===")] == ["attempt 1", "attempt 2"]
        assert [re.sub(r" \(.*| after .*", "", line.split(": ", 1)[1]) for line in lines if line.startswith("===")] == [
            "tokenize-abc began on host 0", "ended", "tokenize-abc began on host 0", "ended"]  # each attempt, in order
    finally:
        storage.remove("memory://steplog-test", recursive=True)


def test_a_remote_step_log_keeps_growing_after_an_upload_while_its_step_runs(monkeypatch):
    """The upload while the step ran moved the local file to the bucket (`storage.put_file`
    consumes it): lines after the first upload went to a deleted file, and the bucket's log
    stopped there, also at the step's end."""
    import time

    from pipeline import storage
    from pipeline.run import steplog

    monkeypatch.setattr(steplog, "SAVE_EVERY_S", 0.05)
    step = "memory://steplog-growing/runs/generate-abc"
    url = f"{step}/logs/host-00000.log"
    try:
        with steplog.step_log(step, host=0, works=True):
            print("before the first upload")
            deadline = time.monotonic() + 10
            while not (storage.exists(url) and b"before" in storage.read_bytes(url)) and time.monotonic() < deadline:
                time.sleep(0.02)
            print("after it")
        lines = storage.read_bytes(url).decode().splitlines()
        assert lines[1:3] == ["before the first upload", "after it"] and " ended after " in lines[3], lines
    finally:
        storage.remove("memory://steplog-growing", recursive=True)


def test_a_step_log_that_cannot_be_written_does_not_fail_the_step(tmp_path, capsys):
    from pipeline.run import steplog

    step = tmp_path / "merge-abc"
    step.mkdir()
    (step / "logs").write_text("")  # a file where the log folder should be
    with steplog.step_log(str(step), host=0):
        print("first")
        print("second")
    captured = capsys.readouterr()
    assert captured.out == "first\nsecond\n"
    assert captured.err.count("warning: the step log ") == 1 and "it stops here" in captured.err


def test_nothing_is_printed_after_the_error_line(capsys):
    """The contract: an exit 1's last line starts with `error:`. Threads still getting programs
    announced them after it, and on a pod the leader waits for the others' goodbyes meanwhile."""
    import threading
    import time

    import typer

    from pipeline import cli
    from pipeline.errors import begin_output
    from steps.generate import _announcer

    begin_output()  # as a command begins
    announce = _announcer()
    announce("init")
    late = threading.Thread(target=lambda: (time.sleep(0.2), announce("adopt")))
    late.start()
    try:
        cli._fail("generate: it broke", 1)
    except typer.Exit as exit:
        assert exit.exit_code == 1
    finally:
        late.join()
        begin_output()
    printed = capsys.readouterr()
    assert printed.err.splitlines() == ["generate: program 1 (init): compiling, or loading it from the compile cache",
                                        "error: generate: it broke"]  # on stderr, as every line of a run


@pytest.mark.parametrize("columns", [0, 100])
def test_progress_on_a_terminal_that_says_it_is_0_columns_wide_is_plain_lines(columns):
    """tqdm draws nothing on a terminal of 0 columns (some containers' pseudo-terminals): a run
    there showed no progress at all, and its step logs got blank lines."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    with open(side, "w", closefd=True) as terminal:
        with Progress(total=10, desc="generate host 0/1", unit="sample", file=terminal) as bar:
            bar.update(10)
        terminal.flush()
        shown = os.read(main, 65536).decode()
    os.close(main)
    if columns:
        assert shown.startswith("\rgenerate host 0/1:   0%|")  # a bar
    else:
        assert shown.startswith("generate host 0/1: 10/10 samples, "), shown
