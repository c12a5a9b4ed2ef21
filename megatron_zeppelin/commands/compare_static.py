"""The best static CP size of each static CP baseline: the size a user would pick for their data.

TE ring CP, LLaMA-3's all-gather CP and hybrid DP run with one CP size for the whole run
(``baselines.STATIC_CP_BASELINES``). Their builders default to a rule (the smallest group that
holds the longest document, ``baselines.rule_cp_size``); a user who tunes the run sets whichever
size runs fastest on their data. ``best_static`` prices every size ``baselines.static_cp_sizes``
allows, one size for all the batches (a static choice), and keeps the one of the lowest mean step
time under the baseline's name; the rule's own results, whose size may change from batch to
batch, stay beside it under ``rule_name(builder)``. Speedups "vs TE" are then against the best
static TE ring CP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_zeppelin.planner.baselines import (
    STATIC_CP_BASELINES,
    rule_cp_size,
    static_cp_sizes,
)
from megatron_zeppelin.topology.model import Topology

__all__ = ["RULE_SUFFIX", "StaticChoice", "best_static", "mean_step", "rule_name"]

RULE_SUFFIX = " (rule)"


def rule_name(builder: str) -> str:
    """The name of ``builder``'s results at its default rule, next to its best static size."""
    return builder + RULE_SUFFIX


def mean_step(runs: Sequence) -> float | None:
    """Mean step time of one builder's runs (``SimResult``), ``None`` where a batch failed."""
    if not runs or any(isinstance(r, str) for r in runs):
        return None
    return sum(r.step_time_s for r in runs) / len(runs)


@dataclass(frozen=True)
class StaticChoice:
    """The CP size kept for one baseline and the mean step time of every size priced (``None``
    where some batch could not be planned at that size)."""

    size: int
    step_times: dict[int, float | None]


def best_static(
    batches: Sequence[Sequence[int]],
    results: dict[str, list],
    price: Callable[[str, int], list],
    *,
    topology: Topology,
    capacity: int,
) -> tuple[dict[str, list], dict[str, StaticChoice]]:
    """``results`` (of ``compare_batches``, the static baselines at their rule) with each static
    CP baseline's runs replaced by those of its fastest static size, the rule's runs kept under
    ``rule_name`` right after it; and per baseline the choice. ``price(builder, cp_size)`` plans
    and simulates ``batches`` with that size (a list like ``results``' values). A baseline no
    size can plan keeps the rule's results (its error) alone."""
    out: dict[str, list] = {}
    choices: dict[str, StaticChoice] = {}
    for name, runs in results.items():
        out[name] = runs
        if name not in STATIC_CP_BASELINES:
            continue
        try:
            sizes = static_cp_sizes(name, batches, topology, capacity)
            rules = {rule_cp_size(name, b, topology, capacity) for b in batches}
        except ValueError:
            continue  # no group holds the longest document: the rule's error row says so
        by_size = {}
        for size in sizes:
            # One rule size for every batch: its results are that size's, already priced.
            by_size[size] = runs if rules == {size} else price(name, size)
        means = {size: mean_step(r) for size, r in by_size.items()}
        fit = [size for size in sizes if means[size] is not None]
        if not fit:
            continue
        best = min(fit, key=lambda size: (means[size], size))
        out[name] = by_size[best]
        out[rule_name(name)] = runs
        choices[name] = StaticChoice(best, means)
    return out, choices
