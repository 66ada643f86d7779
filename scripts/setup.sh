#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the pipeline installed, and
# the demo checkpoint (a tiny random-weight Llama built locally, nothing downloaded).
#   bash scripts/setup.sh          # to run the pipeline
#   bash scripts/setup.sh --test   # also the test and benchmark tools (pytest, torch CPU, GCS emulator)
# It says what it is doing: one line per phase, one per package pip collects (pip's errors
# and warnings come through as they are), and how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
started=$SECONDS
extras=""
what="the pipeline"
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
  what="the pipeline and the test tools"
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: [1/4] creating the virtual environment .venv ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv .venv
else
  echo "setup: [1/4] using the virtual environment .venv ($(.venv/bin/python --version 2>&1))"
fi

echo "setup: [2/4] installing $what with pip (a minute or two on a fresh machine)"
# pip's own lines, one per package it collects; everything else it prints to stdout is dropped.
.venv/bin/python -m pip install --disable-pip-version-check --progress-bar off -e ".${extras}" \
  | sed -u -n -e 's/^Collecting \([^ ;]*\).*/  collecting \1/p' \
              -e 's/^Installing collected packages: .*/  installing the collected packages/p' \
              -e 's/^Successfully installed \(.*\)/  installed: \1/p'

echo "setup: [3/4] building the engine's CPU decode-attention kernel (C++, a few seconds; optional)"
# Where no C++ compiler builds it, the engine attends with XLA operations instead (slower on a CPU).
.venv/bin/python -m engine.cpu_attention | sed -u 's/^/  /' || echo "  not built: the engine will use its XLA attention"

echo "setup: [4/4] building the demo checkpoint in demo/model"
# transformers' "PyTorch was not found" advice is noise here: it builds a config and a tokenizer only.
TRANSFORMERS_NO_ADVISORY_WARNINGS=1 .venv/bin/python demo/checkpoint.py demo/model

echo "setup: done in $((SECONDS - started)) s; try: .venv/bin/pipeline run all --config demo/config.yaml"
