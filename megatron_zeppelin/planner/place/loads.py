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
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import FWD_SHARE, CostModel, Link
from megatron_zeppelin.planner.cost.thresholds import linear_seconds_per_token
from megatron_zeppelin.planner.place.schemes import SchemePrices
from megatron_zeppelin.planner.plan.plan import zigzag_loads
from megatron_zeppelin.topology.model import Topology

__all__ = ["Loads", "LoadsSnapshot", "RankShare", "min_ring"]

LoadsSnapshot = tuple[tuple[int, ...], list[tuple[float, float, float, int]]]
"""Some ranks and their ``(cost, attention, exposed, tokens)`` at ``Loads.snapshot``."""


def min_ring(length: int, capacity: int, *, start: int = 1, multiple: int = 1) -> int | None:
    """Smallest ring size (a multiple of ``multiple``, at least ``start``) whose zigzag chunks
    fit ``capacity`` per rank; ``None`` when even one token per rank would not fit."""
    g = max(start, math.ceil(length / capacity))
    g = multiple * math.ceil(g / multiple)
    if length + 2 * g <= capacity * g and g <= length + multiple:
        return g  # a zigzag position holds two chunks of at most ``L/2g + 1`` tokens each
    while g <= length + multiple:
        if max(zigzag_loads(length, g)) <= capacity:
            return g
        g += multiple
    return None


@dataclass(frozen=True)
class RankShare:
    """One rank's share of a split document under some scheme, one layer forward+backward."""

    compute_s: float
    """Attention seconds of the rank's blocks."""
    exposed_s: float
    """Transfer seconds the rank's compute does not hide, at the rank whose edges cross nodes
    (the most exposed)."""
    inner_exposed_s: float | None = None
    """The same at a rank whose ring edges stay inside its node; ``None``: ``exposed_s``."""

    def exposed_at(self, crosses_nodes: bool) -> float:
        if crosses_nodes or self.inner_exposed_s is None:
            return self.exposed_s
        return self.inner_exposed_s


def _exposed(ring_size: int, step_s: float, forward_s: float, backward_s: float) -> float:
    """Transfer seconds a ring rank's ``ring_size - 1`` steps do not hide: a forward step's
    transfer (``forward_s``) while the block's forward runs, a backward step's (``backward_s``)
    while its backward runs; ``step_s``: one step's compute, forward and backward."""
    forward = max(0.0, forward_s - FWD_SHARE * step_s)
    return (ring_size - 1) * (forward + max(0.0, backward_s - (1 - FWD_SHARE) * step_s))


