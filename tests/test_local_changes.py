"""Tier: pure. The refinement's local changes compiled by numba (``planner/loops/local_changes.py``)
against numpy's, a round at a time (``refine._NumpyRounds``): the same changes, in the same
order, to the last bit of every GPU's load, so a plan is the same with numba or without.

Skipped where numba is not installed (the ``fast`` extra); the numpy path is what the rest of
the suite then runs.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from pool_batches import CAPACITY, NEEDS_NUMBA, assert_same_loads, pool_placed, stress_batch

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.loops import local_changes
from megatron_zeppelin.planner.place import refine as refine_module
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.place.pool import pool_goal
from megatron_zeppelin.planner.place.refine import refine
from megatron_zeppelin.planner.plan.plan import Tier
from megatron_zeppelin.topology.presets import get_topology

pytestmark = [pytest.mark.pure, NEEDS_NUMBA]


def _placed(name: str, gpus: int, fill: float, seed: int, order: int):  # noqa: ANN202
    """A pool placement of a sampled batch, before its refinement."""
    batch = stress_batch(name, gpus, fill, seed, CAPACITY)
    placements, _, loads, choice = pool_placed(batch, order)
    goal = pool_goal(batch.array, loads, batch.rules.chunks[1])
    return batch.array, placements, loads, choice.attention, goal


def _both(monkeypatch: pytest.MonkeyPatch, args: tuple, rounds: int, **kwargs):  # noqa: ANN202
    """``refine`` on two copies of ``args``: compiled, then with numpy; each copy's placements,
    loads and change count."""
    out = []
    for jit in (True, False):
        array, placements, loads, attention, goal = copy.deepcopy(args)
        monkeypatch.setattr(refine_module, "compiled", lambda jit=jit: jit)
        made = refine(array, placements, loads, attention, rounds, goal, **kwargs)
        out.append((placements, loads, made))
    return out


def _assert_same(compiled, numpy) -> None:  # noqa: ANN001
    (placements, loads, made), (want_placements, want_loads, want_made) = compiled, numpy
    assert made == want_made
    assert placements == want_placements
    assert_same_loads(loads, want_loads)


@pytest.mark.parametrize(
    ("name", "gpus", "fill", "seed", "order"),
    [
        ("wikipedia", 64, 0.95, 0, 0),
        ("prolong", 64, 0.95, 1, 3),
        ("wlbllm", 32, 0.95, 0, 7),
        ("lognormal", 32, 0.5, 1, 1),
        ("mixture", 64, 0.95, 2, 2),
        ("sft-bimodal", 32, 0.95, 0, 5),
        ("power-law", 64, 0.95, 1, 4),
    ],
)
@pytest.mark.parametrize("light", [16, 1 << 10])
def test_compiled_rounds_make_numpys_changes(
    monkeypatch: pytest.MonkeyPatch, name: str, gpus: int, fill: float, seed: int, order: int,
    light: int,
) -> None:  # fmt: skip
    """The pool's refinement (few light GPUs, rings placed again where the busiest GPU has no
    local change) and the second refinement's (every GPU light, ``search._retime``)."""
    args = _placed(name, gpus, fill, seed, order)
    compiled, numpy = _both(monkeypatch, args, 4 * gpus, light=light)
    assert numpy[2] > 0, "nothing to compare: the batch needs no change"
    _assert_same(compiled, numpy)


