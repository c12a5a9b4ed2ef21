"""NIC-aware routing of cross-node ring edges over proxy GPUs.

A ring edge ``src -> dst`` across nodes is split into parts, one per NIC ``j`` of the source
node: ``src`` hands part ``j`` over NVLink to a GPU next to NIC ``j`` (itself when it sits
there), which sends it over its rail to the GPU of the same local index on the destination node,
which hands it to ``dst`` over NVLink. Weights are integer token counts.

How much goes to each NIC ("water filling", per source node): take all the node's cross-node
edges that carry messages in the same ring steps, ``B`` tokens in all per step. Every NIC should
carry ``B / m``. An edge first keeps on its own NIC that NIC's fair fraction (all of it when the
NIC is not overloaded), and the excess of every overloaded NIC is spread over the underloaded
NICs in proportion to what they lack. One edge alone is thus split evenly over all NICs, and
edges that already leave from distinct NICs in equal amounts go direct.

Edges are grouped by the ring size of their documents: a ring of ``g`` ranks sends in steps
``0 .. g-2``, so the edges active in a step are the groups with ``g`` above it, and balancing
each group on its own balances every step. An edge shared by documents of different ring sizes
(rare: the planner rotates each document's in-node order) is balanced with its largest group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from megatron_zeppelin.planner.plan.plan import Route, RoutePart, Scheme, SequencePlan, Tier
from megatron_zeppelin.topology.model import Topology


def cross_node_edges(
    sequences: Sequence[SequencePlan], topology: Topology
) -> dict[tuple[int, int], tuple[int, int]]:
    """Cross-node ring edges ``(src, dst)`` -> (tokens sent in step 0, largest ring size)."""
    edges: dict[tuple[int, int], list[int]] = {}
    inter, flat = Tier.INTER, Scheme.RING
    for seq in sequences:
        if seq.tier != inter or seq.scheme != flat:  # 2-D rings are rails: never routed
            continue
        block: dict[int, int] = defaultdict(int)
        for span in seq.attention:
            block[span.rank] += span.num_tokens
        g = len(seq.ring)
        for i, src in enumerate(seq.ring):
            dst = seq.ring[(i + 1) % g]
            if topology.same_node(src, dst):
                continue
            entry = edges.setdefault((src, dst), [0, 0])
            entry[0] += block[src]  # at step 0 every rank sends its own block
            entry[1] = max(entry[1], g)
    return {edge: (tokens, g) for edge, (tokens, g) in edges.items()}


def _nic_shares(tokens: list[int], own_nic: list[int], num_nics: int) -> list[list[float]]:
    """Per edge, the tokens each NIC carries (water filling; see the module docstring)."""
    total = float(sum(tokens))
    fair = total / num_nics
    own_load = [0.0] * num_nics
    for n, nic in zip(tokens, own_nic):
        own_load[nic] += n
    lack = [max(0.0, fair - load) for load in own_load]
    total_lack = sum(lack)
    shares = []
    for n, nic in zip(tokens, own_nic):
        keep = n if own_load[nic] <= fair else n * fair / own_load[nic]
        row = [0.0] * num_nics
        row[nic] = keep
        excess = n - keep
        if excess > 0:
            for j in range(num_nics):
                row[j] += excess * lack[j] / total_lack
        shares.append(row)
    return shares


def _proxy_of_nic(topology: Topology, src: int, nic: int) -> int:
    """The GPU next to ``nic`` on ``src``'s node that relays ``src``'s part: ``src`` itself
    when it sits next to that NIC, else one of the NIC's GPUs (chosen by ``src``'s local index
    so several senders spread over them)."""
    if topology.nic_of(src) == nic:
        return src
    gpus = topology.gpus_of_nic(nic)
    return topology.rank_of(topology.node_of(src), gpus[topology.local_of(src) % len(gpus)])


def build_routes(sequences: Sequence[SequencePlan], topology: Topology) -> tuple[Route, ...]:
    """A route for every cross-node ring edge of the inter-node documents, sorted by edge."""
    edges = cross_node_edges(sequences, topology)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for (src, dst), (_, g) in edges.items():
        groups[(topology.node_of(src), g)].append((src, dst))
    m = topology.nics_per_node
    routes = []
    for key in sorted(groups):
        members = sorted(groups[key])
        tokens = [edges[e][0] for e in members]
        shares = _nic_shares(tokens, [topology.nic_of(src) for src, _ in members], m)
        for (src, dst), row in zip(members, shares):
            parts = []
            for nic, share in enumerate(row):
                weight = round(share)
                if weight <= 0:
                    continue
                proxy = _proxy_of_nic(topology, src, nic)
                dst_proxy = topology.rank_of(topology.node_of(dst), topology.local_of(proxy))
                parts.append(RoutePart(proxy, dst_proxy, weight))
            if not parts:  # a message of a few tokens: send it on the sender's own rail
                dst_proxy = topology.rank_of(topology.node_of(dst), topology.local_of(src))
                parts.append(RoutePart(src, dst_proxy, 1))
            routes.append(Route(src, dst, tuple(parts)))
    routes.sort(key=lambda r: (r.src, r.dst))
    return tuple(routes)
