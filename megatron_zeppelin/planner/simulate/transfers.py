"""Ring transfers of many documents, step by step, timed on shared links, as arrays.

The same timing as ``simulator.step_transfer_times``, for every step of every pass at once: in one
ring step all messages (and route parts) that use the same GPU's NVLink port or the same NIC (per
direction) split its bandwidth; a message finishes when its most loaded link has drained, plus one
latency per hop; a rank waits for the last of the messages it sends or receives. Messages follow
``schedule.ring_schedule``: at step ``s`` ring position ``i`` sends the block of position
``(i - s) mod g`` to position ``i + 1``; blocks of several documents on one edge in one step
travel as one message. A message over a route is cut like ``schedule.message_legs`` cuts it:
its tokens by the route's weights (``split_by_weights_array``, the array ``split_by_weights``),
part ``j`` on the hops of ``stepwise.route_hops``; all messages are timed without leaving numpy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.plan.phases import ZigzagRings, split_by_layout, unique_inverse
from megatron_zeppelin.planner.plan.plan import Route, SequencePlan
from megatron_zeppelin.planner.plan.schedule import Message
from megatron_zeppelin.topology.model import Topology

__all__ = [
    "RingMessages",
    "ring_messages",
    "ring_messages_of",
    "split_by_weights_array",
    "split_by_weights_rows",
    "transfer_times",
]


@dataclass(frozen=True)
class RingMessages:
    """One row per message: its pass and step (``group = pass * num_steps + step``), its edge
    and its tokens."""

    group: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    tokens: np.ndarray
    num_steps: int
    """Steps per pass: ``max(ring size) - 1``."""
    scale: np.ndarray | None = None
    """Per message, its bytes per token over the sizes ``transfer_times`` is given (``None``:
    all 1; the 2-D documents' column rings carry a head group's K/V)."""

    def scaled(self) -> np.ndarray:
        return np.ones(len(self.tokens)) if self.scale is None else self.scale

    def joined(self, other: RingMessages) -> RingMessages:
        """Both lists of messages, as separate messages (groups numbered alike)."""
        cat = np.concatenate
        return RingMessages(
            cat([self.group, other.group]),
            cat([self.src, other.src]),
            cat([self.dst, other.dst]),
            cat([self.tokens, other.tokens]),
            max(self.num_steps, other.num_steps),
            cat([self.scaled(), other.scaled()]),
        )

    @classmethod
    def of(cls, groups: list[list[Message]], scales: list[float]) -> RingMessages:
        """Message lists, list ``i`` as group ``i`` with bytes-per-token scale ``scales[i]``."""
        rows = [
            (i, m.src, m.dst, m.num_tokens, scale)
            for i, (ms, scale) in enumerate(zip(groups, scales))
            for m in ms
        ]
        group, src, dst, tokens, scale = (
            (np.asarray(c) for c in zip(*rows)) if rows else (np.zeros(0, dtype=np.int64),) * 5
        )
        return cls(
            group.astype(np.int64),
            src.astype(np.int64),
            dst.astype(np.int64),
            tokens.astype(np.int64),
            len(groups),
            scale.astype(np.float64),
        )


def split_by_weights_array(num_tokens: np.ndarray, weights: Sequence[int]) -> np.ndarray:
    """``plan.split_by_weights`` of each of ``num_tokens`` (one row of parts per entry): the
    route split of every message on one edge at once."""
    w = np.asarray(weights, dtype=np.int64)
    return split_by_weights_rows(num_tokens, np.broadcast_to(w[None, :], (len(num_tokens), len(w))))


def split_by_weights_rows(num_tokens: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``plan.split_by_weights`` of ``num_tokens[i]`` by ``weights[i]`` (a row per entry)."""
    w = np.asarray(weights, dtype=np.int64)
    total = w.sum(axis=1, keepdims=True)
    n = np.asarray(num_tokens, dtype=np.int64)[:, None]
    base = n * w // total
    rest = (n[:, 0] - base.sum(axis=1))[:, None]
    # Largest remainder first, ties to the lower index: a stable sort keeps index order.
    order = np.argsort(-(n * w % total), axis=1, kind="stable")
    extra = np.zeros_like(base)
    np.put_along_axis(extra, order, np.arange(w.shape[1])[None, :] < rest, axis=1)
    return base + extra


