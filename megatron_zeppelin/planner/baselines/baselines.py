"""Baseline layouts that Zeppelin is compared against, each expressed as ``Plan`` objects.

Every builder takes the documents of one batch (their lengths), a topology and a per-GPU token
capacity and returns a list of plans, one per *round*: rounds run one after another (micro-batches
of gradient accumulation, or Megatron's scheduling groups separated by barriers). Zeppelin fits a
batch in one plan; a baseline that cannot hold every document at once needs more rounds, and the
simulator adds their times. Sequence ids are the documents' indices in the batch.

Assumptions, one per baseline:

* ``te-ring-cp``: TransformerEngine ring context parallelism with a static CP size. Documents are
  packed, longest first, into fixed-length samples of ``cp_size * capacity`` tokens (first fit;
  a document never straddles two samples). Each sample goes to one CP group of ``cp_size``
  consecutive ranks (data parallel across groups) and every document of the sample is split zigzag
  over the whole group, in group-rank order (TE's THD format). Default ``cp_size``: the smallest
  power of two whose group holds the longest document.
* ``llama3-allgather-cp``: the same layout; K/V are all-gathered once over the group before the
  attention kernel instead of travelling around a ring (``AttentionComm.ALLGATHER``).
* ``hybrid-dp``: documents longer than ``threshold`` (default: the capacity) are split zigzag over
  a fixed CP group (``cp_size`` consecutive ranks, the least loaded group by attention cost); every
  shorter document stays whole on the GPU holding the fewest tokens (data parallel).
* ``megatron-dynamic-cp``: Megatron-LM's hybrid/dynamic CP scheduler, megatron-core's
  ``BalancedCPScheduler.get_groups_and_subsamples``: each document gets a power-of-two CP group
  holding at most ``capacity`` tokens per rank, documents are grouped into scheduling groups
  separated by barriers, and inside a group every document is its own forward/backward pass (so
  its plans carry ``meta["execution"] = "sequential"``). Its decisions are made by
  ``megatron_schedule.py`` (the same output as megatron-core's, tested, in a fraction of the
  time); ``scheduler="megatron-core"`` calls megatron-core's own (``meta["scheduler"]`` says
  which ran).
* ``flexsp``: FlexSP-style heterogeneous sequence-parallel groups, greedy instead of a MILP. Each
  document needs a power-of-two group holding it; longest first, a document opens a new aligned
  group of its size while free ranks remain and the least loaded existing group of that size
  would pass the average load, else it joins the least loaded group that is large enough. Group
  sizes follow memory, as Megatron's dynamic CP does (FlexSP's solver also weighs cost): where
  one document's group outlasts every other rank's work, both baselines take that document's
  time on its group, to the microsecond. Groups run concurrently, each packing its documents
  into one ring-attention pass (FlexSP uses all-to-all sequence parallelism; the ring keeps one
  communication model across baselines).

Every baseline runs its linear modules where its attention tokens are (no remapping) and has no
routes: cross-node traffic leaves through each sender's own NIC.

The CP size of the first three is a static choice of the run. The default above is a rule of
thumb; a user tunes it for their data, so comparisons price every size ``static_cp_sizes``
allows and keep the fastest (``commands/compare_static.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from megatron_zeppelin.planner.baselines.megatron_schedule import (
    balanced_cp_schedule,
    megatron_core_schedule,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.plan.plan import (
    AttentionComm,
    Plan,
    SequencePlan,
    Tier,
    TokenRange,
    zigzag_loads,
    zigzag_spans,
)
from megatron_zeppelin.topology.model import Topology

Doc = tuple[int, int]  # (sequence id, length)
Group = tuple[tuple[int, ...], list[int], list[float]]  # ring, tokens per position, cost per rank

BASELINES = ("te-ring-cp", "llama3-allgather-cp", "hybrid-dp", "megatron-dynamic-cp", "flexsp")
BASELINE_KERNELS = {
    "te-ring-cp": "te",
    "llama3-allgather-cp": "te",
    "hybrid-dp": "te",
    "megatron-dynamic-cp": "te",
    "flexsp": "flash",
}
"""The attention kernel each baseline runs as deployed (names of ``attention.kernels.kernels``): the
four that run inside Megatron-LM use TransformerEngine's fused attention (TE's ring and all-gather
CP, and core attention of Megatron's dynamic CP and data-parallel ranks); FlexSP calls flash-attn
2's varlen kernels. ``planner/baselines/kernel_curves.py`` prices each with that kernel's curve."""


# --- shared pieces ---------------------------------------------------------------------------
def _check_inputs(lengths: Sequence[int], topology: Topology, capacity: int) -> list[int]:
    lengths = [int(n) for n in lengths]
    if capacity < 1:
        raise ValueError(f"capacity must be a positive number of tokens, got {capacity}")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError("give at least one document, every length >= 1")
    longest = max(lengths)
    if longest > capacity * topology.world_size:
        raise ValueError(
            f"a document of {longest} tokens does not fit {topology.world_size} GPUs of "
            f"{capacity} tokens each: raise --capacity or add GPUs"
        )
    return lengths


def _pow2_at_least(n: float) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def group_size_for(length: int, capacity: int, world_size: int) -> int:
    """Smallest power-of-two ring whose zigzag split keeps every rank within ``capacity``."""
    size = _pow2_at_least(length / capacity)
    while max(zigzag_loads(length, size)) > capacity:
        size *= 2
    if size > world_size:
        raise ValueError(
            f"a document of {length} tokens needs a group of {size} GPUs of {capacity} tokens "
            f"but the cluster has {world_size}: raise --capacity"
        )
    return size


def sequence_on(
    seq_id: int, length: int, ring: tuple[int, ...], topology: Topology
) -> SequencePlan:
    """A document split zigzag over ``ring`` (kept whole for a ring of one)."""
    tier = Tier.of_ring(ring, topology.gpus_per_node)
    return SequencePlan(seq_id, length, tier, ring, zigzag_spans(length, ring))


def plan_without_remap(
    sequences: list[SequencePlan],
    topology: Topology,
    *,
    name: str,
    capacity: int | None,
    attention_comm: AttentionComm = AttentionComm.RING,
    meta: dict | None = None,
) -> Plan:
    """A plan whose linear layout is its attention layout (no remapping, no routes)."""
    sequences = sorted(sequences, key=lambda s: s.id)
    linear: list[list[TokenRange]] = [[] for _ in range(topology.world_size)]
    for seq in sequences:
        for span in seq.attention:
            linear[span.rank].append(TokenRange(seq.id, span.start, span.end))
    return Plan(
        topology=topology,
        sequences=tuple(sequences),
        linear=tuple(tuple(r) for r in linear),
        capacity=capacity,
        attention_comm=attention_comm,
        name=name,
        meta=dict(meta or {}),
    )


def _in_rounds(
    docs: list[tuple[int, int]],
    build_round: Callable[
        [list[tuple[int, int]]], tuple[list[SequencePlan], list[tuple[int, int]]]
    ],
) -> list[list[SequencePlan]]:
    """Call ``build_round`` on the documents left over until none are."""
    rounds = []
    while docs:
        placed, docs = build_round(docs)
        assert placed, "a round placed no document although every document fits one round"
        rounds.append(placed)
    return rounds


# --- TransformerEngine ring CP and LLaMA-3 all-gather CP ---------------------------------------
def _packed_cp(
    lengths: list[int],
    topology: Topology,
    capacity: int,
    cp_size: int | None,
    name: str,
    comm: AttentionComm,
) -> list[Plan]:
    world = topology.world_size
    if cp_size is None:
        cp_size = group_size_for(max(lengths), capacity, world)
    if cp_size < 1 or cp_size > world:
        raise ValueError(f"cp_size must be between 1 and the {world} GPUs, got {cp_size}")
    for n in lengths:
        if max(zigzag_loads(n, cp_size)) > capacity:
            raise ValueError(
                f"a document of {n} tokens does not fit a CP group of {cp_size} GPUs of "
                f"{capacity} tokens: raise cp_size or capacity"
            )
    num_groups = world // cp_size
    samples = _first_fit_samples(lengths, cp_size, capacity)
    plans = []
    num_rounds = -(-len(samples) // num_groups)
    for k in range(num_rounds):
        sequences = []
        for group, (_, docs) in enumerate(samples[k * num_groups : (k + 1) * num_groups]):
            ring = tuple(range(group * cp_size, (group + 1) * cp_size))
            sequences += [sequence_on(i, n, ring, topology) for i, n in docs]
        meta = {
            "cp_size": cp_size,
            "round": k,
            "num_rounds": num_rounds,
            "sample_tokens": cp_size * capacity,
            "execution": "concurrent",
        }
        plans.append(
            plan_without_remap(
                sequences, topology, name=name, capacity=capacity, attention_comm=comm, meta=meta
            )
        )
    return plans


def _first_fit_samples(
    lengths: list[int], cp_size: int, capacity: int
) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
    """First fit decreasing into samples of ``cp_size`` ranks: a document joins the first sample
    whose every rank keeps within ``capacity`` with its zigzag share added. Samples' per-rank
    loads are rows of one array, so each document scans them at once."""
    loads = np.zeros((16, cp_size), dtype=np.int64)
    samples: list[list[tuple[int, int]]] = []
    for seq_id in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        add = np.asarray(zigzag_loads(lengths[seq_id], cp_size), dtype=np.int64)
        fits = np.flatnonzero((loads[: len(samples)] + add <= capacity).all(axis=1))
        if len(fits):
            index = int(fits[0])
        else:
            index = len(samples)
            if index == len(loads):
                loads = np.concatenate([loads, np.zeros_like(loads)])
            samples.append([])
        loads[index] += add
        samples[index].append((seq_id, lengths[seq_id]))
    return [(loads[i], docs) for i, docs in enumerate(samples)]


def te_ring_cp(
    lengths: Sequence[int], *, topology: Topology, capacity: int, cp_size: int | None = None
) -> list[Plan]:
    """TransformerEngine ring CP over packed fixed-length samples (module docstring)."""
    lengths = _check_inputs(lengths, topology, capacity)
    return _packed_cp(lengths, topology, capacity, cp_size, "te-ring-cp", AttentionComm.RING)


def llama3_allgather_cp(
    lengths: Sequence[int], *, topology: Topology, capacity: int, cp_size: int | None = None
) -> list[Plan]:
    """LLaMA-3 all-gather CP: TE's layout, K/V all-gathered once per group."""
    lengths = _check_inputs(lengths, topology, capacity)
    return _packed_cp(
        lengths, topology, capacity, cp_size, "llama3-allgather-cp", AttentionComm.ALLGATHER
    )


