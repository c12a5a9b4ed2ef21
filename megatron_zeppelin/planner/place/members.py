"""Changes to a placed ring, for the pass after the pool placement (``refine.py``).

Where the busiest GPU holds ring shares that no move of a whole document relieves, one of its
rings is placed again (``replace_ring``), or its place in one of them goes to the least loaded
GPU with room for a member's tokens, of its own node (the ring keeps its links) or of any node
(``move_member``). A ring that changes is priced again (``remove_ring``,
``pool_rings.place_on``: one that leaves or joins a node changes its links), and the change is
kept only where every member ends below the busiest load; otherwise ``loads`` are left as they
were. Capacity holds: a new member has room for the most tokens a member of the ring takes, and
a moved ring is kept only where every member (whose place in the zigzag may change with the
ring's order) has room.

Trading places between two rings (the busy GPU taking a lightly loaded GPU's smaller share in
another ring) was measured on the stress batches and left out: it lowered the predicted peak
but scattered the rings over more nodes, and the simulated step got slower.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.place.pool_rings import place_on, place_ring
from megatron_zeppelin.planner.place.ring_options import TOLERANCE, PoolGoal, most_tokens
from megatron_zeppelin.planner.plan.plan import Tier

__all__ = ["move_member", "remove_ring", "replace_ring"]


def _saved(loads: Loads) -> tuple[list, list, list, list]:
    return loads.cost[:], loads.attention[:], loads.exposed[:], loads.tokens[:]


def _restore(loads: Loads, saved: tuple[list, list, list, list]) -> None:
    loads.cost, loads.attention, loads.exposed, loads.tokens = saved


def move_member(
    length: int, placement: Placement, loads: Loads, rank: int, below: float
) -> Placement | None:
    """The ring of ``placement`` with ``rank`` swapped for the least loaded GPU with room for a
    member's tokens, of ``rank``'s node or of any node, whichever ends the ring's busiest member
    lower, where every member then ends below ``below`` and within capacity; else ``None``,
    ``loads`` unchanged."""
    saved = _saved(loads)
    k = loads.topology.gpus_per_node
    per_rank = most_tokens(length, len(placement.ring))
    remove_ring(placement, length, loads)
    cost = np.asarray(loads.cost)
    free = (loads.capacity - np.asarray(loads.tokens)) >= per_rank
    free[list(placement.ring)] = False
    start = rank // k * k
    options = set()
    if free.any():
        options.add(int(np.argmin(np.where(free, cost, np.inf))))
    if free[start : start + k].any():
        options.add(start + int(np.argmin(np.where(free, cost, np.inf)[start : start + k])))
    best: tuple[float, Placement, tuple] | None = None
    for other in sorted(options):
        ring = tuple(sorted(other if r == rank else r for r in placement.ring))
        snapshot = loads.snapshot(ring)
        new = place_on(ring, length, loads, False)
        peak = max(loads.cost[r] for r in ring)
        # Listed in rank order, the other members may change places in the zigzag, and with
        # them their tokens: every member's room is checked, not only the new one's.
        fits = all(loads.tokens[r] <= loads.capacity for r in ring)
        if fits and peak < below and (best is None or peak < best[0]):
            best = (peak, new, loads.snapshot(ring))
        loads.restore(snapshot)
    if best is None:
        _restore(loads, saved)
        return None
    loads.restore(best[2])
    return best[1]


def replace_ring(
    doc: int,
    length: int,
    placement: Placement,
    loads: Loads,
    goal: PoolGoal,
    below: float,
    barred: np.ndarray,
) -> Placement | None:
    """``doc``'s ring taken off its GPUs and placed again, not on ``barred`` GPUs
    (``pool_rings.place_ring``: the smallest ring whose every member then ends below ``below``), or
    ``None`` with ``loads`` as they were where no ring does."""
    saved = _saved(loads)
    remove_ring(placement, length, loads)
    goal = replace(goal, target=below / TOLERANCE)
    new = place_ring(doc, length, loads, goal, fallback=False, barred=barred)
    if new is None or new.ring == placement.ring or max(loads.cost[r] for r in new.ring) >= below:
        _restore(loads, saved)
        return None
    return new


def remove_ring(placement: Placement, length: int, loads: Loads) -> None:
    """Take off ``loads`` what ``pool_rings.place_on`` put there for ``placement``: its
    members' loads are measured by adding the ring again onto them emptied (the same prices,
    from the same ``Loads``), and subtracted."""
    ring = placement.ring
    k = loads.topology.gpus_per_node
    nodes = {r // k for r in ring}
    whole = placement.tier == Tier.INTER and len(ring) == k * len(nodes)
    snapshot = loads.snapshot(ring)
    for r in ring:
        loads.cost[r], loads.attention[r], loads.exposed[r], loads.tokens[r] = 0.0, 0.0, 0.0, 0
    place_on(ring, length, loads, whole and loads.two_d is not None)
    added = loads.snapshot(ring)[1]
    loads.restore(snapshot)
    for r, (cost, attention, exposed, tokens) in zip(ring, added):
        loads.cost[r] -= cost
        loads.attention[r] -= attention
        loads.exposed[r] -= exposed
        loads.tokens[r] -= tokens
