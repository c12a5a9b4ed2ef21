"""The baselines' fast choices equal the plain scans they replaced.

``te-ring-cp`` / ``llama3-allgather-cp`` first-fit their samples over an array of all samples'
loads, ``hybrid-dp`` takes the GPU with the fewest tokens from a heap and ``flexsp`` its groups
from per-size heaps. Each test here keeps the straightforward version (every sample, GPU or
group scanned in order for each document, as the builders first did) and asks for the same
documents on the same rings in the same rounds on hundreds of random batches, ties included.

Tier: pure.
"""

from __future__ import annotations

import random

import pytest

from megatron_zeppelin.planner.baselines.baselines import build_baseline, group_size_for
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import zigzag_loads
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

Rounds = list[list[tuple[int, tuple[int, ...]]]]  # per round, (sequence id, ring) by id
TOPOLOGIES = (
    Topology(num_nodes=1, gpus_per_node=4, nics_per_node=1),
    Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2),
    Topology(num_nodes=4, gpus_per_node=8, nics_per_node=4),
)


def _longest_first(docs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return sorted(docs, key=lambda d: (-d[1], d[0]))


def _in_rounds(lengths: list[int], build_round) -> Rounds:
    rounds, docs = [], list(enumerate(lengths))
    while docs:
        placed, docs = build_round(docs)
        rounds.append(sorted(placed))
    return rounds


def _first_fit_scan(lengths: list[int], world: int, capacity: int) -> Rounds:
    """TE's packing: each document into the first sample with room on every rank."""
    cp = group_size_for(max(lengths), capacity, world)
    samples: list[tuple[list[int], list[int]]] = []
    for seq_id, n in _longest_first(list(enumerate(lengths))):
        add = zigzag_loads(n, cp)
        for loads, ids in samples:  # noqa: B007 (the loop leaves the chosen sample bound)
            if all(a + b <= capacity for a, b in zip(loads, add)):
                break
        else:
            loads, ids = [0] * cp, []
            samples.append((loads, ids))
        for i, b in enumerate(add):
            loads[i] += b
        ids.append(seq_id)
    per_round = world // cp
    return [
        sorted(
            (seq_id, tuple(range(g * cp, (g + 1) * cp)))
            for g, (_, ids) in enumerate(samples[k : k + per_round])
            for seq_id in ids
        )
        for k in range(0, len(samples), per_round)
    ]


def _hybrid_dp_scan(lengths: list[int], world: int, capacity: int, cost) -> Rounds:
    """Long documents on the cheapest group with room, short ones on the GPU with fewest
    tokens (lowest rank on ties), found by scanning every GPU."""
    long_docs = [n for n in lengths if n > capacity]
    cp = max(group_size_for(max(long_docs), capacity, world), 2) if long_docs else 1

    def build_round(docs):
        tokens, group_cost = [0] * world, [0.0] * (world // cp)
        placed, left = [], []
        for seq_id, n in _longest_first(docs):
            if n > capacity:
                add = zigzag_loads(n, cp)
                for g in sorted(range(len(group_cost)), key=lambda g: (group_cost[g], g)):
                    ring = tuple(range(g * cp, (g + 1) * cp))
                    if all(tokens[r] + a <= capacity for r, a in zip(ring, add)):
                        for r, a in zip(ring, add):
                            tokens[r] += a
                        group_cost[g] += cost.document_attention_time(n) / cp
                        placed.append((seq_id, ring))
                        break
                else:
                    left.append((seq_id, n))
                continue
            rank = min(range(world), key=lambda r: (tokens[r], r))
            if tokens[rank] + n <= capacity:
                tokens[rank] += n
                placed.append((seq_id, (rank,)))
            else:
                left.append((seq_id, n))
        return placed, left

    return _in_rounds(lengths, build_round)


def _flexsp_scan(lengths: list[int], world: int, capacity: int, cost) -> Rounds:
    """FlexSP's greedy with every group and every aligned block scanned per document."""

    def doc_cost(n: int) -> float:
        return cost.document_attention_time(n) + cost.linear_time(n)

    def fits(group, n: int) -> bool:
        ring, tokens, _ = group
        return all(t + a <= capacity for t, a in zip(tokens, zigzag_loads(n, len(ring))))

    def build_round(docs):
        target = sum(doc_cost(n) for _, n in docs) / world
        free, groups, placed, left = [True] * world, [], [], []
        for seq_id, n in _longest_first(docs):
            size = group_size_for(n, capacity, world)
            same = [g for g in groups if len(g[0]) == size and fits(g, n)]
            best = min(same, key=lambda g: g[2][0], default=None)
            block = next(
                (b for b in range(0, world - size + 1, size) if all(free[b : b + size])), None
            )
            if block is not None and (best is None or best[2][0] + doc_cost(n) / size > target):
                ring = tuple(range(block, block + size))
                for r in ring:
                    free[r] = False
                best = (ring, [0] * size, [0.0])
                groups.append(best)
            elif best is None:
                larger = [g for g in groups if len(g[0]) > size and fits(g, n)]
                best = min(larger, key=lambda g: g[2][0], default=None)
                if best is None:
                    left.append((seq_id, n))
                    continue
            ring, tokens, load = best
            for i, a in enumerate(zigzag_loads(n, len(ring))):
                tokens[i] += a
            load[0] += doc_cost(n) / len(ring)
            placed.append((seq_id, ring))
        return placed, left

    return _in_rounds(lengths, build_round)


def _random_batch(rng: random.Random, capacity: int, world: int) -> list[int]:
    n = rng.choice((1, 3, 10, 30, 80))
    longest = rng.choice((capacity // 2, capacity, 2 * capacity, 4 * capacity))
    longest = min(longest, capacity * world // 2)
    if rng.random() < 0.3:  # few distinct lengths: ties everywhere
        pool = [rng.randint(1, longest) for _ in range(rng.randint(1, 3))]
        return [rng.choice(pool) for _ in range(n)]
    return [rng.randint(1, longest) for _ in range(n)]


def _rounds_of(plans) -> Rounds:
    return [sorted((s.id, s.ring) for s in plan.sequences) for plan in plans]


@pytest.mark.parametrize("name", ["te-ring-cp", "llama3-allgather-cp", "hybrid-dp", "flexsp"])
def test_same_choices_as_the_plain_scan(name: str) -> None:
    rng = random.Random(name)
    for _ in range(200):
        topology = rng.choice(TOPOLOGIES)
        world, capacity = topology.world_size, rng.choice((64, 1000, 4096))
        cost = CostModel.default(get_model("llama-7b"), topology)
        lengths = _random_batch(rng, capacity, world)
        plans = build_baseline(name, lengths, topology=topology, capacity=capacity, cost_model=cost)
        if name == "hybrid-dp":
            expected = _hybrid_dp_scan(lengths, world, capacity, cost)
        elif name == "flexsp":
            expected = _flexsp_scan(lengths, world, capacity, cost)
        else:
            expected = _first_fit_scan(lengths, world, capacity)
        assert _rounds_of(plans) == expected, (name, world, capacity, lengths)
