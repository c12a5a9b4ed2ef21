"""The plan: where every token of a micro-batch goes. Frozen data that checks itself.

A plan answers three questions for one micro-batch:

* **attention layout**: for each document (``SequencePlan``), which ranks compute which query
  ranges, and the ring those ranks form (``ring``; ring step ``s`` sends a K/V block from
  ``ring[i]`` to ``ring[(i + 1) % g]``). A rank's K/V block for a document is the same tokens as
  its query ranges. A rank's attention buffer is its ranges in canonical order: documents by id,
  then the document's spans in the order listed (zigzag: chunk ``i`` then chunk ``2g-1-i``).
* **linear layout**: per rank, the token ranges it holds for embedding, QKV, projections, MLP and
  loss; its buffer is the ranges in the order listed.
* **scheme**: a document across whole nodes may run with its heads split inside each node and
  one ring per rail across the nodes (``Scheme.TWO_D``; ``heads.py``); its attention spans are
  then where its tokens arrive, and the engine moves heads itself.
* **routing**: for every ring edge that crosses nodes, how its messages are split over proxy
  GPUs so that every NIC carries a share (``Route``). Edges with no route go direct.

The runtime only executes a plan; it never decides. Every builder (the Zeppelin planner and every
baseline) produces this one type so one simulator and one engine serve them all.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_zeppelin.fileio import atomic_write_text
from megatron_zeppelin.planner.plan_parts import (
    AttentionComm,
    Route,
    RoutePart,
    Scheme,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
    node_chunks,
    node_grid,
    split_by_weights,
    zigzag_bounds,
    zigzag_loads,
    zigzag_sequences,
    zigzag_spans,
)
from megatron_zeppelin.topology.model import Topology

__all__ = [  # the parts are re-exported: a plan's readers import them from here
    "PLAN_FORMAT",
    "READ_FORMATS",
    "AttentionComm",
    "Plan",
    "Route",
    "RoutePart",
    "Scheme",
    "SequencePlan",
    "Span",
    "Tier",
    "TokenRange",
    "node_chunks",
    "node_grid",
    "split_by_weights",
    "zigzag_bounds",
    "zigzag_loads",
    "zigzag_sequences",
    "zigzag_spans",
]

PLAN_FORMAT = "zeppelin-plan/2"
READ_FORMATS = ("zeppelin-plan/1", PLAN_FORMAT)
"""Formats ``Plan.from_dict`` reads: ``/2`` added ``scheme`` per sequence (``/1`` plans are all
rings)."""


def _check_two_d(seq: SequencePlan, topology: Topology) -> None:
    """A 2-D document's grid and token layout (see ``SequencePlan.scheme``)."""
    if len(seq.ring) < 2:
        raise ValueError(f"sequence {seq.id}: a 2-D document needs a ring of at least 2 ranks")
    try:
        grid = node_grid(seq.ring, topology)
    except ValueError as exc:
        raise ValueError(f"sequence {seq.id}: {exc}") from None
    n = len(grid)
    bounds = zigzag_bounds(seq.length, n)  # node i holds chunks i and 2n-1-i
    row_of = {rank: i for i, row in enumerate(grid) for rank in row}
    for span in seq.attention:
        i = row_of[span.rank]
        (a, b), (c, d) = bounds[i], bounds[2 * n - 1 - i]
        if not (a <= span.start and span.end <= b or c <= span.start and span.end <= d):
            chunks = node_chunks(seq.length, n, i)
            raise ValueError(
                f"sequence {seq.id}: span [{span.start}, {span.end}) on rank {span.rank} lies "
                f"outside its node's chunks {chunks}"
            )


def _span_start(span: Span) -> int:
    return span.start


