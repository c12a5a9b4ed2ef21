"""The best static CP size of TE ring CP, the all-gather CP and hybrid DP in ``zeppelin compare``:
chosen from the sizes that hold every batch, and never slower than any one of them."""

from __future__ import annotations

import pytest

from megatron_zeppelin.commands.compare_static import best_static, mean_step, rule_name
from megatron_zeppelin.commands.simulate import compare_batches, summarize
from megatron_zeppelin.planner.baselines import (
    STATIC_CP_BASELINES,
    build_baseline,
    rule_cp_size,
    static_cp_sizes,
)
from megatron_zeppelin.planner.costmodel import CostModel
from megatron_zeppelin.planner.distributions import sample_lengths
from megatron_zeppelin.planner.models import get_model
from megatron_zeppelin.planner.plan import zigzag_loads
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPO = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2)
CAPACITY = 8192
COST = CostModel.default(get_model("llama-7b"), TOPO)
# Two long-tail batches whose longest documents need a group of 2 (the rule's size in both),
# on which hybrid DP runs faster with its long documents over 4 GPUs.
BATCHES = [
    sample_lengths("prolong", num_tokens=int(0.7 * 8 * CAPACITY), seed=s, max_length=16384)
    for s in (1, 2)
]
COMMON = dict(topology=TOPO, cost_model=COST, capacity=CAPACITY)


def _price(name: str, size: int) -> list:
    return compare_batches(BATCHES, builders=(name,), cp_sizes={name: size}, **COMMON)[name]


@pytest.fixture(scope="module")
def chosen():
    rule = compare_batches(BATCHES, builders=STATIC_CP_BASELINES, **COMMON)
    results, choices = best_static(BATCHES, rule, _price, topology=TOPO, capacity=CAPACITY)
    return rule, results, choices


@pytest.mark.parametrize("name", STATIC_CP_BASELINES)
def test_static_sizes_divide_the_gpus_and_hold_every_document(name: str) -> None:
    sizes = static_cp_sizes(name, BATCHES, TOPO, CAPACITY)
    longest = max(max(b) for b in BATCHES)
    assert sizes == sorted(sizes) and sizes[0] == max(
        rule_cp_size(name, b, TOPO, CAPACITY) for b in BATCHES
    )
    for size in sizes:
        assert TOPO.world_size % size == 0 and size & (size - 1) == 0
        assert max(zigzag_loads(longest, size)) <= CAPACITY
        for lengths in BATCHES:
            build_baseline(name, lengths, topology=TOPO, capacity=CAPACITY, cp_size=size)
    if sizes[0] > 1 and name != "hybrid-dp":  # the next smaller size cannot hold the longest
        with pytest.raises(ValueError, match="does not fit a CP group"):
            build_baseline(name, [longest], topology=TOPO, capacity=CAPACITY, cp_size=sizes[0] // 2)


@pytest.mark.parametrize("name", STATIC_CP_BASELINES)
def test_best_static_is_never_slower_than_any_one_size(chosen, name: str) -> None:
    rule, results, choices = chosen
    choice = choices[name]
    assert choice.size in static_cp_sizes(name, BATCHES, TOPO, CAPACITY)
    assert set(choice.step_times) == set(static_cp_sizes(name, BATCHES, TOPO, CAPACITY))
    best = mean_step(results[name])
    for size in choice.step_times:
        assert best <= mean_step(_price(name, size)) + 1e-12
    assert results[rule_name(name)] is rule[name]  # the rule's row kept beside it


def test_the_rule_is_not_always_the_best_static_size(chosen) -> None:
    rule, results, choices = chosen
    rules = {rule_cp_size("hybrid-dp", b, TOPO, CAPACITY) for b in BATCHES}
    assert rules == {2} and choices["hybrid-dp"].size == 4
    assert mean_step(results["hybrid-dp"]) < mean_step(rule["hybrid-dp"])


def test_rows_say_which_size_and_compare_with_the_best_static_te(chosen) -> None:
    _, results, choices = chosen
    rows = {r["builder"]: r for r in summarize(results, choices)}
    te = rows["te-ring-cp"]
    assert te["cp_size"] == choices["te-ring-cp"].size
    assert rows[rule_name("te-ring-cp")]["cp_size"] == "rule"
    assert te["speedup_vs_te"] == pytest.approx(1.0)
    for row in rows.values():
        assert row["speedup_vs_te"] == pytest.approx(te["step_time_s"] / row["step_time_s"])
        rule_te = rows[rule_name("te-ring-cp")]["step_time_s"]
        assert row["speedup_vs_te_rule"] == pytest.approx(rule_te / row["step_time_s"])
