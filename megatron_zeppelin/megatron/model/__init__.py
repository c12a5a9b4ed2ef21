"""The model pieces Megatron's layer spec (``megatron/spec.py``) swaps in or configures:
Zeppelin's core attention, per-document rotary embeddings, the attention variants it honours,
norms without Apex, and the per-token loss.

``core_attention``, ``rotary``, ``variants``, ``norms``, ``loss``. Imports nothing else of
``megatron/``.
"""
