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

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from megatron_zeppelin.fileio import atomic_write_text
from megatron_zeppelin.planner.plan.plan_checks import (
    check_attention,
    check_capacity,
    check_linear,
    check_routes,
)
from megatron_zeppelin.planner.plan.plan_parts import (
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
    pack_layout,
    pack_sequences,
    share_spans,
    split_by_weights,
    unpack_layout,
    unpack_sequences,
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
    "share_spans",
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
        self._index_routes()

    def _index_routes(self) -> None:
        # Not a field: an index for ``route_of``, which the schedule asks once per message.
        object.__setattr__(self, "_route_index", {(r.src, r.dst): r for r in self.routes})

    def __reduce__(self) -> tuple:
        """Pickled in pieces of plain values (``plan_parts.pack_sequences``), its records rebuilt
        in bulk: a planner process sends training a plan per micro-batch
        (``megatron/plans/plan_workers.py``), at 10^4 documents about 30,000 records. Not validated
        again: it was where it was made."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["sequences"] = pack_sequences(self.sequences)
        fields["linear"] = pack_layout(self.linear)
        return _unpickle_plan, (type(self), fields)

    # --- invariants (``plan_checks``: plans of thousands of documents on a thousand GPUs are
    # validated every step) --------------------------------------------------------------------
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
        lengths, attention_tokens = check_attention(self.sequences, self.topology)
        linear_tokens = check_linear(self.linear, lengths, ids)
        check_routes(self.routes, self.topology)
        if self.capacity is not None:
            check_capacity(self.capacity, attention_tokens, linear_tokens)

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

    @property
    def route_index(self) -> dict[tuple[int, int], Route]:
        """The routes by ring edge ``(src, dst)``, made once per plan (read it, do not change
        it)."""
        return self._route_index  # type: ignore[attr-defined]

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


def _unpickle_plan(cls: type[Plan], fields: dict[str, Any]) -> Plan:
    """``Plan.__reduce__``'s inverse."""
    fields["sequences"] = unpack_sequences(fields["sequences"])
    fields["linear"] = unpack_layout(fields["linear"])
    plan = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(plan, name, value)
    plan._index_routes()
    return plan


def _scheme(value: Any) -> Scheme:
    try:
        return Scheme(value)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in Scheme)
        raise ValueError(
            f"unknown scheme {value!r} in the plan file; choose one of {choices}"
        ) from None
