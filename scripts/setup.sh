#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the pipeline installed, and
# the demo checkpoint (a tiny random-weight Llama built locally, nothing downloaded).
#   bash scripts/setup.sh          # to run the pipeline
#   bash scripts/setup.sh --test   # also the test and benchmark tools (pytest, torch CPU, GCS emulator)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
extras=""
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}"
.venv/bin/python demo/checkpoint.py demo/model
