"""The cost model: seconds for attention, linear modules and transfers, from the model's
dimensions and the hardware (datasheet figures or a calibration file).

``models`` (dimensions and presets), ``costmodel`` (``CostModel``), ``calibration`` (measured
speeds), ``thresholds`` (tier thresholds, per-document costs), ``steptime`` (a layer's step from
per-rank figures: what the simulator reports and the planner minimizes).

The lowest wing (``planner.WINGS``): it imports no other part of the planner.
"""
