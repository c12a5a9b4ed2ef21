"""Ring messages of a plan, step by step, and the bytes they put on each link class.

Pure: the engine executes this schedule, the simulator times it, and the byte counters of the
communication layer must match ``link_bytes`` exactly. The backward's gradient messages are
``gradient_schedule``; ``training_link_bytes`` predicts a whole forward and backward.

How a message travels is ``message_legs``, the one place a routed message is cut over its route:
both exchangers (``comm/exchange.py``, ``comm/threads.py``), ``link_bytes`` and the simulator
take their legs from it, so transfers, counters and predictions agree row for row.

2-D documents (``Scheme.TWO_D``) are not in the ring schedule: their rings run on the head
layout (``heads.head_plan``, whose schedule this module computes like any plan's) after a head
all-to-all inside each node (``exchange_messages``); ``two_d_link_bytes`` predicts both and
``engine_link_bytes`` everything one layer of the engine sends.

Ring semantics (one document, ring ``r_0 .. r_{g-1}``): before step 0 every position holds its own
K/V block. At step ``s`` (``0 <= s < g-1``) position ``i`` sends the block it currently holds,
which is the block of position ``(i - s) mod g``, to position ``(i + 1) mod g``. After ``g-1``
steps every position has seen every block. All documents step together: step ``s`` carries the
messages of every document whose ring has more than ``s + 1`` members; the blocks of several
documents that travel on the same edge in the same step are concatenated into one message,
ordered by document id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from megatron_zeppelin.planner.plan.heads import AttentionShape, head_plan, node_members
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    Route,
    Scheme,
    SequencePlan,
    Tier,
    split_by_weights,
)
from megatron_zeppelin.topology.model import Topology

MAX_HOPS = 3
"""A leg visits at most four GPUs: sender, source proxy, destination proxy, receiver."""


@dataclass(frozen=True)
class Segment:
    """The K/V block of document ``seq`` owned by ``origin`` (its query ranks' tokens)."""

    seq: int
    origin: int
    num_tokens: int


@dataclass(frozen=True)
class Message:
    """All blocks sent on the edge ``src -> dst`` in one ring step."""

    src: int
    dst: int
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)


@dataclass(frozen=True)
class Leg:
    """One piece of a message on a fixed path: rows ``[offset, offset + num_tokens)`` of the
    message travel ``path`` (ranks visited in order, consecutive duplicates removed)."""

    offset: int
    num_tokens: int
    path: tuple[int, ...]

    @property
    def hops(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.path[:-1], self.path[1:]))


def message_legs(msg: Message, route: Route | None) -> tuple[Leg, ...]:
    """The legs of ``msg`` (pieces with rows only, in row order): one direct leg without a
    route; with one, the rows cut by ``split_by_weights`` over the route's parts, part ``j``
    travelling ``src -> src_proxy_j -> dst_proxy_j -> dst`` (NVLink, the proxies' rail across
    nodes, NVLink; a hop to the same GPU is skipped)."""
    if route is None:
        return (Leg(0, msg.num_tokens, (msg.src, msg.dst)),) if msg.num_tokens else ()
    assert (route.src, route.dst) == (msg.src, msg.dst), (route, msg)
    legs = []
    offset = 0
    for path, n in zip(
        route_paths(route), split_by_weights(msg.num_tokens, [p.weight for p in route.parts])
    ):
        if n:
            legs.append(Leg(offset, n, path))
        offset += n
    return tuple(legs)


def route_paths(route: Route) -> tuple[tuple[int, ...], ...]:
    """The path of each of ``route``'s parts, zero-weight parts included (``message_legs``
    keeps those that carry rows): ``src -> src_proxy -> dst_proxy -> dst``, a hop to the same
    GPU skipped."""
    paths = []
    for part in route.parts:
        path = [route.src]
        for rank in (part.src_proxy, part.dst_proxy, route.dst):
            if rank != path[-1]:
                path.append(rank)
        assert len(path) - 1 <= MAX_HOPS
        paths.append(tuple(path))
    return tuple(paths)


