"""Planner processes (``megatron/plans/plan_workers.py``): their plans equal the training process's,
in order, through the feed and across a resume; a planning error comes back as the planner's
own; a worker that dies fails its micro-batches with an error naming it, never a hang; no
worker outlives the feed or the training process. Tiers: ``dist`` (starts planner processes)
and ``pure`` (the flags, and plans through pickle)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.documents.sampler import DocumentSampler
from megatron_zeppelin.megatron.plans.feed import MicroBatchFeed
from megatron_zeppelin.megatron.plans.plan_workers import PlannerProcesses, PlanRecipe
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import Scheme, SequencePlan, Span, Tier, TokenRange
from megatron_zeppelin.planner.plan.plan_parts import (
    pack_layout,
    pack_sequences,
    unpack_layout,
    unpack_sequences,
)
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

LENGTHS = [700, 31, 250, 90, 1200, 64, 5, 400, 333, 12, 880, 150, 47, 610, 2, 300]
TIMEOUT = 120  # seconds any answer may take on a loaded CI machine


def _recipe(topology: Topology, capacity: int, model: str = "tiny") -> PlanRecipe:
    config = ZeppelinConfig(capacity=capacity)
    cost_model = CostModel.default(get_model(model), topology)
    return PlanRecipe(topology, cost_model, config, config.planner_options(cost_model))


SMALL = _recipe(Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2), 1024)
# 4 nodes of 8: rings inside and across nodes, the 2-D scheme, routes over every NIC.
WIDE = _recipe(get_topology("zeppelin-C", num_nodes=4), 32768, "llama-7b")


def _sampler() -> DocumentSampler:
    return DocumentSampler(
        LENGTHS, tokens_per_step=1500, num_micro_batches=3, seed=3, micro_batch_capacity=4096
    )


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A child of this process lingers as a zombie until reaped: reap it if it is ours.
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


@pytest.mark.dist
def test_a_worker_plans_what_the_training_process_plans_in_order() -> None:
    batches = [sample_lengths("prolong", num_tokens=1 << 20, seed=s) for s in range(3)]
    batches += [sample_lengths("wikipedia", num_tokens=1 << 19, seed=5)]
    expected = [WIDE(lengths) for lengths in batches]
    kinds = {(s.tier, s.scheme) for plan in expected for s in plan.sequences}
    assert {(Tier.LOCAL, Scheme.RING), (Tier.INTRA, Scheme.RING)} <= kinds
    assert any(tier == Tier.INTER for tier, _ in kinds)
    seconds: list[float] = []
    planners = PlannerProcesses(WIDE, 2, seconds.append)
    try:
        futures = [planners.submit(list(lengths)) for lengths in batches]
        got = [f.result(timeout=TIMEOUT) for f in futures]
        # A worker has planned: it stays light (no PyTorch, ~0.2 s to start).
        for pid in planners.pids:
            with open(f"/proc/{pid}/maps") as f:
                assert "libtorch" not in f.read()
    finally:
        planners.close()
    assert got == expected
    assert [p.to_json() for p in got] == [p.to_json() for p in expected]
    assert [p.route_of(r.src, r.dst) for p in got for r in p.routes] == [
        r for p in got for r in p.routes
    ]  # the route index is rebuilt with the plan
    assert len(seconds) == len(batches) and all(s > 0 for s in seconds)


@pytest.mark.dist
def test_the_feed_with_planner_processes_equals_planning_in_the_step_across_a_resume() -> None:
    inline = MicroBatchFeed(_sampler(), SMALL, ahead=0)
    feed = MicroBatchFeed(_sampler(), SMALL, ahead=4, workers=2)
    try:
        first = [feed.next() for _ in range(4)]
        assert [m.plan for m in first] == [inline.next().plan for _ in range(4)]
        # A resume drops the plans made ahead; the workers still answer them, in order, and
        # those answers must not land on the micro-batches asked for after it.
        state = feed.state_dict()
        feed.load_state_dict(state)
        inline.load_state_dict(state)
        after = [(m.step.step, m.index, m.plan) for m in (feed.next() for _ in range(7))]
        assert after == [(m.step.step, m.index, m.plan) for m in (inline.next() for _ in range(7))]
        assert feed.stats.num_plans == sum(m.plan is not None for m in first) + sum(
            p is not None for *_, p in after
        )
        assert 0.0 < feed.stats.planning_s and 0.0 <= feed.stats.hidden_s
        assert 0.0 < feed.stats.startup_s  # waited for once, before the first plan
        pids = feed._planner.pids  # type: ignore[union-attr]
    finally:
        feed.close()
        inline.close()
    assert all(_gone(pid, 10) for pid in pids)


@pytest.mark.dist
def test_a_planning_error_comes_back_as_the_planners_own_and_the_worker_goes_on() -> None:
    too_long = [5000, 10]  # over 4 GPUs x 1024 tokens
    with pytest.raises(ValueError) as here:
        SMALL(too_long)
    planners = PlannerProcesses(SMALL, 1, lambda s: None)
    try:
        failed = planners.submit(too_long)
        fine = planners.submit(LENGTHS[:6])
        with pytest.raises(ValueError) as there:
            failed.result(timeout=TIMEOUT)
        assert type(there.value) is type(here.value)
        assert str(there.value) == str(here.value)
        assert fine.result(timeout=TIMEOUT) == SMALL(LENGTHS[:6])
    finally:
        planners.close()


@pytest.mark.dist
def test_a_worker_that_dies_fails_its_micro_batches_with_an_error_naming_it() -> None:
    batches = [list(sample_lengths("wlbllm", num_tokens=1 << 21, seed=s)) for s in range(4)]
    planners = PlannerProcesses(WIDE, 1, lambda s: None)
    try:
        futures = [planners.submit(lengths) for lengths in batches]
        pid = planners.pids[0]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        for future in futures:
            with pytest.raises(RuntimeError) as err:
                future.result(timeout=TIMEOUT)
            message = str(err.value)
            assert f"pid {pid}" in message and "killed by signal 9" in message
            assert "--zeppelin-plan-workers 0" in message
        # Later micro-batches fail at once, with the same words.
        with pytest.raises(RuntimeError, match=f"pid {pid}"):
            planners.submit(batches[0]).result(timeout=TIMEOUT)
        assert time.monotonic() - start < 30
    finally:
        planners.close()


@pytest.mark.dist
def test_a_worker_killed_while_starting_is_named_and_waiting_for_it_ends() -> None:
    planners = PlannerProcesses(SMALL, 1, lambda s: None)
    try:
        pid = planners.pids[0]
        os.kill(pid, signal.SIGKILL)
        waiter = threading.Thread(target=planners.wait_ready, daemon=True)
        waiter.start()
        waiter.join(TIMEOUT)
        assert not waiter.is_alive(), "waiting for a dead worker to start never ended"
        with pytest.raises(RuntimeError, match=f"pid {pid}.*killed by signal 9"):
            planners.submit(LENGTHS).result(timeout=TIMEOUT)
    finally:
        planners.close()


class _Unknown:
    """Pickles here; its module is not importable in a planner process."""

    def __call__(self, lengths):
        return SMALL(lengths)


@pytest.mark.dist
def test_a_worker_that_fails_to_start_says_so_with_its_exit_code() -> None:
    planners = PlannerProcesses(_Unknown(), 1, lambda s: None)  # type: ignore[arg-type]
    try:
        planners.wait_ready()
        with pytest.raises(RuntimeError, match=r"exited with code 1 \(its error is on"):
            planners.submit(LENGTHS).result(timeout=TIMEOUT)
    finally:
        planners.close()


@pytest.mark.pure
def test_a_recipe_that_does_not_pickle_is_refused_before_any_process_starts() -> None:
    with pytest.raises(TypeError, match="picklable recipe"):
        PlannerProcesses(lambda lengths: SMALL(lengths), 1, lambda s: None)  # type: ignore[arg-type]


@pytest.mark.dist
def test_no_worker_outlives_a_training_process_that_exits_mid_plan() -> None:
    code = textwrap.dedent(
        """
        from megatron_zeppelin.config import ZeppelinConfig
        from megatron_zeppelin.megatron.plans.plan_workers import PlannerProcesses, PlanRecipe
        from megatron_zeppelin.planner.cost.costmodel import CostModel
        from megatron_zeppelin.planner.baselines.distributions import sample_lengths
        from megatron_zeppelin.planner.cost.models import get_model
        from megatron_zeppelin.topology.presets import get_topology

        topology = get_topology("zeppelin-C", num_nodes=128)
        cost = CostModel.default(get_model("llama-7b"), topology)
        config = ZeppelinConfig(capacity=65536)
        recipe = PlanRecipe(topology, cost, config, config.planner_options(cost))
        planners = PlannerProcesses(recipe, 1, lambda s: None)
        for seed in range(20):  # seconds of planning queued: the worker is busy at exit
            planners.submit(list(sample_lengths("wlbllm", num_tokens=1 << 22, seed=seed)))
        print(planners.pids[0], flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    # It ends at the end of the plan in progress (its answer finds no reader), not after 20.
    assert _gone(pid, 30), f"planner process {pid} is still running"


@pytest.mark.pure
def test_plans_survive_pickle_with_every_record_kind() -> None:
    plan = WIDE(sample_lengths("prolong", num_tokens=1 << 20, seed=1))
    copy = pickle.loads(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy == plan and copy.to_json() == plan.to_json()
    assert any(s.scheme == Scheme.TWO_D for s in plan.sequences) or any(
        s.tier == Tier.INTER for s in plan.sequences
    )
    # The records are rebuilt from packed pieces (``Plan.__reduce__``): frozen, slotted, of
    # their own types, equal field by field, the routes indexed again.
    assert all(copy.route_of(r.src, r.dst) == r for r in plan.routes) and plan.routes
    assert {type(r) for ranges in copy.linear for r in ranges} == {TokenRange}
    assert {type(s) for s in copy.sequences} == {SequencePlan}
    for old, new in zip(plan.sequences, copy.sequences):
        assert (new.id, new.length, new.tier, new.ring, new.scheme) == (
            old.id,
            old.length,
            old.tier,
            old.ring,
            old.scheme,
        )
        assert [(s.rank, s.start, s.end) for s in new.attention] == [
            (s.rank, s.start, s.end) for s in old.attention
        ]
    with pytest.raises(AttributeError):
        copy.sequences[0].attention[0].start = 3  # type: ignore[misc]


@pytest.mark.pure
def test_records_survive_packing_where_there_are_none_or_they_are_out_of_order() -> None:
    layout = ((), (TokenRange(3, 5, 9), TokenRange(1, 0, 2)), ())
    assert unpack_layout(pack_layout(layout)) == layout
    assert unpack_layout(pack_layout(((),) * 4)) == ((),) * 4
    assert unpack_sequences(pack_sequences(())) == () and unpack_layout(pack_layout(())) == ()
    spans = (Span(1, 4, 6), Span(0, 0, 4))
    sequences = (SequencePlan(7, 6, Tier.INTRA, (0, 1), spans),)
    assert unpack_sequences(pack_sequences(sequences)) == sequences


@pytest.mark.pure
def test_a_plan_packs_in_pieces_that_rebuild_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of a few records each (``_CHUNK``: what the reader thread unpickles at once)
    rebuild the same plan, documents and ranks cut at any place."""
    from megatron_zeppelin.planner.plan import plan_parts

    plan = WIDE(sample_lengths("prolong", num_tokens=1 << 20, seed=1))
    for chunk in (1, 7, 64):
        monkeypatch.setattr(plan_parts, "_CHUNK", chunk)
        assert len(pack_sequences(plan.sequences)) == -(-len(plan.sequences) // chunk)
        assert len(pack_layout(plan.linear)) > 1
        assert pickle.loads(pickle.dumps(plan)) == plan


@pytest.mark.pure
def test_planning_and_unpickling_leave_no_cycles_for_the_collector() -> None:
    """With Megatron's ``--manual-gc`` (the collector off; docs/MEGATRON.md) a plan must be
    freed by reference counting alone: making one, sending it through pickle and dropping both
    leaves nothing for ``gc.collect()`` to find, with every kind of record and a capacity
    fallback (an exception raised and caught inside the planner)."""
    import gc

    batches = [
        sample_lengths("prolong", num_tokens=1 << 20, seed=1),
        sample_lengths("wlbllm", num_tokens=1 << 20, seed=2),
    ]
    tight = _recipe(Topology(num_nodes=2, gpus_per_node=1, nics_per_node=1), 377)
    WIDE(batches[0])  # one-time caches (cost tables, zigzag loads) before counting
    tight([247, 211, 65, 216])
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        fallback = tight([247, 211, 65, 216])  # refused staged, placed by the last resort
        assert fallback.meta.get("fallback")
        for lengths in batches:
            plan = WIDE(lengths)
            copy = pickle.loads(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
            assert copy == plan
            del plan, copy
        del fallback
        assert gc.collect() == 0
    finally:
        (gc.enable if enabled else gc.disable)()


@pytest.mark.pure
@pytest.mark.parametrize(
    ("ahead", "workers", "processes"),
    [(2, None, 1), (0, None, 0), (3, 0, 0), (3, 3, 3), (1, 1, 1)],
)
def test_planner_processes_from_the_flags(ahead: int, workers: int | None, processes: int) -> None:
    config = ZeppelinConfig(plan_ahead=ahead, plan_workers=workers).validate()
    assert config.planner_processes == processes


@pytest.mark.pure
@pytest.mark.parametrize(
    ("ahead", "workers", "words"),
    [
        (2, 3, "raise --zeppelin-plan-ahead to at least 3"),
        (0, 1, "raise --zeppelin-plan-ahead to at least 1"),
        (2, -1, "--zeppelin-plan-workers must be >= 0"),
    ],
)
def test_contradictory_planner_flags_are_refused_with_the_flag_to_change(
    ahead: int, workers: int, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        ZeppelinConfig(plan_ahead=ahead, plan_workers=workers).validate()
