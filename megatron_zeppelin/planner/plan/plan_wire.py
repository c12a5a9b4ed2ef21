"""A plan as bytes for the wire: the records' fields in integer columns, one buffer, checked on
receipt.

A planner process hands its training process a plan per micro-batch, and with plans shared
(``megatron/plans/shared_plans.py``) the first rank of every node broadcasts each plan it makes
to every rank: at 1024 GPUs and 10^4 documents, every rank takes about 30,000 records per
micro-batch. ``encode`` writes them as columns of little-endian int32; ``decode`` checks the
columns and rebuilds the records in bulk (``plan_parts.records_of``), never running the code a
pickle names, and never validating the plan again: it was where it was made.

Layout (``FORMAT`` 1)::

    b"ZPLN"  u16 format  u16 0  u32 n            the head (``_HEAD``)
    n bytes of JSON, padded with spaces to 4 bytes:
        {"counts": [documents, ring members, spans, ranks, ranges, routes, route parts],
         "name", "capacity", "attention_comm", "topology", "meta"}
    int32 columns, back to back (``_COLUMNS``, each as long as the count it names):
        per document: id, length, tier, scheme, ring size, spans
        ring members; span rank, start, end
        per rank: ranges; range document, start, end
        per route: source, destination, parts; part source proxy, destination proxy, weight

Tiers and schemes are their index in ``Tier`` and ``Scheme``. Whatever is wrong with a payload
(another format, cut short, counts that do not add up, a rank off the topology, an empty or
reversed range) is a ``ValueError`` naming it.

The records a decoded plan holds are left out of Python's cyclic collector (``_untrack``): they
hold no reference cycles (frozen ints, enum members and tuples of them), and are freed by their
reference counts alone. Watched, each plan's 30,000 records would make the collector pass over
the whole training process about once every other micro-batch (docs/BENCHMARKS.md, "Planning at
scale").
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from collections import deque
from itertools import chain
from operator import attrgetter

import numpy as np

from megatron_zeppelin.planner.plan.plan import (
    AttentionComm,
    Plan,
    Route,
    RoutePart,
    Scheme,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
)
from megatron_zeppelin.planner.plan.plan_parts import columns_of, grouped_records, records_of
from megatron_zeppelin.topology.model import Topology

__all__ = ["FORMAT", "decode", "encode"]

FORMAT = 1
_MAGIC = b"ZPLN"
_HEAD = struct.Struct("<4sHHI")
_INT = np.dtype("<i4")
_TIERS, _SCHEMES = tuple(Tier), tuple(Scheme)
_TIER_CODE = {t: i for i, t in enumerate(_TIERS)}
_SCHEME_CODE = {s: i for i, s in enumerate(_SCHEMES)}
_COLUMNS = (
    ("document id", 0), ("document length", 0), ("tier", 0), ("scheme", 0), ("ring size", 0),
    ("spans of a document", 0), ("ring member", 1), ("span rank", 2), ("span start", 2),
    ("span end", 2), ("ranges of a rank", 3), ("range document", 4), ("range start", 4),
    ("range end", 4), ("route source", 5), ("route destination", 5), ("parts of a route", 5),
    ("part source proxy", 6), ("part destination proxy", 6), ("part weight", 6),
)  # fmt: skip
"""Each column's name and the index of its length in the header's ``counts``."""
_CHUNK = 512
"""Documents, or ranges, whose records are built at once. Each ``records_of`` is a C-level pass
that holds the interpreter lock, and the training thread takes it back between them. And the
records are left out of the collector as soon as they are built (``_untrack``): a pass of the
collector that ran while thousands were still watched would count them as new long-lived
objects, and bring the next full pass nearer."""


def encode(plan: Plan) -> bytes:
    """``plan`` as bytes (module docstring); ``decode`` gives it back."""
    seqs = plan.sequences
    spans = list(chain.from_iterable(map(attrgetter("attention"), seqs)))
    ranges = list(chain.from_iterable(plan.linear))
    parts = list(chain.from_iterable(map(attrgetter("parts"), plan.routes)))
    columns = (
        *columns_of(seqs, "id", "length"),
        list(map(_TIER_CODE.__getitem__, map(attrgetter("tier"), seqs))),
        list(map(_SCHEME_CODE.__getitem__, map(attrgetter("scheme"), seqs))),
        [len(s.ring) for s in seqs],
        [len(s.attention) for s in seqs],
        list(chain.from_iterable(map(attrgetter("ring"), seqs))),
        *columns_of(spans, "rank", "start", "end"),
        list(map(len, plan.linear)),
        *columns_of(ranges, "seq", "start", "end"),
        *columns_of(plan.routes, "src", "dst"),
        [len(r.parts) for r in plan.routes],
        *columns_of(parts, "src_proxy", "dst_proxy", "weight"),
    )
    counts = [len(seqs), len(columns[6]), len(spans), len(plan.linear), len(ranges)]
    header = {
        "counts": [*counts, len(plan.routes), len(parts)],
        "name": plan.name,
        "capacity": plan.capacity,
        "attention_comm": AttentionComm(plan.attention_comm).value,
        "topology": plan.topology.to_dict(),
        "meta": plan.meta,
    }
    text = json.dumps(header, separators=(",", ":"), default=_plain).encode()
    text += b" " * (-len(text) % 4)
    body = np.concatenate([np.asarray(c, dtype=np.int64) for c in columns])
    if body.size and (body.min() < -(2**31) or body.max() >= 2**31):
        raise ValueError(f"plan {plan.name!r} holds a number outside int32: it has no wire form")
    return b"".join((_HEAD.pack(_MAGIC, FORMAT, 0, len(text)), text, body.astype(_INT).tobytes()))


def decode(data: bytes | bytearray | memoryview) -> Plan:
    """The plan ``encode`` wrote; ``ValueError`` naming what is wrong with anything else."""
    header, columns = _read(memoryview(data))
    try:
        topology = Topology.from_dict(header["topology"])
        fields = {
            "name": str(header["name"]),
            "capacity": header["capacity"],
            "attention_comm": AttentionComm(header["attention_comm"]),
            "meta": dict(header["meta"]),
        }
        if fields["capacity"] is not None and type(fields["capacity"]) is not int:
            raise ValueError(f"capacity {fields['capacity']!r} is not a whole number")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"plan payload: a malformed header field ({exc})") from None
    _check(columns, header["counts"], topology.world_size)
    ids, lengths, tiers, schemes, ring_sizes, num_spans, members, *rest = columns
    fields["sequences"] = _sequences(
        ids, lengths, tiers, schemes, ring_sizes, num_spans, members, rest[:3]
    )
    fields["linear"] = _layout(rest[3], rest[4:7])
    fields["routes"] = _routes(rest[7:10], rest[10:13])
    plan = object.__new__(Plan)
    object.__setattr__(plan, "topology", topology)
    for name, value in fields.items():
        object.__setattr__(plan, name, value)
    plan._index_routes()
    return plan


def _plain(value: object) -> object:
    """A numpy number or array in a plan's ``meta`` as the plain value JSON writes."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"a plan's meta holds {type(value).__name__} {value!r}: JSON cannot write it")


