"""Attention for Zeppelin plans: online-softmax merge, varlen kernels, ring attention, engine.

``ZeppelinAttention(plan, rank, exchanger)`` is the entry point; ``merge`` is the pure maths,
``kernel_api`` the varlen-kernel interface, ``kernels`` the registry of the pluggable kernels
(``torch``, ``torch-flash``, ``flash``, ``flash3``, ``auto``; one module each), ``layout`` the
per-rank ring schedule and masks, ``ring`` the forward/backward passes and their autograd
Function.
"""

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.kernels.kernels import (
    available_kernels,
    choose_kernel,
    flash_available,
    get_kernel,
    register_kernel,
)
from megatron_zeppelin.attention.merge import merge, merge_rows

__all__ = [
    "VarlenBatch",
    "ZeppelinAttention",
    "available_kernels",
    "choose_kernel",
    "flash_available",
    "get_kernel",
    "merge",
    "merge_rows",
    "register_kernel",
]