@dataclass(frozen=True)
class Plan:
    """A validated placement of one micro-batch. See the module docstring."""

    topology: Topology
    sequences: tuple[SequencePlan, ...]
    linear: tuple[tuple[TokenRange, ...], ...]
    """Per rank (index = rank), the token ranges held in the linear layout."""
    routes: tuple[Route, ...] = ()
    capacity: int | None = None
    """Per-GPU token capacity the plan respects in both layouts; ``None``: unchecked."""
    attention_comm: AttentionComm = AttentionComm.RING
    name: str = "zeppelin"
    """Which builder made it (``zeppelin``, ``te-ring-cp``, ...)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form facts from the builder (thresholds used, group sizes); serialized as is."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequences", tuple(self.sequences))
        object.__setattr__(self, "linear", tuple(tuple(r) for r in self.linear))
        object.__setattr__(self, "routes", tuple(self.routes))
        self.validate()
        # Not a field: an index for ``route_of``, which the schedule asks once per message.
        object.__setattr__(self, "_route_index", {(r.src, r.dst): r for r in self.routes})

    # --- invariants (one pass over spans and ranges: plans of thousands of documents on a
    # thousand GPUs are validated every step) ------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first broken invariant: sizes that do not fit the
        topology, attention spans or linear ranges that do not partition every document,
        routes off their nodes, or a rank over its capacity in either layout."""
        world = self.topology.world_size
        if len(self.linear) != world:
            raise ValueError(
                f"plan lists linear ranges for {len(self.linear)} ranks but its topology has "
                f"{world} GPUs"
            )
        ids = [s.id for s in self.sequences]
        if ids != sorted(ids) or len(set(ids)) != len(ids):
            raise ValueError("sequence ids must be unique and listed in increasing order")
        lengths, attention_tokens = _check_attention(self.sequences, self.topology)
        linear_tokens = _check_linear(self.linear, lengths, ids)
        _check_routes(self.routes, self.topology)
        if self.capacity is not None:
            _check_capacity(self.capacity, attention_tokens, linear_tokens)

    # --- views -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.sequences]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.sequences)

    def attention_ranges(self, rank: int) -> list[TokenRange]:
        """Rank's attention buffer in canonical order (documents by id, spans as listed)."""
        return [
            TokenRange(seq.id, s.start, s.end)
            for seq in self.sequences
            for s in seq.attention
            if s.rank == rank
        ]

    def linear_ranges(self, rank: int) -> list[TokenRange]:
        return list(self.linear[rank])

    def num_attention_tokens(self, rank: int) -> int:
        return sum(r.num_tokens for r in self.attention_ranges(rank))

    def num_linear_tokens(self, rank: int) -> int:
        return sum(r.num_tokens for r in self.linear[rank])

    def sequence(self, seq_id: int) -> SequencePlan:
        for s in self.sequences:
            if s.id == seq_id:
                return s
        raise KeyError(seq_id)

    def route_of(self, src: int, dst: int) -> Route | None:
        return self._route_index.get((src, dst))  # type: ignore[attr-defined]

    def tier_counts(self) -> dict[str, int]:
        counts = {t.value: 0 for t in Tier}
        for s in self.sequences:
            counts[Tier(s.tier).value] += 1
        return counts

    # --- serialization (docs/DESIGN.md, "The plan file") -----------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "name": self.name,
            "topology": self.topology.to_dict(),
            "capacity": self.capacity,
            "attention_comm": AttentionComm(self.attention_comm).value,
            "sequences": [
                {
                    "id": s.id,
                    "length": s.length,
                    "tier": Tier(s.tier).value,
                    "ring": list(s.ring),
                    "attention": [
                        {"rank": a.rank, "start": a.start, "end": a.end} for a in s.attention
                    ],
                    **({"scheme": Scheme(s.scheme).value} if s.scheme != Scheme.RING else {}),
                }
                for s in self.sequences
            ],
            "linear": {
                str(rank): [{"seq": r.seq, "start": r.start, "end": r.end} for r in ranges]
                for rank, ranges in enumerate(self.linear)
            },
            "routes": [
                {
                    "src": r.src,
                    "dst": r.dst,
                    "parts": [[p.src_proxy, p.dst_proxy, p.weight] for p in r.parts],
                }
                for r in self.routes
            ],
            "meta": self.meta,
        }

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path is not None:
            atomic_write_text(path, text)  # a reader never sees half a plan
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict) or data.get("format") not in READ_FORMATS:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"not a plan file: expected format {' or '.join(map(repr, READ_FORMATS))}, "
                f"got {got!r}"
            )
        try:
            topology = Topology.from_dict(data["topology"])
            world = topology.world_size
            sequences = []
            for s in data["sequences"]:
                ring = tuple(s.get("ring") or sorted({a["rank"] for a in s["attention"]}))
                tier = s.get("tier") or Tier.of_ring(ring, topology.gpus_per_node)
                sequences.append(
                    SequencePlan(
                        id=int(s["id"]),
                        length=int(s["length"]),
                        tier=Tier(tier),
                        ring=ring,
                        attention=tuple(
                            Span(int(a["rank"]), int(a["start"]), int(a["end"]))
                            for a in s["attention"]
                        ),
                        scheme=_scheme(s.get("scheme", "ring")),
                    )
                )
            linear_map = data["linear"]
            unknown = set(linear_map) - {str(r) for r in range(world)}
            if unknown:
                raise ValueError(
                    f"linear layout names ranks {sorted(unknown)} outside 0..{world - 1}"
                )
            linear = tuple(
                tuple(
                    TokenRange(int(r["seq"]), int(r["start"]), int(r["end"]))
                    for r in linear_map.get(str(rank), [])
                )
                for rank in range(world)
            )
            routes = tuple(
                Route(
                    int(r["src"]),
                    int(r["dst"]),
                    tuple(RoutePart(int(a), int(b), int(w)) for a, b, w in r["parts"]),
                )
                for r in data.get("routes", [])
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed plan file: missing or mistyped field ({exc!r})") from exc
        return cls(
            topology=topology,
            sequences=tuple(sequences),
            linear=linear,
            routes=routes,
            capacity=data.get("capacity"),
            attention_comm=AttentionComm(data.get("attention_comm", "ring")),
            name=data.get("name", "zeppelin"),
            meta=dict(data.get("meta") or {}),
        )

    @property
    def has_two_d(self) -> bool:
        """Whether any document runs the 2-D scheme."""
        return bool(self.two_d_sequences)

    @functools.cached_property
    def two_d_sequences(self) -> tuple[SequencePlan, ...]:
        """The documents that run the 2-D scheme (found once: the simulator and the engine ask
        for them several times per plan)."""
        two_d = Scheme.TWO_D
        return tuple(s for s in self.sequences if s.scheme == two_d)

    @classmethod
    def from_json(cls, text_or_path: str) -> Plan:
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path) as f:
                text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"plan file is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def _scheme(value: Any) -> Scheme:
    try:
        return Scheme(value)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in Scheme)
        raise ValueError(
            f"unknown scheme {value!r} in the plan file; choose one of {choices}"
        ) from None


