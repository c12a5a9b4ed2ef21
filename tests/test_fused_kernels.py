"""Pure tier: the cuDNN-class and switched kernels' adapters on the CPU, against stand-ins.

* ``te``: TransformerEngine's ``fused_attn_fwd``/``_bwd`` stood in per calling convention (TE
  2.1, 2.8, 2.12, 2.15; ``te_standins.py`` says what each reproduces), with both layouts of the
  softmax statistics, computed in float64: the adapter must match dense float64 attention, and
  an adapter speaking another release's convention must fail.
* ``cudnn``: PyTorch's cuDNN operators stood in with their top-left causal mask
  (``cudnn_standins.py``): in float64 the adapter's cut of bottom-right causal pairs (an
  unmasked part and a square causal part merged by lse) must equal dense attention, and the
  operator must only ever run causal on square pairs. The real operators bind the adapter's
  arguments (they then refuse CPU tensors, after parsing).
* ``torch-fa3``/``torch-fa4``: PyTorch's flash-attention switch stood in: each kernel runs its
  implementation, ``torch-flash`` puts FlashAttention-2 back, and the availability probes say
  what is missing.
"""

from __future__ import annotations

import importlib.util

import cudnn_standins
import pytest
import te_standins
import torch

from megatron_zeppelin.attention.kernels import kernel_fa_switch
from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.kernels.kernel_aten import FlashSwitch, TorchFlashKernel
from megatron_zeppelin.attention.kernels.kernel_cudnn import TorchCudnnKernel
from megatron_zeppelin.attention.kernels.kernel_fa_switch import TorchFA3Kernel, TorchFA4Kernel
from megatron_zeppelin.attention.kernels.kernel_te import TEFusedKernel, te_release
from megatron_zeppelin.attention.kernels.kernel_torch import TorchKernel
from megatron_zeppelin.testing.reference import pair_attention, random_qkv
from megatron_zeppelin.testing.tolerances import relative_error

pytestmark = pytest.mark.pure

F64 = (torch.float64,)
CAUSAL = ([1, 40, 17, 33, 5], [1, 56, 17, 70, 9])
"""Pair lengths as the ring makes them: squares, suffixes (more keys), one-query pairs."""
FULL = ([5, 24, 17, 9], [7, 24, 3, 30])


def _inputs(causal: bool, dtype=torch.float64, seed: int = 3):  # noqa: ANN001, ANN202
    """GQA (8 query heads over 2 K/V heads), head dim 16, float64 unless ``dtype``."""
    lengths_q, lengths_k = CAUSAL if causal else FULL
    q, _, _ = random_qkv(sum(lengths_q), num_heads=8, num_kv_heads=2, head_dim=16, seed=seed)
    _, k, v = random_qkv(sum(lengths_k), num_heads=8, num_kv_heads=2, head_dim=16, seed=seed + 1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 2), dtype=q.dtype)
    batch = VarlenBatch(lengths_q, lengths_k, causal=causal)
    return [x.to(dtype) for x in (q, k, v, dout)], batch