def routes_by_edge(plan: Plan, *, routing: bool = True) -> dict[tuple[int, int], Route]:
    """``plan``'s routes keyed by ring edge (empty with ``routing=False``: every message goes
    direct)."""
    return plan.route_index if routing else {}


def block_tokens(
    plan: Plan, sequences: Iterable[SequencePlan] | None = None
) -> dict[tuple[int, int], int]:
    """Tokens of each (document, rank) K/V block (of ``sequences`` alone where given)."""
    sizes: dict[tuple[int, int], int] = defaultdict(int)
    for seq in plan.sequences if sequences is None else sequences:
        for span in seq.attention:
            sizes[(seq.id, span.rank)] += span.num_tokens
    return dict(sizes)


def relayed_edges(routes: Mapping[tuple[int, int], Route], rank: int) -> set[tuple[int, int]]:
    """The ring edges of ``routes`` whose parts ``rank`` relays (a proxy, not an end)."""
    return {
        edge
        for edge, route in routes.items()
        if rank not in edge
        and any(rank in (part.src_proxy, part.dst_proxy) for part in route.parts)
    }


def ring_schedule(
    plan: Plan,
    tiers: tuple[Tier, ...] = (Tier.INTRA, Tier.INTER),
    *,
    sizes: dict[tuple[int, int], int] | None = None,
    rank: int | None = None,
    routes: Mapping[tuple[int, int], Route] | None = None,
) -> list[list[Message]]:
    """Messages per ring step for the documents of the given tiers (see the module docstring).

    Messages in a step are sorted by ``(src, dst)``; every rank computes the same list.
    ``sizes``: ``block_tokens(plan)`` when the caller already has it (it walks every span of
    the plan, so callers building several schedules of one plan compute it once).

    With ``rank``, only the messages ``rank`` sends, receives or relays over ``routes``
    (``plan.route_index`` by default), in the same order and with the same segments, and as
    many steps: what one rank of a thousand acts on, worked out from the documents of its
    rings and of the edges it relays alone (the rest of the schedule is never built).
    """
    wanted = {Tier(t) for t in tiers}
    # Ring size first: most documents are local, and the tier test is the slower one. 2-D
    # documents run their rings on the head layout (``two_d_link_bytes``).
    rings = [
        s
        for s in plan.sequences
        if len(s.ring) > 1 and Tier(s.tier) in wanted and s.scheme == Scheme.RING
    ]
    num_steps = max((s.ring_size - 1 for s in rings), default=0)
    keep: Callable[[int, int], bool] | None = None
    if rank is not None:
        relayed = relayed_edges(plan.route_index if routes is None else routes, rank)
        relays = {src for src, _ in relayed}
        rings = [s for s in rings if rank in s.ring or not relays.isdisjoint(s.ring)]

        def keep(src: int, dst: int) -> bool:
            return src == rank or dst == rank or (src, dst) in relayed

    if sizes is None:
        sizes = block_tokens(plan, rings if rank is not None else None)
    steps: list[list[Message]] = []
    for step in range(num_steps):
        edges: dict[tuple[int, int], list[Segment]] = defaultdict(list)
        for seq in rings:
            g = seq.ring_size
            if step >= g - 1:
                continue
            for i, src in enumerate(seq.ring):
                dst = seq.ring[(i + 1) % g]
                if keep is not None and not keep(src, dst):
                    continue
                origin = seq.ring[(i - step) % g]
                n = sizes.get((seq.id, origin), 0)
                edges[(src, dst)].append(Segment(seq.id, origin, n))
        steps.append([Message(src, dst, tuple(segs)) for (src, dst), segs in sorted(edges.items())])
    return steps


