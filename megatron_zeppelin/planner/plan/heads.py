"""The 2-D scheme's geometry (pure): head groups, the rings across nodes, the head all-to-all.

A 2-D document (``SequencePlan.scheme == Scheme.TWO_D``) spans ``n`` whole nodes of ``G`` GPUs
(``plan.node_grid``). Its ranks hold it in two layouts:

    token layout (the plan's attention spans)     head layout (inside the engine)
    rank (i, j): a piece of node i's tokens,      rank (i, j): all of node i's tokens,
                 every head                                    the heads of group j

where node ``i`` (ring order) holds zigzag chunks ``i`` and ``2n-1-i`` of the document
(``plan.node_chunks``) and ``j`` is a rank's local GPU index. Any token layout inside the node's
chunks works; the planner keeps the flat ring's zigzag spans, which always lie there (chunks
``iG .. iG+G-1`` and their mirrors of a ring of ``nG`` are node chunks ``i`` and ``2n-1-i``), so
choosing the scheme moves no token. The engine moves a document from
the token layout to the head layout with one all-to-all inside each node (Q, K and V), runs
column ``j`` (the ranks of local index ``j`` on the document's nodes: one rail) as a zigzag ring
of ``n`` over head group ``j``, and moves the output back (a second all-to-all); the backward
moves dO in and dQ, dK, dV back. A ring of ``n`` nodes thus computes in ``n`` phases (``n - 1``
transfer steps) instead of ``n*G`` (``n*G - 1``),
each step's blocks are ``G`` times larger, and every rail's NIC carries one ring.

``head_plan`` describes the column rings as an ordinary ``Plan`` on the head layout (one
sequence per document and column), so the ring schedule, the byte prediction, the simulator and
the engine's ring layout serve it unchanged. ``schedule.exchange_messages`` lists the
all-to-all's messages (same node only, never routed).

Head groups (``head_groups``): group ``j`` of ``G`` takes query heads ``[j*H/G, (j+1)*H/G)`` and
the K/V heads those queries use. With at least as many K/V heads as GPUs per node the K/V heads
split too (``nkv/G`` per group); with fewer, each group takes the one K/V head its queries share,
so a K/V head is replicated over ``G/nkv`` ranks and their dK/dV are summed on the way back. A
head count that splits neither way (``H`` not a multiple of ``G``, or ``G`` and ``nkv`` not
multiples of one another) cannot use the scheme; the planner keeps such documents on the flat
ring (``schemes.py``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.cost.models import ModelSpec
from megatron_zeppelin.planner.plan.phases import Local, ZigzagRings
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    SequencePlan,
    Tier,
    TokenRange,
    node_grid,
    zigzag_bounds,
    zigzag_spans,
)

__all__ = [
    "AttentionShape",
    "HeadGroups",
    "HeadPlan",
    "column_layout",
    "node_members",
    "head_groups",
    "head_plan",
]


@dataclass(frozen=True)
class HeadGroups:
    """Which query and K/V heads each of ``num_groups`` ranks of a node takes."""

    num_groups: int
    q: tuple[tuple[int, int], ...]
    """Per group, its query heads ``[start, end)``."""
    kv: tuple[tuple[int, int], ...]
    """Per group, its K/V heads ``[start, end)``; overlapping when K/V heads are replicated."""

    @property
    def replicated(self) -> bool:
        return len(set(self.kv)) < self.num_groups

    @property
    def num_q(self) -> int:
        return self.q[0][1] - self.q[0][0]

    @property
    def num_kv(self) -> int:
        return self.kv[0][1] - self.kv[0][0]

    def of(self, group: int) -> list[tuple[int, int]]:
        """Group ``group``'s head ranges in full Q, K and V tensors."""
        return [self.q[group], self.kv[group], self.kv[group]]

    @property
    def widths(self) -> tuple[int, int, int]:
        """Heads of one group's Q, K and V."""
        return (self.num_q, self.num_kv, self.num_kv)

    @property
    def whole(self) -> list[tuple[int, int]]:
        """Every head of a group's Q, K and V tensors (their head ranges in the head layout)."""
        return [(0, n) for n in self.widths]


