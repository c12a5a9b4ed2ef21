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

# pip's build chatter goes to a log that is shown only when an install fails.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
quiet_pip() {
  if ! python -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
}
python -c "import torch" 2>/dev/null || quiet_pip "torch==${TORCH_VERSION}"
quiet_pip -e ".[dev]"
# The planner's compiled loops (numba, one of the development tools) built once into numba's
# cache: the planner processes of a run then load them in about a second instead of each
# compiling them for 15 s or more on its first plan (docs/DESIGN.md, "What a plan costs, and
# where").
zeppelin compile-planner >/dev/null ||
  { echo "setup: building the planner's compiled loops failed (above)" >&2; exit 1; }