# --- hybrid DP ---------------------------------------------------------------------------------
def _hybrid_cp_size(long_docs: list[int], capacity: int, world: int) -> int:
    """Hybrid DP's default CP group: the smallest holding its longest long document, at least 2
    (a group of one would be data parallel); 1 where there is no long document."""
    return max(group_size_for(max(long_docs), capacity, world), 2) if long_docs else 1


def hybrid_dp(
    lengths: Sequence[int],
    *,
    topology: Topology,
    capacity: int,
    cost_model: CostModel | None = None,
    cp_size: int | None = None,
    threshold: int | None = None,
) -> list[Plan]:
    """Short documents whole on one GPU, long ones over a fixed CP group (module docstring)."""
    lengths = _check_inputs(lengths, topology, capacity)
    world = topology.world_size
    threshold = capacity if threshold is None else int(threshold)
    long_docs = [n for n in lengths if n > threshold]
    if cp_size is None:
        cp_size = _hybrid_cp_size(long_docs, capacity, world)
    if cp_size > world:
        raise ValueError(f"cp_size {cp_size} exceeds the {world} GPUs")
    for n in long_docs:
        if max(zigzag_loads(n, cp_size)) > capacity:
            raise ValueError(
                f"a document of {n} tokens does not fit a CP group of {cp_size} GPUs of "
                f"{capacity} tokens: raise cp_size or capacity"
            )

    def attn_cost(n: int) -> float:
        return cost_model.document_attention_time(n) if cost_model else float(n) * n

    def build_round(docs: list[tuple[int, int]]):
        tokens = [0] * world
        group_cost = [0.0] * (world // cp_size)
        placed, left = [], []
        fewest: list[tuple[int, int]] | None = None  # (tokens, rank), once long ones are placed
        for seq_id, n in sorted(docs, key=lambda d: (-d[1], d[0])):
            if n > threshold:
                add = zigzag_loads(n, cp_size)
                order = sorted(range(len(group_cost)), key=lambda g: (group_cost[g], g))
                for g in order:
                    ring = tuple(range(g * cp_size, (g + 1) * cp_size))
                    if all(tokens[r] + a <= capacity for r, a in zip(ring, add)):
                        for r, a in zip(ring, add):
                            tokens[r] += a
                        group_cost[g] += attn_cost(n) / cp_size
                        placed.append(sequence_on(seq_id, n, ring, topology))
                        break
                else:
                    left.append((seq_id, n))
            else:
                if fewest is None:  # every long document is placed (longest first)
                    fewest = [(t, r) for r, t in enumerate(tokens)]
                    heapq.heapify(fewest)
                _, rank = fewest[0]  # the GPU holding the fewest tokens
                if tokens[rank] + n <= capacity:
                    tokens[rank] += n
                    heapq.heapreplace(fewest, (tokens[rank], rank))
                    placed.append(sequence_on(seq_id, n, (rank,), topology))
                else:
                    left.append((seq_id, n))
        return placed, left

    rounds = _in_rounds(list(enumerate(lengths)), build_round)
    return [
        plan_without_remap(
            seqs,
            topology,
            name="hybrid-dp",
            capacity=capacity,
            meta={
                "cp_size": cp_size,
                "threshold": threshold,
                "round": k,
                "num_rounds": len(rounds),
                "execution": "concurrent",
            },
        )
        for k, seqs in enumerate(rounds)
    ]


# --- FlexSP (greedy) ---------------------------------------------------------------------------
def _fits(
    group: tuple[tuple[int, ...], list[int], list[float]], length: int, capacity: int
) -> bool:
    ring, tokens, _ = group
    return all(t + a <= capacity for t, a in zip(tokens, zigzag_loads(length, len(ring))))


class _FlexspRound:
    """Groups of one FlexSP round: each size's groups in a heap by load (entries whose load has
    changed since are skipped), and each size's first aligned block that may still be free."""

    def __init__(self, world: int, capacity: int) -> None:
        self.world, self.capacity = world, capacity
        self.free = [True] * world
        self.groups: list[Group] = []
        self.heaps: dict[int, list[tuple[float, int]]] = {}
        self.next_block: dict[int, int] = {}

    def least_loaded(self, size: int, length: int) -> int | None:
        """The least loaded group of ``size`` with room for ``length`` (ties: the oldest)."""
        heap = self.heaps.get(size, [])
        skipped, found = [], None
        while heap:
            load, index = heapq.heappop(heap)
            group = self.groups[index]
            if load != group[2][0]:
                continue  # stale entry: the group was pushed again with its new load
            skipped.append((load, index))
            if _fits(group, length, self.capacity):
                found = index
                break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def free_block(self, size: int) -> int | None:
        block = self.next_block.get(size, 0)
        while block + size <= self.world and not all(self.free[block : block + size]):
            block += size
        self.next_block[size] = block
        return block if block + size <= self.world else None

    def load(self, index: int) -> float:
        return self.groups[index][2][0]

    def open(self, block: int, size: int) -> int:
        ring = tuple(range(block, block + size))
        for r in ring:
            self.free[r] = False
        self.groups.append((ring, [0] * size, [0.0]))
        heapq.heappush(self.heaps.setdefault(size, []), (0.0, len(self.groups) - 1))
        return len(self.groups) - 1

    def add(self, index: int, length: int, cost: float) -> tuple[int, ...]:
        ring, tokens, load = self.groups[index]
        for i, a in enumerate(zigzag_loads(length, len(ring))):
            tokens[i] += a
        load[0] += cost / len(ring)
        heapq.heappush(self.heaps[len(ring)], (load[0], index))
        return ring


def flexsp(
    lengths: Sequence[int],
    *,
    topology: Topology,
    capacity: int,
    cost_model: CostModel | None = None,
) -> list[Plan]:
    """FlexSP-style heterogeneous SP groups, greedy (module docstring)."""
    lengths = _check_inputs(lengths, topology, capacity)
    world = topology.world_size

    def doc_cost(n: int) -> float:
        if cost_model is None:
            return float(n) * n
        return cost_model.document_attention_time(n) + cost_model.linear_time(n)

    def build_round(docs: list[tuple[int, int]]):
        target = sum(doc_cost(n) for _, n in docs) / world
        groups = _FlexspRound(world, capacity)
        placed, left = [], []
        for seq_id, n in sorted(docs, key=lambda d: (-d[1], d[0])):
            size = group_size_for(n, capacity, world)
            per_rank = doc_cost(n) / size
            best = groups.least_loaded(size, n)
            block = groups.free_block(size)
            if block is not None and (best is None or groups.load(best) + per_rank > target):
                best = groups.open(block, size)
            elif best is None:
                larger = [
                    g
                    for s in groups.heaps
                    if s > size
                    if (g := groups.least_loaded(s, n)) is not None
                ]
                best = min(larger, key=lambda g: (groups.load(g), g), default=None)
                if best is None:
                    left.append((seq_id, n))
                    continue
            ring = groups.add(best, n, doc_cost(n))
            placed.append(sequence_on(seq_id, n, ring, topology))
        return placed, left

    rounds = _in_rounds(list(enumerate(lengths)), build_round)
    return [
        plan_without_remap(
            seqs,
            topology,
            name="flexsp",
            capacity=capacity,
            meta={
                "round": k,
                "num_rounds": len(rounds),
                "execution": "concurrent",
                "group_sizes": sorted({len(s.ring) for s in seqs}, reverse=True),
            },
        )
        for k, seqs in enumerate(rounds)
    ]


# --- Megatron-LM dynamic (hybrid) CP -----------------------------------------------------------
MEGATRON_SCHEDULERS = ("reimplemented", "megatron-core")
"""Who decides Megatron's schedule: ``megatron_schedule.py`` or megatron-core itself."""


def megatron_groups(
    lengths: list[int], world: int, capacity: int, scheduler: str = "reimplemented"
) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Megatron's scheduling groups: per group, its documents as ``(seq_id, ranks)`` by id."""
    if scheduler == "reimplemented":
        return [
            sorted((seq_id, group.ranks) for group in groups for seq_id, _ in group.docs)
            for groups in balanced_cp_schedule(lengths, world, capacity)
        ]
    if scheduler != "megatron-core":
        raise ValueError(
            f"unknown scheduler {scheduler!r}; choose one of {', '.join(MEGATRON_SCHEDULERS)}"
        )
    groups = []
    for per_rank in megatron_core_schedule(lengths, world, capacity):
        ranks_of: dict[int, list[int]] = {}
        for rank, ids in enumerate(per_rank):
            for seq_id in ids:
                ranks_of.setdefault(seq_id, []).append(rank)
        groups.append([(i, tuple(ranks)) for i, ranks in sorted(ranks_of.items())])
    return groups


def megatron_dynamic_cp(
    lengths: Sequence[int],
    *,
    topology: Topology,
    capacity: int,
    scheduler: str = "reimplemented",
) -> list[Plan]:
    """Megatron-LM's hybrid/dynamic CP schedule, one plan per scheduling group."""
    lengths = _check_inputs(lengths, topology, capacity)
    groups = megatron_groups(lengths, topology.world_size, capacity, scheduler)
    seen = sorted(i for group in groups for i, _ in group)
    assert seen == list(range(len(lengths))), "the scheduler dropped or repeated a document"
    plans = []
    for k, group in enumerate(groups):
        seqs = [sequence_on(i, lengths[i], ranks, topology) for i, ranks in group]
        # Each document is its own forward/backward pass, so only one of them is resident at a
        # time: capacity holds per document, not for the sum the plan would check.
        meta = {
            "round": k,
            "num_rounds": len(groups),
            "execution": "sequential",
            "scheduler": scheduler,
            "capacity_per_document": capacity,
        }
        plans.append(
            plan_without_remap(seqs, topology, name="megatron-dynamic-cp", capacity=None, meta=meta)
        )
    return plans


# --- the static CP sizes a user could choose ---------------------------------------------------
STATIC_CP_BASELINES = ("te-ring-cp", "llama3-allgather-cp", "hybrid-dp")
"""Baselines whose CP size is one static choice of the run (``cp_size`` of ``build_baseline``)."""


def rule_cp_size(name: str, lengths: Sequence[int], topology: Topology, capacity: int) -> int:
    """The CP size ``name`` takes without ``cp_size`` (module docstring): the smallest power of
    two whose group holds the longest document (for ``hybrid-dp``, the longest above the
    capacity, and at least 2; 1 where no document is above it)."""
    world = topology.world_size
    if name in ("te-ring-cp", "llama3-allgather-cp"):
        return group_size_for(max(lengths), capacity, world)
    if name == "hybrid-dp":
        return _hybrid_cp_size([n for n in lengths if n > capacity], capacity, world)
    raise ValueError(
        f"{name!r} has no static CP size; choose one of {', '.join(STATIC_CP_BASELINES)}"
    )


def static_cp_sizes(
    name: str, lengths: Sequence[int], topology: Topology, capacity: int
) -> list[int]:
    """The CP sizes a user could set for the batch ``lengths``: powers of two that divide the
    GPUs and hold its longest document (``rule_cp_size``, which only grows with the documents,
    so every larger size holds them too), and the rule's own size where it does not divide
    them. ``hybrid-dp`` without a document above the capacity has no group to size: its one
    choice is the rule's."""
    world = topology.world_size
    smallest = rule_cp_size(name, [int(n) for n in lengths], topology, capacity)
    if name == "hybrid-dp" and smallest == 1:
        return [1]
    sizes = {smallest}
    size = 1
    while size <= world:
        if size >= smallest and world % size == 0:
            sizes.add(size)
        size *= 2
    return sorted(sizes)


# --- registry ----------------------------------------------------------------------------------
def build_baseline(
    name: str,
    lengths: Sequence[int],
    *,
    topology: Topology,
    capacity: int,
    cost_model: CostModel | None = None,
    cp_size: int | None = None,
) -> list[Plan]:
    """Plans (one per round) of baseline ``name`` for one batch; see ``BASELINES``."""
    if name == "te-ring-cp":
        return te_ring_cp(lengths, topology=topology, capacity=capacity, cp_size=cp_size)
    if name == "llama3-allgather-cp":
        return llama3_allgather_cp(lengths, topology=topology, capacity=capacity, cp_size=cp_size)
    if name == "hybrid-dp":
        return hybrid_dp(
            lengths, topology=topology, capacity=capacity, cost_model=cost_model, cp_size=cp_size
        )
    if name == "megatron-dynamic-cp":
        return megatron_dynamic_cp(lengths, topology=topology, capacity=capacity)
    if name == "flexsp":
        return flexsp(lengths, topology=topology, capacity=capacity, cost_model=cost_model)
    raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
