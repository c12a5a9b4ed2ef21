"""Where a ring of the pool placement may go, and what each of its members then carries.

A document split over ``size`` GPUs can run (``options``):

* on one node over NVLink (``"node"``, ``size`` at most a node's GPUs);
* over part of the GPUs of two nodes or more as a flat ring (``"any"``), only where its pieces
  of ``L / size`` tokens hide a NIC transfer (``PoolGoal.nic_chunk``) or no node holds it:
  ``Loads`` prices each ring alone, and many flat rings of short pieces sharing a node's NICs
  and NVLink ports run slower than it predicts;
* over whole nodes with the 2-D scheme (``"whole"``), where the flat ring's pieces would hide
  their transfers, or, for a document that no such ring brings within the target
  (``wide_two_d``), wherever a node's chunk of ``L / n`` tokens does: a 2-D ring step carries a
  node's chunk (one head group per GPU), not a GPU's piece, and its price (``Loads.ring_key``,
  head all-to-alls included) is what decides. The scheme spans two nodes or more: one node's
  GPUs are the ``"node"`` option.

The pool placement (``pool.py``) and the batch's least load (``least_load.py``) read the same
options (the least load adds the staged placement's rings over whole nodes to them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads, min_ring
from megatron_zeppelin.planner.plan.plan import zigzag_loads

__all__ = [
    "TOLERANCE",
    "PoolGoal",
    "least_member_load",
    "most_tokens",
    "narrowest",
    "options",
    "price",
    "wide_two_d",
]

TOLERANCE = 1.02
"""A ring member may end this far above the target load."""


@dataclass(frozen=True)
class PoolGoal:
    """What the pool placement aims at and may do."""

    target: float
    """The load every GPU should end at (seconds per layer, ``Loads.cost``)."""
    floor: int
    """Tokens every GPU ends up holding (``pool._floor_tokens``)."""
    nic_chunk: int
    """Per-rank tokens below which a ring across nodes stops hiding its transfers
    (``tiers.chunk_thresholds``): smaller pieces cross nodes only where capacity needs it."""
    member_tokens: int
    """The most tokens a ring member takes (``pool._member_tokens``)."""


def price(
    length: int,
    size: int,
    loads: Loads,
    *,
    two_d: bool,
    in_node: bool = True,
    crossing: bool = True,
) -> float:
    """Per-member load of a ring of ``size``: on NVLink inside a node (where it fits one and
    ``in_node``), else across nodes, with the 2-D scheme's price only when asked (it needs whole
    nodes); ``crossing`` as in ``Loads.ring_key`` (the busiest member, by default)."""
    if size <= loads.topology.gpus_per_node and in_node:
        return loads.ring_key(length, size, "nvlink", crossing=crossing)
    return loads.ring_key(length, size, "nic", flat=not two_d, crossing=crossing)


def least_member_load(length: int, size: int, loads: Loads, where: str) -> float:
    """The least a ring of ``size`` at ``where`` (``options``) adds to one member's load: at a
    member whose ring edges stay inside its node; ``options`` gives the most, at a member whose
    edges cross nodes."""
    return price(
        length, size, loads, two_d=where == "whole", in_node=where == "node", crossing=False
    )


def narrowest(length: int, loads: Loads, most: int) -> int:
    """The narrowest ring the pool gives a document: its members take at most ``most`` tokens
    (``PoolGoal.member_tokens``), or where no ring does, at most a GPU's capacity."""
    return max(2, min_ring(length, most) or min_ring(length, loads.capacity) or 2)


def wide_two_d(length: int, loads: Loads, goal: PoolGoal) -> bool:
    """Whether the document may take the 2-D scheme over more nodes than its pieces allow a flat
    ring across (module docstring): where the rings that hide their transfers piece by piece
    (the largest on one node, the largest flat one, and the largest such over whole nodes, the
    least loaded of each kind) all leave their members above the target."""
    k = loads.topology.gpus_per_node
    widest = length // max(1, goal.nic_chunk)  # the largest ring whose pieces hide a transfer
    if loads.two_d is None or widest < k or length // 2 < goal.nic_chunk:
        return False  # no 2-D ring, or a document a node's ring serves well enough
    keys = [loads.ring_key(length, k, "nvlink")]
    if widest > k:
        keys.append(loads.ring_key(length, widest, "nic", flat=True))
    if widest >= 2 * k:
        keys.append(loads.ring_key(length, widest - widest % k, "nic"))
    return min(keys) > goal.target * TOLERANCE


def options(
    length: int, size: int, loads: Loads, goal: PoolGoal, *, wide: bool | None = None
) -> list[tuple[float, str]]:
    """Where a ring of ``size`` may go and its per-member load there (module docstring), in the
    order the pool tries them; ``wide``: ``wide_two_d`` of the document (``None``: worked out
    where it matters)."""
    k = loads.topology.gpus_per_node
    cross = length // size >= goal.nic_chunk or length > k * loads.capacity
    out = []
    if size <= k:
        out.append((price(length, size, loads, two_d=False), "node"))
    if size % k == 0 and size > k and loads.two_d is not None:
        spread = size >= 2 * k and length // (size // k) >= goal.nic_chunk
        if cross or (spread and (wide_two_d(length, loads, goal) if wide is None else wide)):
            out.append((price(length, size, loads, two_d=True), "whole"))
    if cross:
        out.append((price(length, size, loads, two_d=False, in_node=False), "any"))
    return out


# Room for a batch's long documents times the ring sizes priced for each: every order of the
# pool prices them again (a smaller cache lets them push each other out).
@functools.lru_cache(maxsize=1 << 16)
def most_tokens(length: int, size: int) -> int:
    """``max(zigzag_loads(length, size))``, for large rings in array arithmetic (the same cuts:
    ``round`` and ``np.rint`` both round halves to even, and both divide exactly)."""
    if size <= 16:
        return max(zigzag_loads(length, size))
    n = 2 * size
    cuts = np.rint(np.arange(n + 1, dtype=np.int64) * length / n).astype(np.int64)
    front = cuts[1 : size + 1] - cuts[:size]
    back = cuts[n : n - size : -1] - cuts[n - 1 : n - 1 - size : -1]
    return int((front + back).max())
