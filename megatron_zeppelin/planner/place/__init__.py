"""Placements: documents onto nodes and GPUs, as tiers, rings and shares, with the loads they
leave.

``loads`` (per-GPU predicted load), ``tiers`` (stage 1), ``placement`` (stages 2 and 3),
``schemes`` (flat ring or 2-D), the pool placement (``ring_options``, ``least_load``,
``pool_rings``, ``pool``), ``shares`` (uneven ring shares), and the pass after it (``members``,
``refine``).

May import ``cost/``, ``plan/``, ``simulate/`` and ``loops/`` (``planner.WINGS``).
"""
