"""What Zeppelin is compared with: the baselines' layouts as plans, Megatron's dynamic
context-parallel schedule, the document-length distributions batches are drawn from, and each
system's kernel curve.

``baselines``, ``megatron_schedule``, ``distributions``, ``kernel_curves``.

The top wing (``planner.WINGS``): it may import any other; none imports it.
"""
