"""PyTorch's own FlashAttention varlen kernels behind ``kernel_api.AttentionKernel``:
``"torch-flash"``, for GPUs without the flash-attn package (plain ``pip install torch``).

PyTorch ships FlashAttention-2's varlen kernels as two operators (schemas as in torch 2.13):

* ``aten::_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
  dropout_p, is_causal, return_debug_mask, *, scale=None, window_size_left=None,
  window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
  num_splits=None) -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)``;
* ``aten::_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q,
  cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
  window_size_left=None, window_size_right=None) -> (dq, dk, dv)``.

``cum_seq_*`` are int32 cumulative offsets, the log-sum-exp is ``(nq, t)`` float32 for packed
(3-D) inputs, the causal mask is aligned to the bottom-right corner (the kernel is
FlashAttention-2's; PyTorch's own ``scaled_dot_product_attention`` refuses ``is_causal`` with
unequal lengths on this backend for that reason), and grouped-query K/V are taken as they are.
From torch 2.10, ``torch.nn.attention.varlen.varlen_attn`` wraps the same two operators (in
torch 2.13 it always takes the flash path: its cuDNN switch returns False). Its backward runs
through autograd with the output and log-sum-exp of its own forward, while a ring's backward
must use the merged ones, so this kernel calls the operators directly, the backward the way
``varlen_attn``'s own backward does: dropout 0, an unused ``(2,)`` uint64 ``rng_state`` and an
empty ``unused`` tensor (the kernel reads them only for dropout). A call's window goes in as
``window_size_left``/``_right`` (FlashAttention-2's convention, the one ``kernel_api.py``
uses); calls without one leave both unset.

On a CPU-only build both operators exist and raise for CPU tensors; with meta tensors they
return the shapes above, which the tests use. Calls run on the caller's current CUDA stream.
Shapes as in ``kernel_api.py``.

The implementation behind the two operators can be switched, process-wide, by
``torch.nn.attention.activate_flash_attention_impl("FA3" | "FA4")`` (``FlashSwitch``;
``kernel_fa_switch.py`` has the kernels that use it). This kernel is FlashAttention-2, so it
puts PyTorch's own implementation back (``restore_flash_attention_impl``) before a call if
another one is active: kernels measured one after another each run what they are called.
"""

from __future__ import annotations

import importlib

import torch

from megatron_zeppelin.attention.kernels.kernel_api import (
    VarlenBatch,
    check_half_inputs,
    cuda_capability,
)

__all__ = ["FlashSwitch", "TorchFlashKernel", "torch_flash_unavailable"]


def torch_flash_unavailable() -> str | None:
    """Why kernel ``"torch-flash"`` cannot run here (``None`` when it can)."""
    if not torch.backends.cuda.is_flash_attention_available():
        return f"this PyTorch ({torch.__version__}) was built without its flash attention kernels"
    capability = cuda_capability()
    if capability is None:
        return "PyTorch's flash attention kernels need a CUDA GPU and none is visible"
    if capability < (8, 0):
        return (
            "PyTorch's flash attention kernels need compute capability 8.0 or newer; this GPU "
            f"has {capability[0]}.{capability[1]}"
        )
    return None


def _window_kwargs(batch: VarlenBatch) -> dict[str, int]:
    """The operators' window arguments for ``batch`` (none for a call without a window)."""
    if batch.window is None:
        return {}
    left, right = batch.window_size
    return {"window_size_left": left, "window_size_right": right}


class FlashSwitch:
    """PyTorch's switch of the implementation behind its flash operators: the functions of
    ``torch.nn.attention`` (``activate_flash_attention_impl``, ``current_flash_attention_impl``,
    ``restore_flash_attention_impl``, ``list_flash_attention_impls``), or a stand-in of them."""

    def __init__(self, api: object | None = None) -> None:
        self._api = api if api is not None else importlib.import_module("torch.nn.attention")

    @property
    def present(self) -> bool:
        """Whether this PyTorch has the switch (torch 2.11 and later)."""
        return hasattr(self._api, "activate_flash_attention_impl")

    def offers(self, impl: str) -> bool:
        return self.present and impl in self._api.list_flash_attention_impls()

    def use(self, impl: str | None) -> None:
        """Make ``impl`` (``None``: PyTorch's FlashAttention-2) the active implementation; a
        no-op when it already is (one call of ``current_flash_attention_impl``)."""
        if not self.present:
            assert impl is None, f"{impl} needs PyTorch's flash-attention switch"
            return
        if self._api.current_flash_attention_impl() == impl:
            return
        if impl is None:
            self._api.restore_flash_attention_impl()
        else:
            self._api.activate_flash_attention_impl(impl)


class TorchFlashKernel:
    """PyTorch's FlashAttention varlen operators (fp16/bf16 on CUDA). ``ops`` defaults to
    ``torch.ops.aten`` and ``switch`` to PyTorch's own (tests pass stand-ins with their
    contract). ``impl`` is the implementation the operators must run (``None``:
    FlashAttention-2, PyTorch's own)."""

    name = "torch-flash"
    supports_window = True
    impl: str | None = None

    def __init__(self, *, ops: object | None = None, switch: FlashSwitch | None = None) -> None:
        if ops is None:
            problem = torch_flash_unavailable()
            if problem is not None:
                raise ValueError(f"kernel {self.name!r} cannot run: {problem}")
            ops = torch.ops.aten
        self._ops = ops
        self._switch = switch if switch is not None else FlashSwitch()

    def forward(self, q_tnd, k_tnd, v_tnd, batch, *, softmax_scale):  # noqa: ANN001
        check_half_inputs(self.name, q_tnd, k_tnd, v_tnd, batch)
        self._switch.use(self.impl)
        q, k, v = q_tnd.contiguous(), k_tnd.contiguous(), v_tnd.contiguous()
        cu_q, cu_k = batch.cu_seqlens(q.device)
        out, lse, *_ = self._ops._flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            batch.max_seqlen_q,
            batch.max_seqlen_k,
            0.0,
            batch.causal,
            False,
            scale=softmax_scale,
            **_window_kwargs(batch),
        )
        assert tuple(lse.shape) == (q.shape[1], q.shape[0]), (tuple(lse.shape), tuple(q.shape))
        return out, lse.float().t()

    def backward(self, dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, *, softmax_scale):  # noqa: ANN001
        check_half_inputs(self.name, q_tnd, k_tnd, v_tnd, batch)
        self._switch.use(self.impl)
        q, k, v = q_tnd.contiguous(), k_tnd.contiguous(), v_tnd.contiguous()
        cu_q, cu_k = batch.cu_seqlens(q.device)
        rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = self._ops._flash_attention_backward(
            dout_tnd.contiguous(),
            q,
            k,
            v,
            out_tnd.to(q.dtype).contiguous(),
            lse_tn.float().t().contiguous(),
            cu_q,
            cu_k,
            batch.max_seqlen_q,
            batch.max_seqlen_k,
            0.0,
            batch.causal,
            rng_state,
            unused,
            scale=softmax_scale,
            **_window_kwargs(batch),
        )
        return dq, dk, dv
