"""Shared fixtures (a one-process gloo world) and the rule that every test names its tier.

Tiers, cheapest first (``pyproject.toml`` describes each marker): ``pure``, ``threads``,
``dist``, ``host``, ``gpu``. The edit loop is ``pytest -m "not dist and not host and not gpu"``.

A ``host`` test never skips: the main suite deselects the tier (``-m "not host"``) and the host
tier (``scripts/host_tier.sh``) runs it where ``megatron.training`` imports, so a skip there
would hide a broken environment. Host test files import ``megatron.training`` inside their tests,
never at import, so every environment can collect them and deselect them by marker; a test file
that skips as a whole (a module-level ``importorskip``) is refused for the same reason.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from examples import FULL
from hypothesis import settings

# Tests run small tensors on a few shared cores: one intra-op thread each. With more, OpenMP's
# workers spin-wait on a core another process holds and a 0.1 ms kernel takes 50 ms (the worker
# processes of the dist tests set the same, as the CPU job does).
torch.set_num_threads(1)

# ``--hypothesis-profile full`` (scripts/test.sh): each property draws its full count of
# examples (``examples.py``); the edit loop draws fewer.
settings.register_profile(FULL, settings.get_profile("default"))


@pytest.fixture(autouse=True)
def _root_log_handlers_restored():
    """Handlers a test leaves on the root logger are removed after it. pytest's log capture is
    off (``-p no:logging``), so Megatron's ``logging.basicConfig`` in one test would otherwise
    bind the root logger to that test's captured stderr, closed once the test ends."""
    before = list(logging.root.handlers)
    yield
    for handler in logging.root.handlers[:]:
        if handler not in before:
            logging.root.removeHandler(handler)
            handler.close()


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
    """Refuse a test that names no tier, or more than one: the quick loop selects by tier.
    Then order the dist tier first (below)."""
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
    # The dist tier's tests (processes, up to minutes each) first: with both cores in use
    # (scripts/test.sh, pytest-xdist) the short ones then fill the end, instead of one long
    # test running alone on one core at the end.
    items.sort(key=lambda item: item.get_closest_marker("dist") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test file that skips as a whole hides its tests from the tier markers: make it fail."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(collector, pytest.Module):
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skips at import ({_skip_reason(report)}): skip inside the tests "
            "that need it (a tier marker deselects them where they cannot run)"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skipped ``host`` test fails: the host tier must not pass without having run it."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("host") and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (
            f"host tests do not skip ({_skip_reason(report)}): run the tier with "
            "scripts/host_tier.sh, or deselect it with -m 'not host'"
        )


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
