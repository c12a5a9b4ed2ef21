"""Each micro-batch's plan, made ahead of training: the feed that pairs micro-batches with their
plans, the planner processes, plans made on one rank per node and shared, and plans handed out
again where lengths repeat.

``feed``, ``plan_workers``, ``shared_plans``, ``reuse``. Imports ``megatron/documents/`` for the
sampler.
"""
