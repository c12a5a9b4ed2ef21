"""Megatron-LM's GPT pretraining with Zeppelin: ``python -m megatron_zeppelin.pretrain_gpt``.

Takes every Megatron-LM flag plus ``--zeppelin`` and the ``--zeppelin-*`` flags, e.g.

    torchrun --nproc-per-node 8 --nnodes 2 ... -m megatron_zeppelin.pretrain_gpt \\
        --tensor-model-parallel-size 1 --micro-batch-size 1 --seq-length 16384 \\
        --data-path /data/corpus_text_document --zeppelin --zeppelin-topology dgx-h100

Needs Megatron-LM itself (``megatron.training``), which megatron-core does not ship: use the
Docker image or put a Megatron-LM checkout on ``PYTHONPATH``. The hooks are in
``megatron/hooks.py``; this file only wires them into ``pretrain()``.
"""

from __future__ import annotations

import sys


def _require_megatron_training():
    try:
        from megatron.core.enums import ModelType
        from megatron.training import pretrain
    except ImportError as exc:
        raise SystemExit(
            "megatron_zeppelin.pretrain_gpt needs Megatron-LM's megatron.training, which is not "
            f"importable here ({exc}). Use the project's Docker image, or put a Megatron-LM "
            "checkout on PYTHONPATH (PYTHONPATH=/path/to/Megatron-LM)."
        ) from exc
    return pretrain, ModelType


def main() -> int:
    pretrain, model_type = _require_megatron_training()
    from megatron_zeppelin.megatron import hooks

    if "--zeppelin" not in sys.argv[1:]:
        raise SystemExit("megatron_zeppelin.pretrain_gpt runs Zeppelin: add --zeppelin")
    # Megatron's loader builds the (tiny) marker dataset on every rank, not only on TP rank 0.
    hooks.train_valid_test_datasets_provider.is_distributed = True
    # The model provider runs hooks.setup on its first call: after Megatron's initialization,
    # before the model and the data, which both need the groups and the cost model.
    pretrain(
        hooks.train_valid_test_datasets_provider,
        hooks.model_provider,
        model_type.encoder_or_decoder,
        hooks.forward_step,
        extra_args_provider=hooks.extra_args_provider,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