def _read(buf: memoryview) -> tuple[dict, list[np.ndarray]]:
    """The header and the columns of a payload, their sizes checked."""
    if len(buf) < _HEAD.size:
        raise ValueError(f"plan payload of {len(buf)} bytes: too short for a plan")
    magic, version, _, size = _HEAD.unpack_from(buf)
    if magic != _MAGIC:
        raise ValueError(f"plan payload starts with {bytes(magic)!r}, not {_MAGIC!r}: not a plan")
    if version != FORMAT:
        raise ValueError(f"plan payload in wire format {version}; this version reads {FORMAT}")
    start = _HEAD.size + size
    try:
        header = json.loads(bytes(buf[_HEAD.size : start]))
        counts = [int(c) for c in header["counts"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"plan payload: its header is not a plan's ({exc})") from None
    if len(counts) != 7 or min(counts) < 0 or len(buf) < start:
        raise ValueError(f"plan payload: header counts {counts} (or the header) cut short")
    lengths = [counts[k] for _, k in _COLUMNS]
    if len(buf) - start != _INT.itemsize * sum(lengths):
        raise ValueError(
            f"plan payload holds {len(buf) - start} bytes of columns where its header counts "
            f"{_INT.itemsize * sum(lengths)}: cut short or padded"
        )
    body = np.frombuffer(buf, dtype=_INT, offset=start).astype(np.int64)
    ends = np.cumsum(lengths).tolist()
    return header, [body[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def _check(columns: list[np.ndarray], counts: list[int], world: int) -> None:
    """Every column's values in range, every group count adding up to the records it groups."""
    named = dict(zip((name for name, _ in _COLUMNS), columns))

    def fail(name: str, what: str) -> None:
        raise ValueError(f"plan payload: {name} {what}")

    def within(name: str, low: int, high: int) -> None:
        column = named[name]
        if column.size and (column.min() < low or column.max() >= high):
            fail(name, f"outside [{low}, {high}): {int(column.min())} .. {int(column.max())}")

    if counts[3] != world:
        fail("ranges of a rank", f"listed for {counts[3]} ranks on a topology of {world} GPUs")
    within("tier", 0, len(_TIERS))
    within("scheme", 0, len(_SCHEMES))
    within("ring size", 1, world + 1)
    for name in ("ring member", "span rank", "route source", "route destination"):
        within(name, 0, world)
    within("part source proxy", 0, world)
    within("part destination proxy", 0, world)
    groups = ("ring size", 1), ("spans of a document", 2), ("ranges of a rank", 4)
    for group, index in (*groups, ("parts of a route", 6)):
        if named[group].min(initial=0) < 0 or int(named[group].sum()) != counts[index]:
            fail(group, f"add up to {int(named[group].sum())}, not {counts[index]}")
    doc_length = np.repeat(named["document length"], named["spans of a document"])
    for kind, limit in (("span", doc_length), ("range", None)):
        start, end = named[f"{kind} start"], named[f"{kind} end"]
        if start.size and (start.min() < 0 or (end <= start).any()):
            fail(f"{kind} start", "negative, or not before its end")
        if limit is not None and (end > limit).any():
            fail(f"{kind} end", "past its document's length")


def _sequences(ids, lengths, tiers, schemes, ring_sizes, num_spans, members, span_columns):
    """The documents' records, ``_CHUNK`` documents at a time."""
    ring_ends = np.cumsum(ring_sizes).tolist()
    span_ends = np.cumsum(num_spans).tolist()
    out: list[SequencePlan] = []
    for a in range(0, len(ids), _CHUNK):
        b = min(a + _CHUNK, len(ids))
        r0, r1 = ring_ends[a - 1] if a else 0, ring_ends[b - 1]
        s0, s1 = span_ends[a - 1] if a else 0, span_ends[b - 1]
        ring_members = members[r0:r1].tolist()
        ends = [e - r0 for e in ring_ends[a:b]]
        rings = list(map(tuple, map(ring_members.__getitem__, map(slice, [0, *ends[:-1]], ends))))
        attention = grouped_records(
            Span, num_spans[a:b].tolist(), [c[s0:s1].tolist() for c in span_columns]
        )
        _untrack(chain(attention, chain.from_iterable(attention)))
        columns = (
            ids[a:b].tolist(),
            lengths[a:b].tolist(),
            list(map(_TIERS.__getitem__, tiers[a:b].tolist())),
            rings,
            attention,
            list(map(_SCHEMES.__getitem__, schemes[a:b].tolist())),
        )
        records = records_of(SequencePlan, *columns)
        _untrack(records)
        out += records
    return tuple(out)


def _layout(counts: np.ndarray, range_columns: list[np.ndarray]) -> tuple:
    """Every rank's linear ranges, in pieces of ranks holding about ``_CHUNK`` ranges."""
    ends = np.cumsum(counts).tolist()
    per_rank = max(1, (ends[-1] if ends else 0) // max(1, len(ends)))
    step = max(1, _CHUNK // per_rank)  # ranks per piece
    out: list[tuple[TokenRange, ...]] = []
    for a in range(0, len(ends), step):
        b = min(a + step, len(ends))
        r0, r1 = ends[a - 1] if a else 0, ends[b - 1]
        ranks = grouped_records(
            TokenRange, counts[a:b].tolist(), [c[r0:r1].tolist() for c in range_columns]
        )
        _untrack(chain(ranks, chain.from_iterable(ranks)))
        out += ranks
    return tuple(out)


def _routes(route_columns: list[np.ndarray], part_columns: list[np.ndarray]) -> tuple:
    """The routes (a few per cross-node ring edge: plain records)."""
    srcs, dsts, num_parts = (c.tolist() for c in route_columns)
    parts = list(map(RoutePart, *(c.tolist() for c in part_columns)))
    ends = np.cumsum(num_parts).tolist()
    return tuple(
        Route(s, d, tuple(parts[a:b])) for s, d, a, b in zip(srcs, dsts, [0, *ends[:-1]], ends)
    )


if sys.implementation.name == "cpython":
    _GC_UNTRACK = ctypes.pythonapi.PyObject_GC_UnTrack
    _GC_UNTRACK.argtypes, _GC_UNTRACK.restype = [ctypes.py_object], None

    def _untrack(objects) -> None:
        """Leave ``objects`` (records and tuples of records, which hold no reference cycles)
        out of the cyclic collector's passes; reference counting still frees them."""
        deque(map(_GC_UNTRACK, objects), maxlen=0)

else:  # pragma: no cover - another interpreter's collector: leave it be

    def _untrack(objects) -> None:
        pass
