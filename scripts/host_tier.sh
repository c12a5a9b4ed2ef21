#!/usr/bin/env bash
# The host test tier: tests marked `host` (tests/host/ and any other) against Megatron-LM's real
# megatron.training, which ships in the megatron-core 0.19 wheel and needs Python 3.12.
#
#   bash scripts/host_tier.sh [PYTEST ARGS...]
#
# The Python 3.12 environment is built once into a cache directory named after the pinned
# versions (torch first and pinned, so no other requirement can move it) and reused while they
# stay the same: ${XDG_CACHE_HOME:-$HOME/.cache}/megatron_zeppelin/host-<key>.
# ZEPPELIN_HOST_ENV names an environment of your own instead, used as it is (never built or
# removed). This repository is put on PYTHONPATH, not installed. Python 3.12 is found as
# $HOST_PYTHON, python3.12 on PATH, pyenv's 3.12 or /usr/(local/)bin/python3.12.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION=3.12
TORCH_VERSION=2.13.0
MCORE_VERSION=0.19.2
# What the host tests import besides torch and megatron-core (psutil: Megatron's checkpoint
# writer needs it and the wheel does not declare it).
HOST_PACKAGES=(numpy pyyaml tqdm pytest hypothesis psutil)

fail() {
  echo "host tier: $*" >&2
  exit 1
}

find_python() {
  local candidates=() root
  [ -n "${HOST_PYTHON:-}" ] && candidates+=("$HOST_PYTHON")
  candidates+=("$(command -v "python$PYTHON_VERSION" 2>/dev/null)")
  if command -v pyenv >/dev/null 2>&1 && root="$(pyenv root 2>/dev/null)"; then
    candidates+=($(ls -d "$root"/versions/"$PYTHON_VERSION"*/bin/python 2>/dev/null | sort -V -r))
  fi
  candidates+=("/usr/local/bin/python$PYTHON_VERSION" "/usr/bin/python$PYTHON_VERSION")
  local python
  for python in "${candidates[@]}"; do
    [ -n "$python" ] && [ -x "$python" ] || continue
    if "$python" -c "import sys, venv; sys.exit('%d.%d' % sys.version_info[:2] != '$PYTHON_VERSION')" \
        2>/dev/null; then
      echo "$python"
      return 0
    fi
  done
  return 1
}

requirements="torch==$TORCH_VERSION megatron-core==$MCORE_VERSION ${HOST_PACKAGES[*]}"
key="py$PYTHON_VERSION-torch$TORCH_VERSION-mcore$MCORE_VERSION-$(
  printf '%s' "$requirements" | sha256sum | cut -c1-8)"
env_dir="${XDG_CACHE_HOME:-$HOME/.cache}/megatron_zeppelin/host-$key"

build_env() {
  local python log
  python="$(find_python)" || fail "Python $PYTHON_VERSION not found (megatron-core" \
    "$MCORE_VERSION needs Python >= 3.12): install it (pyenv install $PYTHON_VERSION) or set" \
    "HOST_PYTHON=/path/to/python$PYTHON_VERSION"
  echo "host tier: building $env_dir with $python (once; several GB, torch's CUDA build)"
  rm -rf "$env_dir"
  mkdir -p "$(dirname "$env_dir")"
  "$python" -m venv "$env_dir" || fail "cannot create a virtual environment at $env_dir"
  log="$(mktemp)"
  # torch first and pinned (then pinned again), so megatron-core's requirements cannot move it.
  if ! "$env_dir/bin/python" -m pip install -q "torch==$TORCH_VERSION" >"$log" 2>&1 ||
     ! "$env_dir/bin/python" -m pip install -q $requirements >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    fail "pip install failed (above); the half-built environment is rebuilt on the next run"
  fi
  rm -f "$log"
  "$env_dir/bin/python" -W ignore -c "import megatron.training, torch; \
assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__" ||
    fail "the environment at $env_dir does not import megatron.training"
  echo "$requirements" > "$env_dir/.complete"
}

if [ -n "${ZEPPELIN_HOST_ENV:-}" ]; then
  # An environment of the user's: used as it is, never rebuilt or removed.
  env_dir="$ZEPPELIN_HOST_ENV"
  "$env_dir/bin/python" -W ignore -c "import megatron.training" ||
    fail "ZEPPELIN_HOST_ENV=$env_dir does not import megatron.training: install" \
      "$requirements there, or unset ZEPPELIN_HOST_ENV to build the cached environment"
elif [ ! -f "$env_dir/.complete" ]; then
  mkdir -p "$(dirname "$env_dir")"
  exec 9>"$env_dir.lock"
  flock 9 2>/dev/null || true  # another run building the same environment finishes first
  [ -f "$env_dir/.complete" ] || build_env
fi

PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$env_dir/bin/python" -m pytest -q -m host "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "host tier: no tests were collected: failing" >&2
  exit 1
fi
exit "$status"
