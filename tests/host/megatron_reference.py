"""Test-only: Megatron's own GPT, trained by ``pretrain()`` on the documents Zeppelin's sampler
draws: the one-process reference the host tests compare Zeppelin with.

    python run_on_cpu.py --ranks 1 -m megatron_reference ARGS...

takes the arguments of a ``megatron_zeppelin.pretrain_gpt`` run (``--zeppelin`` included: the
plugin's data path picks each step's documents, so both runs train the same global batches)
and trains Megatron's own model on them, in one process. Two things differ from the plugin's
entry point, both Megatron's own way of doing them:

* the model is ``GPTModel`` built as Megatron-LM's ``gpt_builders`` builds it: Megatron's local
  layer spec (its ``DotProductAttention``, which reads ``--window-size``,
  ``--window-attn-skip-freq`` and ``--softmax-type`` itself) and Megatron's ``RotaryEmbedding``
  with ``--rotary-*``, ``--use-rope-scaling`` and ``--rotary-seq-len-interpolation-factor``;
* each micro-batch (``hooks.forward_step`` draws training, validation and test ones as in a
  Zeppelin run, and hands them to ``run_megatron`` here instead of the plugin's step) lays each
  document in a row of its own, padded at its end: Megatron's causal attention and rotary know
  nothing of documents, and a row per document makes them per-document (positions from 0, no
  key of another document). Padding comes after every real token, so no real token sees it,
  and it is masked out of the loss.

The loss is Megatron's per-token loss over the same tokens as the plugin's, so the two runs'
losses and updates agree to float32 rounding.
"""

from __future__ import annotations

import sys
import warnings
from functools import partial

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_zeppelin import pretrain_gpt
from megatron_zeppelin.megatron import hooks
from megatron_zeppelin.megatron.documents.batch import build_reference_batch
from megatron_zeppelin.megatron.model.loss import megatron_loss_func


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config=None,  # noqa: ANN001
    pg_collection=None,  # noqa: ANN001
) -> GPTModel:
    """Megatron's own GPT for the flags (``hooks.setup`` first, for the plugin's sampler)."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if hooks._STATE.config is None:
        hooks.setup(args)
    if config is None:
        config = core_transformer_config_from_args(args)
    config.calculate_per_token_loss = True  # the plugin's loss, over the same tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = get_gpt_layer_local_spec(
            normalization=args.normalization, qk_layernorm=args.qk_layernorm
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def document_rows(slices, dataset) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Megatron's batch keys ``[b, s]`` with one document per row, padded at the end."""
    rows = [build_reference_batch([piece], dataset) for piece in slices]
    width = max(row.num_tokens for row in rows)

    def stack(name: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros((len(rows), width), dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : row.num_tokens] = getattr(row, name)
        return out

    return {
        "tokens": stack("tokens_t", torch.int64),
        "labels": stack("labels_t", torch.int64),
        "loss_mask": stack("loss_mask_t", torch.float32),
        "position_ids": torch.arange(width).expand(len(rows), width).contiguous(),
    }


def run_megatron(model, item, documents):  # noqa: ANN001, ANN201
    """One micro-batch of the plugin's sampler (training, validation or test: ``hooks``
    dispatches them as in a Zeppelin run) through Megatron's own model."""
    if item.plan is None:
        return hooks.empty_micro_batch(model)
    batch = document_rows(item.slices, documents)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return losses, partial(megatron_loss_func, batch["loss_mask"])


if __name__ == "__main__":
    hooks.model_provider = model_provider
    hooks._run = run_megatron
    sys.exit(pretrain_gpt.main())
