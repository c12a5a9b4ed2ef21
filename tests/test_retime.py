"""Tier: pure. The kept placement refined again on the simulator's figures (``search._retime``).

``Loads`` prices every ring alone; the simulator sees rings that share a node's NICs, or a GPU,
wait on each other. After the simulator has timed the kept placement, the planner moves whole
documents off the GPUs the simulator finds busiest and times the result; the faster of the two
is the plan.
"""

from __future__ import annotations

import pytest

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.search import search
from megatron_zeppelin.planner.search.partition import plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

CAPACITY = 32_768
MODEL = get_model("llama-7b")
# (distribution, GPUs, fill, seed): batches where the retimed placement is faster.
RETIMED_FASTER = [("mixture", 16, 0.95, 2), ("power-law", 64, 0.5, 0)]


def _plan(dist: str, gpus: int, fill: float, seed: int):  # noqa: ANN202
    topology = get_topology("zeppelin-C", num_nodes=gpus // 8)
    cost = CostModel.default(MODEL, topology)
    tokens = int(fill * gpus * CAPACITY)
    lengths = sample_lengths(dist, num_tokens=tokens, seed=seed, max_length=tokens // 2)
    plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=CAPACITY)
    return plan, cost


@pytest.mark.parametrize(("dist", "gpus", "fill", "seed"), RETIMED_FASTER)
def test_retimed_placement_is_kept_where_the_simulator_finds_it_faster(
    monkeypatch: pytest.MonkeyPatch, dist: str, gpus: int, fill: float, seed: int
) -> None:
    plan, cost = _plan(dist, gpus, fill, seed)
    step = simulate(plan, cost).step_time_s
    retimed = [c for c in plan.meta["candidates"] if c.get("retimed")]
    assert len(retimed) == 1
    # The plan is the retimed placement, and its predicted step is the simulator's.
    assert step == pytest.approx(MODEL.num_layers * retimed[0]["simulated_layer_s"], rel=1e-9)
    assert plan.meta["predicted_step_s"] == pytest.approx(step, rel=1e-9)
    # Without the pass, the same batch plans slower.
    monkeypatch.setattr(search, "_retime", lambda *args: None)
    without, _ = _plan(dist, gpus, fill, seed)
    assert not any(c.get("retimed") for c in without.meta["candidates"])
    assert step < simulate(without, cost).step_time_s * (1 - 1e-3)


@pytest.mark.parametrize(
    ("dist", "gpus", "fill", "seed"),
    # The retimed placement is slower on the first, faster on the second.
    [("uniform-long", 16, 0.5, 3), ("power-law", 32, 0.5, 0)],
)
def test_retiming_never_makes_the_step_slower(
    monkeypatch: pytest.MonkeyPatch, dist: str, gpus: int, fill: float, seed: int
) -> None:
    """Where the pass runs, the plan is at least as fast as without it, and is the fastest of
    the candidates the simulator timed, the retimed one among them. (The placement with uneven
    shares, faster than both on the first batch and with nothing for the pass to move, is left
    out.)"""
    monkeypatch.setattr(search, "place_shares", lambda *_: None)
    plan, cost = _plan(dist, gpus, fill, seed)
    step = simulate(plan, cost).step_time_s
    assert any(c.get("retimed") for c in plan.meta["candidates"])
    timed = [c["simulated_layer_s"] for c in plan.meta["candidates"] if "simulated_layer_s" in c]
    assert step == pytest.approx(MODEL.num_layers * min(timed), rel=1e-9)
    monkeypatch.setattr(search, "_retime", lambda *args: None)
    without, _ = _plan(dist, gpus, fill, seed)
    assert step <= simulate(without, cost).step_time_s * (1 + 1e-12)