def link_bytes(
    plan: Plan,
    steps: list[list[Message]],
    *,
    bytes_per_token: int,
    routing: bool,
) -> dict[str, int]:
    """Bytes each link class carries for ``steps``: ``nvlink`` (within a node), ``nic`` (across
    nodes, all NICs) and ``nic:<node>.<nic>`` per sending NIC.

    Every hop of every leg (``message_legs``) counts once: within a node on NVLink, across nodes
    on the NIC next to the hop's sender (a direct message's sender, a routed part's source proxy).
    """
    topo = plan.topology
    routes = routes_by_edge(plan, routing=routing)
    out: dict[str, int] = defaultdict(int)
    out["nvlink"] = 0
    out["nic"] = 0
    for step in steps:
        for msg in step:
            _add_legs(out, topo, msg, routes.get((msg.src, msg.dst)), bytes_per_token)
    return dict(out)


def _add_legs(
    out: dict[str, int], topo: Topology, msg: Message, route: Route | None, bytes_per_token: int
) -> None:
    """``link_bytes``' count of one message: every hop of every leg once."""
    for leg in message_legs(msg, route):
        for a, b in leg.hops:
            _add_hop(out, topo, a, b, leg.num_tokens * bytes_per_token)


def _add_hop(out: dict[str, int], topo: Topology, a: int, b: int, num_bytes: int) -> None:
    """One hop ``a -> b`` of ``num_bytes``: on NVLink within a node, else on the NIC next to
    ``a``."""
    if topo.same_node(a, b):
        out["nvlink"] += num_bytes
    else:
        out["nic"] += num_bytes
        out[f"nic:{topo.node_of(a)}.{topo.nic_of(a)}"] += num_bytes


def ring_link_bytes(
    plan: Plan,
    tiers: tuple[Tier, ...],
    *,
    bytes_per_token: int,
    routing: bool,
    gradients: bool = False,
    routes_of: Plan | None = None,
) -> dict[str, int]:
    """``link_bytes(plan, ring_schedule(plan, tiers), ...)`` (with ``gradients``, of
    ``gradient_schedule``), counted without building the schedule: at a thousand GPUs its
    messages are hundreds of thousands, and a ring of ``g`` members ``g - 1`` steps of ``g``.

    An edge the plan does not route carries the same bytes whatever travels with them, so its
    document's share is counted once for all steps: over the K/V steps, edge ``i -> i + 1``
    carries every block but the receiver's own; over the gradient steps, every block's gradient
    but the sender's. A routed edge's message is cut by its route's weights as a whole, so its
    documents' tokens are summed per step first, as the schedule would send them.
    ``routes_of``: the plan whose routes the messages take (``plan`` by default; the column
    rings of ``head_plan`` take their plan's).
    """
    topo = plan.topology
    routes = routes_by_edge(routes_of or plan, routing=routing)
    wanted = {Tier(t) for t in tiers}
    out: dict[str, int] = defaultdict(int)
    out["nvlink"] = 0
    out["nic"] = 0
    routed: dict[tuple[int, int, int], int] = defaultdict(int)  # (step, src, dst) -> tokens
    shift = 1 if gradients else 0
    for seq in plan.sequences:
        ring = seq.ring
        g = len(ring)
        if g < 2 or Tier(seq.tier) not in wanted or seq.scheme != Scheme.RING:
            continue
        blocks: dict[int, int] = defaultdict(int)
        for span in seq.attention:
            blocks[span.rank] += span.end - span.start
        total = sum(blocks.values())
        for i, src in enumerate(ring):
            dst = ring[(i + 1) % g]
            if (src, dst) in routes:
                for step in range(g - 1):
                    tokens = blocks.get(ring[(i - step - shift) % g], 0)
                    if tokens:
                        routed[(step, src, dst)] += tokens
                continue
            tokens = total - blocks.get(ring[i] if gradients else dst, 0)
            if tokens:  # a message of no tokens has no leg
                _add_hop(out, topo, src, dst, tokens * bytes_per_token)
    for (_, src, dst), tokens in routed.items():
        message = Message(src, dst, (Segment(-1, src, tokens),))
        _add_legs(out, topo, message, routes[(src, dst)], bytes_per_token)
    return dict(out)


