"""The host tier (``scripts/host_tier.sh``): Megatron-LM's real ``megatron.training`` on CPU, in
the Python 3.12 environment with megatron-core 0.19. Where ``megatron.training`` is not
importable (the main suite's environment) this directory is not collected."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("megatron.training") is None:
    collect_ignore_glob = ["test_*.py"]

# Megatron announces the optional packages it lacks here (Apex, TransformerEngine, absl) and
# its argument defaults; Python 3.12 flags the argparse and TorchScript APIs it still uses.
KNOWN_WARNINGS = (
    r"ignore::UserWarning:megatron\.(core|training)(\..*)?",
    "ignore::DeprecationWarning:argparse",
    r"ignore::DeprecationWarning:torch\.jit\..*",
)


def pytest_configure(config):
    for line in KNOWN_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
