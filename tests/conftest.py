"""Shared fixtures (a one-process gloo world) and the rule that every test names its tier.

Tiers, cheapest first (``pyproject.toml`` describes each marker): ``pure``, ``threads``,
``dist``, ``host``, ``gpu``. The edit loop is ``pytest -m "not dist and not host and not gpu"``.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one rank; Megatron's parallel state is torn down after too, for
    code under test that initializes it itself."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture
def one_rank(one_process_group):
    """``one_process_group`` with Megatron's parallel state initialized (TP 1)."""
    from megatron_zeppelin.megatron.runtime import init_megatron_parallel

    return init_megatron_parallel(1)


TIERS = ("pure", "threads", "dist", "host", "gpu")


def pytest_collection_modifyitems(config, items):
    """Refuse a test that names no tier, or more than one: the quick loop selects by tier."""
    wrong = []
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {sorted(tiers) or 'no tier marker'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one tier marker ("
            + ", ".join(TIERS)
            + "):\n  "
            + "\n  ".join(wrong)
        )