def gradient_schedule(
    plan: Plan,
    tiers: tuple[Tier, ...] = (Tier.INTRA, Tier.INTER),
    *,
    sizes: dict[tuple[int, int], int] | None = None,
    kv_steps: list[list[Message]] | None = None,
) -> list[list[Message]]:
    """The dK/dV messages of the backward, step by step, for the documents of ``tiers``.

    They travel the edges of ``ring_schedule(plan, tiers)`` one step behind the K/V blocks: at
    step ``s`` position ``i`` passes on the gradient of the block it received at step ``s - 1``
    (its own block's contributions stay home at compute 0), i.e. the gradient of the block of
    position ``(i - s - 1) mod g``; the last step, ``g - 2``, brings every block's gradient home
    to its owner. Message ``m`` of a step has the same edge and document order as K/V message
    ``m``; only the segments' origins (and so their sizes) differ.

    ``sizes`` (``block_tokens(plan)``) and ``kv_steps`` (``ring_schedule(plan, tiers)``) may be
    passed when the caller has them already; they are computed otherwise. Given one rank's
    ``kv_steps`` (``ring_schedule``'s ``rank``), the gradients of that rank's messages.
    """
    if kv_steps is None:
        sizes = block_tokens(plan) if sizes is None else sizes
        kv_steps = ring_schedule(plan, tiers=tiers, sizes=sizes)
    docs = {seq.id: seq for seq in plan.sequences if len(seq.ring) > 1}
    if sizes is None:  # the blocks of the documents ``kv_steps`` carries, and no others
        carried = {seg.seq for step in kv_steps for msg in step for seg in msg.segments}
        sizes = block_tokens(plan, [docs[seq] for seq in sorted(carried)])
    rings = {seq_id: seq.ring for seq_id, seq in docs.items()}
    steps = []
    for step in kv_steps:
        messages = []
        for msg in step:
            segments = []
            for seg in msg.segments:
                ring = rings[seg.seq]
                back = ring[(ring.index(seg.origin) - 1) % len(ring)]
                segments.append(Segment(seg.seq, back, sizes.get((seg.seq, back), 0)))
            messages.append(Message(msg.src, msg.dst, tuple(segments)))
        steps.append(messages)
    return steps


def training_link_bytes(
    plan: Plan,
    *,
    kv_bytes_per_token: int,
    grad_bytes_per_token: int,
    routing: bool,
) -> dict[str, int]:
    """Bytes per link class of one attention forward and backward of the flat rings as the
    engine runs them (2-D documents: ``two_d_link_bytes``).

    The forward sends K and V around the rings (``ring_schedule``); the backward sends them
    again (only the rank's own tokens are kept from the forward) and dK, dV behind them
    (``gradient_schedule``). ``kv_bytes_per_token``: K and V of one token in the input dtype;
    ``grad_bytes_per_token``: dK and dV of one token as they travel (float32 for half-precision
    inputs). Each tier is its own exchange in the engine, so each is predicted on its own: a
    routed message is split by its route's weights per tier, exactly as the exchanger cuts it.
    Keys as in ``link_bytes``; a NIC key appears when any of the passes lists it.
    """
    if kv_bytes_per_token < 0 or grad_bytes_per_token < 0:
        raise ValueError(
            f"bytes per token must be non-negative, got K/V {kv_bytes_per_token} and "
            f"gradient {grad_bytes_per_token}"
        )
    total: dict[str, int] = {"nvlink": 0, "nic": 0}
    for tier in (Tier.INTER, Tier.INTRA):
        passes = ((False, 2 * kv_bytes_per_token), (True, grad_bytes_per_token))  # K/V twice
        for gradients, bytes_per_token in passes:
            counts = ring_link_bytes(
                plan,
                (tier,),
                bytes_per_token=bytes_per_token,
                routing=routing,
                gradients=gradients,
            )
            for key, value in counts.items():
                total[key] = total.get(key, 0) + value
    return total


