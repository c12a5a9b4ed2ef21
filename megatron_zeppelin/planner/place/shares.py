"""A placement with uneven ring shares: documents laid end to end along each node's GPUs.

The pool placement (``pool.py``) gives every member of a ring an equal share, so a ring takes
whole GPUs: a document worth 2.6 GPUs takes 3 at 0.87 of the target each, or 2 at 1.3. Where
every document is a ring, nothing whole is left to fill what the rings leave, and the busiest
GPUs end 6-9% above the mean. A ring's members need not hold equal shares, though: under
``plan.share_spans`` a member computes the ring's attention in proportion to its tokens. Here
documents are laid end to end along each node's GPUs, like words along lines, every GPU taking
one stretch of the target load: a GPU at a boundary holds the end of one document and the
start of the next, each a share sized to what the stretch holds.

1. Each document is priced as work: ``Loads.ring_key`` of the ring it would need at the target,
   times the ring's size, and no less than its tokens' part of a GPU's capacity (so that no GPU
   runs out of room).
2. Documents worth more than a node take whole consecutive nodes and the start of the next.
3. The others go, longest first, to the node with the least work left to take that still holds
   them (best fit).
4. Inside each node, its documents are laid end to end in that order, and each GPU takes what
   lies in its stretch. A member whose share is too small to hide the ring's transfers across
   nodes (``MIN_NIC_SHARE`` of a stretch), or that would hold fewer than 2 tokens, hands its
   share to the ring's other members.

The target is the least one at which every document finds room, bisected between the GPUs' mean work
and ``_MOST`` times it; where numba is installed, each step of the bisection lays the batch out in
one compiled call (``loops/shares_line.py``: the same members and tokens). ``search`` tries this
placement where every document is a ring (``pool.pool_orders``' ring orders) and keeps it only where
the simulator times it faster than the others. Measured on the stress batches, it wins where
documents are few and all long (uniform-long at fill 0.5) and loses where GPUs are nearly full of
tokens: each GPU's tokens then bind as much as its seconds, and one line cannot even out both.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from functools import partial

import numpy as np

from megatron_zeppelin.planner.loops import shares_line
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.plan.plan import Tier

__all__ = ["MIN_NIC_SHARE", "place_shares"]

MIN_NIC_SHARE = 0.3
"""The least share of a ring across nodes a member keeps, as a part of a GPU's target load:
with less, its own compute no longer hides the blocks that reach it over the NICs."""
MIN_SHARE = 0.1
"""A member with less than this part of a GPU's target load hands it to the others where each
of them gains at most ``_SPREAD`` of a GPU's load: it adds a ring step (and the whole document's
K/V on its links) for little compute."""
_SPREAD = 0.01
_ROOM = 0.98
"""Part of a GPU's capacity the line fills with tokens (the rest absorbs rounding)."""
_MOST = 1.5
"""The highest target tried, as a multiple of the GPUs' mean work."""
_BISECTIONS = 12
"""Steps of the bisection for the least target that places every document."""

_Laid = list[tuple[tuple[int, ...], tuple[int, ...] | None]]
"""Per document: its ring and each member's tokens (``None``: whole on one GPU)."""


