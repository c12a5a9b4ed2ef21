"""Tier: pure. The pool placement with its compiled loops (``planner/loops/whole_docs.py`` for
the whole documents, ``ring_line.py`` for the rings, each ring's GPUs searched by
``ring_search.py``) against ring by ring with the compiled search alone, and against numpy's:
the same placement of every document and the same loads, to the last bit, on every pool order.

Skipped where numba is not installed (the ``fast`` extra).
"""

from __future__ import annotations

import pytest
from pool_batches import NEEDS_NUMBA, assert_same_loads, pool_placed, stress_batch

from megatron_zeppelin.planner.loops import ring_line, ring_search, whole_docs
from megatron_zeppelin.planner.place import pool as pool_module
from megatron_zeppelin.planner.place import pool_rings
from megatron_zeppelin.planner.place.pool import ALL_ORDERS
from megatron_zeppelin.planner.plan.plan import Tier

pytestmark = [pytest.mark.pure, NEEDS_NUMBA]


def _pool(name: str, gpus: int, capacity: int, fill: float, seed: int, order: int):  # noqa: ANN202
    """``place_pool`` of a sampled batch in pool order ``order``: placements, loads
    (``fixed-N``: one length, whole documents left without room become rings)."""
    placements, promotions, loads, _ = pool_placed(
        stress_batch(name, gpus, fill, seed, capacity), order
    )
    return placements, promotions, loads


@pytest.mark.parametrize(
    ("name", "gpus", "capacity", "fill", "seed"),
    [
        ("wikipedia", 64, 16_384, 0.95, 0),
        ("prolong", 64, 16_384, 0.95, 1),
        ("power-law", 64, 32_768, 0.95, 0),
        ("lognormal", 32, 32_768, 0.95, 2),
        ("mixture", 64, 32_768, 0.5, 1),
        ("sft-bimodal", 32, 32_768, 0.95, 0),
        ("long-tail", 32, 32_768, 0.95, 1),
        ("fixed-3000", 16, 4_096, 0.95, 0),
    ],
)
@pytest.mark.parametrize("order", range(len(ALL_ORDERS)))
def test_compiled_pool_places_as_numpy(
    monkeypatch: pytest.MonkeyPatch, name: str, gpus: int, capacity: int, fill: float, seed: int,
    order: int,
) -> None:  # fmt: skip
    assert whole_docs.compiled() and ring_search.compiled() and ring_line.compiled()
    line = _pool(name, gpus, capacity, fill, seed, order)
    monkeypatch.setattr(pool_module.ring_line, "compiled", lambda: False)
    ring_by_ring = _pool(name, gpus, capacity, fill, seed, order)
    monkeypatch.setattr(whole_docs, "compiled", lambda: False)
    monkeypatch.setattr(pool_rings.ring_search, "compiled", lambda: False)
    assert pool_module.whole_docs.compiled() is False
    numpy = _pool(name, gpus, capacity, fill, seed, order)
    want, want_promotions, want_loads = numpy
    for placements, promotions, loads in (line, ring_by_ring):
        assert placements == want
        assert promotions == want_promotions
        assert_same_loads(loads, want_loads)
    assert any(p.tier == Tier.LOCAL for p in want)
    if name.startswith("fixed-"):
        assert promotions > 0, "no whole document was left without room: the ring path untried"
