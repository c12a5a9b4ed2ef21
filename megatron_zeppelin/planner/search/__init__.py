"""The planner's search: candidate placements of a batch, kept by the simulator's step time, and
``plan_batch`` (``partition``), the planner's entry point.

``candidate`` (one placement as the search compares them), ``staged`` (the staged variants),
``spread`` (the last resort under tight capacity), ``search``, ``partition``.

May import every wing below it (``planner.WINGS``): ``cost/``, ``plan/``, ``simulate/``,
``place/``.
"""
