#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels the engine needs beyond a stock JAX + PyTorch image,
# for a GPU (or TPU) machine that cannot download: haliax (pinned in pyproject.toml) and the two
# pure-Python packages it brings that such images lack (aqtp, jmp). Everything else the engine
# and the benchmarks import (jax, equinox, jaxtyping, safetensors, numpy, torch, transformers)
# is expected on the image. Copy the folder over; scripts/gpu_bench.sh installs it from there.
#
#   bash scripts/offline_wheels.sh              # into .whl/ (git ignores it)
#   bash scripts/offline_wheels.sh DIR 3.12     # another folder, the target machine's Python
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python_version=${2:-3.12}
haliax=$(grep -o '"haliax==[^"]*"' pyproject.toml | tr -d '"')
python=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
mkdir -p "$dest"
# All three are pure Python (py3-none-any), so one download serves any Linux machine.
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp --platform manylinux2014_x86_64 -d "$dest" "$haliax" "aqtp>=0.8.2" "jmp>=0.0.4"
ls -1 "$dest"