def _check_attention(
    sequences: tuple[SequencePlan, ...], topology: Topology
) -> tuple[dict[int, int], list[int]]:
    """Every document's spans partition it over its ring, whose tier it names. Returns the
    lengths by id and the attention tokens per rank."""
    world = topology.world_size
    lengths: dict[int, int] = {}
    attention_tokens = [0] * world
    local, ring_scheme = Tier.LOCAL, Scheme.RING
    for seq in sequences:
        if seq.length < 1:
            raise ValueError(f"sequence {seq.id} has length {seq.length}; lengths must be >= 1")
        lengths[seq.id] = seq.length
        ring, spans = seq.ring, seq.attention
        # Fast path for the common case, a whole document on one GPU (the checks of
        # ``_check_ring`` reduce to these).
        if len(ring) == 1 and len(spans) == 1 and seq.tier == local and seq.scheme == ring_scheme:
            span, rank = spans[0], ring[0]
            if (
                span.rank == rank
                and span.start == 0
                and span.end == seq.length
                and (0 <= rank < world)
            ):
                attention_tokens[rank] += seq.length
                continue
        _check_ring(seq, topology, attention_tokens)
    return lengths, attention_tokens


def _check_ring(seq: SequencePlan, topology: Topology, attention_tokens: list[int]) -> None:
    world = topology.world_size
    ring = seq.ring
    ring_set = set(ring)
    if not ring or len(ring_set) != len(ring):
        raise ValueError(f"sequence {seq.id}: its ring must list distinct ranks")
    if min(ring) < 0 or max(ring) >= world:
        rank = next(r for r in ring if not 0 <= r < world)
        raise ValueError(f"sequence {seq.id}: rank {rank} outside 0..{world - 1}")
    spans = seq.attention
    if len(spans) > 1:
        spans = sorted(spans, key=_span_start)
    pos = 0
    for span in spans:
        if span.rank not in ring_set:
            raise ValueError(
                f"sequence {seq.id}: span on rank {span.rank} outside its ring {seq.ring}"
            )
        if span.start != pos or span.end <= span.start:
            raise ValueError(
                f"sequence {seq.id}: attention spans must partition [0, {seq.length}) "
                f"with non-empty ranges (gap or overlap at token {pos})"
            )
        pos = span.end
        attention_tokens[span.rank] += span.end - span.start
    if pos != seq.length:
        raise ValueError(
            f"sequence {seq.id}: attention spans cover [0, {pos}) of [0, {seq.length})"
        )
    expected = Tier.of_ring(ring, topology.gpus_per_node)
    if seq.tier != expected:  # Tier is a str enum: "local" == Tier.LOCAL
        raise ValueError(f"sequence {seq.id}: tier {seq.tier} but its ring is {expected}")
    if seq.scheme != Scheme.RING:
        _check_two_d(seq, topology)


