"""The parts a plan is made of (``plan.py`` assembles and checks them): where a document's
attention runs (``Tier``, ``Scheme``), its query spans (``Span``, ``SequencePlan``), the linear
layout's ranges (``TokenRange``), the routes of cross-node ring edges (``Route``), and the
zigzag geometry every builder cuts documents with.
"""

from __future__ import annotations

import functools
import pickle
from collections import deque
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass
from enum import Enum
from itertools import accumulate, chain, repeat
from operator import attrgetter, itemgetter

from megatron_zeppelin.topology.model import Topology

__all__ = [
    "AttentionComm",
    "Route",
    "RoutePart",
    "Scheme",
    "SequencePlan",
    "Span",
    "Tier",
    "TokenRange",
    "columns_of",
    "grouped_records",
    "node_chunks",
    "node_grid",
    "records_of",
    "share_spans",
    "split_by_weights",
    "zigzag_bounds",
    "zigzag_loads",
    "zigzag_sequences",
    "zigzag_spans",
]


class Tier(str, Enum):
    """Where a document's attention runs."""

    LOCAL = "local"  # whole document on one GPU, no communication
    INTRA = "intra"  # ring of GPUs inside one node (NVLink)
    INTER = "inter"  # ring spanning several nodes (NICs)

    @classmethod
    def of_ring(cls, ring: tuple[int, ...] | list[int], gpus_per_node: int) -> Tier:
        """The tier a ring of ranks stands for: one rank, one node, or several nodes."""
        if len(ring) == 1:
            return cls.LOCAL
        node = ring[0] // gpus_per_node
        same = all(r // gpus_per_node == node for r in ring)
        return cls.INTRA if same else cls.INTER


class AttentionComm(str, Enum):
    """How K/V reach the query holders of a split document."""

    RING = "ring"  # P2P ring, one K/V block per step (TE ring CP, Zeppelin)
    ALLGATHER = "allgather"  # all-gather K/V once over the group (LLaMA-3 CP)


class Scheme(str, Enum):
    """How a split document's attention runs (docs/DESIGN.md, "Two-dimensional attention for
    documents that span nodes")."""

    RING = "ring"  # one ring over every rank of ``ring``
    TWO_D = "2d"  # heads split inside each node, one ring per head group across the nodes


# The records a plan holds one of per document, span or range (10^4 to 10^6 of them) keep their
# fields in slots (half the memory of an instance dict) and write them with the slots' own
# setters (a frozen dataclass's generated ``__init__`` calls ``object.__setattr__`` per field,
# twice as slow). Equality, hashing, ``repr`` and ``replace`` are the dataclass's. A record
# pickled on its own calls that ``__init__`` (``__reduce__``: the dataclass's state setter, per
# field, takes three times as long); a whole plan pickles its records packed instead
# (``pack_sequences``), and they are made in bulk (``_records``).
@dataclass(frozen=True, slots=True, init=False)
class Span:
    """Query tokens ``[start, end)`` of one document computed on ``rank``."""

    rank: int
    start: int
    end: int

    def __init__(self, rank: int, start: int, end: int) -> None:
        set_rank, set_start, set_end = _SPAN_SETTERS
        set_rank(self, rank)
        set_start(self, start)
        set_end(self, end)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def __reduce__(self) -> tuple:
        return type(self), (self.rank, self.start, self.end)


@dataclass(frozen=True, slots=True, init=False)
class TokenRange:
    """Tokens ``[start, end)`` of document ``seq``."""

    seq: int
    start: int
    end: int

    def __init__(self, seq: int, start: int, end: int) -> None:
        set_seq, set_start, set_end = _TOKEN_RANGE_SETTERS
        set_seq(self, seq)
        set_start(self, start)
        set_end(self, end)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def __reduce__(self) -> tuple:
        return type(self), (self.seq, self.start, self.end)


@dataclass(frozen=True, slots=True, init=False)
class SequencePlan:
    """One document's attention placement."""

    id: int
    length: int
    tier: Tier
    ring: tuple[int, ...]
    """Ranks of the document's ring in ring order; one rank for a local document."""
    attention: tuple[Span, ...]
    """Query ranges per rank; they partition ``[0, length)``. Empty spans are not listed."""
    scheme: Scheme = Scheme.RING
    """``TWO_D``: ``ring`` lists whole nodes, node by node in ring order (``node_grid``; the
    order inside a node does not matter: a rank's head group is its local GPU index);
    ``attention`` is where the document's tokens arrive with all their heads, each rank's spans
    inside its node's zigzag chunks (``node_chunks``). The engine moves heads between the
    node's ranks itself."""

    def __init__(
        self,
        id: int,  # noqa: A002 (the plan file's name for it)
        length: int,
        tier: Tier,
        ring: tuple[int, ...],
        attention: tuple[Span, ...],
        scheme: Scheme = Scheme.RING,
    ) -> None:
        set_id, set_length, set_tier, set_ring, set_attention, set_scheme = _SEQUENCE_SETTERS
        set_id(self, id)
        set_length(self, length)
        set_tier(self, tier)
        set_ring(self, ring)
        set_attention(self, attention)
        set_scheme(self, scheme)

    def __reduce__(self) -> tuple:
        fields = (self.id, self.length, self.tier, self.ring, self.attention, self.scheme)
        return type(self), fields

    @property
    def is_two_d(self) -> bool:
        return self.scheme == Scheme.TWO_D

    @property
    def ring_size(self) -> int:
        return len(self.ring)

    def spans_of(self, rank: int) -> tuple[Span, ...]:
        return tuple(s for s in self.attention if s.rank == rank)


def _slot_setters(cls: type, *names: str) -> tuple:
    return tuple(cls.__dict__[name].__set__ for name in names)


_SPAN_SETTERS = _slot_setters(Span, "rank", "start", "end")
_TOKEN_RANGE_SETTERS = _slot_setters(TokenRange, "seq", "start", "end")
_SEQUENCE_SETTERS = _slot_setters(
    SequencePlan, "id", "length", "tier", "ring", "attention", "scheme"
)


@dataclass(frozen=True)
class RoutePart:
    """One part of a routed message: ``src -> src_proxy`` (NVLink, skipped when equal),
    ``src_proxy -> dst_proxy`` (the proxies' rail, across nodes), ``dst_proxy -> dst`` (NVLink,
    skipped when equal). ``weight`` is its share; see ``split_by_weights``."""

    src_proxy: int
    dst_proxy: int
    weight: int


@dataclass(frozen=True)
class Route:
    """How every message on the ring edge ``src -> dst`` (different nodes) is split."""

    src: int
    dst: int
    parts: tuple[RoutePart, ...]


def split_by_weights(num_tokens: int, weights: tuple[int, ...] | list[int]) -> list[int]:
    """Split ``num_tokens`` into integer parts proportional to ``weights`` (largest remainder,
    ties to the lower index). Deterministic, so sender, proxies and receiver agree."""
    total = sum(weights)
    assert total > 0 and all(w >= 0 for w in weights), weights
    base = [num_tokens * w // total for w in weights]
    rest = num_tokens - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(num_tokens * weights[i] % total), i))
    for i in order[:rest]:
        base[i] += 1
    return base