def head_groups(num_heads: int, num_kv_heads: int, num_groups: int) -> HeadGroups:
    """The head groups of the module docstring; ``ValueError`` when the heads do not split."""
    h, nkv, g = num_heads, num_kv_heads, num_groups
    if g < 1 or nkv < 1 or h % nkv:
        raise ValueError(f"{h} query heads over {nkv} K/V heads cannot split over {g} GPUs")
    if h % g or (nkv % g and g % nkv):
        raise ValueError(
            f"{h} query heads and {nkv} K/V heads do not split over the {g} GPUs of a node "
            f"(the query heads must be a multiple of {g}, and {g} and the K/V heads multiples "
            "of one another): plan these documents with the flat ring"
        )
    q = tuple((j * h // g, (j + 1) * h // g) for j in range(g))
    if nkv % g == 0:
        kv = tuple((j * nkv // g, (j + 1) * nkv // g) for j in range(g))
    else:
        kv = tuple((j * nkv // g, j * nkv // g + 1) for j in range(g))
    return HeadGroups(g, q, kv)


@dataclass(frozen=True)
class AttentionShape:
    """Per-GPU attention heads and the bytes of one value as it travels."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_bytes: int
    """Q, K, V, the output and its gradient (the input dtype)."""
    grad_value_bytes: int
    """dQ, dK, dV as they travel (float32 for half-precision inputs)."""

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.value_bytes

    @property
    def grad_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.grad_value_bytes

    def groups(self, num_groups: int) -> HeadGroups:
        return head_groups(self.num_heads, self.num_kv_heads, num_groups)

    @classmethod
    def of_model(cls, model: ModelSpec) -> AttentionShape:
        """One GPU's heads under the model's tensor parallelism (K/V heads replicated when
        fewer than the TP size), every value in the model's dtype (the simulator's
        convention)."""
        tp = model.tensor_parallel
        return cls(
            num_heads=model.num_heads // tp,
            num_kv_heads=max(1, model.num_kv_heads // tp),
            head_dim=model.head_dim,
            value_bytes=model.dtype_bytes,
            grad_value_bytes=model.dtype_bytes,
        )

    @classmethod
    def as_sent(cls, model: ModelSpec) -> AttentionShape:
        """``of_model`` with the gradients as the engine sends them: float32 for half-precision
        inputs."""
        shape = cls.of_model(model)
        return dataclasses.replace(shape, grad_value_bytes=max(4, shape.value_bytes))


@dataclass(frozen=True)
class HeadPlan:
    """The column rings of a plan's 2-D documents, as a plan on the head layout."""

    plan: Plan
    """One sequence per (document, column), ids ``0, 1, ...`` in that order; a rank's head
    buffer is its ``attention_ranges`` there, so documents come by id."""
    document: tuple[int, ...]
    """Per head-plan sequence, the document (sequence id of the original plan)."""
    gpus_per_node: int

    @property
    def num_groups(self) -> int:
        return self.gpus_per_node


def head_plan(plan: Plan) -> HeadPlan | None:
    """The column rings of ``plan``'s 2-D documents (``None`` when it has none), made once per
    plan and kept on it: the engine, the simulator and the byte predictions all ask. (Not a
    cache keyed by the plan: hashing a plan walks every one of its records, and a cache would
    keep old plans alive.)"""
    kept = plan.__dict__.get("_head_plan", _NOT_YET)
    if kept is _NOT_YET:
        kept = _head_plan(plan)
        object.__setattr__(plan, "_head_plan", kept)
    return kept


_NOT_YET = object()


def _head_plan(plan: Plan) -> HeadPlan | None:
    topo = plan.topology
    sequences, document = [], []
    for seq in plan.two_d_sequences:
        nodes = [topo.node_of(row[0]) for row in node_grid(seq.ring, topo)]
        for j in range(topo.gpus_per_node):  # column j: local GPU j of every node, one rail
            column = tuple(topo.rank_of(node, j) for node in nodes)
            tier = Tier.INTER if len(column) > 1 else Tier.LOCAL
            spans = zigzag_spans(seq.length, column)
            sequences.append(SequencePlan(len(sequences), seq.length, tier, column, spans))
            document.append(seq.id)
    if not sequences:
        return None
    linear = defaultdict(list)
    for seq in sequences:
        for span in seq.attention:
            linear[span.rank].append(TokenRange(seq.id, span.start, span.end))
    heads = Plan(
        topology=topo,
        sequences=tuple(sequences),
        linear=tuple(tuple(linear[r]) for r in range(topo.world_size)),
        name=f"{plan.name}/heads",
    )
    return HeadPlan(heads, tuple(document), topo.gpus_per_node)


def column_layout(
    plan: Plan,
) -> tuple[Local, list[ZigzagRings], list[tuple[int, SequencePlan]]]:
    """``phases.split_by_layout`` of ``head_plan(plan).plan.sequences`` without building them:
    the simulator's arrays read nothing else of the column rings. Column ``j`` of a document
    over ``n`` nodes holds zigzag chunks ``i`` and ``2n-1-i`` at position ``i``, like every other
    column: one row of bounds serves all ``G``."""
    topo = plan.topology
    k = topo.gpus_per_node
    local: list[int] = []  # the rank of every column of one node
    local_lengths: list[int] = []
    zigzag: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
    other: list[tuple[int, SequencePlan]] = []
    for seq in plan.two_d_sequences:
        nodes = [topo.node_of(row[0]) for row in node_grid(seq.ring, topo)]
        n = len(nodes)
        columns = [tuple(topo.rank_of(node, j) for node in nodes) for j in range(k)]
        bounds = zigzag_bounds(seq.length, n)
        if n == 1:
            local += [column[0] for column in columns]
            local_lengths += [seq.length] * k
        elif all(end > start for start, end in bounds):
            chunks, rings = zigzag[n]
            chunks.append([(bounds[i], bounds[2 * n - 1 - i]) for i in range(n)])
            rings.append(columns)
        else:  # a document shorter than 2n tokens: empty chunks are left out
            tier = Tier.INTER
            other += [
                (0, SequencePlan(0, seq.length, tier, column, zigzag_spans(seq.length, column)))
                for column in columns
            ]
    groups = [
        ZigzagRings(
            np.repeat(np.asarray(chunks, dtype=np.int64), k, axis=0),
            np.asarray(rings, dtype=np.int64).reshape(-1, n),
            np.zeros(len(rings) * k, dtype=np.int64),
        )
        for n, (chunks, rings) in zigzag.items()
    ]
    ranks = np.asarray(local, dtype=np.int64)
    lengths = np.asarray(local_lengths, dtype=np.int64)
    return (np.zeros(len(ranks), dtype=np.int64), ranks, lengths), groups, other


def node_members(plan: Plan) -> list[tuple[int, tuple[int, ...], dict[int, int]]]:
    """Per 2-D document and node: the document's id, the node's ranks and every rank's tokens
    of the document (the all-to-all's participants; ``schedule.exchange_messages``)."""
    out = []
    for seq in plan.two_d_sequences:
        tokens: dict[int, int] = defaultdict(int)
        for span in seq.attention:
            tokens[span.rank] += span.num_tokens
        for row in node_grid(seq.ring, plan.topology):
            out.append((seq.id, row, tokens))
    return out