def _check_linear(
    linear: tuple[tuple[TokenRange, ...], ...], lengths: dict[int, int], ids: list[int]
) -> list[int]:
    """The linear ranges partition every document. Returns the linear tokens per rank."""
    seqs: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    linear_tokens = [0] * len(linear)
    for rank, ranges in enumerate(linear):
        num = 0
        for r in ranges:
            seq, start, end = r.seq, r.start, r.end
            length = lengths.get(seq)
            if length is None:
                raise ValueError(f"linear layout of rank {rank} names unknown sequence {seq}")
            if not 0 <= start < end <= length:
                raise ValueError(
                    f"linear layout of rank {rank}: range [{start}, {end}) of sequence "
                    f"{seq} is empty or outside [0, {length})"
                )
            seqs.append(seq)
            starts.append(start)
            ends.append(end)
            num += end - start
        linear_tokens[rank] = num
    if not _partition(seqs, starts, ends, lengths):
        _name_the_gap(sorted(zip(seqs, starts, ends)), lengths, ids)
    return linear_tokens


def _partition(
    seqs: list[int], starts: list[int], ends: list[int], lengths: dict[int, int]
) -> bool:
    """Whether the ranges (each inside its document) partition every document of ``lengths``,
    told with arrays: sorted by (document, start, end), each document's ranges run from 0 to
    its length. ``False`` also when the values are not plain integers (``_name_the_gap`` then
    walks them)."""
    seq, start, end = (np.array(values) for values in (seqs, starts, ends))
    if any(a.dtype.kind != "i" for a in (seq, start, end)) or not len(seq):
        return False
    order = np.lexsort((end, start, seq))
    seq, start, end = seq[order], start[order], end[order]
    first = np.ones(len(seq), dtype=bool)
    first[1:] = seq[1:] != seq[:-1]
    last = np.r_[first[1:], True]
    length = np.array(list(map(lengths.__getitem__, seq[last].tolist())))
    return (
        bool((start == np.where(first, 0, np.r_[0, end[:-1]])).all())
        and bool((end[last] == length).all())
        and int(first.sum()) == len(lengths)
    )


def _name_the_gap(
    pieces: list[tuple[int, int, int]], lengths: dict[int, int], ids: list[int]
) -> None:
    """Raise naming the first document the sorted ``pieces`` do not partition."""
    current, pos, num_seen = None, 0, 0
    for seq_id, start, end in pieces:
        if seq_id != current:
            if current is not None and pos != lengths[current]:
                raise ValueError(f"linear layout covers [0, {pos}) of sequence {current}")
            current, pos, num_seen = seq_id, 0, num_seen + 1
        if start != pos:
            raise ValueError(f"linear layout does not partition sequence {seq_id} (token {pos})")
        pos = end
    if current is not None and pos != lengths[current]:
        raise ValueError(f"linear layout covers [0, {pos}) of sequence {current}")
    if num_seen != len(lengths):
        named = {piece[0] for piece in pieces}
        missing = next(i for i in ids if i not in named)
        raise ValueError(f"linear layout covers [0, 0) of sequence {missing}")


def _check_routes(routes: tuple[Route, ...], topology: Topology) -> None:
    for route in routes:
        if topology.same_node(route.src, route.dst):
            raise ValueError(f"route {route.src}->{route.dst} does not cross nodes")
        if not route.parts or any(p.weight < 0 for p in route.parts):
            raise ValueError(f"route {route.src}->{route.dst} needs parts with weights >= 0")
        if sum(p.weight for p in route.parts) <= 0:
            raise ValueError(f"route {route.src}->{route.dst} has zero total weight")
        for p in route.parts:
            if not (
                topology.same_node(p.src_proxy, route.src)
                and topology.same_node(p.dst_proxy, route.dst)
            ):
                raise ValueError(
                    f"route {route.src}->{route.dst}: proxies {p.src_proxy}->{p.dst_proxy} "
                    "must sit on the source and destination nodes"
                )
    if len({(r.src, r.dst) for r in routes}) != len(routes):
        raise ValueError("a ring edge is routed twice")


def _check_capacity(capacity: int, attention_tokens: list[int], linear_tokens: list[int]) -> None:
    for rank, pair in enumerate(zip(attention_tokens, linear_tokens)):
        for label, n in zip(("attention", "linear"), pair):
            if n > capacity:
                raise ValueError(
                    f"rank {rank} holds {n} tokens in the {label} layout, over its "
                    f"capacity of {capacity}"
                )
