"""How many examples a Hypothesis property draws.

Each property names its count for the full suite: ``scripts/test.sh`` runs pytest with
``--hypothesis-profile full`` (the profile is registered in ``conftest.py``). The edit loop,
which names no profile, draws a third of that, at least 10 (``examples``): every property
still runs on varied inputs, and an example that failed once is replayed first in both (from
Hypothesis's example database).
"""

from __future__ import annotations

from hypothesis import settings

FULL = "full"
"""The Hypothesis profile of the full suite: every property draws its full count."""


def examples(full: int) -> int:
    """``full`` under the ``full`` profile, else a third of it (at least 10)."""
    if settings.get_current_profile_name() == FULL:
        return full
    return max(10, full // 3)