class Loads:
    """Per-GPU predicted seconds and tokens while documents are placed.

    Per rank: ``attention`` (compute seconds), ``exposed`` (ring transfers the compute does not
    hide), ``tokens``, and ``cost``, what balancing looks at: attention plus exposed plus, with
    ``balance_linear``, the tokens' linear seconds (the time the rank would take if its linear
    modules ran on its attention tokens). Balancing that sum keeps both the attention and the
    token counts close to even, so no tokens need to move; without ``balance_linear`` only the
    attention layout is balanced and the linear layout evens the tokens (the remapping pays the
    difference).

    What a split document costs each of its ranks comes from one function, ``rank_share``: a
    zigzag ring, or over whole nodes the 2-D scheme where the cost model prices it faster
    (``schemes.SchemePrices``, with ``two_d``)."""

    def __init__(
        self,
        topology: Topology,
        capacity: int,
        cost_model: CostModel,
        num_links: int = 1,
        *,
        balance_linear: bool = True,
        two_d: bool = False,
        shares: dict | None = None,
        keys: dict | None = None,
    ) -> None:
        self.topology = topology
        self._shares: dict[tuple, RankShare] = {} if shares is None else shares
        """``rank_share`` by its arguments; placements of one batch with the same ``two_d``
        may share it (the planner asks for the same few lengths and ring sizes many times)."""
        self._keys: dict[tuple, float] = {} if keys is None else keys
        """``ring_key`` by its arguments; shared as ``shares`` is, by placements that also
        balance alike (``balance_linear`` sets the key's linear seconds)."""
        self.two_d = SchemePrices(cost_model, topology) if two_d else None
        """With ``two_d``: a ring over whole nodes is priced as the faster of the flat ring and
        the 2-D scheme (``schemes.py``)."""
        self.num_links = num_links
        """Links a cross-node ring edge uses: every NIC of the node with routing, else one."""
        self.capacity = capacity
        self.token_weight = linear_seconds_per_token(cost_model)
        self.balance_linear = balance_linear
        self.linear_weight = self.token_weight if balance_linear else 0.0
        """Seconds a token adds to ``cost``."""
        self.cost_model = cost_model
        world = topology.world_size
        self.cost = [0.0] * world
        self.attention = [0.0] * world
        self.exposed = [0.0] * world
        self.tokens = [0] * world
        self._overhead_s = cost_model.attention.overhead_s
        self._kv_bytes = cost_model.kv_bytes(1)
        flops = cost_model.model.attn_flops_per_pair()
        # (seconds per pair at full rate, half_tokens, fall_tokens) of both curves; scalar maths
        # here because the planner calls this once per document and ring size.
        self._curves = {
            diagonal: (flops / eff.flops_per_s, eff.half_tokens, eff.fall_tokens)
            for diagonal, eff in ((True, cost_model.diagonal), (False, cost_model.attention))
        }
        self._terms: np.ndarray | None = None
        """``ring_terms``, once asked."""

    def _block_seconds(self, pairs: float, num_tokens: float, *, diagonal: bool) -> float:
        """``Efficiency.busy_seconds`` of the cost model, in scalars."""
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

    def rank_share(
        self, length: int, ring_size: int, link: Link, num_links: int = 1, *, flat: bool = False
    ) -> RankShare:
        """One rank of a zigzag ring of ``ring_size`` over ``link``: ``ring_seconds`` of compute,
        and per ring step the transfer its block's compute does not hide. A forward step moves
        K/V while the block's forward runs, a backward step K/V and dK/dV while its backward
        runs. Across nodes (``link="nic"``) a routed edge (``num_links`` NICs) sends a part per
        NIC: over NVLink to the NIC's GPU, over the NIC, over NVLink again; so every relaying
        GPU's NVLink port carries its own ring message and a part, and the ranks at the edge
        wait for the slowest part. A ring over whole nodes is priced as the faster of that and
        the 2-D scheme where the loads allow it, unless ``flat`` (the ring runs flat whatever
        its size: the pool placement's rings over part of a node's GPUs)."""
        # Over NVLink the NICs play no part: one entry serves every ``num_links``.
        two_d = self.two_d if link == "nic" and not flat else None
        key = (length, ring_size, link, num_links if link == "nic" else 1, two_d is not None)
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = self._rank_share(length, ring_size, link, num_links, two_d)
        return share

    def _rank_share(
        self, length: int, ring_size: int, link: Link, num_links: int, two_d: SchemePrices | None
    ) -> RankShare:
        g = ring_size
        compute = self.ring_seconds(length, g)
        if g == 1:
            return RankShare(compute, 0.0)
        step = compute / g
        (forward, backward), inner = self._step_transfers(length, g, link, num_links)
        if link == "nvlink":  # the planner's most frequent question: plain arithmetic
            return RankShare(compute, _exposed(g, step, forward, backward))
        flat = RankShare(compute, _exposed(g, step, forward, backward), _exposed(g, step, *inner))
        if two_d is not None and g % self.topology.gpus_per_node == 0:
            # The second scheme for a ring over whole nodes: its price is compute and unhidden
            # transfers (head all-to-alls included) together.
            scheme = two_d.two_d(length, g // self.topology.gpus_per_node)
            if scheme is not None and scheme < compute + flat.exposed_s:
                return RankShare(scheme, 0.0)
        return flat

    def _step_transfers(
        self, length: int, ring_size: int, link: Link, num_links: int
    ) -> tuple[tuple[float, float], tuple[float, float]]:
        """Seconds of one ring step's transfer, forward (K/V) and backward (K/V and dK/dV), of a
        block of ``L/g`` tokens: at a member whose ring edges cross nodes, and at one whose edges
        stay inside its node (the same on NVLink)."""
        kv = self._kv_bytes * length / ring_size
        nvlink, nic = self.cost_model.nvlink, self.cost_model.nic
        if link == "nvlink":
            times = (nvlink.time(kv), nvlink.time(2 * kv))
            return times, times
        relayed = 1 + 1 / num_links if num_links > 1 else 1.0

        def edge(num_bytes: float) -> float:
            if num_links == 1:  # direct: the sender's NIC
                return max(nvlink.time(num_bytes), nic.time(num_bytes))
            drain = max(
                relayed * num_bytes / nvlink.bytes_per_s,
                num_bytes / (num_links * nic.bytes_per_s),
            )
            return drain + 2 * nvlink.latency_s + nic.latency_s

        inner = (nvlink.time(relayed * kv), nvlink.time(relayed * (2 * kv)))
        return (edge(kv), edge(2 * kv)), inner

    def ring_finish(self, length: int, ring_size: int, link: Link, num_links: int = 1) -> float:
        """One ring rank's predicted seconds for a document: its ``rank_share`` and its tokens'
        linear work."""
        share = self.rank_share(length, ring_size, link, num_links)
        return share.compute_s + share.exposed_s + self.token_weight * length / ring_size

    def ring_key(
        self, length: int, ring_size: int, link: Link, *, flat: bool = False, crossing: bool = True
    ) -> float:
        """What a ring adds to each member's ``cost`` (zigzag rounding aside); ``flat`` as in
        ``rank_share``. ``crossing=False``: at a member whose ring edges stay inside its node
        (``RankShare.exposed_at``), which waits the least; else at one whose edges cross nodes,
        the most."""
        key = (length, ring_size, link, flat, crossing)
        value = self._keys.get(key)
        if value is None:
            share = self.rank_share(length, ring_size, link, self.num_links, flat=flat)
            exposed = share.exposed_s if crossing else share.exposed_at(False)
            value = share.compute_s + exposed + self.linear_weight * length / ring_size
            self._keys[key] = value
        return value

    def ring_terms(self) -> np.ndarray:
        """What ``rank_share`` and ``ring_key`` read to price a ring over NVLink, or flat across
        nodes, for the compiled loops (``loops/ring_prices.py``, which work them out with the
        same operations): both curves' ``(seconds per pair, half_tokens, fall_tokens)``
        (diagonal first), the overhead per kernel call, the K/V bytes per token, NVLink's
        latency and bytes per second, ``FWD_SHARE``, ``linear_weight``, the NICs' latency and
        bytes per second, and ``num_links``."""
        if self._terms is None:
            nvlink, nic = self.cost_model.nvlink, self.cost_model.nic
            self._terms = np.asarray(
                [
                    *(value or 0.0 for value in self._curves[True]),
                    *(value or 0.0 for value in self._curves[False]),
                    self._overhead_s,
                    self._kv_bytes,
                    nvlink.latency_s,
                    nvlink.bytes_per_s,
                    FWD_SHARE,
                    self.linear_weight,
                    nic.latency_s,
                    nic.bytes_per_s,
                    self.num_links,
                ],
                dtype=np.float64,
            )
        return self._terms

    def best_num_nodes(self, length: int, rest_work: float) -> int:
        """How many whole nodes a document's ring should span so that the step ends soonest:
        ``n`` nodes end at ``max(t_n, (rest_work + n k t_n) / world)``, the ring's per-rank
        ``ring_key`` ``t_n`` or, when the other documents (``rest_work`` balanced seconds on
        one GPU each) fill every GPU evenly around the ring, their mean. Bigger rings shorten
        ``t_n`` but add chunks that compute less efficiently and transfers they cannot hide.
        One node means a ring over its GPUs on NVLink."""
        k, num_nodes = self.topology.gpus_per_node, self.topology.num_nodes
        world = self.topology.world_size
        best = (math.inf, 1)
        for n in range(1, num_nodes + 1):
            link: Link = "nvlink" if n == 1 else "nic"
            t = self.ring_key(length, n * k, link)
            end = max(t, (rest_work + n * k * t) / world)
            if end < best[0] * (1 - 1e-9):
                best = (end, n)
            if t * world <= rest_work + n * k * t:
                break  # the mean sets the end from here on, and more ranks only raise it
        return best[1]

    def add_ring(
        self, ring: Sequence[int], length: int, link: Link = "nvlink", *, flat: bool = False
    ) -> None:
        """Add a document split zigzag over ``ring`` (whole for a ring of one); ``link``:
        ``"nic"`` when the ring spans nodes; ``flat`` as in ``rank_share``. Transfers the ring
        cannot hide keep its ranks busy as surely as compute does."""
        share = self.rank_share(length, len(ring), link, self.num_links, flat=flat)
        k, compute, weight = self.topology.gpus_per_node, share.compute_s, self.linear_weight
        cost, attention, exposed_s, tokens = self.cost, self.attention, self.exposed, self.tokens
        if link == "nvlink":  # no edge crosses nodes: every member alike
            exposed = share.exposed_s
            for rank, n in zip(ring, zigzag_loads(length, len(ring))):
                cost[rank] += compute + exposed + weight * n
                attention[rank] += compute
                exposed_s[rank] += exposed
                tokens[rank] += n
            return
        # A member whose ring edges both stay inside its node waits less (``exposed_at``).
        edge, inner = share.exposed_at(True), share.exposed_at(False)
        nodes = [rank // k for rank in ring]
        after = [*nodes[1:], nodes[0]]
        for rank, n, before, node, then in zip(
            ring, zigzag_loads(length, len(ring)), [nodes[-1], *nodes], nodes, after
        ):
            exposed = edge if before != node or then != node else inner
            cost[rank] += compute + exposed + weight * n
            attention[rank] += compute
            exposed_s[rank] += exposed
            tokens[rank] += n

    def add_shares(
        self, ring: Sequence[int], length: int, tokens: Sequence[int], link: Link = "nvlink"
    ) -> None:
        """Add a document split over ``ring`` with uneven shares (``plan.share_spans``): member
        ``i`` holds ``tokens[i]`` tokens and computes that share of the ring's attention pairs
        (the flat ring's ``ring_seconds`` scaled by its tokens over ``L/g``). Its ring steps
        bring blocks of ``L/g`` tokens on average, each hidden by its own step's compute, so a
        small share hides less of them."""
        g = len(ring)
        compute = self.ring_seconds(length, g)
        even = length / g
        (forward, backward), inner = self._step_transfers(length, g, link, self.num_links)
        k, weight = self.topology.gpus_per_node, self.linear_weight
        nodes = [rank // k for rank in ring]
        before, after = [nodes[-1], *nodes[:-1]], [*nodes[1:], nodes[0]]
        for rank, n, prev, node, then in zip(ring, tokens, before, nodes, after):
            mine = compute * n / even
            crossing = link == "nic" and (prev != node or then != node)
            times = (forward, backward) if crossing else inner
            exposed = _exposed(g, mine / g, *times)
            self.cost[rank] += mine + exposed + weight * n
            self.attention[rank] += mine
            self.exposed[rank] += exposed
            self.tokens[rank] += n

    def add_local(self, rank: int, length: int, seconds: float | None = None) -> None:
        """Add a whole document; ``seconds``: its ``ring_seconds(length, 1)`` when known (the
        planner computes them for the whole batch at once)."""
        if seconds is None:
            seconds = self.ring_seconds(length, 1)
        self.cost[rank] += seconds + self.linear_weight * length
        self.attention[rank] += seconds
        self.tokens[rank] += length

    def snapshot(self, ranks: Sequence[int]) -> LoadsSnapshot:
        """The loads of ``ranks``, to ``restore`` when a placement on them is given up."""
        ranks = tuple(ranks)
        values = [(self.cost[r], self.attention[r], self.exposed[r], self.tokens[r]) for r in ranks]
        return ranks, values

    def restore(self, snapshot: LoadsSnapshot) -> None:
        ranks, values = snapshot
        for r, (cost, attention, exposed, tokens) in zip(ranks, values):
            self.cost[r], self.attention[r], self.exposed[r], self.tokens[r] = (
                cost,
                attention,
                exposed,
                tokens,
            )

    def load(self, rank: int) -> float:
        return self.cost[rank]

    def room(self, rank: int) -> int:
        return self.capacity - self.tokens[rank]
