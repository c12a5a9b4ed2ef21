"""Zeppelin's core attention: the one module Megatron's layer spec swaps for ours.

Megatron's ``SelfAttention`` computes Q, K and V with its own (tensor-parallel) linear layers in
the rank's **linear layout** and hands them to ``core_attention``; whatever comes back goes into
its output projection. In between, this module

1. rotates Q and K with per-document RoPE (``rotary.py``; the model is built with
   ``position_embedding_type='none'``, so Megatron applies no rotary of its own),
2. moves Q, K and V to the **attention layout** with one all-to-all (``comm.remap``),
3. runs the ring-attention engine (``attention.engine.ZeppelinAttention``),
4. moves the output back to the linear layout with the inverse all-to-all.

Step 2 and 4 are skipped when the plan's two layouts coincide (remapping off). Gradients run the
same path backwards: the remaps are each other's backward, the engine sends dK/dV around rings.

The per-micro-batch context (plan, rank, exchanger, remap group, positions) reaches the module
through Megatron's own seam: ``GPTModel.forward(..., packed_seq_params=...)`` passes its argument
untouched to every layer's core attention, so the step builds one ``ZeppelinPackedSeqParams``
(a ``PackedSeqParams`` subclass) and hands it to the model. Its ``qkv_format`` is ``'sbhd'`` so
Megatron neither squeezes the batch dim nor applies packed rotary.

With tensor parallelism each TP rank sees its own heads; the Zeppelin ranks are the data-parallel
ranks of one TP index, so ``rank`` is the data-parallel rank and the remap group and exchanger
span that rank's data-parallel group.

Shapes: ``s`` tokens of the rank's linear layout, ``b = 1`` (packed), ``t`` tokens of its
attention layout, ``n`` heads on this TP rank, ``d`` head dim, ``h = n * d``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_zeppelin.megatron.rotary import apply_rotary
from megatron_zeppelin.planner.plan import Plan


@dataclass
class ZeppelinPackedSeqParams(PackedSeqParams):
    """Per-micro-batch context for ``ZeppelinCoreAttention`` (see the module docstring)."""

    plan: Plan | None = None
    """The micro-batch's plan; the same object on every rank."""
    rank: int = 0
    """This process's Zeppelin rank (its data-parallel rank)."""
    exchanger: Any = None
    """The ring transport, e.g. ``comm.exchange.DistExchanger``, set to this plan."""
    remap_group: dist.ProcessGroup | None = None
    """Process group of the Zeppelin ranks for the remap all-to-all; ``None``: the world."""
    positions: torch.Tensor | None = None
    """Position of every linear-layout token inside its document (int64, ``s``)."""
    kernel: str = "auto"
    """Attention kernel handed to the engine."""
    watch: Any = None
    """``comm.watch.CommWatch`` bounding the remap all-to-all and naming a stalled rank with
    the layer; ``None``: plain collectives."""
    _engine: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format == "thd":
            raise ValueError(
                "ZeppelinPackedSeqParams carries [s, b, n, d] tensors: leave qkv_format"
            )

    @property
    def remaps(self) -> bool:
        """Whether the two layouts differ anywhere (every rank computes the same answer)."""
        assert self.plan is not None
        return any(
            self.plan.linear_ranges(r) != self.plan.attention_ranges(r)
            for r in range(self.plan.world_size)
        )

    def engine(self, softmax_scale: float | None) -> Any:
        """The engine for this micro-batch, built once and shared by every layer."""
        if self._engine is None:
            from megatron_zeppelin.attention.engine import ZeppelinAttention

            self._engine = ZeppelinAttention(
                self.plan,
                self.rank,
                self.exchanger,
                kernel=self.kernel,
                softmax_scale=softmax_scale,
            )
        return self._engine


class ZeppelinCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron's ``SelfAttention`` (causal, per document)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str = "self",
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection: Any = None,
        *,
        rotary_base: float | None = 10000.0,
        rotary_percent: float = 1.0,
        **unused: Any,
    ) -> None:
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(
                "Zeppelin core attention supports self-attention only (decoder models)"
            )
        if config.context_parallel_size != 1:
            raise ValueError(
                "Zeppelin replaces context parallelism: set --context-parallel-size 1 and let "
                "Zeppelin span the data-parallel ranks"
            )
        self.layer_number = layer_number
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.rotary_base = rotary_base
        self.rotary_percent = rotary_percent

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        params = packed_seq_params
        if not isinstance(params, ZeppelinPackedSeqParams) or params.plan is None:
            raise ValueError(
                "Zeppelin core attention needs the micro-batch's plan: pass a "
                "ZeppelinPackedSeqParams as GPTModel.forward(..., packed_seq_params=...)"
            )
        if attention_bias is not None:
            raise ValueError("Zeppelin core attention does not support an attention bias")
        s, b, n, d = query.shape
        if b != 1:
            raise ValueError(
                f"Zeppelin packs documents into one row: batch size must be 1, got {b}"
            )
        q_snd, k_snd, v_snd = query[:, 0], key[:, 0], value[:, 0]
        if self.rotary_base is not None:
            if params.positions is None or params.positions.shape[0] != s:
                raise ValueError(
                    f"per-document RoPE needs one position per linear token ({s}) in "
                    "ZeppelinPackedSeqParams.positions"
                )
            positions = params.positions.to(query.device)
            q_snd = apply_rotary(
                q_snd, positions, base=self.rotary_base, rotary_percent=self.rotary_percent
            )
            k_snd = apply_rotary(
                k_snd, positions, base=self.rotary_base, rotary_percent=self.rotary_percent
            )
        n_kv = k_snd.shape[1]
        engine = params.engine(self.softmax_scale)
        watch, layer = params.watch, self.layer_number
        if params.remaps:
            from megatron_zeppelin.comm.remap import attention_to_linear, linear_to_attention

            # One all-to-all for Q, K and V together: rows travel with all their features.
            qkv_sf = torch.cat(
                [q_snd.reshape(s, -1), k_snd.reshape(s, -1), v_snd.reshape(s, -1)], 1
            )
            qkv_tf = linear_to_attention(qkv_sf, params.plan, params.rank, params.remap_group,
                                         watch=watch, layer=layer)  # fmt: skip
            t = qkv_tf.shape[0]
            q_tnd, k_tnd, v_tnd = qkv_tf.split([n * d, n_kv * d, n_kv * d], dim=1)
            _mark_ring(watch, layer)
            out_tnd = engine(
                q_tnd.reshape(t, n, d), k_tnd.reshape(t, n_kv, d), v_tnd.reshape(t, n_kv, d)
            )
            out_sh = attention_to_linear(out_tnd.reshape(t, n * d), params.plan, params.rank,
                                         params.remap_group, watch=watch, layer=layer)  # fmt: skip
        else:
            _mark_ring(watch, layer)
            out_sh = engine(q_snd, k_snd, v_snd).reshape(s, n * d)
        return out_sh.reshape(s, 1, n * d)


def _mark_ring(watch: Any, layer: int) -> None:
    """Tell the watch the ring runs now, so a ring transfer that times out is reported at this
    layer (the exchanger bounds the transfers itself)."""
    if watch is not None:
        watch.at(layer=layer, phase="forward", what="ring attention")
