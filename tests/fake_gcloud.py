"""A fake `gcloud` for the TPU babysitter tests: plays a scenario of TPU states and ssh outcomes.

Installed by tests/test_tpu.py as an executable named `gcloud` first on PATH. It reads
`scenario.json` and keeps the simulated world in `state.json` (both in $FAKE_GCLOUD_DIR),
appends each call's argv to `calls.jsonl`, and answers the `compute tpus tpu-vm` and
`compute tpus queued-resources` commands the babysitter issues:

    {"hosts": 2,
     "node": ["READY"],                      # states for successive describes; the last one stays
     "after_create": ["CREATING", "READY"],  # what the node plays after a create
     "queued": ["ACTIVE"], "queued_after_create": ["WAITING_FOR_RESOURCES", "ACTIVE"],
     "ssh": {"0": [0, {"exit": 255, "say": "Connection closed", "then": "PREEMPTED"}]},
     "describe_fails": ["ERROR: ... UNAVAILABLE"]}  # what the first describes print, exit 1

An ssh outcome is an exit code or {"exit", "say" (a line printed), "then" (the node's state
afterwards: a preemption), "exec": true (run the remote command with bash, as worker i of
a local pod), "preempt_when": GLOB (with exec: SIGTERM the command once GLOB matches)}.
A worker's ssh calls past the end of its list succeed.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HOME = Path(os.environ["FAKE_GCLOUD_DIR"])
SPEC = {"acceleratorType": "v5p-16", "runtimeVersion": "v2-alpha-tpuv5"}


@contextmanager
def world():
    with open(HOME / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        scenario = json.loads((HOME / "scenario.json").read_text())
        path = HOME / "state.json"
        state = json.loads(path.read_text()) if path.exists() else {
            "node": scenario.get("node", ["READY"]), "queued": scenario.get("queued", ["ACTIVE"]), "ssh": {}}
        yield scenario, state
        path.write_text(json.dumps(state))


def play(state: dict, key: str) -> str:
    """The next state of `key`'s sequence (the last one stays)."""
    current = state[key][0]
    if len(state[key]) > 1:
        state[key] = state[key][1:]
    return current


def main(argv: list[str]) -> int:
    with open(HOME / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(HOME / "calls.jsonl", "a") as f:
            f.write(json.dumps(argv) + "\n")
    kind, verb, name = argv[2], argv[3], argv[4]
    if verb == "ssh":
        return ssh(int(flag(argv, "--worker")), flag(argv, "--command"))
    with world() as (scenario, state):
        key = "node" if kind == "tpu-vm" else "queued"
        if verb == "describe":
            failures = state.setdefault("describe_fails", scenario.get("describe_fails", []))
            if failures:  # gcloud's own error, one describe each
                print(failures.pop(0), file=sys.stderr)
                return 1
            current = play(state, key)
            if current == "MISSING":
                print(f"ERROR: (gcloud.compute.tpus.{kind}.describe) NOT_FOUND: {name} was not found", file=sys.stderr)
                return 1
            if key == "queued":
                print(json.dumps({"name": name, "state": {"state": current}}))
            else:
                endpoints = [{"ipAddress": f"10.0.0.{i + 2}", "port": 8470} for i in range(scenario["hosts"])]
                print(json.dumps({"name": name, "state": current, "networkEndpoints": endpoints, **SPEC,
                                  "schedulingConfig": scenario.get("scheduling", {})}))
            return 0
        if verb == "create":
            if scenario.get("create_fails"):  # true, or what gcloud says
                said = scenario["create_fails"]
                print(said if isinstance(said, str) else "ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: "
                      "no capacity", file=sys.stderr)
                return 1
            state[key] = scenario.get(f"{key}_after_create" if key == "queued" else "after_create", ["READY"])
            if key == "queued":
                state["node"] = scenario.get("after_create", ["READY"])
            return 0
        if verb == "delete":
            state[key] = ["MISSING"]
            if key == "queued":
                state["node"] = ["MISSING"]
            return 0
    print(f"fake gcloud: unexpected command {argv}", file=sys.stderr)
    return 2


def flag(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(name + "="))


def ssh(worker: int, command: str) -> int:
    with world() as (scenario, state):
        calls = state["ssh"].get(str(worker), 0)
        state["ssh"][str(worker)] = calls + 1
        outcomes = scenario.get("ssh", {}).get(str(worker), [])
        outcome = outcomes[calls] if calls < len(outcomes) else 0
        outcome = outcome if isinstance(outcome, dict) else {"exit": outcome}
        if outcome.get("exec"):
            # One coordinator port per round of ssh calls, shared by the workers of that round.
            port = state.setdefault("ports", {}).setdefault(str(calls), free_port())
    code = run(command, worker, scenario["hosts"], port, outcome) if outcome.get("exec") else outcome["exit"]
    if outcome.get("say"):
        print(outcome["say"], file=sys.stderr)
    if outcome.get("then"):
        with world() as (scenario, state):
            state["node"] = [outcome["then"]]
            state["queued"] = ["SUSPENDED"]
    return outcome.get("exit", code)


def run(command: str, worker: int, hosts: int, port: int, outcome: dict) -> int:
    env = {**os.environ, "PIPELINE_NUM_PROCESSES": str(hosts), "PIPELINE_PROCESS_ID": str(worker),
           "PIPELINE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
    proc = subprocess.Popen(["bash", "-c", command], env=env, start_new_session=True)
    pattern = outcome.get("preempt_when")
    while proc.poll() is None:
        if pattern and glob.glob(pattern):
            os.killpg(proc.pid, signal.SIGTERM)  # the preemption notice
            pattern = None
        time.sleep(0.05)
    return proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
