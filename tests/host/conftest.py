"""The host tier (``scripts/host_tier.sh``): Megatron-LM's real ``megatron.training`` on CPU, in
the Python 3.12 environment with megatron-core 0.19. Where ``megatron.training`` is not
importable (the main suite's environment) this directory is not collected."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("megatron.training") is None:
    collect_ignore_glob = ["test_*.py"]
