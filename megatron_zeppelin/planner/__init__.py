"""Pure planning: document lengths + topology + cost model -> a validated ``Plan``.

No torch.distributed here: every rank computes the same plan from the same lengths.

The planner is in wings (sub-packages), each importing only the wings before it in ``WINGS``:
``cost/`` (the cost model), ``plan/`` (the plan contract and what follows from a plan),
``simulate/`` (the step-time simulator), ``loops/`` (the placement's innermost loops, compiled
by numba where it is installed), ``place/`` (placements of documents on GPUs),
``search/`` (the search over placements and ``plan_batch``), ``baselines/`` (the systems
compared with). The names below are the planner's public ones.
"""

from megatron_zeppelin.planner.baselines.distributions import (
    DISTRIBUTIONS,
    read_lengths_file,
    sample_lengths,
)
from megatron_zeppelin.planner.cost.calibration import (
    CALIBRATION_FORMAT,
    Calibration,
    apply_calibration,
    fit_efficiency,
    fit_link,
    load_calibration,
    save_calibration,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel, Efficiency, LinkCost
from megatron_zeppelin.planner.cost.models import MODEL_PRESETS, ModelSpec, get_model
from megatron_zeppelin.planner.plan.plan import (
    PLAN_FORMAT,
    Plan,
    Route,
    RoutePart,
    Scheme,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
)
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch, tier_thresholds

# The wings, lowest first: a wing imports only wings before it (tests/test_layout.py).
WINGS = ("cost", "plan", "simulate", "loops", "place", "search", "baselines")

__all__ = [
    "CALIBRATION_FORMAT",
    "DISTRIBUTIONS",
    "MODEL_PRESETS",
    "PLAN_FORMAT",
    "Calibration",
    "CostModel",
    "Efficiency",
    "LinkCost",
    "ModelSpec",
    "Plan",
    "PlannerOptions",
    "Route",
    "RoutePart",
    "Scheme",
    "SequencePlan",
    "Span",
    "Tier",
    "TokenRange",
    "apply_calibration",
    "fit_efficiency",
    "fit_link",
    "get_model",
    "load_calibration",
    "plan_batch",
    "read_lengths_file",
    "sample_lengths",
    "save_calibration",
    "tier_thresholds",
]
