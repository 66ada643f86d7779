"""Storage faults: a flaky or restarted GCS (the emulator), a full or read-only local disk.

Whatever happens, a run either completes with exactly the rows of a clean run, or fails
with one `error:` line naming the storage URL and leaves no step marked complete; the rerun
then completes. Runs are real `pipeline` processes against fake-gcs-server (filesystem
backend, so objects survive an emulator restart) or a size-limited tmpfs.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import Process, free_port, pipeline, start_fake_gcs, write_config

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection"}


class FlakyProxy(ThreadingHTTPServer):
    """An HTTP proxy in front of the emulator that fails every `every`-th request with a 503.

    Half of the failures happen before the request reaches the emulator, half after it was
    served (the answer is lost), the two ways a real network drops a call.
    """

    daemon_threads = True

    def __init__(self, upstream_port: int, every: int, max_failures: int):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream_port, self.every, self.max_failures = upstream_port, every, max_failures
        self.requests = self.failures = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def decide(self, path: str) -> str:
        del path  # any request may fail
        with self.lock:
            self.requests += 1
            if self.requests % self.every or self.failures >= self.max_failures:
                return "pass"
            self.failures += 1
            return "drop request" if self.failures % 2 else "drop answer"


class DownloadFaultProxy(FlakyProxy):
    """Every download (`alt=media`) of an object whose name holds `name` fails with a 503, however
    often it is tried; everything else passes (listings and metadata too)."""

    def __init__(self, upstream_port: int, name: str):
        super().__init__(upstream_port, every=1, max_failures=0)
        self.name = name

    def decide(self, path: str) -> str:
        if "alt=media" in path and self.name in path:
            with self.lock:
                self.failures += 1
            return "drop request"
        return "pass"


class _ProxyHandler(BaseHTTPRequestHandler):
    server: FlakyProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while size := int(self.rfile.readline().strip() or b"0", 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return data
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _relay(self) -> None:
        body = self._body()
        fate = self.server.decide(self.path)
        if fate != "drop request":
            upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            status, reply_headers, reply = answer.status, answer.getheaders(), answer.read()
            upstream.close()
        if fate != "pass":
            status, reply_headers = 503, [("Content-Type", "application/json")]
            reply = json.dumps({"error": {"code": 503, "message": f"injected fault ({fate})"}}).encode()
        self.send_response(status)
        for key, value in reply_headers:
            if key.lower() not in HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay


class Emulator:
    """fake-gcs-server with a filesystem backend on a fixed port: stop and start it at will."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = start_fake_gcs(self.port, "-backend", "filesystem", "-filesystem-root", str(self.root))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def bucket(self) -> str:
        name = f"faults-{uuid.uuid4().hex[:8]}"
        request = urllib.request.Request(f"{self.url}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10).close()
        return f"gs://{name}"


@pytest.fixture
def emulator(tmp_path):
    emu = Emulator(tmp_path / "gcs")
    emu.start()
    yield emu
    emu.stop()


def start_run(start_pipeline, config: str, storage_host: str | None = None, **env: str) -> Process:
    """`pipeline run all` in the background; gs:// goes to storage_host when given."""
    if storage_host:
        env["STORAGE_EMULATOR_HOST"] = storage_host
    return start_pipeline("run", "all", "--config", config, env=env)


def finish(run: Process, timeout_s: float = 400) -> tuple[int, str]:
    """(exit code, everything it printed) once it ends."""
    return run.finish(timeout_s), run.output


def merged_rows(root: str, storage_host: str | None = None) -> list[tuple]:
    """(prompt, sample, token ids, finish reason) of the merged result under `root`."""
    import gcsfs

    if root.startswith("gs://"):
        fs = gcsfs.GCSFileSystem(endpoint_url=storage_host, token="anon", skip_instance_cache=True)
        path = root[len("gs://"):]
    else:
        import fsspec

        fs, path = fsspec.filesystem("file"), root
    files = sorted(f for f in fs.glob(f"{path}/merge-*/merged-*.parquet"))
    assert files, f"no merged output under {root}"
    rows: list[tuple] = []
    for name in files:
        table = pq.read_table(name, filesystem=fs)
        rows += zip(table["prompt_index"].to_pylist(), table["sample_index"].to_pylist(),
                    table["completion_token_ids"].to_pylist(), table["finish_reason"].to_pylist())
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_model) -> list[tuple]:
    """The merged rows of a clean run of the default test config on local disk (greedy decoding)."""
    folder = tmp_path_factory.mktemp("clean")
    result = pipeline("run", "all", "--config", write_config(folder, demo_model))
    assert result.returncode == 0, result.stdout + result.stderr
    return merged_rows(str(folder / "runs"))


