"""The plan contract and what follows from a plan alone: where every token of a micro-batch
goes, and the messages, routes, phases and layouts that placement implies.

``plan_parts``, ``plan_checks`` and ``plan`` (the frozen, self-checking ``Plan`` and its file),
``routing`` (NIC-aware routes), ``schedule`` (ring messages step by step), ``heads`` (the 2-D
scheme's geometry), ``phases`` (what every rank computes in every ring phase), ``linear_layout``
(where linear modules run), ``remap_layout`` (the rows the remap moves).

May import ``cost/`` only (``planner.WINGS``).
"""
