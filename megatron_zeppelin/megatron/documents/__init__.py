"""The documents a run trains on: Megatron's indexed datasets read document by document, the
seeded stream and sampler of micro-batches, blends and splits, a rank's tokens of its
micro-batch, and the sampler's place saved beside Megatron's checkpoints.

``data``, ``stream``, ``sampler``, ``blend``, ``batch``, ``resume``. Imports nothing else of
``megatron/``.
"""
