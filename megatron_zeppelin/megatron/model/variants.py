"""Megatron's attention settings as Zeppelin's core attention takes them: every one it honours,
and a clear refusal of every other that would change the model.

Megatron's ``SelfAttention`` builds its ``core_attention`` from the ``TransformerConfig`` and a
few keywords; Megatron's own modules (``DotProductAttention``, TransformerEngine's) read several
settings from the config that change what the layer computes. Zeppelin's core attention reads
the same ones, the way megatron-core 0.19 reads them, so a run trains the model its flags ask
for:

* ``window_size`` / ``window_attn_skip_freq`` (``--window-size L,0``,
  ``--window-attn-skip-freq``): sliding-window attention in the layers Megatron's own
  ``is_layer_window_attention`` picks; a query sees the ``L`` tokens before it and itself.
  ``L = -1`` is no window (TransformerEngine's convention); a right window other than 0 would
  let a token see later ones and is refused;
* ``softmax_type`` (``--softmax-type``): ``off-by-one`` adds 1 to every softmax denominator (a
  zero sink logit per head), ``learnable`` a learned logit per head, the parameter
  ``softmax_offset`` of Megatron's ``DotProductAttention`` (same name, shape, dtype, TP
  sharding and initialisation: ``config.init_method``), so checkpoints and parameter counts
  match;
* ``no_rope_freq`` (``--no-rope-freq``): layers that skip rotary embeddings.

Refused at construction, each naming the flag to change (a setting that reached the module and
was ignored would train another model): attention dropout, context parallelism, a mask other
than causal, an unknown keyword (a setting of a newer Megatron), QK-clip and max-logit logging
(they read per-head maximum logits the ring does not compute), FP8 attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

__all__ = [
    "CAUSAL_MASKS",
    "check_settings",
    "layer_window",
    "skips_rope",
    "softmax_offset",
    "window_left",
]

CAUSAL_MASKS = frozenset(
    getattr(AttnMaskType, name)
    for name in ("causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
    if hasattr(AttnMaskType, name)
)
"""Megatron's mask types that mean "causal" for one document's self-attention (queries and keys
are the same tokens, so the top-left and bottom-right alignments agree)."""


def window_left(window_size: Sequence[int] | None) -> int | None:
    """The left window of Megatron's ``window_size`` ``(left, right)`` (``None``: no window);
    ``ValueError`` for a window Zeppelin's causal attention cannot run."""
    if window_size is None:
        return None
    if len(window_size) != 2:
        raise ValueError(f"--window-size takes LEFT,RIGHT, got {tuple(window_size)}")
    left, right = (int(x) for x in window_size)
    if right != 0:
        raise ValueError(
            f"--window-size {left},{right}: a right window lets a token see later tokens, and "
            "Zeppelin's attention (a GPT's) is causal: use --window-size L,0"
        )
    if left < -1:
        raise ValueError(f"--window-size {left},0: the left window is -1 (none) or at least 0")
    return None if left == -1 else left


def layer_window(config: Any, layer_number: int) -> int | None:
    """The left window of layer ``layer_number`` (1-based), as Megatron's own attention picks
    it (``--window-attn-skip-freq`` makes some layers full)."""
    window = window_left(config.window_size)
    if window is None:
        return None
    use = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
    return window if use else None


def skips_rope(config: Any, layer_number: int) -> bool:
    """Whether layer ``layer_number`` applies no rotary embedding (``--no-rope-freq``;
    Megatron's config turns an integer into the per-layer list)."""
    pattern = getattr(config, "no_rope_freq", None)
    return bool(pattern[layer_number - 1]) if pattern else False


def check_settings(config: Any, *, attn_mask_type: Any, unknown: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the flag to change for a setting that reaches core attention
    and that Zeppelin's attention would not honour (see the module docstring)."""
    if unknown:
        raise ValueError(
            f"Zeppelin's core attention was built with settings it does not know "
            f"({', '.join(sorted(unknown))}): this Megatron asks core attention for something "
            "Zeppelin does not implement; remove the flag that sets it or run without --zeppelin"
        )
    if attn_mask_type not in CAUSAL_MASKS:
        raise ValueError(
            f"Zeppelin's attention is causal within each document, but this layer asks for "
            f"{attn_mask_type}: build a GPT (decoder) model"
        )
    if config.context_parallel_size != 1:
        raise ValueError(
            "Zeppelin replaces context parallelism: set --context-parallel-size 1 and let "
            "Zeppelin span the data-parallel ranks"
        )
    if config.attention_dropout:
        raise ValueError(
            f"Zeppelin's ring attention applies no attention dropout: set "
            f"--attention-dropout 0 (the config has {config.attention_dropout:g})"
        )
    for field, flag in (
        ("qk_clip", "--qk-clip"),
        ("log_max_attention_logit", "--log-max-attention-logit"),
        ("fp8_dot_product_attention", "--fp8-dot-product-attention"),
    ):
        if getattr(config, field, False):
            raise ValueError(
                f"{flag} needs TransformerEngine's attention (per-head maximum logits, FP8 "
                f"kernels), which Zeppelin's ring attention does not compute: drop {flag}"
            )
    window_left(config.window_size)
    if getattr(config, "softmax_type", "vanilla") not in ("vanilla", "off-by-one", "learnable"):
        raise ValueError(f"--softmax-type {config.softmax_type} is not one Megatron defines")


def softmax_offset(config: Any, num_heads: int) -> torch.Tensor | None:
    """The sink logits of ``config.softmax_type`` for ``num_heads`` heads (this TP rank's), made
    as Megatron's ``DotProductAttention`` makes them: ``None`` for ``vanilla``, zeros for
    ``off-by-one``, a ``Parameter`` drawn with ``config.init_method`` for ``learnable``, on the
    current device in ``config.params_dtype``."""
    kind = getattr(config, "softmax_type", "vanilla")
    if kind == "vanilla":
        return None
    # The device Megatron draws on (the current GPU), so a seeded run draws the same values.
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if kind == "off-by-one":
        return torch.zeros(num_heads, device=device, dtype=config.params_dtype)
    offset = torch.nn.Parameter(torch.empty(num_heads, device=device, dtype=config.params_dtype))
    if config.perform_initialization:
        config.init_method(offset)
    return offset
