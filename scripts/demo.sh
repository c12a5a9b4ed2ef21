#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: a Zeppelin training run on CPU, 4 gloo processes
# emulating 2 nodes x 2 GPUs, on a synthetic variable-length dataset. Extra arguments go to
# `zeppelin train` (see `zeppelin train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec zeppelin train "$@"
