"""Megatron-LM's dynamic (hybrid) context-parallel schedule, made from group records and heaps.

megatron-core's ``BalancedCPScheduler.get_groups_and_subsamples`` (0.16,
``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``) decides, for one global batch, which
documents every DPxCP rank runs in every scheduling group. It rescans all ranks for each
document it places, so 10^4 documents on 1024 ranks take close to a minute. This module makes
the same decisions from one record per rank group: every rank of a group holds the same
documents and the same load, so the scans over ranks become heaps over groups.
``tests/test_megatron_schedule.py`` checks the output against megatron-core's own scheduler on
hundreds of random batches; ``megatron_core_schedule`` calls the real one.

The rules, as megatron-core applies them (the baseline reproduces Megatron as it runs, so rules
that look accidental are kept):

* A document of ``L`` tokens needs ``size(L) = 2^ceil(log2(L / capacity))`` ranks (at least 1,
  in floating point as Megatron computes it) and weighs ``L^2 / size(L)`` on each of them.
* Documents are taken longest first (ties in batch order). Each scheduling group is made from
  what the previous ones left, in the order left.
* **Buckets.** The documents are cut, in order, into consecutive buckets, as many as there are
  distinct sizes (``k``): a bucket closes before a document that would take it past 1.1 times the
  mean weight per bucket, or when the documents left number at most ``k - 2 x buckets closed``.
* **Placement.** The head of the first bucket that can be placed goes next: it can be placed if a
  rank group of its size exists or enough ranks are still free. Enough free ranks: it opens a new
  group on the lowest free ranks. Otherwise: the least loaded group of its size (ties: the oldest).
  Once a document smaller than the first one placed has gone in, the scheduling group closes as
  soon as the heaviest rank is within 5 % of the lightest (free ranks weigh 0); it also closes
  when no head can be placed.
* **Trim.** While no rank is free and the ranks are more than 5 % apart, the last document of the
  heaviest group (the first such group; one holding a single document stops the trim) goes back
  to the documents left, at their end, if that narrows the gap.
* **Spread.** While ranks are free, the oldest of the smallest groups doubles (to the world size
  at most), the groups after it moving up. Where the free ranks are too few for that, megatron-core
  fails (an index past the last rank); here that is a ``ValueError``.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections import deque
from dataclasses import dataclass, field

Doc = tuple[int, int]  # (sequence id, length)

BALANCE_SLACK = 0.05
"""A scheduling group is balanced when its heaviest rank is within this fraction of the
lightest (megatron-core's ``delta``)."""
BUCKET_SLACK = 1.1
"""A bucket closes before a document that would take it past this multiple of the mean."""


def gpus_needed(length: int, capacity: int) -> int:
    """Ranks Megatron gives a document: ``ceil(L / capacity)`` up to a power of two, as megatron-
    core computes it (``log2`` of the float ratio)."""
    exponent = math.ceil(math.log2(length / capacity))
    return 1 << exponent if exponent > 0 else 1


def workload(length: int, capacity: int) -> float:
    """Megatron's per-rank weight of a document on its group: ``L^2 / size``."""
    return (length * length) / gpus_needed(length, capacity)


@dataclass
class CPGroup:
    """Consecutive ranks ``start .. start + size - 1`` running ``docs`` one after another."""

    start: int
    size: int
    docs: list[Doc] = field(default_factory=list)
    load: float = 0.0
    """Each member rank's summed weight (Megatron's ``exec_times``; all members are equal)."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))


def check_fits(lengths: list[int], world: int, capacity: int) -> None:
    """``ValueError`` unless every document's group fits the cluster (megatron-core would fail an
    assertion deep inside instead)."""
    longest = max(lengths)
    if gpus_needed(longest, capacity) > world:
        raise ValueError(
            f"a document of {longest} tokens needs a power-of-two CP group larger than the "
            f"{world} GPUs at {capacity} tokens per GPU: raise --capacity"
        )


def balanced_cp_schedule(lengths: list[int], world: int, capacity: int) -> list[list[CPGroup]]:
    """Megatron's scheduling groups for one batch, each a list of rank groups covering every
    rank (module docstring). Sequence ids are indices into ``lengths``."""
    check_fits(lengths, world, capacity)
    docs = sorted(enumerate(lengths), key=lambda d: -d[1])
    rounds = []
    while docs:
        groups, docs = _scheduling_group(docs, world, capacity)
        rounds.append(groups)
    return rounds


def per_rank_ids(groups: list[CPGroup], world: int) -> list[list[int]]:
    """One scheduling group as megatron-core returns it: per rank, its documents' ids."""
    ids: list[list[int]] = [[] for _ in range(world)]
    for group in groups:
        held = [seq_id for seq_id, _ in group.docs]
        for rank in group.ranks:
            ids[rank] = list(held)
    return ids


def _scheduling_group(
    docs: list[Doc], world: int, capacity: int
) -> tuple[list[CPGroup], list[Doc]]:
    """One scheduling group and the documents it leaves, in their order."""
    placing = _Placement(world, capacity)
    leftovers = placing.run(_buckets(docs, capacity))
    if placing.next_free == world:
        _trim(placing.groups, leftovers, capacity)
    _spread(placing.groups, world - placing.next_free, world)
    return placing.groups, leftovers


