"""The step-time simulator: times a plan on its topology with the cost model, per rank.

``simulator`` (every phase as arrays), ``stepwise`` (the same timeline message by message),
``transfers`` (ring transfers on shared links).

May import ``cost/`` and ``plan/`` (``planner.WINGS``); never the placement or the search.
"""