def place_shares(array: np.ndarray, loads: Loads) -> list[Placement] | None:
    """Every document of ``array`` laid along the GPUs (module docstring), its work added to
    ``loads`` (empty on entry); ``None`` where no target up to ``_MOST`` times the mean places
    them all within capacity."""
    lengths = [int(length) for length in array.tolist()]
    whole = [loads.ring_key(length, 1, "nvlink") for length in lengths]
    mean = sum(whole) / loads.topology.world_size
    lay = _compiled_lay(lengths, whole, loads) or partial(_lay, lengths, whole, loads)
    laid = lay(_MOST * mean)
    if laid is None:
        return None
    low, high = 1.0, _MOST
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        trial = lay(middle * mean)
        if trial is None:
            low = middle
        else:
            high, laid = middle, trial
    k = loads.topology.gpus_per_node
    placements = []
    for length, (ring, tokens) in zip(lengths, _listed(laid)):
        if tokens is None:
            loads.add_local(ring[0], length)
            placements.append(Placement(Tier.LOCAL, ring))
            continue
        across = len({rank // k for rank in ring}) > 1
        loads.add_shares(ring, length, tokens, "nic" if across else "nvlink")
        placements.append(Placement(Tier.INTER if across else Tier.INTRA, ring, tokens))
    return placements


def _compiled_lay(
    lengths: list[int], whole: list[float], loads: Loads
) -> Callable[[float], shares_line.Laid | None] | None:
    """``_lay`` of these documents as one compiled call per target (``loops/shares_line.py``:
    the same members and tokens), or ``None`` without numba."""
    if not shares_line.compiled():
        return None
    topology = loads.topology
    return partial(
        shares_line.lay,
        np.asarray(lengths, dtype=np.int64),
        np.asarray(whole, dtype=np.float64),
        k=topology.gpus_per_node,
        num_nodes=topology.num_nodes,
        room=_ROOM * loads.capacity,
        capacity=loads.capacity,
        terms=loads.ring_terms(),
        shares=(MIN_SHARE, MIN_NIC_SHARE, _SPREAD),
    )


def _listed(laid: _Laid | shares_line.Laid) -> _Laid:
    """``_lay``'s answer, from the compiled loop's arrays where it came from there."""
    if isinstance(laid, list):
        return laid
    offsets, ranks, tokens = (column.tolist() for column in laid)
    out: _Laid = []
    for start, stop in zip(offsets, offsets[1:]):
        if stop - start == 1:
            out.append(((ranks[start],), None))
        else:
            out.append((tuple(ranks[start:stop]), tuple(tokens[start:stop])))
    return out


def _lay(lengths: list[int], whole: list[float], loads: Loads, target: float) -> _Laid | None:
    """Steps 1-4 of the module docstring at ``target`` seconds per GPU; ``None`` where a
    document finds no room (no node left, or a GPU over capacity)."""
    topology = loads.topology
    k, num_nodes = topology.gpus_per_node, topology.num_nodes
    node_work = k * target
    room = _ROOM * loads.capacity
    work = [
        max(_work(length, cost, loads, target), target * length / room)
        for length, cost in zip(lengths, whole)
    ]
    order = sorted(range(len(lengths)), key=lambda d: (-work[d], d))
    content: list[list[tuple[int, float]]] = [[] for _ in range(num_nodes)]
    left = [node_work] * num_nodes
    tolerance = 1e-9 * node_work
    after = 0  # the first node no document worth more than a node has taken
    # The nodes by the work left to take (ties: the lower node), made once the documents worth
    # more than a node (the first in ``order``) have their nodes: each other document's best fit
    # is then a search, not a pass over every node.
    by_left: list[tuple[float, int]] | None = None
    for doc in order:
        amount = work[doc]
        if amount > node_work + tolerance:
            full = int(amount // node_work)
            extra = amount - full * node_work
            if extra <= tolerance:
                extra = 0.0
            if after + full + (extra > 0) > num_nodes:
                return None
            for node in range(after, after + full):
                content[node].append((doc, node_work))
                left[node] = 0.0
            after += full
            if extra > 0:
                content[after].append((doc, extra))
                left[after] -= extra
                after += 1
            continue
        if by_left is None:
            by_left = sorted(zip(left, range(num_nodes)))
        at = bisect.bisect_left(by_left, (amount - tolerance, -1))  # the least left that holds it
        if at == len(by_left):
            return None
        _, node = by_left.pop(at)
        content[node].append((doc, amount))
        left[node] -= amount
        bisect.insort(by_left, (left[node], node))
    stretches: list[list[tuple[int, float]]] = [[] for _ in lengths]
    for node, docs in enumerate(content):
        position = 0.0
        for doc, amount in docs:
            start, end = position, position + amount
            position = end
            first = min(k - 1, int(start / target))
            last = min(k - 1, max(first, math.ceil(end / target - 1e-9) - 1))
            for gpu in range(first, last + 1):
                share = min(end, (gpu + 1) * target) - max(start, gpu * target)
                if share > tolerance:
                    stretches[doc].append((node * k + gpu, share))
    laid: _Laid = []
    tokens_on = [0] * topology.world_size
    for length, members in zip(lengths, stretches):
        if len(members) == 1:  # whole on one GPU: most documents (``_members``' answer)
            rank = members[0][0]
            tokens_on[rank] += length
            laid.append(((rank,), None))
            continue
        ring, tokens = _members(length, members, k, target)
        for rank, num in zip(ring, tokens or (length,)):
            tokens_on[rank] += num
        laid.append((ring, tokens))
    if max(tokens_on) > loads.capacity:
        return None
    return laid


def _work(length: int, whole: float, loads: Loads, target: float) -> float:
    """A document's work as a ring of the size its work at ``target`` needs (``whole``: on one
    GPU): the members' ``ring_key`` times their number."""
    size = max(1, math.ceil(whole / target))
    if size == 1:
        return whole
    link = "nvlink" if size <= loads.topology.gpus_per_node else "nic"
    return size * loads.ring_key(length, size, link, flat=True)


def _members(
    length: int, members: list[tuple[int, float]], k: int, target: float
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """A document's ring and its members' tokens from its stretches ``(rank, share)``:
    members whose share is too small (module docstring, step 4) hand it to the others."""
    ranks = [rank for rank, _ in members]
    shares = [share for _, share in members]
    while len(ranks) > 1:
        across = len({rank // k for rank in ranks}) > 1
        least = min(range(len(shares)), key=shares.__getitem__)
        tokens = _split(length, shares)
        smallest = shares[least]
        spare = smallest < MIN_SHARE * target and smallest <= _SPREAD * target * (len(ranks) - 1)
        if min(tokens) >= 2 and not spare and not (across and smallest < MIN_NIC_SHARE * target):
            return tuple(ranks), tuple(tokens)
        small = min(range(len(tokens)), key=lambda i: (tokens[i], shares[i]))
        del ranks[small], shares[small]
    return (ranks[0],), None


def _split(length: int, shares: list[float]) -> list[int]:
    """``length`` tokens in proportion to ``shares``, rounded down and the rest given to the
    largest remainders."""
    total = sum(shares)
    exact = [length * share / total for share in shares]
    tokens = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: tokens[i] - exact[i])
    for i in order[: length - sum(tokens)]:
        tokens[i] += 1
    return tokens
