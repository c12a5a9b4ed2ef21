"""A ring's price and sizes for the compiled loops, as ``Loads`` and ``zigzag_loads`` work them out.

The compiled loops that place rings (``node_rings.py``: stage 3 on one node; ``ring_search.py``:
the pool's tries of a ring; ``ring_line.py``: the pool's rings added to the loads, with each
member's share) price a ring at each size as ``Loads.rank_share`` and
``Loads.ring_key`` price it over NVLink or flat across nodes, with the same float operations in
the same order on the same terms (``Loads.ring_terms``), so to the last bit
(``tests/test_placement_shortcuts.py`` compares them), and cut it as ``zigzag_loads`` does.
Rings over whole nodes with the 2-D scheme stay with ``Loads`` (``schemes.py``).

They are compiled here, in this module (``loops/jit.py``), and a loop's module takes them over
by name before compiling its own (``bind``): a compiled function calls what its module's names
hold when it is compiled.
"""

from __future__ import annotations

import functools

import numpy as np

from megatron_zeppelin.planner.loops import jit

__all__ = ["bind", "compiled"]

_NAMES = (
    "_zigzag_tokens",
    "_most_tokens",
    "_block",
    "_compute",
    "_time",
    "_waits",
    "_share",
    "_key",
    "_edge",
    "_flat_share",
    "_flat_key",
    "_min_ring",
)
"""The functions ``bind`` hands over, helpers first."""


def compiled() -> bool:
    """Whether the functions run compiled in this process."""
    return _compiled() is not None


def bind(namespace: dict) -> bool:
    """The compiled functions put in ``namespace`` (a loop's module's ``globals()``) under their
    names, before its loops are compiled; ``False`` (nothing put) without numba."""
    kernels = _compiled()
    if kernels is None:
        return False
    namespace.update(kernels)
    return True


def _zigzag_tokens(length, size, position):  # noqa: ANN001, ANN202 - compiled by numba
    """``zigzag_loads(length, size)[position]``: cuts ``round(j * L / 2g)``, halves to even."""
    n = 2 * size
    a = np.rint(position * length / n)
    b = np.rint((position + 1) * length / n)
    c = np.rint((n - 1 - position) * length / n)
    d = np.rint((n - position) * length / n)
    return int(b - a + d - c)


def _most_tokens(length, size):  # noqa: ANN001, ANN202 - compiled by numba
    """``max(zigzag_loads(length, size))``."""
    most = 0
    for position in range(size):
        most = max(most, _zigzag_tokens(length, size, position))
    return most


def _block(pairs, num_tokens, pair_seconds, half, fall):  # noqa: ANN001, ANN202 - compiled
    """``Loads._block_seconds``."""
    slowdown = 1.0 + half / num_tokens + (num_tokens / fall if fall else 0.0)
    return pair_seconds * pairs * slowdown


def _compute(length, g, terms):  # noqa: ANN001, ANN202 - compiled by numba
    """``Loads.ring_seconds(length, g)`` of a ring of two GPUs or more."""
    chunk = length / g
    pairs = length * length / (2 * g)
    own = _block(pairs / g, chunk, terms[0], terms[1], terms[2])
    rest = _block(pairs * (g - 1) / g, chunk, terms[3], terms[4], terms[5])
    return own + rest + g * terms[6]


def _time(latency, bytes_per_s, num_bytes):  # noqa: ANN001, ANN202 - compiled by numba
    """``LinkCost.time``."""
    return latency + num_bytes / bytes_per_s if num_bytes > 0 else 0.0


def _waits(g, step, forward, backward, share):  # noqa: ANN001, ANN202 - compiled by numba
    """``loads._exposed``: what a ring's ``g - 1`` steps of ``step`` seconds' compute leave of
    their transfers, ``forward`` and ``backward`` seconds each."""
    waits = max(0.0, forward - share * step)
    return (g - 1) * (waits + max(0.0, backward - (1 - share) * step))


def _share(length, g, terms):  # noqa: ANN001, ANN202 - compiled by numba
    """``Loads.rank_share(length, g, "nvlink")``: its compute and exposed seconds."""
    if g == 1:
        return _block(length * (length + 1) / 2, length, terms[0], terms[1], terms[2]), 0.0
    compute = _compute(length, g, terms)
    kv = terms[7] * length / g
    forward = _time(terms[8], terms[9], kv)
    backward = _time(terms[8], terms[9], 2 * kv)
    return compute, _waits(g, compute / g, forward, backward, terms[10])


def _key(length, g, terms):  # noqa: ANN001, ANN202 - compiled by numba
    """``Loads.ring_key(length, g, "nvlink")``."""
    compute, waits = _share(length, g, terms)
    return compute + waits + terms[11] * length / g


def _edge(num_bytes, terms):  # noqa: ANN001, ANN202 - compiled by numba
    """``Loads._step_transfers``' ``edge``: a transfer of ``num_bytes`` over a ring edge across
    nodes, direct (one NIC: the slower of NVLink and the NIC) or routed over ``num_links`` NICs
    (a part per NIC, relayed over NVLink at both ends)."""
    links = terms[14]
    if links == 1:
        return max(_time(terms[8], terms[9], num_bytes), _time(terms[12], terms[13], num_bytes))
    relayed = 1 + 1 / links
    drain = max(relayed * num_bytes / terms[9], num_bytes / (links * terms[13]))
    return drain + 2 * terms[8] + terms[12]


def _flat_share(length, g, terms):  # noqa: ANN001, ANN202 - compiled by numba
    """``Loads.rank_share(length, g, "nic", flat=True)`` of a flat ring of two GPUs or more
    across nodes: its compute seconds, and its exposed seconds at a member whose ring edges
    cross nodes and at one whose edges stay inside its node (a routed edge's parts relayed over
    NVLink)."""
    compute = _compute(length, g, terms)
    kv = terms[7] * length / g
    step = compute / g
    links = terms[14]
    relayed = 1 + 1 / links if links > 1 else 1.0
    edge = _waits(g, step, _edge(kv, terms), _edge(2 * kv, terms), terms[10])
    forward = _time(terms[8], terms[9], relayed * kv)
    backward = _time(terms[8], terms[9], relayed * (2 * kv))
    return compute, edge, _waits(g, step, forward, backward, terms[10])


def _flat_key(length, g, terms):  # noqa: ANN001, ANN202 - compiled by numba
    """``Loads.ring_key(length, g, "nic", flat=True)``: a flat ring of two GPUs or more across
    nodes, at a member whose edges cross them."""
    compute, waits, _ = _flat_share(length, g, terms)
    return compute + waits + terms[11] * length / g


def _min_ring(length, capacity, start):  # noqa: ANN001, ANN202 - compiled by numba
    """``loads.min_ring(length, capacity, start=start)``, -1 for ``None``."""
    g = max(start, -(-length // capacity))
    if length + 2 * g <= capacity * g and g <= length + 1:
        return g
    while g <= length + 1:
        if _most_tokens(length, g) <= capacity:
            return g
        g += 1
    return -1


@functools.cache
def _compiled() -> dict | None:
    """The functions compiled in this module, by name, or ``None`` without numba."""
    if jit.compile_loops(globals(), *_NAMES) is None:
        return None
    return {name: globals()[name] for name in _NAMES}
