"""Megatron-LM glue: what Megatron's training loop calls through ``pretrain_gpt.py``.

``hooks`` (the functions ``pretrain()`` takes), ``args`` (the ``--zeppelin*`` flags and their
checks), ``spec`` (the layer specs, named by ``--spec megatron_zeppelin.megatron.spec``),
``runtime`` (what a run builds once), ``step`` (one micro-batch), ``report``, ``pipeline``,
``evaluation``, ``precision``; the rooms ``documents/`` (the data path), ``plans/`` (plans made
ahead), ``model/`` (the pieces the layer spec swaps in) and ``coverage/`` (every flag's answer).
The training job without Megatron's loop is ``job/``.
"""
