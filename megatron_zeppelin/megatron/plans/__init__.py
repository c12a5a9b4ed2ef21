"""Each micro-batch's plan, made ahead of training: the feed that pairs micro-batches with their
plans, the planner processes, and plans made on one rank per node and shared.

``feed``, ``plan_workers``, ``shared_plans``. Imports ``megatron/documents/`` for the sampler.
"""
