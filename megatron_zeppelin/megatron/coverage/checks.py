"""Checks of flags whose refusal depends on more than their own value (``answers.Check``):
each returns the one-line refusal, or ``None`` when the run may go on."""

from __future__ import annotations

import argparse

from megatron_zeppelin.megatron.coverage.answers import shown

POSITION_EMBEDDINGS = ("rope", "none", "learned_absolute")
BALANCING_WITHOUT_LOSS = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
"""Load-balancing kinds that are a loss, inert at coefficient 0, or nothing at all."""


def _as_list(value) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]


def token_dispatcher(args: argparse.Namespace) -> str | None:
    """All-to-all always; all-gather only where the ranks it gathers over hold the same rows,
    and without pipeline parallelism (its stages exchange rows whose count changes per
    micro-batch: Megatron's ``variable_seq_lengths``, which the all-gather dispatcher refuses)."""
    kind = getattr(args, "moe_token_dispatcher_type", "allgather")
    if kind == "alltoall" or not getattr(args, "num_experts", None):
        return None  # a dense model dispatches nothing
    if kind == "allgather":
        if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
            return (
                "--moe-token-dispatcher-type allgather: --zeppelin with pipeline parallelism "
                "sends each stage a row count that changes per micro-batch, which Megatron's "
                "allgather token dispatcher does not support: use --moe-token-dispatcher-type "
                "alltoall"
            )
        ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
        if ep == 1 and etp == tp:
            return None  # it gathers over one Zeppelin rank's TP ranks: the same rows
        return (
            f"--moe-token-dispatcher-type allgather with --expert-model-parallel-size {ep} and "
            f"expert tensor parallelism {etp}: the all-gather dispatcher needs the same token "
            "count on every rank it gathers over, and Zeppelin's ranks hold different counts "
            "every micro-batch: use --moe-token-dispatcher-type alltoall"
        )
    return (
        f"--moe-token-dispatcher-type {kind}: only the alltoall and allgather dispatchers are "
        "tested with Zeppelin's varying token counts per rank: use --moe-token-dispatcher-type "
        "alltoall"
    )


def load_balancing(args: argparse.Namespace) -> str | None:
    """An auxiliary-loss kind (at coefficient 0: ``--moe-aux-loss-coeff`` is refused) or none;
    routing algorithms over a rank's tokens (sinkhorn, quantile balancing) are refused."""
    kinds = _as_list(getattr(args, "moe_router_load_balancing_type", "aux_loss"))
    other = [k for k in kinds if k not in BALANCING_WITHOUT_LOSS]
    if not other:
        return None
    return (
        f"--moe-router-load-balancing-type {shown(kinds)}: {', '.join(other)} balances the "
        "experts over the tokens a rank holds, which Zeppelin's plan changes every "
        "micro-batch: use --moe-router-load-balancing-type none"
    )


def aux_loss_coefficient(args: argparse.Namespace) -> str | None:
    coefficients = [float(c or 0.0) for c in _as_list(getattr(args, "moe_aux_loss_coeff", 0.0))]
    if not any(coefficients):
        return None
    return (
        f"--moe-aux-loss-coeff {shown(coefficients)}: Megatron's load-balancing loss multiplies "
        "two means over the tokens each rank holds, and Zeppelin changes which tokens a rank "
        "holds every micro-batch, so the loss would differ from the model's: set "
        "--moe-aux-loss-coeff 0"
    )


def weight_remat(flag: str, remat_dest: str):
    """A check refusing ``flag`` where it shards each weight over more GPUs than its tensor
    parallelism (Megatron's ``*gtp_weight_remat_size`` above 1)."""

    def check(args: argparse.Namespace) -> str | None:
        size = int(getattr(args, remat_dest, 1) or 1)
        if size == 1:
            return None
        return (
            f"{flag}: weights sharded over {size} times more GPUs than tensor parallelism "
            "count the tokens of that group in the per-token loss, which is not run with "
            f"Zeppelin's token layout: drop {flag}"
        )

    return check


def eval_interval(args: argparse.Namespace) -> str | None:
    """Megatron divides ``--train-iters`` by it when it counts samples, even with
    ``--eval-iters 0``; its default (``None``) fails there with a ``TypeError``."""
    if args.eval_interval:
        return None
    return (
        "--eval-interval: Megatron divides --train-iters by --eval-interval when it counts "
        "samples, even with --eval-iters 0: add --eval-interval (any positive number, e.g. "
        "--eval-interval 1000)"
    )


def kv_channels(args: argparse.Namespace) -> str | None:
    """Head dim must be hidden / heads (Megatron's default), as the cost model prices it."""
    value = getattr(args, "kv_channels", None)
    heads, hidden = args.num_attention_heads, args.hidden_size
    if value is None or value * heads == hidden:
        return None
    return (
        f"--kv-channels {value}: Zeppelin's cost model takes head dim = hidden size / heads "
        f"({hidden} / {heads}): drop --kv-channels"
    )


def window_size(args: argparse.Namespace) -> str | None:
    """A causal left window (``L,0``, or ``-1,0`` for none) is what Zeppelin can mask."""
    # lazy: ``variants`` imports torch and megatron-core (seconds), which the planning commands
    # that read these checks (``zeppelin plan``, ``simulate``, the benchmarks) need nowhere else.
    from megatron_zeppelin.megatron.model.variants import window_left

    try:
        window_left(getattr(args, "window_size", None))
    except ValueError as exc:
        return str(exc)
    return None


def position_embedding(args: argparse.Namespace) -> str | None:
    kind = getattr(args, "position_embedding_type", "rope")
    if kind in POSITION_EMBEDDINGS:
        return None
    return (
        f"--position-embedding-type {kind}: Zeppelin applies rotary positions per document "
        f"inside its core attention: use --position-embedding-type "
        f"{', '.join(POSITION_EMBEDDINGS)}"
    )


def transformer_impl(args: argparse.Namespace) -> str | None:
    kind = getattr(args, "transformer_impl", "local")
    if kind in ("local", "transformer_engine"):
        return None
    return (
        f"--transformer-impl {kind}: Zeppelin's spec builds Megatron's local or "
        "TransformerEngine layers: use --transformer-impl local or transformer_engine"
    )


def eval_micro_batch_size(args: argparse.Namespace) -> str | None:
    value = getattr(args, "eval_micro_batch_size", None)
    if value in (None, 1):
        return None
    return (
        f"--eval-micro-batch-size {value}: --zeppelin packs each micro-batch's documents into "
        "one row: set --eval-micro-batch-size 1"
    )


def dataloader_type(args: argparse.Namespace) -> str | None:
    if getattr(args, "dataloader_type", None) != "external":
        return None
    return (
        "--dataloader-type external: --zeppelin draws the documents itself: drop "
        "--dataloader-type external"
    )


def rank_mapping(args: argparse.Namespace) -> str | None:
    """A pipeline stage's data-parallel ranks on consecutive GPUs (``args.stage_node``)."""
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if pp == 1 or not getattr(args, "use_tp_pp_dp_mapping", False):
        return None
    return (
        "--use-tp-pp-dp-mapping: --zeppelin needs each pipeline stage's data-parallel ranks on "
        "consecutive GPUs (Megatron's default rank order): drop --use-tp-pp-dp-mapping"
    )