def zigzag_bounds(length: int, ring_size: int) -> list[tuple[int, int]]:
    """The ``2g`` chunk bounds of a causal document cut for a ring of ``g``: ``round(j*L/2g)``."""
    num_chunks = 2 * ring_size
    cuts = [round(j * length / num_chunks) for j in range(num_chunks + 1)]
    return [(cuts[j], cuts[j + 1]) for j in range(num_chunks)]


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few many times
def zigzag_loads(length: int, ring_size: int) -> tuple[int, ...]:
    """Tokens each ring position holds under zigzag (chunks ``i`` and ``2g-1-i``)."""
    if ring_size == 1:
        return (length,)
    n = 2 * ring_size  # position i holds chunks [cuts[i], cuts[i+1]) and [cuts[n-1-i], cuts[n-i])
    cuts = [round(j * length / n) for j in range(n + 1)]
    return tuple(cuts[i + 1] - cuts[i] + cuts[n - i] - cuts[n - 1 - i] for i in range(ring_size))


def zigzag_spans(length: int, ring: tuple[int, ...]) -> tuple[Span, ...]:
    """Zigzag attention spans: ring position ``i`` holds chunks ``i`` and ``2g-1-i``
    (``zigzag_bounds``). Empty chunks (documents shorter than ``2g``) are left out."""
    n = 2 * len(ring)
    cuts = [round(j * length / n) for j in range(n + 1)]
    spans = []
    for i, rank in enumerate(ring):
        start, end = cuts[i], cuts[i + 1]
        if end > start:
            spans.append(Span(rank, start, end))
        start, end = cuts[n - 1 - i], cuts[n - i]
        if end > start:
            spans.append(Span(rank, start, end))
    return tuple(spans)


