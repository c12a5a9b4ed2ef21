"""Bad planner input fails early with a message that says what to change.

Tier: pure.
"""

from __future__ import annotations

import pytest

from megatron_zeppelin.planner.baselines.distributions import (
    DISTRIBUTIONS,
    read_lengths_file,
    sample_lengths,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

TOPO = get_topology("zeppelin-C", num_nodes=2)
COST = CostModel.default(get_model("llama-7b"), TOPO)


def _plan(lengths, capacity=10_000, **options):
    return plan_batch(
        lengths,
        topology=TOPO,
        cost_model=COST,
        capacity=capacity,
        options=PlannerOptions(**options),
    )


def test_empty_batch():
    with pytest.raises(ValueError, match="empty"):
        _plan([])


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_non_positive_or_non_integer_length_names_document(bad):
    with pytest.raises(ValueError, match="document 1 has length"):
        _plan([10, bad, 20])


def test_document_longer_than_cluster_names_it_and_capacity():
    cluster = 16 * 1000
    with pytest.raises(ValueError, match=rf"document 2 has {cluster + 1} tokens.*{cluster}"):
        _plan([5, 5, cluster + 1], capacity=1000)


def test_batch_over_cluster_capacity():
    with pytest.raises(ValueError, match="more than the cluster capacity"):
        _plan([900] * 20, capacity=1000)


def test_capacity_and_thresholds_checked():
    with pytest.raises(ValueError, match="capacity"):
        _plan([10], capacity=0)
    with pytest.raises(ValueError, match="capacity"):
        plan_batch([10], topology=TOPO, cost_model=COST)
    with pytest.raises(ValueError, match="thresholds"):
        _plan([10], thresholds=(500, 100))
    with pytest.raises(ValueError, match="thresholds"):
        _plan([10], thresholds="fast")


def test_options_capacity_overrides_argument():
    plan = plan_batch(
        [1000] * 16, topology=TOPO, cost_model=COST, options=PlannerOptions(capacity=2000)
    )
    assert plan.capacity == 2000


def test_unknown_model_and_distribution():
    with pytest.raises(ValueError, match="known presets"):
        get_model("llama-9000b")
    with pytest.raises(ValueError, match="known"):
        sample_lengths("books", num_tokens=100, seed=0)
    with pytest.raises(ValueError, match="num_tokens"):
        sample_lengths(DISTRIBUTIONS[0], num_tokens=0, seed=0)


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("12\nabc\n", 2, "not an integer"),
        ("# c\n\n5\n0\n", 4, "at least 1"),
        ("3\n-2 # x\n", 2, ""),
    ],
)
def test_malformed_lengths_file_names_line(tmp_path, text, line, what):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"lengths.txt, line {line}: .*{what}"):
        read_lengths_file(str(path))


def test_lengths_file_comments_and_blanks(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# header\n10\n\n  20  # trailing\n30\n")
    assert read_lengths_file(str(path)) == [10, 20, 30]
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no document lengths"):
        read_lengths_file(str(tmp_path / "empty.txt"))


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_sampled_lengths_sum_exactly_and_respect_max_length(name):
    lengths = sample_lengths(name, num_tokens=200_000, seed=3, max_length=8192)
    assert sum(lengths) == 200_000
    assert min(lengths) >= 1 and max(lengths) <= 8192
    assert lengths == sample_lengths(name, num_tokens=200_000, seed=3, max_length=8192)
    assert lengths != sample_lengths(name, num_tokens=200_000, seed=4, max_length=8192)
