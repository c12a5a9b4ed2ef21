"""Sampled batches placed by the pool, shared by the placement's tests (``test_refine.py``,
``test_local_changes.py``, ``test_whole_docs.py``), and the mark that skips a test of a
compiled loop where numba is not installed.

A batch is drawn as ``scripts/compare_sweep.py --stress`` draws it (zeppelin-C, LLaMA-7B,
documents cut at half the batch); ``fixed-N`` is a batch of documents of N tokens each (the
pool then leaves whole documents without room, and they become rings).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import pytest

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.cost.thresholds import tier_thresholds
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement, TierChoice
from megatron_zeppelin.planner.place.pool import ALL_ORDERS, place_pool
from megatron_zeppelin.planner.place.tiers import TierRules, assign_tiers, chunk_thresholds
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

CAPACITY = 32_768

NEEDS_NUMBA = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None,
    reason="the compiled loops need numba (the fast extra)",
)
"""Skips, test by test, a test of a compiled loop against numpy's where numba is missing."""


@dataclass(frozen=True)
class Batch:
    array: np.ndarray
    topology: Topology
    cost: CostModel
    rules: TierRules
    capacity: int

    def new_loads(self) -> Loads:
        """Empty loads as the search places the pool on: routed, the 2-D scheme allowed."""
        topology = self.topology
        return Loads(topology, self.capacity, self.cost, topology.nics_per_node, two_d=True)


def stress_batch(name: str, gpus: int, fill: float, seed: int, capacity: int = CAPACITY) -> Batch:
    """``fill`` of ``gpus`` GPUs' ``capacity`` drawn from distribution ``name`` (or ``fixed-N``)."""
    topology = get_topology("zeppelin-C", num_nodes=gpus // 8)
    cost = CostModel.default(get_model("llama-7b"), topology)
    tokens = int(fill * gpus * capacity)
    if name.startswith("fixed-"):
        length = int(name.split("-")[1])
        array = np.full(tokens // length, length)
    else:
        lengths = sample_lengths(name, num_tokens=tokens, seed=seed, max_length=tokens // 2)
        array = np.asarray(lengths)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    return Batch(array, topology, cost, rules, capacity)


def pool_placed(batch: Batch, order: int | tuple) -> tuple[list[Placement], int, Loads, TierChoice]:
    """``place_pool`` of ``batch`` in ``order`` (an index of ``pool.ALL_ORDERS``, or the order
    itself) on fresh loads: its placements, capacity promotions, loads and stage-1 tiers."""
    first, scale, cross = ALL_ORDERS[order] if isinstance(order, int) else order
    loads = batch.new_loads()
    choice = assign_tiers(batch.array, loads, batch.rules)
    placements, promotions = place_pool(
        batch.array, choice, loads, batch.rules.chunks[1], first, scale, cross=cross
    )
    return placements, promotions, loads, choice


def assert_same_loads(loads: Loads, want: Loads) -> None:
    """Every GPU's cost, attention and exposed seconds and tokens, bit for bit (the same float
    operations in the same order)."""
    for name in ("cost", "attention", "exposed", "tokens"):
        assert getattr(loads, name) == getattr(want, name), name
