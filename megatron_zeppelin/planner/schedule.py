"""Ring messages of a plan, step by step, and the bytes they put on each link class.

Pure: the engine executes this schedule, the simulator times it, and the byte counters of the
communication layer must match ``link_bytes`` exactly.

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
from dataclasses import dataclass

from megatron_zeppelin.planner.plan import Plan, Tier, split_by_weights


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


def block_tokens(plan: Plan) -> dict[tuple[int, int], int]:
    """Tokens of each (document, rank) K/V block."""
    sizes: dict[tuple[int, int], int] = defaultdict(int)
    for seq in plan.sequences:
        for span in seq.attention:
            sizes[(seq.id, span.rank)] += span.num_tokens
    return dict(sizes)


def ring_schedule(plan: Plan, tiers: tuple[Tier, ...] = (Tier.INTRA, Tier.INTER)) -> list[list[Message]]:
    """Messages per ring step for the documents of the given tiers (see the module docstring).

    Messages in a step are sorted by ``(src, dst)``; every rank computes the same list.
    """
    sizes = block_tokens(plan)
    wanted = {Tier(t) for t in tiers}
    rings = [s for s in plan.sequences if Tier(s.tier) in wanted and s.ring_size > 1]
    num_steps = max((s.ring_size - 1 for s in rings), default=0)
    steps: list[list[Message]] = []
    for step in range(num_steps):
        edges: dict[tuple[int, int], list[Segment]] = defaultdict(list)
        for seq in rings:
            g = seq.ring_size
            if step >= g - 1:
                continue
            for i, src in enumerate(seq.ring):
                origin = seq.ring[(i - step) % g]
                n = sizes.get((seq.id, origin), 0)
                edges[(src, seq.ring[(i + 1) % g])].append(Segment(seq.id, origin, n))
        steps.append(
            [Message(src, dst, tuple(segs)) for (src, dst), segs in sorted(edges.items())]
        )
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

    A direct cross-node message leaves through the sender's NIC. A routed one is split with
    ``split_by_weights`` over its route's parts: sender -> source proxy over NVLink (skipped when
    the same GPU), the source proxy's NIC across nodes, destination proxy -> receiver over NVLink.
    """
    topo = plan.topology
    out: dict[str, int] = defaultdict(int)
    out["nvlink"] = 0
    out["nic"] = 0

    def nic_send(rank: int, num_bytes: int) -> None:
        out["nic"] += num_bytes
        out[f"nic:{topo.node_of(rank)}.{topo.nic_of(rank)}"] += num_bytes

    for step in steps:
        for msg in step:
            num_bytes = msg.num_tokens * bytes_per_token
            if topo.same_node(msg.src, msg.dst):
                out["nvlink"] += num_bytes
                continue
            route = plan.route_of(msg.src, msg.dst) if routing else None
            if route is None:
                nic_send(msg.src, num_bytes)
                continue
            parts = split_by_weights(msg.num_tokens, [p.weight for p in route.parts])
            for part, n in zip(route.parts, parts):
                part_bytes = n * bytes_per_token
                if part_bytes == 0:
                    continue
                if part.src_proxy != msg.src:
                    out["nvlink"] += part_bytes
                nic_send(part.src_proxy, part_bytes)
                if part.dst_proxy != msg.dst:
                    out["nvlink"] += part_bytes
    return dict(out)
