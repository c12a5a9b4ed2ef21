"""Zeppelin's core attention: the one module Megatron's layer spec swaps for ours.

Megatron's ``SelfAttention`` computes Q, K and V with its own (tensor-parallel) linear layers in
the rank's **linear layout** and hands them to ``core_attention``; whatever comes back goes into
its output projection. In between, this module

1. rotates Q and K with per-document RoPE (``rotary.py``; the model is built with
   ``position_embedding_type='none'``, so Megatron applies no rotary of its own),
2. moves Q, K and V to the **attention layout** with one all-to-all (``comm.remap``),
3. runs the ring-attention engine (``attention.engine.ZeppelinAttention``) with the layer's
   sliding window and attention sink, if the config asks for them (``variants.py``),
4. moves the output back to the linear layout with the inverse all-to-all.

Step 2 and 4 are skipped when the plan's two layouts coincide (remapping off). A rank's linear
buffer may end in padding rows (``batch.pad_linear_batch``: a multiple of the tensor-parallel
size under sequence parallelism, at least one row on a rank the plan leaves empty); only the
plan's ``num_linear_tokens`` real rows take part, the padding rows get a zero output. Gradients
run the same path backwards: the remaps are each other's backward, the engine sends dK/dV around
rings.

The per-micro-batch context (plan, rank, exchanger, remap group, positions) reaches the module
through Megatron's own seam: ``GPTModel.forward(..., packed_seq_params=...)`` passes its argument
untouched to every layer's core attention, so the step builds one ``ZeppelinPackedSeqParams``
(a ``PackedSeqParams`` subclass) and hands it to the model. Its ``qkv_format`` is ``'sbhd'`` so
Megatron neither squeezes the batch dim nor applies packed rotary.

With tensor parallelism each TP rank sees its own heads, for the whole of the rank's linear
buffer even under sequence parallelism (Megatron's QKV projection all-gathers the sequence
before it and the output projection reduce-scatters after it). The Zeppelin ranks are the
data-parallel ranks of one TP index, so ``rank`` is the data-parallel rank and the remap group
and exchanger span that rank's data-parallel group.

Shapes: ``s`` tokens of the rank's linear layout, ``b = 1`` (packed), ``t`` tokens of its
attention layout, ``n`` heads on this TP rank, ``d`` head dim, ``h = n * d``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.comm.protocol import Exchanger
from megatron_zeppelin.comm.remap import remap_rows
from megatron_zeppelin.megatron.model import variants
from megatron_zeppelin.megatron.model.rotary import MEGATRON_DEFAULT, Rope, apply_rotary
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.plan.remap_layout import plan_layouts, remap_pair


@dataclass
class ZeppelinPackedSeqParams(PackedSeqParams):
    """Per-micro-batch context for ``ZeppelinCoreAttention`` (see the module docstring)."""

    plan: Plan | None = None
    """The micro-batch's plan; the same object on every rank."""
    rank: int = 0
    """This process's Zeppelin rank (its data-parallel rank)."""
    exchanger: Exchanger | None = None
    """The ring transport, e.g. ``comm.exchange.DistExchanger``, bound to this plan
    (``for_plan``)."""
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
    _remap: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format == "thd":
            raise ValueError(
                "ZeppelinPackedSeqParams carries [s, b, n, d] tensors: leave qkv_format"
            )

    @property
    def num_linear_tokens(self) -> int:
        """Real (planned) tokens of this rank's linear layout; rows past them are padding."""
        assert self.plan is not None
        return self.plan.num_linear_tokens(self.rank)

    @property
    def remaps(self) -> bool:
        """Whether the two layouts differ anywhere (every rank computes the same answer)."""
        return self.remap_layouts() is not None

    def remap_layouts(self) -> tuple[Any, Any] | None:
        """``(linear -> attention, attention -> linear)`` moves of this rank, or ``None`` when
        the layouts coincide. Worked out once per micro-batch: every layer reuses them, so no
        layer call rescans the plan's ranks or hashes the plan."""
        if self._remap is None:
            plan = self.plan
            assert plan is not None
            layouts = plan_layouts(plan)
            differ = layouts[0] != layouts[1]
            self._remap = (self._layouts(layouts),) if differ else (None,)
        return self._remap[0]

    def _layouts(self, layouts: tuple[Any, Any]) -> tuple[Any, Any]:

        size, me = dist.get_world_size(self.remap_group), dist.get_rank(self.remap_group)
        if size != self.plan.world_size or me != self.rank:
            raise ValueError(
                f"the plan is for {self.plan.world_size} ranks and this is rank {self.rank}, but "
                f"the remap group has {size} ranks and this process is its rank {me}: pass the "
                "group of the plan's ranks"
            )
        return remap_pair(self.plan, self.rank, layouts)

    def engine(self, softmax_scale: float | None) -> Any:
        """The engine for this micro-batch, built once and shared by every layer."""
        if self._engine is None:
            self._engine = ZeppelinAttention(
                self.plan,
                self.rank,
                self.exchanger,
                kernel=self.kernel,
                softmax_scale=softmax_scale,
            )
        return self._engine


class ZeppelinCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron's ``SelfAttention`` (causal, per document).

    ``rope``: Megatron's rotary settings (``Rope.from_args``), ``None`` for a model without
    rotary embeddings. The config's attention variants are read as Megatron's own attention
    reads them (``variants.py``); a setting this module would not honour raises here, at model
    construction, with the flag to change."""

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
        rope: Rope | None = MEGATRON_DEFAULT,
        **unknown: Any,
    ) -> None:
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(
                "Zeppelin core attention supports self-attention only (decoder models)"
            )
        variants.check_settings(config, attn_mask_type=attn_mask_type, unknown=unknown)
        self.layer_number = layer_number
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.rope = None if variants.skips_rope(config, layer_number) else rope
        self.window = variants.layer_window(config, layer_number)
        self.tp_group = _tp_group(pg_collection)
        heads = config.num_attention_heads // self.tp_group.size()
        offset = variants.softmax_offset(config, heads)
        # Per-head sink logits of this TP rank's heads (--softmax-type), or None; the name
        # and kind (parameter or plain tensor) are DotProductAttention's.
        if isinstance(offset, torch.nn.Parameter):
            self.register_parameter("softmax_offset", offset)
        else:
            self.softmax_offset = offset

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's distributed checkpoint of the learnable sink logits, sharded over TP along
        the heads as ``DotProductAttention`` shards them (nothing else to save)."""
        state = self.state_dict(prefix="", keep_vars=True) if self.has_learned_sink else {}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )

    @property
    def has_learned_sink(self) -> bool:
        return isinstance(self.softmax_offset, torch.nn.Parameter)

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
        real = params.num_linear_tokens
        if s < real:
            raise ValueError(
                f"rank {params.rank} holds {real} linear-layout tokens of the plan but core "
                f"attention got {s} rows: build the batch from this micro-batch's plan"
            )
        # Rows past ``real`` pad the rank's buffer (to a multiple of the tensor-parallel size
        # under sequence parallelism, to one row on a rank without tokens): they attend to
        # nothing, nothing attends to them, and their output is zero.
        q_snd, k_snd, v_snd = query[:real, 0], key[:real, 0], value[:real, 0]
        if self.rope is not None:
            if params.positions is None or params.positions.shape[0] != s:
                raise ValueError(
                    f"per-document RoPE needs one position per linear row ({s}) in "
                    "ZeppelinPackedSeqParams.positions"
                )
            positions = params.positions[:real].to(query.device)
            q_snd = apply_rotary(q_snd, positions, self.rope)
            k_snd = apply_rotary(k_snd, positions, self.rope)
        out_sh = self._attend(params, q_snd, k_snd, v_snd)
        if s > real:
            out_sh = torch.cat([out_sh, out_sh.new_zeros(s - real, out_sh.shape[1])])
        return out_sh.reshape(s, 1, n * d)

    def _attend(self, params: ZeppelinPackedSeqParams, q_snd, k_snd, v_snd) -> torch.Tensor:
        """Attention of the rank's real rows, in and out of the attention layout."""
        s, n, d = q_snd.shape
        n_kv = k_snd.shape[1]
        ring = params.engine(self.softmax_scale)
        sink = self.softmax_offset
        sink = None if sink is None else sink.to(q_snd.device)

        def engine(q_tnd, k_tnd, v_tnd):  # noqa: ANN001, ANN202
            return ring(q_tnd, k_tnd, v_tnd, window=self.window, sink_n=sink)

        watch, layer = params.watch, self.layer_number
        layouts = params.remap_layouts()
        if layouts is None:
            _mark_ring(watch, layer)
            return engine(q_snd, k_snd, v_snd).reshape(s, n * d)

        there, back = layouts
        # One all-to-all for Q, K and V together: rows travel with all their features.
        # Explicit widths: a rank without tokens has s = 0, where -1 is ambiguous.
        kv_width = n_kv * d
        qkv_sf = torch.cat(
            [q_snd.reshape(s, n * d), k_snd.reshape(s, kv_width), v_snd.reshape(s, kv_width)], 1
        )
        qkv_tf = remap_rows(
            qkv_sf,
            there,
            params.remap_group,
            back=back,
            watch=watch,
            layer=layer,
            what="remap linear->attention",
        )
        t = qkv_tf.shape[0]
        q_tnd, k_tnd, v_tnd = qkv_tf.split([n * d, kv_width, kv_width], dim=1)
        _mark_ring(watch, layer)
        out_tnd = engine(
            q_tnd.reshape(t, n, d), k_tnd.reshape(t, n_kv, d), v_tnd.reshape(t, n_kv, d)
        )
        return remap_rows(
            out_tnd.reshape(t, n * d),
            back,
            params.remap_group,
            back=there,
            watch=watch,
            layer=layer,
            what="remap attention->linear",
        )


def _tp_group(pg_collection: Any) -> Any:
    """The tensor-parallel group of this layer: from Megatron's ``pg_collection`` when it
    passes one, else Megatron's global one."""
    if pg_collection is not None and hasattr(pg_collection, "tp"):
        return pg_collection.tp
    return parallel_state.get_tensor_model_parallel_group()


def _mark_ring(watch: Any, layer: int) -> None:
    """Tell the watch the ring runs now, so a ring transfer that times out is reported at this
    layer (the exchanger bounds the transfers itself)."""
    if watch is not None:
        watch.at(layer=layer, phase="forward", what="ring attention")
