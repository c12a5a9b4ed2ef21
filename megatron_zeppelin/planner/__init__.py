"""Pure planning: document lengths + topology + cost model -> a validated ``Plan``.

No torch.distributed here: every rank computes the same plan from the same lengths.
"""

from megatron_zeppelin.planner.calibration import (
    CALIBRATION_FORMAT,
    Calibration,
    apply_calibration,
    fit_efficiency,
    fit_link,
    load_calibration,
    save_calibration,
)
from megatron_zeppelin.planner.costmodel import CostModel, Efficiency, LinkCost
from megatron_zeppelin.planner.distributions import DISTRIBUTIONS, read_lengths_file, sample_lengths
from megatron_zeppelin.planner.models import MODEL_PRESETS, ModelSpec, get_model
from megatron_zeppelin.planner.partition import PlannerOptions, plan_batch, tier_thresholds
from megatron_zeppelin.planner.plan import (
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