def share_spans(length: int, ring: tuple[int, ...], tokens: Sequence[int]) -> tuple[Span, ...]:
    """Zigzag chunks of uneven sizes: ring position ``i`` holds ``tokens[i]`` tokens, the next
    ``tokens[i] // 2`` from the document's front and the rest, mirrored, from its back (so
    position 0 holds the first and the last tokens). A causal document's attention pairs then
    split over the ring in proportion to the tokens, as under zigzag: a front chunk
    ``[a, a + n)`` and its mirror ``[L - b - m, L - b)`` together see about ``n * L`` keys when
    ``m`` is about ``n`` and ``b`` about ``a``. Each position needs at least 2 tokens."""
    if len(tokens) != len(ring) or sum(tokens) != length or min(tokens) < 2:
        raise ValueError(
            f"a ring of {len(ring)} ranks needs as many token shares of at least 2, summing to "
            f"the document's {length} tokens (got {list(tokens)})"
        )
    spans, front, back = [], 0, length
    for rank, num in zip(ring, tokens):
        head = num // 2
        spans.append(Span(rank, front, front + head))
        spans.append(Span(rank, back - (num - head), back))
        front, back = front + head, back - (num - head)
    return tuple(spans)


def zigzag_sequences(
    lengths: list[int],
    rings: list[tuple[int, ...]],
    tiers: list[Tier],
    shares: dict[int, Sequence[int]] | None = None,
    ids: Sequence[int] | None = None,
) -> tuple[SequencePlan, ...]:
    """Documents ``0, 1, ...`` of ``lengths`` (or ``ids``, one per length) on ``rings``: whole
    on a ring of one rank, else zigzagged over it (``zigzag_spans``), or, for the documents of
    ``shares`` (by position in ``lengths``), over it with the tokens each member is given
    (``share_spans``). Most documents are whole: they are built with C-level maps, the rings
    one by one."""
    num_docs = len(lengths)
    firsts = list(map(itemgetter(0), rings))
    whole = _records(Span, _SPAN_SETTERS, num_docs, firsts, repeat(0), lengths)
    attention: list[tuple[Span, ...]] = list(zip(whole))
    shares = shares or {}
    for i, ring in enumerate(rings):
        if i in shares:
            attention[i] = share_spans(lengths[i], ring, shares[i])
        elif len(ring) > 1:
            attention[i] = zigzag_spans(lengths[i], ring)
    numbers = range(num_docs) if ids is None else ids
    columns = (numbers, lengths, tiers, rings, attention, repeat(Scheme.RING))
    return tuple(_records(SequencePlan, _SEQUENCE_SETTERS, num_docs, *columns))


def _records(cls: type, setters: tuple, count: int, *columns: Iterable) -> list:
    """``count`` records of ``cls`` from a column per field (in ``setters``' order), built by
    C-level maps: ``count`` empty records, then each field's slot setter over them. What
    ``__init__`` does for one record, without a Python call per record: about 1.6x faster for
    10^4 of them."""
    assert all(len(c) == count for c in columns if isinstance(c, Sized)), "a field left unset"
    records = list(map(object.__new__, repeat(cls, count)))
    for set_field, column in zip(setters, columns, strict=True):
        deque(map(set_field, records, column), maxlen=0)
    return records


_SETTERS = {Span: _SPAN_SETTERS, TokenRange: _TOKEN_RANGE_SETTERS, SequencePlan: _SEQUENCE_SETTERS}


def records_of(cls: type, *columns: Sequence) -> list:
    """Records of ``cls`` (``Span``, ``TokenRange`` or ``SequencePlan``) from one column per
    field, in the order the fields are declared, built in bulk (``_records``)."""
    return _records(cls, _SETTERS[cls], len(columns[0]), *columns)


def grouped_records(cls: type, counts: list[int], columns: list[list]) -> tuple[tuple, ...]:
    """``records_of`` cut into consecutive tuples of ``counts`` records each."""
    return _grouped_records(cls, _SETTERS[cls], counts, columns)


def node_chunks(length: int, num_nodes: int, position: int) -> list[tuple[int, int]]:
    """The token ranges node ``position`` (of ``num_nodes`` in ring order) holds of a 2-D
    document: zigzag chunks ``position`` and ``2n-1-position`` over the nodes, empty ones left
    out, in position order."""
    bounds = zigzag_bounds(length, num_nodes)
    chosen = (bounds[position], bounds[2 * num_nodes - 1 - position])
    return [(start, end) for start, end in chosen if end > start]