def _block_sizes(seq: SequencePlan) -> list[int]:
    held: dict[int, int] = defaultdict(int)
    for span in seq.attention:
        held[span.rank] += span.num_tokens
    return [held.get(rank, 0) for rank in seq.ring]


def ring_messages(
    sequences: Sequence[SequencePlan], pass_ids: Sequence[int] | None = None
) -> RingMessages:
    """Every ring message of ``sequences`` (one pass unless ``pass_ids`` says otherwise)."""
    _, zigzag, other = split_by_layout(sequences, pass_ids)
    return ring_messages_of(zigzag, other)


def ring_messages_of(
    zigzag: list[ZigzagRings],
    other: list[tuple[int, SequencePlan]] = (),  # type: ignore[assignment]
) -> RingMessages:
    """``ring_messages`` of ``phases.split_by_layout``'s rings: the zigzag ones as arrays, the
    others as ``(pass, document)``."""
    by_size: dict[int, list[tuple[int, SequencePlan]]] = defaultdict(list)
    for pass_id, seq in other:
        by_size[len(seq.ring)].append((pass_id, seq))
    groups = [(z.ring, z.block_tokens, z.pass_id) for z in zigzag]
    for docs in by_size.values():
        rings = np.asarray([seq.ring for _, seq in docs], dtype=np.int64)
        sizes = np.asarray([_block_sizes(seq) for _, seq in docs], dtype=np.int64)
        groups.append((rings, sizes, np.asarray([p for p, _ in docs], dtype=np.int64)))
    num_steps = max((rings.shape[1] for rings, _, _ in groups), default=1) - 1
    columns: list[list[np.ndarray]] = [[], [], [], []]
    for rings, sizes, passes in groups:  # (doc, position), (doc, position), (doc,)
        g = rings.shape[1]
        step = np.arange(g - 1)[:, None]
        position = np.arange(g)[None, :]
        origin = (position - step) % g  # (step, position)
        shape = (len(rings), g - 1, g)
        columns[0].append(np.broadcast_to((passes * num_steps)[:, None, None] + step, shape))
        columns[1].append(np.broadcast_to(rings[:, None, :], shape))
        columns[2].append(np.broadcast_to(np.roll(rings, -1, axis=1)[:, None, :], shape))
        columns[3].append(sizes[:, origin])
    if not columns[0]:
        empty = np.zeros(0, dtype=np.int64)
        return RingMessages(empty, empty, empty, empty, num_steps)
    group, src, dst, tokens = (np.concatenate([c.reshape(-1) for c in col]) for col in columns)
    # Blocks of several documents on one edge in one step are one message.
    width = int(max(src.max(), dst.max())) + 1
    key = (group * width + src) * width + dst
    unique, inverse = np.unique(key, return_inverse=True)
    tokens = np.bincount(inverse, weights=tokens, minlength=len(unique)).astype(np.int64)
    edge = unique % (width * width)
    return RingMessages(unique // (width * width), edge // width, edge % width, tokens, num_steps)


def transfer_times(
    messages: RingMessages,
    topology: Topology,
    cost: CostModel,
    routes: dict[tuple[int, int], Route],
    bytes_per_token: tuple[float, ...],
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Per (group, rank) that sends or receives: the time until its messages of that step have
    arrived, for each message size of ``bytes_per_token``. A cross-node edge in ``routes`` is
    split by its route's weights (``split_by_weights``) into parts on the hops of
    ``stepwise.route_hops``; any other message is one part of one hop. Returns the groups, the
    ranks and one array of seconds per size."""
    k = topology.gpus_per_node
    src, dst = messages.src, messages.dst
    same = src // k == dst // k
    width = topology.world_size
    routed_edges = np.fromiter((a * width + b for a, b in routes), np.int64, len(routes))
    routed = ~same & np.isin(src * width + dst, routed_edges)
    hops = _direct_hops(messages, ~routed, topology, cost)
    if routed.any():
        hops = _joined(hops, _routed_hops(messages, routed, routes, topology, cost))
    # Tokens (at the first size) per (group, port): every hop loads its out and its in port.
    num_ports = 2 * topology.world_size + 2 * topology.num_nodes * topology.nics_per_node
    keys, inverse = unique_inverse(
        np.concatenate(
            [hops.group * num_ports + hops.out_port, hops.group * num_ports + hops.in_port]
        ),
    )
    load = np.bincount(inverse, weights=np.tile(hops.tokens * hops.scale, 2))
    out_load, in_load = load[inverse[: len(hops.group)]], load[inverse[len(hops.group) :]]
    # A part drains at the pace of its most loaded port and pays every hop's latency.
    part_drain = np.zeros(hops.num_parts)
    np.maximum.at(part_drain, hops.part, np.maximum(out_load, in_load) / hops.bandwidth)
    part_latency = np.bincount(hops.part, weights=hops.latency, minlength=hops.num_parts)
    part_tokens = np.zeros(hops.num_parts, dtype=np.int64)
    part_tokens[hops.part] = hops.tokens
    busy = part_tokens > 0  # a part of no tokens sends nothing
    finish = []
    for size in bytes_per_token:
        per_message = np.zeros(len(hops.message_group))
        np.maximum.at(
            per_message, hops.part_message[busy], (part_drain * size + part_latency)[busy]
        )
        finish.append(per_message)
    return _per_rank(hops, finish, topology.world_size)


def _per_rank(hops: _Hops, finish: list[np.ndarray], world: int):
    """The latest finish per (group, rank) over the messages a rank sends or receives."""
    group = np.tile(hops.message_group, 2)
    rank = np.concatenate([hops.message_src, hops.message_dst])
    unique, inverse = unique_inverse(group * world + rank)
    out = []
    for values in finish:
        latest = np.zeros(len(unique))
        np.maximum.at(latest, inverse, np.tile(values, 2))
        out.append(latest)
    return unique // world, unique % world, out


@dataclass(frozen=True)
class _Hops:
    """The hops of every part of every routed message: per hop its group, ports, tokens,
    bandwidth, latency and part; per part its message; per message its group and edge."""

    group: np.ndarray
    out_port: np.ndarray
    in_port: np.ndarray
    tokens: np.ndarray
    scale: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray
    part: np.ndarray
    num_parts: int
    part_message: np.ndarray
    message_group: np.ndarray
    message_src: np.ndarray
    message_dst: np.ndarray


def _direct_hops(
    messages: RingMessages, chosen_mask: np.ndarray, topology: Topology, cost: CostModel
) -> _Hops:
    """Messages that take one hop: inside a node over NVLink, across nodes over the sender's
    and the receiver's NICs."""
    chosen = np.flatnonzero(chosen_mask)
    group, src, dst = messages.group[chosen], messages.src[chosen], messages.dst[chosen]
    out_port, in_port, bandwidth, latency = _hop_links(src, dst, topology, cost)
    parts = np.arange(len(chosen))
    return _Hops(
        group,
        out_port,
        in_port,
        messages.tokens[chosen],
        messages.scaled()[chosen],
        bandwidth,
        latency,
        parts,
        len(chosen),
        parts,
        group,
        src,
        dst,
    )


def _hop_links(
    src: np.ndarray, dst: np.ndarray, topology: Topology, cost: CostModel
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The hops ``src -> dst`` (``stepwise.hop_ports``) as port ids, out and in, with their
    link's bandwidth and latency: inside a node the GPUs' NVLink ports, across nodes the NICs
    next to each end. Port ids: GPU out / in, then NIC out / in per (node, NIC)."""
    world, k, m = topology.world_size, topology.gpus_per_node, topology.nics_per_node
    nic_of = np.asarray([topology.nic_of(r) for r in range(k)], dtype=np.int64)
    same = src // k == dst // k
    out_port = np.where(same, src, 2 * world + (src // k) * m + nic_of[src % k])
    in_port = np.where(
        same, world + dst, 2 * world + topology.num_nodes * m + (dst // k) * m + nic_of[dst % k]
    )
    nv, nic = cost.nvlink, cost.nic
    bandwidth = np.where(same, nv.bytes_per_s, nic.bytes_per_s)
    return out_port, in_port, bandwidth, np.where(same, nv.latency_s, nic.latency_s)


def _joined(a: _Hops, b: _Hops) -> _Hops:
    """The hops of both, parts and messages of ``b`` numbered after ``a``'s."""
    cat = np.concatenate
    return _Hops(
        cat([a.group, b.group]),
        cat([a.out_port, b.out_port]),
        cat([a.in_port, b.in_port]),
        cat([a.tokens, b.tokens]),
        cat([a.scale, b.scale]),
        cat([a.bandwidth, b.bandwidth]),
        cat([a.latency, b.latency]),
        cat([a.part, b.part + a.num_parts]),
        a.num_parts + b.num_parts,
        cat([a.part_message, b.part_message + len(a.message_group)]),
        cat([a.message_group, b.message_group]),
        cat([a.message_src, b.message_src]),
        cat([a.message_dst, b.message_dst]),
    )


def _routed_hops(
    messages: RingMessages,
    is_routed: np.ndarray,
    routes: dict[tuple[int, int], Route],
    topology: Topology,
    cost: CostModel,
) -> _Hops:
    """Hops of the routed messages, edge by edge (edges in order, an edge's messages in order,
    each message's hops in part and path order). A route's parts and hops are the same in every
    step, only the tokens differ: they are worked out once per edge (``_RouteTable``), and
    every message's tokens are split by its edge's weights at once."""
    chosen = np.flatnonzero(is_routed)
    world = topology.world_size
    edges = messages.src[chosen] * world + messages.dst[chosen]
    order = np.argsort(edges, kind="stable")  # by edge, each edge's messages in order
    rows, edges = chosen[order], edges[order]
    unique, edge_of = np.unique(edges, return_inverse=True)
    table = _RouteTable.of(
        [routes[(e // world, e % world)] for e in unique.tolist()], topology, cost
    )
    # Tokens per (message, part): the route's weights, padded with zero weights that never
    # receive a token (``split_by_weights``: a remainder token goes to a positive remainder).
    tokens = split_by_weights_rows(messages.tokens[rows], table.weights[edge_of])
    num_parts = table.num_parts[edge_of]
    part_base = np.cumsum(num_parts) - num_parts
    # One row per (message, hop of its edge's route).
    num_hops = table.num_hops[edge_of]
    message = np.repeat(np.arange(len(rows)), num_hops)
    hop = table.hop_start[edge_of][message] + (
        np.arange(len(message)) - np.repeat(np.cumsum(num_hops) - num_hops, num_hops)
    )
    part_of_hop = table.part[hop]
    return _Hops(
        messages.group[rows][message],
        table.out_port[hop],
        table.in_port[hop],
        tokens[message, part_of_hop],
        messages.scaled()[rows][message],
        table.bandwidth[hop],
        table.latency[hop],
        part_base[message] + part_of_hop,
        int(num_parts.sum()),
        np.repeat(np.searchsorted(chosen, rows), num_parts),
        messages.group[chosen],
        messages.src[chosen],
        messages.dst[chosen],
    )


@dataclass(frozen=True)
class _RouteTable:
    """Routes' parts and hops as arrays: per route its padded weights, parts and first hop;
    per hop its part, ports and link."""

    weights: np.ndarray
    num_parts: np.ndarray
    num_hops: np.ndarray
    hop_start: np.ndarray
    part: np.ndarray
    out_port: np.ndarray
    in_port: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray

    @classmethod
    def of(cls, routes: list[Route], topology: Topology, cost: CostModel) -> _RouteTable:
        """The table of ``routes``, in numpy: a part's path is ``src -> src_proxy -> dst_proxy
        -> dst`` less each rank equal to the one before it (``schedule.route_paths``), so its
        hops are the pairs of neighbours that differ, in path order (``stepwise.route_hops``,
        which the tests compare it with)."""
        num_parts = np.fromiter((len(r.parts) for r in routes), np.int64, len(routes))
        widest = int(num_parts.max()) if len(routes) else 1
        rows = [(r.src, p.src_proxy, p.dst_proxy, r.dst, p.weight) for r in routes for p in r.parts]
        parts = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        first_part = np.cumsum(num_parts) - num_parts
        route_of_part = np.repeat(np.arange(len(routes)), num_parts)
        slot = np.arange(len(parts)) - first_part[route_of_part]  # a part's index in its route
        weights = np.zeros((len(routes), widest), dtype=np.int64)
        weights[route_of_part, slot] = parts[:, 4]
        path = parts[:, :4]
        # Part by part, each in path order: the hops ``path[j-1] -> path[j]`` that move.
        part_of_hop, step = np.nonzero(path[:, 1:] != path[:, :-1])
        out_port, in_port, bandwidth, latency = _hop_links(
            path[part_of_hop, step], path[part_of_hop, step + 1], topology, cost
        )
        num_hops = np.bincount(route_of_part[part_of_hop], minlength=len(routes)).astype(np.int64)
        return cls(
            weights,
            num_parts,
            num_hops,
            np.cumsum(num_hops) - num_hops,
            slot[part_of_hop],
            out_port,
            in_port,
            bandwidth,
            latency,
        )
