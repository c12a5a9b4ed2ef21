"""Plans reused where a micro-batch's lengths repeat (``megatron/plans/reuse.py``): a repeat is
handed the plan the planner made for the same lengths, and the planner is not asked again; other
lengths, the same lengths in another order, and lengths pushed out of the last few are planned;
a failed plan is not kept; a recipe travels to a planner process with an empty store. Tier:
``pure``."""

from __future__ import annotations

import pickle

import pytest

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.plans.plan_workers import PlanRecipe
from megatron_zeppelin.megatron.plans.reuse import RecentPlans
from megatron_zeppelin.megatron.runtime import plan_digest
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.search import partition
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPOLOGY = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
FIXED = [256] * 12  # samples packed to a fixed length: every micro-batch alike
OTHER = [700, 31, 250, 90, 1200, 64, 5, 400]


def _recipe() -> PlanRecipe:
    config = ZeppelinConfig(capacity=1024)
    cost_model = CostModel.default(get_model("tiny"), TOPOLOGY)
    return PlanRecipe(TOPOLOGY, cost_model, config, config.planner_options(cost_model))


@pytest.fixture
def counted(monkeypatch):
    """The lengths ``partition.plan_batch`` is asked to plan, in order."""
    real, asked = partition.plan_batch, []

    def plan_batch(lengths, **kwargs):
        asked.append(list(lengths))
        return real(lengths, **kwargs)

    monkeypatch.setattr(partition, "plan_batch", plan_batch)
    return asked


def test_a_repeat_is_handed_the_plan_made_for_the_same_lengths(counted) -> None:
    recipe = _recipe()
    first = recipe(FIXED)
    again = recipe(list(FIXED))
    assert counted == [FIXED]
    assert again is first and recipe.recent.hits == 1
    # The plan handed out again is the one a planner of its own makes for those lengths.
    assert plan_digest(again) == plan_digest(_recipe()(FIXED))


def test_other_lengths_and_another_order_are_planned(counted) -> None:
    recipe = _recipe()
    recipe(OTHER)
    recipe(OTHER[::-1])
    recipe(FIXED)
    recipe(OTHER)
    assert counted == [OTHER, OTHER[::-1], FIXED]
    assert recipe.recent.hits == 1


def test_the_least_recently_used_lengths_go_first(counted) -> None:
    store = RecentPlans(2)
    plans = {n: object() for n in range(4)}
    made: list[int] = []

    def make(lengths):
        made.append(lengths[0])
        return plans[lengths[0]]

    for n in (0, 1, 0, 2, 0, 1):  # 1 is the least recently used when 2 comes
        assert store.plan([n, 5], make) is plans[n]
    assert made == [0, 1, 2, 1]
    assert len(store) == 2 and store.hits == 2


def test_a_failed_plan_is_not_kept() -> None:
    store, calls = RecentPlans(), []

    def fails_once(lengths):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("document 0 finds no room")
        return lengths

    with pytest.raises(ValueError, match="no room"):
        store.plan([3, 4], fails_once)
    assert store.plan([3, 4], fails_once) == [3, 4]
    assert len(calls) == 2 and len(store) == 1


def test_none_kept_plans_every_micro_batch(counted) -> None:
    store = RecentPlans(0)
    recipe = _recipe()
    for _ in range(2):
        store.plan(FIXED, recipe._plan)
    assert counted == [FIXED, FIXED] and len(store) == 0
    with pytest.raises(ValueError, match=">= 0"):
        RecentPlans(-1)


def test_a_recipe_reaches_a_planner_process_with_an_empty_store(counted) -> None:
    recipe = _recipe()
    recipe(FIXED)
    copy = pickle.loads(pickle.dumps(recipe))
    assert len(copy.recent) == 0 and copy.recent.size == recipe.recent.size
    assert copy == recipe  # the store plays no part in what a recipe plans
    copy(FIXED)
    assert counted == [FIXED, FIXED]