def test_flaky_gcs_requests_are_retried_and_the_result_is_exact(emulator, make_config, reference, start_pipeline):
    proxy = FlakyProxy(emulator.port, every=6, max_failures=10)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        root = f"{emulator.bucket()}/runs"
        config = make_config(run={"root": root, "name": "test"})
        code, output = finish(start_run(start_pipeline, config, proxy.url, PIPELINE_STORAGE_RETRY_S="60"))
    finally:
        proxy.shutdown()
    assert code == 0, output
    assert proxy.failures == 10, "the faults were injected"
    assert "Task was destroyed" not in output  # gcsfs's pending reads, logged by asyncio: dozens before
    assert merged_rows(root, emulator.url) == reference


def test_gcs_restarted_mid_generate_the_run_still_completes_exactly(emulator, make_config, reference, start_pipeline):
    root = f"{emulator.bucket()}/runs"
    config = make_config(run={"root": root, "name": "test"})
    run = start_run(start_pipeline, config, emulator.url, PIPELINE_STORAGE_RETRY_S="60")
    assert run.wait_for("generate: ", timeout_s=240), run.output
    emulator.stop()
    time.sleep(3)
    emulator.start()
    code, output = finish(run)
    assert code == 0, output
    assert merged_rows(root, emulator.url) == reference


def test_gcs_gone_for_good_fails_with_one_line_then_the_rerun_completes(emulator, make_config, reference, start_pipeline):
    root = f"{emulator.bucket()}/runs"
    config = make_config(run={"root": root, "name": "test"})
    run = start_run(start_pipeline, config, emulator.url, PIPELINE_STORAGE_RETRY_S="2")
    assert run.wait_for("generate: ", timeout_s=240), run.output
    emulator.stop()
    code, output = finish(run)
    last = output.strip().splitlines()[-1]
    assert code == 1, output
    assert last.startswith("error: storage: could not") and root.split("/")[2] in last, output

    emulator.start()  # the objects written before the outage are still there: resume
    status = pipeline("status", "--config", config, "--json", env={"STORAGE_EMULATOR_HOST": emulator.url})
    states = {s["name"]: s["state"] for s in json.loads(status.stdout)["steps"]}
    assert states["tokenize"] == "complete" and states["generate"] != "complete", states
    code, output = finish(start_run(start_pipeline, config, emulator.url))
    assert code == 0, output
    assert "waiting:" not in output, "the dead runner's lease (same machine) should be taken at once"
    assert merged_rows(root, emulator.url) == reference


def test_a_model_file_the_storage_will_not_serve_fails_in_one_line_naming_model_path(emulator, make_config, demo_model):
    """engine/checkpoint.py reads through fsspec, not pipeline/storage: a 5xx that outlasted gcsfs's
    own retries (about 33 s a call) ended the run in tracebacks and `error: HttpError: {}, 503`,
    naming nothing."""
    import gcsfs

    model = f"{emulator.bucket()}/model"
    gcsfs.GCSFileSystem(endpoint_url=emulator.url, token="anon", skip_instance_cache=True).put(
        demo_model, model[len("gs://"):], recursive=True)
    proxy = DownloadFaultProxy(emulator.port, "model.safetensors")  # its header, read before any step
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        config = make_config(model={"path": model})
        result = pipeline("run", "tokenize", "--config", config, env={"STORAGE_EMULATOR_HOST": proxy.url}, timeout=300)
    finally:
        proxy.shutdown()
    assert result.returncode == 1, result.stderr[-3000:]
    assert proxy.failures > 0, "the fault was injected"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: storage: could not read the checkpoint at model.path {model} (HttpError"), last
    assert last.endswith("rerun the same command once the storage answers"), last
    assert "Traceback" not in result.stderr, result.stderr[-4000:]


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name]


