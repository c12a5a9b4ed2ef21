"""The step time of one layer from per-rank figures: the function the simulator reports and the
planner minimizes.

A layer runs the linear modules on the linear layout, then (when tokens move) the remapping
all-to-alls, then attention on the attention layout. The all-to-alls synchronize every rank, so
with a remapping the layer takes ``max(linear) + remap + max(attention)``; without one each rank
runs its own linear and attention back to back and the layer takes ``max(linear + attention)``.
``attention`` is a rank's wall time in attention: compute plus the transfers it does not hide.

Both the simulator (``simulator.simulate_rounds``, from its phase-by-phase timeline) and the
planner (``partition``, from its per-document predictions while it compares placements and
linear layouts) call ``layer_seconds``; the remapping is priced by ``remap_seconds`` for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.topology.model import Topology

Moves = dict[tuple[int, int], int]
"""``(src, dst)`` -> tokens moved between two ranks."""


def layer_seconds(linear_s: Sequence[float], attention_s: Sequence[float], remap_s: float) -> float:
    """One layer's time from each rank's linear and attention seconds (module docstring), as
    lists or arrays (the planner prices thousands of layouts on arrays: the same sums and
    maxima)."""
    linear = np.asarray(linear_s, dtype=np.float64)
    attention = np.asarray(attention_s, dtype=np.float64)
    if remap_s > 0:
        return float(linear.max()) + remap_s + float(attention.max())
    return float((linear + attention).max())


def all_to_all_seconds(
    moves: Moves, topology: Topology, cost_model: CostModel, bytes_per_token: float
) -> float:
    """One all-to-all moving ``moves[(src, dst)]`` tokens: every GPU's NVLink port and every NIC
    (per direction) drains its bytes in parallel; the slowest drain plus one latency."""
    if not moves:
        return 0.0
    pairs = np.asarray(list(moves), dtype=np.int64).reshape(-1, 2)
    tokens = np.fromiter(moves.values(), dtype=np.float64, count=len(moves))
    return _all_to_all(pairs[:, 0], pairs[:, 1], tokens, topology, cost_model, bytes_per_token)


def remap_floor(tokens: int, cost_model: CostModel) -> float:
    """The least ``remap_seconds_of`` any moves in which one rank gives or takes ``tokens``
    tokens in all can take: in each of its all-to-alls those tokens leave (or reach) that rank
    through its NVLink port and its NIC, at best both at once, and every all-to-all waits at
    least the lesser latency. 0 where nothing moves."""
    if tokens <= 0:
        return 0.0
    m = cost_model.model
    q_bytes = (m.hidden_bytes_per_token() - m.kv_bytes_per_token()) // 2
    nvlink, nic = cost_model.link("nvlink"), cost_model.link("nic")
    both = nvlink.bytes_per_s + nic.bytes_per_s
    latency = min(nvlink.latency_s, nic.latency_s)
    kv = m.kv_bytes_per_token()
    one_way = tokens * (q_bytes + kv) / both + latency
    other_way = tokens * q_bytes / both + latency
    return 2.0 * (one_way + other_way)


def _all_to_all(
    src: np.ndarray,
    dst: np.ndarray,
    tokens: np.ndarray,
    topology: Topology,
    cost_model: CostModel,
    bytes_per_token: float,
) -> float:
    """``all_to_all_seconds`` of the moves ``src[i] -> dst[i]`` of ``tokens[i]`` (not empty)."""
    world, k, m = topology.world_size, topology.gpus_per_node, topology.nics_per_node
    num_bytes = tokens * bytes_per_token
    nic_of = np.asarray([topology.nic_of(r) for r in range(k)], dtype=np.int64)
    same = src // k == dst // k
    # Ports: GPU out / in (NVLink), NIC out / in per (node, NIC).
    out_port = np.where(same, src, 2 * world + (src // k) * m + nic_of[src % k])
    in_port = np.where(
        same, world + dst, 2 * world + topology.num_nodes * m + (dst // k) * m + nic_of[dst % k]
    )
    load = np.bincount(np.concatenate([out_port, in_port]), weights=np.tile(num_bytes, 2))
    bandwidth = np.full(len(load), cost_model.link("nic").bytes_per_s)
    bandwidth[: 2 * world] = cost_model.link("nvlink").bytes_per_s
    latency = max(
        cost_model.link(kind).latency_s
        for kind, used in (("nvlink", same.any()), ("nic", (~same).any()))
        if used
    )
    return float((load / bandwidth).max()) + latency


def remap_seconds(moves: Moves, topology: Topology, cost_model: CostModel) -> float:
    """The remapping of one layer, forward and backward: Q/K/V (then dQ/dK/dV) travel from the
    linear holder to the attention holder, the output (then its gradient) back; four
    all-to-alls. ``moves`` is keyed ``(attention holder, linear holder)``."""
    if not moves:
        return 0.0
    pairs = np.asarray(list(moves), dtype=np.int64).reshape(-1, 2)
    tokens = np.fromiter(moves.values(), dtype=np.float64, count=len(moves))
    return remap_seconds_of(pairs[:, 0], pairs[:, 1], tokens, topology, cost_model)


def remap_seconds_of(
    attention: np.ndarray,
    linear: np.ndarray,
    tokens: np.ndarray,
    topology: Topology,
    cost_model: CostModel,
) -> float:
    """``remap_seconds`` of the moves ``attention[i] <-> linear[i]`` of ``tokens[i]``, as
    arrays (the planner prices every candidate layout this way)."""
    if not len(tokens):
        return 0.0
    m = cost_model.model
    q_bytes = (m.hidden_bytes_per_token() - m.kv_bytes_per_token()) // 2
    tokens = np.asarray(tokens, dtype=np.float64)
    kv = m.kv_bytes_per_token()
    one_way = _all_to_all(linear, attention, tokens, topology, cost_model, q_bytes + kv)
    other_way = _all_to_all(attention, linear, tokens, topology, cost_model, q_bytes)
    return 2.0 * (one_way + other_way)