def _errors(kernel, causal: bool) -> dict[str, float]:  # noqa: ANN001
    """Relative errors of ``kernel``'s forward and backward (given the reference's output and
    lse, as the ring gives the merged ones) against dense float64 attention."""
    (q, k, v, dout), batch = _inputs(causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = pair_attention(
        *leaves, batch.lengths_q, batch.lengths_k, causal=causal, scale=0.25
    )
    ref.backward(dout)
    out, lse = kernel.forward(q, k, v, batch, softmax_scale=0.25)
    final_out, final_lse = ref.detach(), ref_lse.detach()
    grads = kernel.backward(dout, q, k, v, final_out, final_lse, batch, softmax_scale=0.25)
    got = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    want = {"out": ref, "lse": ref_lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
            "dv": leaves[2].grad}  # fmt: skip
    assert all(got[n].shape == want[n].shape for n in got), {n: got[n].shape for n in got}
    return {n: relative_error(got[n].double(), want[n].detach()) for n in got}


# --- TransformerEngine ----------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed_stats", [True, False])
@pytest.mark.parametrize("version", sorted(te_standins.RELEASES))
def test_te_adapter_matches_dense_attention(version, packed_stats, causal) -> None:
    modules, release = te_standins.te_modules(version, packed_stats=packed_stats)
    kernel = TEFusedKernel(modules=modules, version=version, dtypes=F64)
    errors = _errors(kernel, causal)
    assert max(errors.values()) < 1e-12, errors
    mask = "padding_causal_bottom_right" if causal else "padding"
    assert [c["mask"] for c in release.calls] == [mask, mask]


def test_te_statistics_layout_before_any_forward() -> None:
    """A backward with no forward before it (a fresh kernel) builds the statistics in the
    layout cuDNN's version implies: [b, h, s, 1] before 9.6."""
    modules, _ = te_standins.te_modules("2.8.0", packed_stats=False)
    (q, k, v, dout), batch = _inputs(True)
    out, lse = TorchKernel().forward(q, k, v, batch, softmax_scale=0.25)
    fresh = TEFusedKernel(modules=modules, version="2.8.0", dtypes=F64)
    grads = fresh.backward(dout, q, k, v, out, lse, batch, softmax_scale=0.25)
    want = TorchKernel().backward(dout, q, k, v, out, lse, batch, softmax_scale=0.25)
    assert max(relative_error(g, w) for g, w in zip(grads, want)) < 1e-12


@pytest.mark.parametrize(
    ("speaks", "library"), [("2.12.0", "2.15.0"), ("2.15.0", "2.12.0"), ("2.15.0", "2.1.0")]
)
def test_te_conventions_are_not_interchangeable(speaks, library) -> None:
    """The adapter set to one release's convention fails on another's functions: the stand-ins
    tell the conventions apart, so each passing test above checks its own."""
    modules, _ = te_standins.te_modules(library)
    kernel = TEFusedKernel(modules=modules, version=speaks, dtypes=F64)
    (q, k, v, dout), batch = _inputs(True)
    with pytest.raises((TypeError, RuntimeError)):
        out, lse = kernel.forward(q, k, v, batch, softmax_scale=0.25)
        kernel.backward(dout, q, k, v, out, lse, batch, softmax_scale=0.25)


def test_te_bfloat16_returns_float32_statistics() -> None:
    modules, _ = te_standins.te_modules("2.15.0")
    (q, k, v, _), batch = _inputs(True, dtype=torch.bfloat16)
    out, lse = TEFusedKernel(modules=modules, version="2.15.0").forward(
        q, k, v, batch, softmax_scale=0.25
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="float16 or bfloat16.*use kernel 'torch'"):
        TEFusedKernel(modules=modules, version="2.15.0").forward(
            q.float(), k.float(), v.float(), batch, softmax_scale=0.25
        )


def test_te_releases() -> None:
    assert not te_release("2.0.0").formats and not te_release("2.4.0+3cd6870c").formats
    assert not te_release("2.14.1").formats and te_release("2.15.0").formats
    assert te_release("2.18.0").label == "TransformerEngine 2.18.0"
    with pytest.raises(ValueError, match="older than 2.0.*upgrade"):
        te_release("1.14.0")


# --- PyTorch's cuDNN operators ----------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_cut_is_exact(causal) -> None:
    """Bottom-right causal pairs cut into an unmasked part and a square causal part for the
    top-left operator give dense attention to float64 precision; the operator runs causal on
    square pairs only."""
    ops = cudnn_standins.cudnn_ops()
    errors = _errors(TorchCudnnKernel(ops=ops, dtypes=F64), causal)
    assert max(errors.values()) < 1e-12, errors
    for call in ops.calls:
        lq, lk = call["lengths"]
        if call["causal"]:
            assert lq == lk, call
    assert any(c["causal"] for c in ops.calls) == causal


def test_cudnn_standin_is_top_left() -> None:
    """Without the cut, the stood-in operator's causal mask differs from the ring's on pairs
    with more keys than queries: the test above could fail."""
    (q, k, v, _), batch = _inputs(True)
    ops = cudnn_standins.cudnn_ops()
    cu_q, cu_k = batch.cu_seqlens(q.device)
    out = ops._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, batch.max_seqlen_q, batch.max_seqlen_k, True, 0.0, True,
        scale=0.25,
    )[0]  # fmt: skip
    ref, _ = pair_attention(q, k, v, batch.lengths_q, batch.lengths_k, causal=True, scale=0.25)
    assert relative_error(out, ref) > 0.1


