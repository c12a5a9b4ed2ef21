"""The best static CP size of each static CP baseline: the size a user would pick for their data.

TE ring CP, LLaMA-3's all-gather CP and hybrid DP run with one CP size set at launch
(``baselines.STATIC_CP_BASELINES``). Their builders default to a rule (the smallest group that
holds the batch's longest document, ``baselines.rule_cp_size``); a user who tunes the run sets
whichever size runs fastest on their data. ``best_static`` prices, for each batch, every size
``baselines.static_cp_sizes`` allows, smallest first, and keeps the fastest under the
baseline's name; the rule's results stay beside it under ``rule_name(builder)``. Speedups "vs TE"
are then against the best static TE ring CP.

The size is chosen batch by batch: the fastest one size could run that batch, which no static
choice for the whole run beats (one size for every batch must also hold the longest document of
all of them). So the baseline is never slower than the rule, nor than any one size, on any
batch, and a speedup over it understates rather than overstates what a user would see.

Larger groups than needed only lengthen the rings, and their plans take the simulator longest
(TE ring CP at 128 GPUs: 1 s at a CP size of 4, 79 s at 128). So the sweep stops at the first
size slower than the best so far on every batch (``PATIENCE``); the sizes it did not price are
listed in the choice (``skipped``). Swept until two such sizes in a row, the 48 choices of the
as-deployed comparison at 16-128 GPUs in ``docs/BENCHMARKS.md`` (eight rows, three baselines, two
columns) were the same as stopping at the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_zeppelin.planner.baselines.baselines import (
    STATIC_CP_BASELINES,
    static_cp_sizes,
)
from megatron_zeppelin.topology.model import Topology

__all__ = [
    "PATIENCE",
    "RULE_SUFFIX",
    "StaticChoice",
    "best_static",
    "cp_label",
    "mean_step",
    "rule_name",
]

RULE_SUFFIX = " (rule)"
PATIENCE = 1
"""Sizes in a row slower than the best so far after which larger ones are not priced."""


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
    """For one baseline: the CP size kept for each batch, the step time of every size priced
    per batch (``None`` where that size cannot plan the batch) and the sizes not priced."""

    sizes: tuple[int, ...]
    step_times: tuple[dict[int, float | None], ...]
    skipped: tuple[int, ...] = ()


def cp_label(choice: StaticChoice) -> str:
    """The sizes kept, one where every batch took it, else per batch (``4/8/4``)."""
    if len(set(choice.sizes)) == 1:
        return str(choice.sizes[0])
    return "/".join(map(str, choice.sizes))


def best_static(
    batches: Sequence[Sequence[int]],
    results: dict[str, list],
    price: Callable[[str, int], list],
    *,
    topology: Topology,
    capacity: int,
) -> tuple[dict[str, list], dict[str, StaticChoice]]:
    """``results`` (of ``compare_batches``, the static baselines at their rule) with each static
    CP baseline's runs replaced by those of its fastest static size on each batch, the rule's
    runs kept under ``rule_name`` right after it; and per baseline the choice.
    ``price(builder, cp_size)`` plans and simulates every batch at that size (a list like
    ``results``' values; a batch the size cannot hold gives its error text). A baseline no
    size can plan keeps the rule's results (its error) alone."""
    out: dict[str, list] = {}
    choices: dict[str, StaticChoice] = {}
    for name, runs in results.items():
        out[name] = runs
        if name not in STATIC_CP_BASELINES:
            continue
        try:
            allowed = [set(static_cp_sizes(name, b, topology, capacity)) for b in batches]
        except ValueError:
            continue  # no group holds the longest document: the rule's error row says so
        by_size = _sweep(name, sorted(set().union(*allowed)), price)
        kept, times = [], []
        for i, sizes in enumerate(allowed):
            step = {s: _step(by_size[s][i]) for s in sorted(sizes) if s in by_size}
            fit = [s for s, t in step.items() if t is not None]
            kept.append(min(fit, key=lambda s: (step[s], s)) if fit else None)
            times.append(step)
        if None in kept:
            continue
        out[name] = [by_size[s][i] for i, s in enumerate(kept)]
        out[rule_name(name)] = runs
        skipped = tuple(s for s in sorted(set().union(*allowed)) if s not in by_size)
        choices[name] = StaticChoice(tuple(kept), tuple(times), skipped)
    return out, choices


def _step(run: object) -> float | None:
    return None if isinstance(run, str) else run.step_time_s


def _sweep(name: str, sizes: list[int], price: Callable[[str, int], list]) -> dict[int, list]:
    """Runs of every batch at each of ``sizes``, smallest first, until ``PATIENCE`` sizes in a
    row are slower than the best so far on every batch (or cannot plan it)."""
    by_size: dict[int, list] = {}
    best: list[float | None] | None = None
    slower = 0
    for size in sizes:
        runs = by_size[size] = price(name, size)
        steps = [_step(r) for r in runs]
        best = best or [None] * len(runs)
        better = [t is not None and (b is None or t < b) for t, b in zip(steps, best)]
        best = [t if up else b for t, b, up in zip(steps, best, better)]
        # Count only once every batch has a size that plans it: until then a larger size may
        # be the first to hold some batch's longest document.
        slower = 0 if any(better) or None in best else slower + 1
        if slower == PATIENCE:
            break
    return by_size