def exchange_messages(plan: Plan, *, to_heads: bool, rank: int | None = None) -> list[Message]:
    """The head all-to-all of ``plan``'s 2-D documents, every rank's messages in global order
    (sorted by ``(src, dst)``, a message's segments by document id); with ``rank``, only the
    ones it sends or receives (they never leave a node: none is relayed).

    ``to_heads``: token layout -> head layout; ``src`` sends its own tokens of each document
    (``Segment.origin == src``), the heads of ``dst``'s group. Otherwise head layout -> token
    layout: ``src`` sends ``dst``'s tokens (``origin == dst``), the heads of ``src``'s group.
    A rank's own part stays home and is not a message.
    """
    edges: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    for seq_id, row, tokens in node_members(plan):
        if rank is not None and rank not in row:
            continue
        for src in row:
            for dst in row:
                if rank is not None and rank not in (src, dst):
                    continue
                owner = src if to_heads else dst
                if src != dst and tokens.get(owner, 0):
                    edges[(src, dst)].append(Segment(seq_id, owner, tokens[owner]))
    return [Message(src, dst, tuple(segs)) for (src, dst), segs in sorted(edges.items())]


def head_swap_tokens(plan: Plan) -> int:
    """Tokens one direction of the head all-to-all sends (``exchange_messages``' total),
    without listing its messages: each of a node's tokens of a 2-D document goes to every other
    rank of the node, and no message leaves its node (NVLink alone)."""
    return sum(
        (len(row) - 1) * sum(tokens.get(r, 0) for r in row) for _, row, tokens in node_members(plan)
    )


def two_d_link_bytes(plan: Plan, shape: AttentionShape, *, routing: bool) -> dict[str, int]:
    """Bytes per link class of the 2-D documents in one attention forward and backward.

    Head all-to-alls (NVLink): Q, K, V to the head layout and the output back (forward), dO to
    the head layout and dQ, dK, dV back (backward, gradients in ``grad_value_bytes``). Rings:
    the column rings of ``head_plan`` as the flat rings travel (K/V forward, K/V again and
    dK/dV backward), a group's K/V heads per token. A ring message on an edge the plan routes
    is routed like any message on it (``routing``); the column rings' own edges are rails.
    """
    heads = head_plan(plan)
    total: dict[str, int] = {"nvlink": 0, "nic": 0}
    if heads is None:
        return total
    groups = shape.groups(heads.num_groups)
    d, value, grad = shape.head_dim, shape.value_bytes, shape.grad_value_bytes
    qkv = (groups.num_q + 2 * groups.num_kv) * d  # values of one token's Q, K, V in a group
    o = groups.num_q * d  # values of one token's output (or its gradient) in a group
    kv = 2 * groups.num_kv * d
    # Q, K, V in (forward) and dO in (backward); the output back and dQ, dK, dV back.
    swapped = head_swap_tokens(plan)
    total["nvlink"] += swapped * (qkv * value + o * value) + swapped * (o * value + qkv * grad)
    passes = ((False, 2 * kv * value), (True, kv * grad))  # K/V forward + backward; dK, dV
    for gradients, bytes_per_token in passes:
        counts = ring_link_bytes(
            heads.plan,
            (Tier.INTRA, Tier.INTER),
            bytes_per_token=bytes_per_token,
            routing=routing,
            gradients=gradients,
            routes_of=plan,
        )
        for key, value_ in counts.items():
            total[key] = total.get(key, 0) + value_
    return total


def engine_link_bytes(plan: Plan, shape: AttentionShape, *, routing: bool) -> dict[str, int]:
    """Bytes per link class of one attention forward and backward of the engine: the flat
    rings (``training_link_bytes``) and the 2-D documents (``two_d_link_bytes``)."""
    total = training_link_bytes(
        plan,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        grad_bytes_per_token=shape.grad_bytes_per_token,
        routing=routing,
    )
    for key, value in two_d_link_bytes(plan, shape, routing=routing).items():
        total[key] = total.get(key, 0) + value
    return total