def _buckets(docs: list[Doc], capacity: int) -> list[deque[Doc]]:
    """Consecutive runs of ``docs``, one per distinct size, of about equal weight."""
    sizes = [gpus_needed(n, capacity) for _, n in docs]
    weights = [(n * n) / size for (_, n), size in zip(docs, sizes)]
    num_buckets = len(set(sizes))
    limit = sum(weights) / num_buckets * BUCKET_SLACK
    buckets: list[deque[Doc]] = []
    current: list[Doc] = []
    current_weight = 0.0
    for i, (doc, weight) in enumerate(zip(docs, weights)):
        # Megatron counts a closed bucket twice here (one bucket fewer to make, one more made).
        if current and (
            current_weight + weight > limit or len(docs) - i <= num_buckets - 2 * len(buckets)
        ):
            buckets.append(deque(current))
            current, current_weight = [], 0.0
        current.append(doc)
        current_weight += weight
    if current:
        buckets.append(deque(current))
    return buckets


class _Placement:
    """The placement loop: groups in rank order, and per size a heap of ``(load, index)``
    entries; an entry whose load is no longer its group's is stale and dropped when met."""

    def __init__(self, world: int, capacity: int) -> None:
        self.world, self.capacity = world, capacity
        self.groups: list[CPGroup] = []
        self.next_free = 0  # ranks from here on belong to no group
        self.by_size: dict[int, list[tuple[float, int]]] = {}
        self.lightest: list[tuple[float, int]] = []  # every group
        self.heaviest = 0.0  # loads only grow while placing

    def run(self, buckets: list[deque[Doc]]) -> list[Doc]:
        first_size = None
        check_balance = False
        while buckets:
            index = self._placeable(buckets)
            if index is None:
                break
            doc = buckets[index].popleft()
            size = gpus_needed(doc[1], self.capacity)
            first_size = first_size or size
            self._place(doc, size)
            while buckets and not buckets[0]:
                buckets.pop(0)
            check_balance = check_balance or size < first_size
            if check_balance and buckets and self._balanced():
                break
        return [doc for bucket in buckets for doc in bucket]

    def _placeable(self, buckets: list[deque[Doc]]) -> int | None:
        free = self.world - self.next_free
        for index, bucket in enumerate(buckets):
            if bucket:
                size = gpus_needed(bucket[0][1], self.capacity)
                if size in self.by_size or free >= size:
                    return index
        return None

    def _place(self, doc: Doc, size: int) -> None:
        if self.world - self.next_free >= size:  # free ranks weigh 0: a new group wins
            index = len(self.groups)
            self.groups.append(CPGroup(self.next_free, size))
            self.next_free += size
        else:
            index = _top(self.by_size[size], self.groups)
        group = self.groups[index]
        group.docs.append(doc)
        group.load += workload(doc[1], self.capacity)
        entry = (group.load, index)
        heapq.heappush(self.by_size.setdefault(size, []), entry)
        heapq.heappush(self.lightest, entry)
        self.heaviest = max(self.heaviest, group.load)

    def _balanced(self) -> bool:
        low = 0.0
        if self.next_free == self.world:
            low = self.groups[_top(self.lightest, self.groups)].load
        return self.heaviest - low <= BALANCE_SLACK * self.heaviest


def _top(heap: list[tuple[float, int]], groups: list[CPGroup]) -> int:
    """The least loaded group in ``heap`` (ties: the oldest), dropping stale entries."""
    while heap[0][0] != groups[heap[0][1]].load:
        heapq.heappop(heap)
    return heap[0][1]


def _trim(groups: list[CPGroup], leftovers: list[Doc], capacity: int) -> None:
    """Send back the heaviest group's last document while that narrows the gap between the
    heaviest and lightest ranks (every rank is in a group here)."""
    loads = [group.load for group in groups]
    while True:
        high, low = max(loads), min(loads)
        gap = high - low
        if gap <= BALANCE_SLACK * high or low == 0:
            return
        index = loads.index(high)  # the lowest ranks at the maximum
        group = groups[index]
        if len(group.docs) <= 1:
            return
        doc = group.docs[-1]
        before = loads[index]
        loads[index] = before - workload(doc[1], capacity)
        if max(loads) - min(loads) >= gap:
            loads[index] = before
            return
        group.docs.pop()
        group.load = loads[index]
        leftovers.append(doc)


def _spread(groups: list[CPGroup], free: int, world: int) -> None:
    """Double the oldest smallest group until no rank is free; then lay the groups end to end
    from rank 0 in their order."""
    by_size: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        by_size.setdefault(group.size, []).append(index)  # indices ascend: already heaps
    while free > 0:
        size = min(s for s, heap in by_size.items() if heap)
        grown = min(2 * size, world)
        if grown - size > free:
            raise ValueError(
                f"Megatron's dynamic CP scheduler cannot spread this batch over {world} GPUs "
                f"(a group of {size} would grow to {grown} with {free} GPUs free); use a "
                f"power-of-two number of GPUs"
            )
        index = heapq.heappop(by_size[size])
        heapq.heappush(by_size.setdefault(grown, []), index)
        groups[index].size = grown
        free -= grown - size
    start = 0
    for group in groups:
        group.start = start
        start += group.size


class _GroupOfSize:
    """What ``BalancedCPScheduler`` reads of its DPxCP process group: only ``size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def megatron_core_schedule(lengths: list[int], world: int, capacity: int) -> list[list[list[int]]]:
    """megatron-core's own ``BalancedCPScheduler`` on the batch, called as is: per scheduling
    group, per rank, the documents' ids (``ValueError`` if megatron-core is not installed)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core warns about missing TE/apex
            # lazy: megatron-core imports torch and takes seconds to load; only this check asks it.
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError:
        raise ValueError(
            "megatron-core is not installed: install it to run its own scheduler, or use the "
            "project's (the default)"
        ) from None
    check_fits(lengths, world, capacity)
    scheduler = BalancedCPScheduler(capacity, _GroupOfSize(world))
    _, sample_id_groups = scheduler.get_groups_and_subsamples(
        list(enumerate(lengths)),
        None,  # the config argument is unused
    )
    return sample_id_groups