def node_grid(ring: tuple[int, ...], topology: Topology) -> tuple[tuple[int, ...], ...]:
    """A 2-D document's ring as one row per node (its ranks as listed), nodes in ring order;
    ``ValueError`` unless the ring lists whole nodes, each node's ranks together."""
    k = topology.gpus_per_node
    rows = tuple(tuple(ring[i : i + k]) for i in range(0, len(ring), k))
    nodes = [topology.node_of(row[0]) for row in rows]
    whole = all(sorted(row) == list(topology.ranks_of_node(n)) for row, n in zip(rows, nodes))
    if not whole or len(set(nodes)) != len(nodes):
        raise ValueError(
            f"ring {ring} of a 2-D document must list whole nodes: every rank of each of its "
            f"nodes ({k} per node), node by node"
        )
    return rows


# --- records packed for pickling (``Plan.__reduce__``) --------------------------------------------
_CHUNK = 2048
"""Records per piece of a packed plan. Unpickling a piece and rebuilding its records are C-level
passes that hold the interpreter lock throughout: the training process unpickles plans in a
reader thread, and the thread that launches the step's kernels gets the lock back between
pieces (about a millisecond each) instead of after the whole plan."""


def pack_sequences(sequences: tuple[SequencePlan, ...]) -> list[bytes]:
    """``sequences`` in pieces of ``_CHUNK`` documents, each pickled on its own as lists of plain
    values: ids, lengths, tiers, rings, schemes, the number of spans of each, and the spans'
    ranks, starts and ends (``unpack_sequences``)."""
    return [
        _pickled(_sequence_columns(sequences[a : a + _CHUNK]))
        for a in range(0, len(sequences), _CHUNK)
    ]


def unpack_sequences(pieces: list[bytes]) -> tuple[SequencePlan, ...]:
    out: list[SequencePlan] = []
    for piece in pieces:
        ids, lengths, tiers, rings, schemes, counts, *span_fields = pickle.loads(piece)
        attention = _grouped_records(Span, _SPAN_SETTERS, counts, span_fields)
        fields = (ids, lengths, tiers, rings, attention, schemes)
        out += _records(SequencePlan, _SEQUENCE_SETTERS, len(ids), *fields)
    return tuple(out)


def pack_layout(layout: tuple[tuple[TokenRange, ...], ...]) -> list[bytes]:
    """A layout (token ranges per rank) in pieces of ranks holding about ``_CHUNK`` ranges,
    each pickled on its own as lists: the number of ranges per rank, then their documents,
    starts and ends (``unpack_layout``)."""
    per_rank = max(1, sum(map(len, layout)) // max(1, len(layout)))
    step = max(1, _CHUNK // per_rank)  # ranks per piece
    return [_pickled(_range_columns(layout[a : a + step])) for a in range(0, len(layout), step)]


def unpack_layout(pieces: list[bytes]) -> tuple[tuple[TokenRange, ...], ...]:
    out: list[tuple[TokenRange, ...]] = []
    for piece in pieces:
        counts, *fields = pickle.loads(piece)
        out += _grouped_records(TokenRange, _TOKEN_RANGE_SETTERS, counts, fields)
    return tuple(out)


def _sequence_columns(sequences: tuple[SequencePlan, ...]) -> tuple[list, ...]:
    attention = list(map(attrgetter("attention"), sequences))
    spans = list(chain.from_iterable(attention))
    columns = columns_of(sequences, "id", "length", "tier", "ring", "scheme")
    return (*columns, list(map(len, attention)), *columns_of(spans, "rank", "start", "end"))


def _range_columns(layout: tuple[tuple[TokenRange, ...], ...]) -> tuple[list, ...]:
    ranges = list(chain.from_iterable(layout))
    return (list(map(len, layout)), *columns_of(ranges, "seq", "start", "end"))


def columns_of(records: Sequence, *names: str) -> list[list]:
    """One list per field ``names`` of ``records`` (``records_of``'s columns)."""
    return [list(map(attrgetter(name), records)) for name in names]


def _pickled(columns: tuple[list, ...]) -> bytes:
    return pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)


def _grouped_records(
    cls: type, setters: tuple, counts: list[int], columns: list[list]
) -> tuple[tuple, ...]:
    """Records of ``cls`` from ``columns`` (``_records``), cut into consecutive tuples of
    ``counts`` records each: a document's spans, a rank's ranges."""
    records = _records(cls, setters, len(columns[0]), *columns)
    ends = list(accumulate(counts))
    return tuple(map(tuple, map(records.__getitem__, map(slice, [0, *ends[:-1]], ends))))
