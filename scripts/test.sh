#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main test suite; extra arguments go to pytest.
# The host tier (tests/host/, Megatron's real training loop) runs in its own Python 3.12
# environment: scripts/host_tier.sh (.ci/run runs both).
# pytest exits 5 when it collected no test: that is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
ruff check megatron_zeppelin tests scripts || exit 1
# Both cores (pytest-xdist; tests/conftest.py starts the longest tier first): on two cores about
# two thirds of the time of one process. `-n 0` as an argument runs it in one process.
python -m pytest -q -m "not host" --hypothesis-profile=full -n 2 --dist worksteal --durations=15 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$status"
