"""Plans reused where a micro-batch's lengths repeat one of the last few.

Planning is pure and deterministic (``plan_workers.py``): the same lengths, in the same order,
under the same recipe give the same plan. Where samples have fixed lengths (a dataset packed to
the sequence length, every sample one document) every micro-batch is the same list of lengths,
and at a thousand GPUs planning it again costs as much as the first time. ``RecentPlans`` keeps
the plans of the last ``size`` distinct length lists, by their lengths, and hands one out again
where they repeat: the plan the planner would make, without making it.

A plan is kept as the planner returned it and handed out as it is: nothing reads a plan but to
execute it (its ``meta`` is written once, by the planner). A pickled ``RecentPlans`` arrives
empty (a planner process fills its own).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from megatron_zeppelin.planner.plan.plan import Plan

__all__ = ["RECENT_PLANS", "RecentPlans"]

RECENT_PLANS = 4
"""Plans kept per planner (a 1024-GPU plan of ten thousand documents holds about 4 MB)."""


class RecentPlans:
    """The plans of the last ``size`` distinct length lists planned (least recently used
    first out); ``hits`` counts the plans handed out again."""

    def __init__(self, size: int = RECENT_PLANS) -> None:
        if size < 0:
            raise ValueError(f"plans kept must be >= 0, got {size}")
        self.size = size
        self.hits = 0
        self._plans: OrderedDict[tuple[int, ...], Plan] = OrderedDict()
        self._lock = threading.Lock()  # evaluation feeds plan beside the training feed

    def plan(self, lengths: Sequence[int], make: Callable[[list[int]], Plan]) -> Plan:
        """The plan of ``lengths``: a kept one where they repeat, else ``make(lengths)`` (an
        error it raises is not kept: the same lengths are planned again next time)."""
        if not self.size:
            return make(list(lengths))
        key = tuple(int(n) for n in lengths)
        with self._lock:
            kept = self._plans.get(key)
            if kept is not None:
                self._plans.move_to_end(key)
                self.hits += 1
                return kept
        plan = make(list(key))
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def __reduce__(self) -> tuple:
        return RecentPlans, (self.size,)