def test_full_disk_fails_clearly_marks_nothing_and_the_rerun_completes(small_disk, make_config, reference, start_pipeline):
    config = make_config(run={"root": str(small_disk / "runs"), "name": "test"})
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # leave no room at all
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    code, output = finish(start_run(start_pipeline, config))
    last = output.strip().splitlines()[-1]
    assert code == 1, output
    assert "No space left on device" in last and "the disk is full" in last and str(small_disk) in last, last
    assert not list(small_disk.rglob("_SUCCESS.json")) and not leftovers(small_disk)

    filler.unlink()
    code, output = finish(start_run(start_pipeline, config))
    assert code == 0, output
    assert merged_rows(str(small_disk / "runs")) == reference
    assert not leftovers(small_disk)


def test_read_only_run_root_fails_with_one_line_naming_it(small_disk, make_config, start_pipeline):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    config = make_config(run={"root": str(small_disk / "runs"), "name": "test"})
    code, output = finish(start_run(start_pipeline, config))
    last = output.strip().splitlines()[-1]
    assert code == 2, output  # checked before any step starts (issue 14)
    assert last == (f"error: run.root {small_disk / 'runs'} is not writable ({small_disk}: Read-only file system); "
                    f"choose another run.root or remount it read-write")
    assert "Traceback" not in output


def test_a_connection_error_while_reading_is_not_taken_for_a_damaged_file():
    """storage.unreadable names a file as damaged (and says to make it again) only for what says so
    about its bytes; a reset connection is the storage's fault and goes on as itself."""
    import errno

    from pipeline import storage
    from pipeline.errors import StepFailed

    with pytest.raises(ConnectionResetError):
        with storage.unreadable("generate part", "gs://bucket/part.parquet", "make it again"):
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    with pytest.raises(StepFailed) as err:
        with storage.unreadable("generate part", "gs://bucket/part.parquet", "make it again"):
            raise OSError("Couldn't deserialize thrift: TProtocolException: Invalid data")
    assert str(err.value) == ("generate part gs://bucket/part.parquet cannot be read (Couldn't deserialize thrift: "
                              "TProtocolException: Invalid data): make it again")


def test_files_another_process_writes_or_deletes_in_a_bucket_are_seen(gcs_bucket):
    """gcsfs answers from the listings it made earlier in the process: once a folder was listed,
    another host's new part, another runner's success marker and a file deleted elsewhere all went
    unseen (list_files, exists, is_dir), and `remove` left a file it believed absent."""
    import gcsfs

    from pipeline import storage

    folder = f"{gcs_bucket}/runs/generate-0123456789ab"
    storage.write_bytes(f"{folder}/part-a.parquet", b"a")
    elsewhere = gcsfs.GCSFileSystem(skip_instance_cache=True)  # another process: its own listings
    assert storage.list_files(folder) == [f"{folder}/part-a.parquet"]
    assert not storage.exists(f"{folder}/_SUCCESS.json") and not storage.is_dir(f"{folder}/shard-00000")

    elsewhere.pipe(f"{folder}/part-b.parquet", b"b")
    elsewhere.pipe(f"{folder}/_SUCCESS.json", b"{}")
    elsewhere.pipe(f"{folder}/shard-00000/part-c.parquet", b"c")
    elsewhere.rm(f"{folder}/part-a.parquet")
    assert storage.list_files(folder, suffix=".parquet") == [f"{folder}/part-b.parquet"]
    assert storage.exists(f"{folder}/_SUCCESS.json") and storage.is_dir(f"{folder}/shard-00000")
    assert not storage.exists(f"{folder}/part-a.parquet")

    storage.list_files(folder)
    elsewhere.pipe(f"{folder}/part-d.parquet", b"d")
    storage.remove(f"{folder}/part-d.parquet")
    assert not elsewhere.exists(f"{folder}/part-d.parquet")


