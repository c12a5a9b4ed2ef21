"""Norms for Megatron's local layer spec under sequence parallelism, without Apex.

Megatron's local spec builds its norms with Apex's ``FusedLayerNorm`` where Apex imports and
with ``WrappedTorchNorm`` (plain PyTorch) elsewhere; ``WrappedTorchNorm`` refuses
``sequence_parallel`` outright. The only thing a norm must do differently under sequence
parallelism is mark its weights ``sequence_parallel``, as ``FusedLayerNorm`` and
TransformerEngine's norms do, so that Megatron's ``finalize_model_grads`` (and the CPU job's
``loss.finish_gradients``) sums their gradients over the tensor-parallel ranks, each of which
normalized only its share of the rows. ``SequenceParallelTorchNorm`` is PyTorch's norm with
that mark; ``sequence_parallel_spec`` puts it where Megatron's spec has ``WrappedTorchNorm``
(every layer's two norms, dense and MoE layers alike, and the block's final norm) and leaves
every other module as it is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class SequenceParallelTorchNorm:
    """PyTorch's ``RMSNorm`` / ``LayerNorm`` with weights marked ``sequence_parallel`` like
    Apex's ``FusedLayerNorm`` (``megatron/core/fusions/fused_layer_norm.py``) marks them."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any):
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"--normalization {config.normalization} has no sequence-parallel norm here: use "
                "RMSNorm or LayerNorm, or the 'te' spec"
            )
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def sequence_parallel_spec(spec, num_layers: int) -> TransformerBlockSubmodules:
    """The block of ``spec`` (a layer spec, repeated ``num_layers`` times, or a block spec) with
    its PyTorch norms swapped for ``SequenceParallelTorchNorm``; ``GPTModel`` takes it as its
    ``transformer_layer_spec``."""
    if isinstance(spec, TransformerBlockSubmodules):
        layers, final = list(spec.layer_specs), spec.layer_norm
    else:
        layers, final = [spec] * num_layers, SequenceParallelTorchNorm
    swapped = {id(layer): _swap_norms(layer) for layer in layers}
    if final is WrappedTorchNorm:
        final = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(
        layer_specs=[swapped[id(layer)] for layer in layers], layer_norm=final
    )


def _swap_norms(layer_spec: ModuleSpec) -> ModuleSpec:
    layer_spec = copy.deepcopy(layer_spec)
    submodules = layer_spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(submodules, name, None) is WrappedTorchNorm:
            setattr(submodules, name, SequenceParallelTorchNorm)
    return layer_spec


def needs_sequence_parallel_norms(spec) -> bool:
    """Whether ``spec`` (a layer spec or block spec) builds a norm that refuses sequence
    parallelism."""
    if isinstance(spec, TransformerBlockSubmodules):
        layers = list(spec.layer_specs)
        if spec.layer_norm is WrappedTorchNorm:
            return True
    else:
        layers = [spec]
    return any(
        getattr(layer.submodules, name, None) is WrappedTorchNorm
        for layer in layers
        for name in ("input_layernorm", "pre_mlp_layernorm")
    )
