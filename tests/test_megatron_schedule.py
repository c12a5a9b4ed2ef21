"""Megatron's dynamic CP schedule as ``megatron_schedule.py`` makes it equals megatron-core's.

megatron-core's ``BalancedCPScheduler.get_groups_and_subsamples`` (0.16.1 in the test
environment) runs as is on the same batches; per scheduling group and per rank, the documents'
ids must be the same lists in the same order (megatron-core's per-rank lengths follow from them).
The batches are drawn to reach every rule: ties, lengths at the edges of a group size, batches
where balance closes a scheduling group early, where a trimmed document comes back longer than
the rest, and GPU counts that are not powers of two.

Tier: pure (megatron-core's scheduler is plain Python; no process group).
"""

from __future__ import annotations

import random

import pytest

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.baselines.megatron_schedule import (
    balanced_cp_schedule,
    gpus_needed,
    megatron_core_schedule,
    per_rank_ids,
)

pytestmark = pytest.mark.pure


@pytest.fixture
def megatron_core() -> None:
    pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")


def _ties(rng: random.Random, n: int, capacity: int, world: int) -> list[int]:
    pool = [rng.randint(1, capacity * world) for _ in range(rng.randint(1, 4))]
    return [rng.choice(pool) for _ in range(n)]


def _size_edges(rng: random.Random, n: int, capacity: int, world: int) -> list[int]:
    """Lengths at a power-of-two multiple of the capacity, or one token either side."""
    edges = [capacity * 2**k + rng.choice((-1, 0, 1)) for k in rng.choices(range(6), k=n)]
    return [max(1, min(length, capacity * world)) for length in edges]


def _long_then_equal(rng: random.Random, n: int, capacity: int, world: int) -> list[int]:
    """A few long documents, then many of nearly one length: balance closes the group early."""
    longest = capacity * world
    long = [rng.randint(min(capacity + 1, longest), longest) for _ in range(rng.randint(1, 3))]
    short = rng.randint(1, capacity)
    return long + [min(short + rng.choice((0, 0, 1)), capacity) for _ in range(n * world)]


def _mixed(rng: random.Random, n: int, capacity: int, world: int) -> list[int]:
    longest = capacity * world
    lengths = [rng.randint(1, capacity) for _ in range(n)]
    lengths += [rng.randint(min(capacity + 1, longest), longest) for _ in range(rng.randint(0, 4))]
    rng.shuffle(lengths)
    return lengths


def _lognormal(rng: random.Random, n: int, capacity: int, world: int) -> list[int]:
    draws = (int(rng.lognormvariate(0, 1.5) * capacity) for _ in range(n))
    return [max(1, min(capacity * world, length)) for length in draws]


SHAPES = (_ties, _size_edges, _long_then_equal, _mixed, _lognormal)


def _random_batch(rng: random.Random) -> tuple[list[int], int, int]:
    shape = rng.choice(SHAPES)
    world = rng.choice((1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128, 256))
    capacity = rng.choice((1, 2, 3, 7, 64, 100, 1000, 4096))
    if shape is _long_then_equal:
        world, n = rng.choice((2, 3, 4, 8, 16)), rng.randint(5, 40)
    else:
        n = rng.choice((1, 2, 3, 5, 10, 30, 100, 300))
    return shape(rng, n, capacity, world), world, capacity


def _ours(lengths: list[int], world: int, capacity: int) -> list[list[list[int]]]:
    return [
        per_rank_ids(groups, world) for groups in balanced_cp_schedule(lengths, world, capacity)
    ]


def _assert_same(lengths: list[int], world: int, capacity: int) -> None:
    """Equal schedules, or both refusing (megatron-core with an ``IndexError`` where too few GPUs
    are free to double a group, which a GPU count that is not a power of two allows)."""
    try:
        theirs = megatron_core_schedule(lengths, world, capacity)
    except IndexError:
        with pytest.raises(ValueError, match="power-of-two number of GPUs"):
            _ours(lengths, world, capacity)
        return
    assert _ours(lengths, world, capacity) == theirs, (world, capacity, lengths)


@pytest.mark.parametrize("seed", range(4))
def test_same_schedule_as_megatron_core_on_random_batches(seed: int, megatron_core) -> None:
    rng = random.Random(seed)
    compared = 0
    while compared < 100:
        lengths, world, capacity = _random_batch(rng)
        if gpus_needed(max(lengths), capacity) <= world:
            _assert_same(lengths, world, capacity)
            compared += 1


@pytest.mark.parametrize(
    ("lengths", "world", "capacity"),
    [
        pytest.param([8192, 4097, 8192], 4, 4096, id="trim-sends-the-last-document-back"),
        pytest.param([1, 1, 1, 2], 3, 1, id="balance-closes-the-group"),
        pytest.param([48, 150, 302], 5, 100, id="first-bucket-cannot-be-placed"),
        pytest.param([1, 5, 7, 4], 5, 3, id="bucket-closes-to-save-documents"),
        pytest.param([3, 11, 19, 1, 19, 3], 2, 20, id="trim-stops-at-exactly-5-percent"),
        pytest.param([10, 5, 5, 2, 3, 14, 6], 4, 10, id="balanced-at-exactly-5-percent"),
        pytest.param([525, 179], 5, 1000, id="too-few-free-gpus-to-double"),
        pytest.param([5000] * 40, 8, 4096, id="equal-lengths"),
    ],
)
def test_same_schedule_as_megatron_core_on_each_rule(
    lengths: list[int], world: int, capacity: int, megatron_core
) -> None:
    _assert_same(lengths, world, capacity)


@pytest.mark.parametrize(
    ("dist", "num_tokens", "world", "capacity"),
    [("wikipedia", 1_500_000, 256, 8192), ("prolong", 2_000_000, 128, 16384)],
)
def test_same_schedule_as_megatron_core_at_scale(
    dist: str, num_tokens: int, world: int, capacity: int, megatron_core
) -> None:
    lengths = sample_lengths(dist, num_tokens=num_tokens, seed=3, max_length=world * capacity)
    _assert_same(lengths, world, capacity)


def test_every_rank_in_one_group_and_every_document_once() -> None:
    rng = random.Random(11)
    for _ in range(50):
        lengths, world, capacity = _random_batch(rng)
        if gpus_needed(max(lengths), capacity) > world or world & (world - 1):
            continue
        placed = []
        for groups in balanced_cp_schedule(lengths, world, capacity):
            assert [r for g in groups for r in g.ranks] == list(range(world))
            for group in groups:
                assert group.docs and all(
                    gpus_needed(n, capacity) <= group.size for _, n in group.docs
                )
                placed += [seq_id for seq_id, _ in group.docs]
        assert sorted(placed) == list(range(len(lengths)))