def test_compiled_rounds_past_the_log_and_with_full_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log shorter than the rounds (the loop is called again) and rows of documents that
    fill up as documents move (the rows are widened, and the loop goes on): the same changes."""
    monkeypatch.setattr(local_changes, "_CHUNK", 3)
    monkeypatch.setattr(local_changes, "_SPARE", 0)
    args = _placed("wikipedia", 32, 0.5, 3, 0)
    compiled, numpy = _both(monkeypatch, args, 400)
    assert numpy[2] > 6
    _assert_same(compiled, numpy)


def test_compiled_rounds_keep_ties_as_numpy_breaks_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents of a few lengths on GPUs of equal loads: moves and swaps tie on their peaks
    everywhere, and the first GPU listed, the first document, the lowest rank win alike."""
    topology = get_topology("zeppelin-C", num_nodes=2)
    cost = CostModel.default(get_model("llama-7b"), topology)
    rng = np.random.default_rng(0)
    array = rng.choice([512, 1024, 2048], size=400)
    loads = Loads(topology, 20_000, cost)
    attention = np.asarray([loads.ring_seconds(int(n), 1) for n in array])
    # Half the GPUs get four times the documents of the others, in a repeating pattern.
    where = [(i % 40) // 4 if i % 40 < 32 else 8 + (i % 8) for i in range(len(array))]
    where = [w % topology.world_size for w in where]
    placements = [Placement(Tier.LOCAL, (r,)) for r in where]
    for rank, length, seconds in zip(where, array.tolist(), attention.tolist()):
        loads.add_local(rank, length, seconds)
    args = (array, placements, loads, attention, None)
    for light in (2, 16):
        compiled, numpy = _both(monkeypatch, args, 500, light=light)
        assert numpy[2] > 0
        _assert_same(compiled, numpy)


@pytest.mark.parametrize("seed", range(20))
def test_compiled_light_gpus_are_numpys(seed: int) -> None:
    """The compiled choice of the least loaded GPUs (``_least``: by load, then rank) against
    ``light_gpus``, with many equal loads and GPUs holding nothing."""
    assert local_changes.compiled()
    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 300))
    cost = rng.choice([0.0, 1.0, 1.0 + 2**-52, 2.0, 3.5], size=world)
    count = rng.integers(0, 3, size=world)
    light = int(rng.integers(0, world + 2))
    holders = np.where(count > 0, cost, np.inf)
    least = local_changes._least(holders, min(light + 1, world))  # compiled once asked
    got = least[(least != 0) & (count[least] > 0)]
    assert np.array_equal(got, local_changes.light_gpus(cost, count, 0, light))


@pytest.mark.parametrize("seed", range(40))
def test_order_kept_after_two_values_change_is_a_stable_sort(seed: int) -> None:
    """``_reorder`` (each changed index walked to its place from where it stood) against a fresh
    stable argsort, with ties, GPUs that empty (``inf``), two indices side by side or that cross
    each other, and where each stands kept in step; and ``_busiest`` (from the end of the order)
    against ``np.argmax``."""
    assert local_changes.compiled()
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 70))
    values = rng.choice([0.5, 1.0, 1.5, 2.0, np.inf], size=size)
    order = np.argsort(values, kind="stable").astype(np.int64)
    at = np.argsort(order).astype(np.int64)
    for _ in range(40):
        if rng.random() < 0.3:  # neighbours in the order
            first = int(rng.integers(0, size - 1))
            one, other = order[first], order[first + 1]
        else:
            one, other = rng.choice(size, size=2, replace=False)
        values[one], values[other] = rng.choice([0.25, 1.0, 1.75, 2.5, np.inf], size=2)
        local_changes._reorder(values, order, at, int(one), int(other))
        assert order.tolist() == np.argsort(values, kind="stable").tolist()
        assert at.tolist() == np.argsort(order).tolist()
        finite = np.where(np.isfinite(values), values, -1.0)
        assert local_changes._busiest(finite, np.argsort(finite, kind="stable")) == np.argmax(
            finite
        )


@pytest.mark.parametrize("seed", range(40))
def test_moves_go_where_a_pass_over_every_gpu_sends_them(seed: int) -> None:
    """``_moves``, one walk along the GPUs by load for every document of the busiest GPU,
    against a pass over every GPU in rank order for each: with loads whose sums with a
    document's seconds round alike (a lower rank a little more loaded ends at the very same
    sum, and takes it), GPUs short of room for some documents and not others, documents of one
    length, and some no GPU has room for."""
    assert local_changes.compiled()
    rng = np.random.default_rng(seed)
    world, count = int(rng.integers(2, 80)), int(rng.integers(1, 12))
    cost = rng.choice([0.0, 2.0**-60, 2.0**-58, 0.25, 0.25 + 2.0**-55, 1.0], size=world)
    tokens = rng.integers(0, 10, size=world)
    capacity, busiest = 10, int(rng.integers(world))
    lengths = rng.integers(0, 12, size=count)
    work = rng.choice([1.0, 0.5, 2.0**-3], size=count)
    mine = np.arange(count, dtype=np.int64)
    by_load = np.argsort(cost, kind="stable").astype(np.int64)
    ends, ats = np.empty(count), np.empty(count, dtype=np.int64)
    local_changes._moves(
        cost, tokens, by_load, busiest, mine, count, lengths, work, capacity, ends, ats
    )
    for i in range(count):
        want_end, want_at = np.inf, -1
        for r in range(world):
            fits = tokens[r] <= capacity - lengths[i]
            if r != busiest and fits and cost[r] + work[i] < want_end:
                want_end, want_at = cost[r] + work[i], r
        assert (ends[i], ats[i]) == (want_end, want_at)
