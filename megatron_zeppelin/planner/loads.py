"""Per-GPU predicted load while the planner places documents, and ring-size helpers.

``Loads`` tracks, per GPU, the work the planner balances (attention seconds, the linear seconds
of the GPU's tokens, and the ring transfers its compute cannot hide) and the tokens it holds,
and predicts what a document costs one rank of a ring of a given size (``ring_finish``). The
formulas are the simulator's, in closed form: a zigzag ring of ``g`` ranks gives each rank
``L^2 / 2g`` causal pairs and ``g - 1`` steps, each moving ``L/g`` tokens of K/V forward and
K/V plus dK/dV backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megatron_zeppelin.planner.costmodel import CostModel, Link
from megatron_zeppelin.planner.plan import zigzag_bounds
from megatron_zeppelin.planner.schemes import SchemePrices
from megatron_zeppelin.planner.thresholds import FWD_SHARE, linear_seconds_per_token
from megatron_zeppelin.topology.model import Topology

__all__ = ["Loads", "min_ring", "position_tokens"]


def position_tokens(length: int, ring_size: int) -> list[int]:
    """Tokens each ring position holds under zigzag (chunks ``i`` and ``2g-1-i``)."""
    if ring_size == 1:
        return [length]
    bounds = zigzag_bounds(length, ring_size)
    g2 = 2 * ring_size - 1
    return [
        bounds[i][1] - bounds[i][0] + bounds[g2 - i][1] - bounds[g2 - i][0]
        for i in range(ring_size)
    ]


def min_ring(length: int, capacity: int, *, start: int = 1, multiple: int = 1) -> int | None:
    """Smallest ring size (a multiple of ``multiple``, at least ``start``) whose zigzag chunks
    fit ``capacity`` per rank; ``None`` when even one token per rank would not fit."""
    g = max(start, math.ceil(length / capacity))
    g = multiple * math.ceil(g / multiple)
    while g <= length + multiple:
        if max(position_tokens(length, g)) <= capacity:
            return g
        g += multiple
    return None


class Loads:
    """Per-GPU predicted seconds (attention plus linear) and tokens while documents are placed.

    ``cost`` is what balancing looks at: a GPU's attention seconds plus its tokens' linear
    seconds, the time it would take if its linear modules ran on its attention tokens. Balancing
    this sum keeps both the attention and the token counts close to even, so the linear layout
    needs few (or no) moves; ``attention`` keeps the attention part apart for reporting."""

    def __init__(
        self,
        topology: Topology,
        capacity: int,
        cost_model: CostModel,
        num_links: int = 1,
        *,
        two_d: bool = False,
    ) -> None:
        self.topology = topology
        self.two_d = SchemePrices(cost_model, topology) if two_d else None
        """With ``two_d``: a ring over whole nodes is priced as the faster of the flat ring and
        the 2-D scheme (``schemes.py``)."""
        self.num_links = num_links
        """Links a cross-node ring edge uses: every NIC of the node with routing, else one."""
        self.capacity = capacity
        self.token_weight = linear_seconds_per_token(cost_model)
        self.cost_model = cost_model
        self.cost = [0.0] * topology.world_size
        self.attention = [0.0] * topology.world_size
        self.tokens = [0] * topology.world_size
        self._overhead_s = cost_model.attention.overhead_s
        flops = cost_model.model.attn_flops_per_pair()
        # (seconds per pair at full rate, half_tokens, fall_tokens) of both curves; scalar maths
        # here because the planner calls this once per document and ring size.
        self._curves = {
            diagonal: (flops / eff.flops_per_s, eff.half_tokens, eff.fall_tokens)
            for diagonal, eff in ((True, cost_model.diagonal), (False, cost_model.attention))
        }

    def _block_seconds(self, pairs: float, num_tokens: float, *, diagonal: bool) -> float:
        """``Efficiency.rate`` of the cost model, without the per-call overhead."""
        pair_seconds, half, fall = self._curves[diagonal]
        slowdown = 1.0 + half / num_tokens + (num_tokens / fall if fall else 0.0)
        return pair_seconds * pairs * slowdown

    def ring_seconds(self, length: int, ring_size: int) -> float:
        """One rank's attention seconds in a zigzag ring: ``L^2 / 2g`` pairs, the first ``1/g``
        of them (step 0, the rank's own chunks) on the causal diagonal's curve and the rest as
        unmasked blocks of ``L/g``-token chunks, plus one kernel call per ring step."""
        g = ring_size
        if g == 1:
            return self._block_seconds(length * (length + 1) / 2, length, diagonal=True)
        chunk = length / g
        pairs = length * length / (2 * g)
        own = self._block_seconds(pairs / g, chunk, diagonal=True)
        rest = self._block_seconds(pairs * (g - 1) / g, chunk, diagonal=False)
        return own + rest + g * self._overhead_s

    def ring_finish(self, length: int, ring_size: int, link: Link, num_links: int = 1) -> float:
        """One ring rank's predicted seconds for a document: attention, the transfers its
        compute does not hide, and its tokens' linear work. A forward step moves K/V while the
        block's forward runs, a backward step K/V and dK/dV while its backward runs, over
        ``num_links`` links in parallel (routing spreads a cross-node edge over every NIC)."""
        g = ring_size
        attention = self.ring_seconds(length, g)
        per_rank = length / g
        if g == 1:
            return attention + self.token_weight * per_rank
        step = attention / g
        kv = self.cost_model.kv_bytes(1) * per_rank

        def transfer(num_bytes: float) -> float:
            # Every rank also sends over its NVLink port (in-node edges, hops to proxies).
            nvlink = self.cost_model.transfer_time(num_bytes, "nvlink")
            if link == "nvlink":
                return nvlink
            nic = self.cost_model.nic
            return max(nvlink, nic.latency_s + num_bytes / (nic.bytes_per_s * num_links))

        exposed = max(0.0, transfer(kv) - FWD_SHARE * step)
        exposed += max(0.0, transfer(2 * kv) - (1 - FWD_SHARE) * step)
        flat = attention + (g - 1) * exposed
        k = self.topology.gpus_per_node
        if link == "nic" and self.two_d is not None and g % k == 0:
            two_d = self.two_d.two_d(length, g // k)
            flat = min(flat, two_d) if two_d is not None else flat
        return flat + self.token_weight * per_rank

    def best_num_nodes(self, length: int, share: float, num_links: int) -> int:
        """How many whole nodes a document's ring should span: the fewest whose predicted
        per-rank time fits one GPU's fair ``share``, else the fastest. One node means a ring
        over its GPUs on NVLink."""
        k, num_nodes = self.topology.gpus_per_node, self.topology.num_nodes
        times = [self.ring_finish(length, k, "nvlink")]
        times += [
            self.ring_finish(length, n * k, "nic", num_links) for n in range(2, num_nodes + 1)
        ]
        for n, seconds in enumerate(times, 1):
            if seconds <= share:
                return n
        return 1 + int(np.argmin(times))

    def add_ring(self, ring: Sequence[int], length: int) -> None:
        g = len(ring)
        seconds = self.ring_seconds(length, g)
        # Transfers the ring cannot hide keep its ranks busy as surely as compute does.
        same = all(self.topology.same_node(ring[0], r) for r in ring)
        link: Link = "nvlink" if same else "nic"
        exposed = self.ring_finish(length, g, link, self.num_links) - seconds
        exposed -= self.token_weight * length / g
        for rank, n in zip(ring, position_tokens(length, g)):
            self.cost[rank] += seconds + exposed + self.token_weight * n
            self.attention[rank] += seconds
            self.tokens[rank] += n

    def add_local(self, rank: int, length: int) -> None:
        seconds = self.ring_seconds(length, 1)
        self.cost[rank] += seconds + self.token_weight * length
        self.attention[rank] += seconds
        self.tokens[rank] += length

    def load(self, rank: int) -> float:
        return self.cost[rank]

    def room(self, rank: int) -> int:
        return self.capacity - self.tokens[rank]
