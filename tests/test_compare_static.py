"""The best static CP size of TE ring CP, the all-gather CP and hybrid DP in ``zeppelin compare``:
chosen from the sizes that hold every batch, and never slower than any one of them."""

from __future__ import annotations

import pytest

from megatron_zeppelin.commands.compare_static import best_static, cp_label, mean_step, rule_name
from megatron_zeppelin.commands.simulate import compare_batches, summarize
from megatron_zeppelin.planner.baselines.baselines import (
    STATIC_CP_BASELINES,
    build_baseline,
    rule_cp_size,
    static_cp_sizes,
)
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import zigzag_loads
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPO = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2)
CAPACITY = 8192
COST = CostModel.default(get_model("llama-7b"), TOPO)
# Two long-tail batches whose longest documents need a group of 2 (the rule's size in both); on
# the second hybrid DP runs faster with its long documents over 4 GPUs.
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
    for lengths in BATCHES:
        sizes = static_cp_sizes(name, lengths, TOPO, CAPACITY)
        assert sizes == sorted(sizes) and sizes[0] == rule_cp_size(name, lengths, TOPO, CAPACITY)
        for size in sizes:
            assert TOPO.world_size % size == 0 and size & (size - 1) == 0
            assert max(zigzag_loads(max(lengths), size)) <= CAPACITY
            build_baseline(name, lengths, topology=TOPO, capacity=CAPACITY, cp_size=size)
        if sizes[0] > 1 and name != "hybrid-dp":  # the next smaller size cannot hold the longest
            with pytest.raises(ValueError, match="does not fit a CP group"):
                build_baseline(
                    name, lengths, topology=TOPO, capacity=CAPACITY, cp_size=sizes[0] // 2
                )


@pytest.mark.parametrize("name", STATIC_CP_BASELINES)
def test_best_static_is_never_slower_than_any_one_size(chosen, name: str) -> None:
    """On every batch, the size kept is one that holds it, priced, and no size that holds the
    batch (priced here whether or not the sweep stopped before it) runs it faster."""
    rule, results, choices = chosen
    choice = choices[name]
    for i, lengths in enumerate(BATCHES):
        sizes = static_cp_sizes(name, lengths, TOPO, CAPACITY)
        assert choice.sizes[i] in sizes and choice.sizes[i] in choice.step_times[i]
        assert set(choice.step_times[i]) | set(choice.skipped) >= set(sizes)
        best = results[name][i].step_time_s
        assert best == choice.step_times[i][choice.sizes[i]]
        for size in sizes:
            assert best <= _price(name, size)[i].step_time_s + 1e-12
        assert best <= rule[name][i].step_time_s + 1e-12
    assert results[rule_name(name)] is rule[name]  # the rule's row kept beside it


def test_the_rule_is_not_always_the_best_static_size(chosen) -> None:
    """Hybrid DP's rule takes a group of 2 on both batches; the second runs faster on 4."""
    rule, results, choices = chosen
    assert [rule_cp_size("hybrid-dp", b, TOPO, CAPACITY) for b in BATCHES] == [2, 2]
    assert choices["hybrid-dp"].sizes == (2, 4)
    assert results["hybrid-dp"][1].step_time_s < rule["hybrid-dp"][1].step_time_s
    assert mean_step(results["hybrid-dp"]) < mean_step(rule["hybrid-dp"])


def test_a_size_that_holds_no_batch_yet_does_not_end_the_sweep() -> None:
    """One batch needs a group of 8 and the other runs best on 2: the sweep goes on past the
    sizes that only the second holds until the first is planned."""
    long_doc = [4 * CAPACITY + 100, *BATCHES[0][:20]]
    batches = [BATCHES[0], long_doc]
    assert [rule_cp_size("te-ring-cp", b, TOPO, CAPACITY) for b in batches] == [2, 8]

    def price(name: str, size: int) -> list:
        return compare_batches(batches, builders=(name,), cp_sizes={name: size}, **COMMON)[name]

    rule = compare_batches(batches, builders=("te-ring-cp",), **COMMON)
    results, choices = best_static(batches, rule, price, topology=TOPO, capacity=CAPACITY)
    assert choices["te-ring-cp"].sizes[1] == 8
    assert all(not isinstance(r, str) for r in results["te-ring-cp"])


def test_rows_say_which_size_and_compare_with_the_best_static_te(chosen) -> None:
    _, results, choices = chosen
    rows = {r["builder"]: r for r in summarize(results, choices)}
    te = rows["te-ring-cp"]
    assert te["cp_size"] == cp_label(choices["te-ring-cp"])
    assert rows[rule_name("te-ring-cp")]["cp_size"] == "rule"
    assert rows["hybrid-dp"]["cp_size"] == "2/4"
    assert te["speedup_vs_te"] == pytest.approx(1.0)
    for row in rows.values():
        assert row["speedup_vs_te"] == pytest.approx(te["step_time_s"] / row["step_time_s"])
        rule_te = rows[rule_name("te-ring-cp")]["step_time_s"]
        assert row["speedup_vs_te_rule"] == pytest.approx(rule_te / row["step_time_s"])
