#!/usr/bin/env bash
# Create (or reuse) .venv and install megatron_zeppelin with its development tools.
# torch is installed first and pinned: a looser requirement with no torch present would pull the
# newest CUDA build (several GB) even on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCH_VERSION}"
python -m pip install -q -e ".[dev]"
