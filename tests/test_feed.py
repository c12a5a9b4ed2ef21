"""Planning ahead: the feed gives the same micro-batches and plans as planning in the step,
surfaces a planning error as the planner's own exception, keeps the checkpoint state at step
boundaries, and never holds a process at exit (tier: pure; one quick subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.documents.sampler import DocumentSampler
from megatron_zeppelin.megatron.plans.feed import MicroBatchFeed
from megatron_zeppelin.megatron.plans.plan_workers import PlanRecipe
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

LENGTHS = [700, 31, 250, 90, 1200, 64, 5, 400, 333, 12, 880, 150, 47, 610, 2, 300]
TOPOLOGY = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
COST = CostModel.default(get_model("tiny"), TOPOLOGY)
CONFIG = ZeppelinConfig(capacity=1024, intra_threshold="64", inter_threshold="400")


def _sampler() -> DocumentSampler:
    return DocumentSampler(
        LENGTHS, tokens_per_step=1500, num_micro_batches=3, seed=3, micro_batch_capacity=4096
    )


_plan = PlanRecipe(TOPOLOGY, COST, CONFIG)


def _run(feed: MicroBatchFeed, num: int) -> list[tuple]:
    out = []
    for _ in range(num):
        item = feed.next()
        out.append((item.step.step, item.index, item.slices, item.plan))
    return out


@pytest.mark.parametrize("ahead", [0, 1, 4])
def test_planned_ahead_equals_planned_in_the_step(ahead: int) -> None:
    sampler = _sampler()  # the same stream, planned in the step
    expected = []
    for _ in range(5):
        step = sampler.next_step()
        for i, mb in enumerate(step.micro_batches):
            expected.append((step.step, i, mb, _plan([u.num_tokens for u in mb]) if mb else None))
    feed = MicroBatchFeed(_sampler(), _plan, ahead=ahead)
    try:
        got = _run(feed, len(expected))
    finally:
        feed.close()
    assert got == expected
    stats = feed.stats
    assert stats.num_plans == sum(1 for e in expected if e[3] is not None)
    assert 0.0 <= stats.hidden_s <= stats.planning_s
    if ahead == 0:
        assert stats.hidden_s == 0.0  # the step waited for every plan


def test_state_at_a_step_boundary_is_the_samplers_whatever_was_drawn_ahead() -> None:
    reference = _sampler()
    feed = MicroBatchFeed(_sampler(), _plan, ahead=5)
    try:
        for _ in range(2):  # two whole steps of three micro-batches
            reference.next_step()
            _run(feed, 3)
            assert feed.sampler.step > reference.step  # the feed drew ahead
            assert feed.state_dict() == reference.state_dict()
        resumed = MicroBatchFeed(_sampler(), _plan, ahead=2)
        resumed.load_state_dict(feed.state_dict())
        assert _run(resumed, 6) == _run(feed, 6)
    finally:
        feed.close()
        resumed.close()


def test_a_planning_error_surfaces_on_the_training_thread_as_the_planners_own() -> None:
    bad_step_lengths = []

    def plan_or_fail(lengths):
        if len(bad_step_lengths) == 2:
            raise ValueError("document 2 (65 tokens) finds no room: raise --zeppelin-capacity")
        bad_step_lengths.append(lengths)
        return _plan(lengths)

    before = set(threading.enumerate())
    feed = MicroBatchFeed(_sampler(), plan_or_fail, ahead=3)
    started = set(threading.enumerate()) - before
    assert [t.name for t in started] == ["zeppelin-planner"]
    first, second = feed.next(), feed.next()
    assert first.plan is not None and second.plan is not None
    with pytest.raises(ValueError) as err:
        feed.next()
    assert str(err.value) == "document 2 (65 tokens) finds no room: raise --zeppelin-capacity"
    feed.close()


def test_a_process_with_a_busy_planner_thread_exits() -> None:
    code = textwrap.dedent(
        """
        import time
        from megatron_zeppelin.megatron.plans.feed import MicroBatchFeed
        from megatron_zeppelin.megatron.documents.sampler import DocumentSampler

        def slow(lengths):
            time.sleep(600)

        sampler = DocumentSampler([5, 7, 9, 11], tokens_per_step=20, num_micro_batches=2)
        feed = MicroBatchFeed(sampler, slow, ahead=3)
        feed._fill(4)  # the planner thread is now inside a plan that never ends
        time.sleep(0.2)
        print("leaving")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "leaving"


def test_the_collectors_own_full_passes_are_counted_and_manual_ones_are_not() -> None:
    """A plan brings the training process thousands of objects, and Python's collector then
    passes over everything holding the interpreter lock: the feed counts the full passes the
    collector starts by itself (a ``gc.collect()`` while it is on stands in for one), not
    those a run asks for with it off (Megatron's ``--manual-gc``), and stops at ``close()``."""
    import gc

    enabled = gc.isenabled()
    feed = MicroBatchFeed(_sampler(), _plan, ahead=0)
    try:
        gc.enable()
        gc.collect()
        gc.collect(1)  # not a full pass
        assert feed.stats.collections == 1
        assert 0.0 < feed.stats.longest_collection_s <= feed.stats.collection_s
        gc.disable()
        gc.collect()  # as --manual-gc does at fixed steps
        assert feed.stats.collections == 1
        gc.enable()
        feed.close()
        gc.collect()
        assert feed.stats.collections == 1
        assert feed.stats.to_dict()["collections"] == 1
    finally:
        feed.close()
        (gc.enable if enabled else gc.disable)()


def test_the_planning_line_names_the_collectors_passes_and_the_flag_that_stops_them() -> None:
    from megatron_zeppelin.megatron.report import planning_text

    stats = {"num_plans": 4, "planning_s": 1.0, "hidden_s": 0.8, "waited_s": 0.2}
    quiet = planning_text({**stats, "collections": 0}, manual_gc="--manual-gc")
    assert "collector" not in quiet
    busy = {**stats, "collections": 3, "collection_s": 0.42, "longest_collection_s": 0.19}
    line = planning_text(busy, manual_gc="--manual-gc")
    assert "3 full passes, 0.42 s in all (longest 0.19 s): --manual-gc" in line
    assert "--manual-gc" not in planning_text(busy)  # a run without that flag (the CPU job)


def test_the_planning_line_says_how_many_plans_were_made_here_where_plans_are_shared() -> None:
    from megatron_zeppelin.megatron.report import planning_text

    stats = {"num_plans": 8, "planning_s": 0.3, "hidden_s": 0.0, "waited_s": 0.05}
    shared = planning_text({**stats, "num_made": 4, "shared": True, "collections": 0})
    assert shared.startswith("8 plans taken, 4 made here (ahead included) in 0.30 s, the others")
    assert "training waited 0.05 s for plans" in shared
    alone = planning_text({**stats, "num_made": 8, "shared": False, "collections": 0})
    assert alone.startswith("0.30 s for 8 plans, 0.00 s (0%) hidden behind training")


def test_the_start_up_names_the_collector_only_where_manual_gc_is_off() -> None:
    from megatron_zeppelin.megatron.report import collector_line

    assert collector_line(True) is None
    line = collector_line(False)
    assert line is not None and line.startswith("zeppelin: ") and "--manual-gc" in line