def test_cudnn_refuses_more_queries_than_keys() -> None:
    kernel = TorchCudnnKernel(ops=cudnn_standins.cudnn_ops(), dtypes=F64)
    q, k, v = random_qkv(12, num_heads=2, head_dim=8)
    batch = VarlenBatch([8], [4], causal=True)
    with pytest.raises(ValueError, match="at most as many queries as keys"):
        kernel.forward(q[:8], k[:4], v[:4], batch, softmax_scale=0.25)


def test_cudnn_calls_bind_the_real_operator_schemas() -> None:
    """torch.ops.aten's cuDNN operators parse the adapter's arguments, then refuse CPU tensors
    (a wrong argument would be a TypeError or a schema error first)."""
    kernel = TorchCudnnKernel(ops=torch.ops.aten)
    for causal in (True, False):
        (q, k, v, dout), batch = _inputs(causal, dtype=torch.bfloat16)
        with pytest.raises(NotImplementedError, match="_cudnn_attention_forward.*'CPU' backend"):
            kernel.forward(q, k, v, batch, softmax_scale=0.25)
        lse = torch.zeros(q.shape[:2])
        with pytest.raises(NotImplementedError, match="_cudnn_attention_backward.*'CPU' backend"):
            kernel.backward(dout, q, k, v, q, lse, batch, softmax_scale=0.25)


# --- FlashAttention-3/4 through PyTorch's switch ----------------------------------------------
def test_switched_kernels_run_their_implementation() -> None:
    api = cudnn_standins.flash_switch_api()
    ops = cudnn_standins.recording_flash_ops(api)
    switch = FlashSwitch(api)
    (q, k, v, dout), batch = _inputs(True, dtype=torch.bfloat16)
    ref_out, ref_lse = TorchKernel().forward(q, k, v, batch, softmax_scale=0.25)
    for kernel_type, impl in ((TorchFA3Kernel, "FA3"), (TorchFlashKernel, None),
                              (TorchFA4Kernel, "FA4"), (TorchFlashKernel, None)):  # fmt: skip
        kernel = kernel_type(ops=ops, switch=switch)
        ops.ran.clear()
        out, lse = kernel.forward(q, k, v, batch, softmax_scale=0.25)
        kernel.backward(dout, q, k, v, out, lse, batch, softmax_scale=0.25)
        assert ops.ran == [impl, impl], (kernel.name, ops.ran)
        assert relative_error(lse, ref_lse) < 1e-5 and relative_error(out.float(), ref_out) < 1e-2
    # Activated once per change, not once per call.
    assert api.activations == ["FA3", None, "FA4", None]


def test_switched_kernels_say_what_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    unavailable = kernel_fa_switch._switch_unavailable
    no_switch = FlashSwitch(object())
    assert "no switch to FA3" in unavailable("FA3", no_switch)
    switch = FlashSwitch(cudnn_standins.flash_switch_api())
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "FA4 is not installed (flash_attn.cute.interface" in unavailable("FA4", switch)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: real_find_spec("torch"))
    for capability, impl, verdict in [
        ((9, 0), "FA3", None),
        ((10, 0), "FA3", "do not run on compute capability 10.0"),
        ((10, 0), "FA4", None),
        ((8, 0), "FA4", "needs compute capability 9.0"),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        problem = unavailable(impl, switch)
        assert problem is None if verdict is None else verdict in problem, (impl, problem)