def test_a_stop_while_the_storage_is_retried_before_any_step_is_an_interruption(config_for, monkeypatch):
    """A stop signal while the plan read a bucket that did not answer became `error: prompts.path
    ... could not be read: ... stopped by SIGTERM ...`, exit 1: a scheduler read a failed run, not
    one to rerun (75)."""
    from fsspec.implementations.memory import MemoryFileSystem
    from typer.testing import CliRunner

    from pipeline import storage
    from pipeline.cli import app
    from pipeline.errors import Interrupted
    from pipeline.pod import preemption
    from pipeline.run import checks

    def unreachable(self, path):
        raise ConnectionResetError(104, "Connection reset by peer")

    storage.write_bytes("memory://stopped-bucket/prompts/a.jsonl", b'{"prompt": "one"}\n')
    config = config_for(prompts={"path": "memory://stopped-bucket/prompts/*.jsonl"})
    monkeypatch.setattr(MemoryFileSystem, "isfile", unreachable)
    preemption.reset()
    preemption.request_stop("SIGTERM")
    try:
        with pytest.raises(Interrupted):
            checks.prompt_files("memory://stopped-bucket/prompts/*.jsonl")
        for args in (["run", "all", "--config", config], ["run", "all", "--config", config, "--dry-run"]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 75, result.output
            assert result.stderr.splitlines()[-1] == ("error: stopped by SIGTERM: finished work is committed; rerun "
                                                      "the same command to resume"), result.stderr
    finally:
        preemption.reset()
        monkeypatch.undo()
        storage.remove("memory://stopped-bucket", recursive=True)


def test_a_stop_during_a_storage_back_off_is_heard_at_once():
    """A SIGTERM while storage retries waited out their back-off (up to 30 s a try) was heard only
    when the wait ended, eating a preemption's notice; now the wait ends with the stop."""
    import threading

    from pipeline.errors import Interrupted
    from pipeline.pod import preemption
    from pipeline.storage.retrying import storage_call

    tries = []

    @storage_call("read")
    def unanswered(url):
        tries.append(time.monotonic())
        raise ConnectionResetError(104, "Connection reset by peer")

    preemption.reset()
    stop = threading.Timer(1.5, preemption.request_stop, args=("SIGTERM",))  # inside the second back-off (1 s, then 2 s)
    started = time.monotonic()
    stop.start()
    try:
        with pytest.raises(Interrupted, match="stopped by SIGTERM"):
            unanswered("gs://bucket/x")
        assert time.monotonic() - started < 2.5  # not at the end of the 2 s back-off (3 s)
        assert len(tries) == 2
    finally:
        stop.cancel()
        preemption.reset()


def test_a_stop_signal_ends_a_pause_every_time():
    """`pause` waited on the stop event, which the signal handler sets: a SIGTERM that came while
    the wait held the event's lock blocked the handler on it for good (3 of 5 tries hung)."""
    script = ("import sys\n"
              "from pipeline.errors import Interrupted\n"
              "from pipeline.pod import preemption\n"
              "preemption.install()\n"
              "print('pausing', flush=True)\n"
              "try:\n"
              "    while True:\n"
              "        preemption.pause(0)\n"
              "except Interrupted as err:\n"
              "    print(err, flush=True)\n"
              "    sys.exit(75)\n")
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "pausing\n"
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("a SIGTERM did not end the pause")
        assert code == 75 and proc.stdout.read().startswith("stopped by SIGTERM")


def test_a_delete_whose_answer_was_lost_counts_as_done(monkeypatch):
    """The emulator deleted the run.root probe, its answer was lost, and gcsfs's retry got a 404:
    `remove` raised FileNotFoundError and the checks called run.root not writable (exit 2)."""
    from fsspec.implementations.memory import MemoryFileSystem

    from pipeline import storage

    storage.write_bytes("memory://lost-answer/probe", b"")
    served = MemoryFileSystem.rm

    def served_then_lost(self, path, *args, **kwargs):
        served(self, path, *args, **kwargs)  # done, but the client is told otherwise and asks again
        raise FileNotFoundError(path)

    monkeypatch.setattr(MemoryFileSystem, "rm", served_then_lost)
    storage.remove("memory://lost-answer/probe")
    monkeypatch.undo()
    assert not storage.exists("memory://lost-answer/probe")
