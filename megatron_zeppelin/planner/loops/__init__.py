"""The planner's innermost loops, compiled by numba where it is installed.

``jit`` (numba, where installed and not turned off), ``local_changes`` (the refinement's moves and
swaps of whole documents, round after round), ``node_lpt`` (stage 2's documents onto the least
loaded node with room), ``node_rings`` (stage 3: one node's rings and whole documents),
``ring_line`` (one pool order's rings, one after the other), ``ring_search`` (the GPUs of a
pool ring), ``shares_line`` (the placement with uneven shares at one target load),
``whole_docs`` (the pool's whole documents, longest first, onto the least loaded GPU with
room). Each loop is also written with numpy, in ``place/`` or here, and does the same float
operations in the same order: a plan is the same with numba or without.

Imports nothing of the planner's other wings (``planner.WINGS``): ``place/`` calls these.
"""
