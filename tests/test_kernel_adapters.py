"""Pure tier: the CUDA kernels' adapters, on the CPU, against stand-ins of each library release.

``flash_standins.py`` reproduces the calling convention of flash-attn 2.6, 2.7, 2.8 and
FlashAttention-3 (3.0.0b1 and 3.0.0), custom-op wrapping included, and the contract of PyTorch's
``aten::_flash_attention_forward`` / ``_backward``; its docstring says which file of which
release each follows. Each adapter's forward and backward (given the final output and lse, as the
ring calls it) must match the tiled torch kernel. PyTorch's real operators are also called with
meta tensors, which checks the adapter's arguments against their real schemas. The registry's
``auto`` order and its reasons are checked with the availability probes replaced.
"""

from __future__ import annotations

import inspect
import sys

import flash_standins as standins
import pytest
import torch

from megatron_zeppelin.attention.kernels import kernels
from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.kernels.kernel_aten import TorchFlashKernel
from megatron_zeppelin.attention.kernels.kernel_flash import (
    Flash3Kernel,
    flash2_release,
    flash3_release,
)
from megatron_zeppelin.attention.kernels.kernel_torch import TorchKernel
from megatron_zeppelin.config import KERNELS
from megatron_zeppelin.testing.reference import random_qkv
from megatron_zeppelin.testing.tolerances import assert_close

pytestmark = pytest.mark.pure

SCALE = 0.125
DTYPE = torch.bfloat16


def _inputs(causal: bool, window: int | None = None):  # noqa: ANN202
    """GQA (8 query heads over 2 K/V heads), head dim 64, pairs of unequal sizes; ``window``:
    a left window narrower than most pairs."""
    lengths_q, lengths_k = [1, 40, 17, 33], [1, 56, 17, 33]
    if not causal:
        lengths_k = [5, 24, 17, 9]
    q, _, _ = random_qkv(sum(lengths_q), num_heads=8, num_kv_heads=2, head_dim=64, seed=3)
    _, k, v = random_qkv(sum(lengths_k), num_heads=8, num_kv_heads=2, head_dim=64, seed=4)
    batch = VarlenBatch(lengths_q, lengths_k, causal=causal, window=window)
    return [x.to(DTYPE) for x in (q, k, v)], batch


def _matches_torch_kernel(kernel, causal: bool, window: int | None = None) -> None:  # noqa: ANN001
    assert kernel.supports_window
    (q, k, v), batch = _inputs(causal, window)
    out, lse = kernel.forward(q, k, v, batch, softmax_scale=SCALE)
    ref_out, ref_lse = TorchKernel().forward(q, k, v, batch, softmax_scale=SCALE)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[1])
    assert lse.dtype == torch.float32
    assert_close(out.float(), ref_out, dtype=DTYPE, name="out")
    assert_close(lse, ref_lse, dtype=torch.float32, name="lse")
    # The ring hands the backward the FINAL output (its dtype) and lse (float32, (t, nq)).
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DTYPE)
    final_out = ref_out.to(DTYPE)
    grads = kernel.backward(dout, q, k, v, final_out, ref_lse, batch, softmax_scale=SCALE)
    want = TorchKernel().backward(dout, q, k, v, final_out, ref_lse, batch, softmax_scale=SCALE)
    for name, got, ref, like in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert got.shape == like.shape, name
        assert_close(got.float(), ref, dtype=DTYPE, name=name)


@pytest.fixture
def fake_hopper(monkeypatch):
    """A visible CUDA device of compute capability 9.0, as far as the availability probes see;
    the registry's caches emptied."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(kernels, "_INSTANCES", {})
    monkeypatch.setattr(kernels, "_AUTO", {})


FLASH2_RELEASES = {
    "2.6.3": standins.flash_attn_2_6,
    "2.7.0": lambda: standins.flash_attn_2_7(zero_tensors=False),
    "2.8.3": lambda: standins.flash_attn_2_7(zero_tensors=True),
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("release", sorted(FLASH2_RELEASES))
def test_flash_attn_2_through_the_registry(release, causal, window, monkeypatch, fake_hopper):  # noqa: ANN001, ANN201
    interface = FLASH2_RELEASES[release]()
    monkeypatch.setitem(sys.modules, "flash_attn", standins.flash_attn_package(interface))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    if release != "2.6.3":  # the custom op hides its arguments: nothing to filter by
        sig = inspect.signature(interface._flash_attn_varlen_backward)
        assert list(sig.parameters) == ["args", "kwargs"]
    kernel = kernels.get_kernel("flash", window=window is not None)
    _matches_torch_kernel(kernel, causal, window)
    assert kernel.release.label == f"flash-attn {release}"


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("make", [standins.flash_attn_3_beta, standins.flash_attn_3])
def test_flash_attention_3(make, causal, window) -> None:  # noqa: ANN001
    interface = make()
    kernel = Flash3Kernel(interface=interface, version=interface.__version__)
    _matches_torch_kernel(kernel, causal, window)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_flash_against_the_operators_contract(causal, window) -> None:  # noqa: ANN001
    _matches_torch_kernel(TorchFlashKernel(ops=standins.aten_flash_ops()), causal, window)


def test_torch_flash_calls_match_the_real_operator_schemas() -> None:
    """PyTorch's own operators on meta tensors: wrong arguments would not bind."""
    kernel = TorchFlashKernel(ops=torch.ops.aten)
    (q, k, v), batch = _inputs(True, window=6)
    q, k, v = (torch.empty(x.shape, dtype=x.dtype, device="meta") for x in (q, k, v))
    out, lse = kernel.forward(q, k, v, batch, softmax_scale=SCALE)
    assert out.shape == q.shape and out.dtype == DTYPE
    assert lse.shape == (q.shape[0], q.shape[1]) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(torch.empty_like(q), q, k, v, out, lse, batch, softmax_scale=SCALE)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_adapters_refuse_what_the_kernels_cannot_take() -> None:
    kernel = TorchFlashKernel(ops=standins.aten_flash_ops())
    (q, k, v), batch = _inputs(True)
    with pytest.raises(ValueError, match="float16 or bfloat16.*use kernel 'torch'"):
        kernel.forward(q.float(), k.float(), v.float(), batch, softmax_scale=SCALE)
    with pytest.raises(ValueError, match="multiples of 8"):
        kernel.forward(q[..., :60], k[..., :60], v[..., :60], batch, softmax_scale=SCALE)
    flash3 = Flash3Kernel(interface=standins.flash_attn_3(), version="3.0.0")
    with pytest.raises(ValueError, match="needs 1 query rows|query rows"):
        flash3.forward(q[:-1], k, v, batch, softmax_scale=SCALE)


def test_the_release_decides_the_calling_convention() -> None:
    assert not flash2_release("2.6.3").window_split
    assert flash2_release("2.7.0").window_split
    assert flash2_release("2.7.4.post1").window_split
    assert flash2_release("2.8.3").window_split
    with pytest.raises(ValueError, match="older than 2.6"):
        flash2_release("2.5.9.post1")
    assert flash3_release("3.0.0b1").label == "FlashAttention-3 3.0.0b1"
    assert not flash3_release("3.0.0.b1").window_split  # one window_size tuple
    assert flash3_release("3.0.0").window_split
    with pytest.raises(ValueError, match="not a FlashAttention-3 release"):
        flash3_release("2.8.3")


def _probes(monkeypatch, capability=(9, 0), **problems: str | None) -> None:  # noqa: ANN001
    """Every CUDA kernel can run on a GPU of ``capability`` but those given a problem."""
    table = dict.fromkeys(kernels.CUDA_KERNELS)
    table.update({k.replace("_", "-"): v for k, v in problems.items()})
    monkeypatch.setattr(kernels, "_UNAVAILABLE", {k: (lambda v=v: v) for k, v in table.items()})
    monkeypatch.setattr(kernels, "cuda_capability", lambda: capability)


def test_auto_puts_cudnn_class_kernels_first_on_hopper(monkeypatch) -> None:
    cuda = {"device": "cuda:0", "dtype": torch.bfloat16}
    _probes(monkeypatch)
    name, why = kernels.choose_kernel("auto", **cuda)
    assert name == "te" and "Hopper order" in why
    _probes(monkeypatch, te="TransformerEngine is not installed")
    name, why = kernels.choose_kernel("auto", **cuda)
    assert name == "cudnn" and "TransformerEngine is not installed" in why
    _probes(monkeypatch, te="no te", cudnn="no cudnn")
    assert kernels.choose_kernel("auto", **cuda)[0] == "flash3"
    _probes(monkeypatch, te="a", cudnn="b", flash3="c", torch_fa3="d", torch_fa4="e", flash="f")
    assert kernels.choose_kernel("auto", **cuda)[0] == "torch-flash"
    everything = {name.replace("-", "_"): "missing" for name in kernels.CUDA_KERNELS}
    _probes(monkeypatch, **everything)
    name, why = kernels.choose_kernel("auto", **cuda)
    assert name == "torch" and why.count("missing") == len(kernels.CUDA_KERNELS)
    # Before Hopper flash-attn 2 leads; Blackwell skips FlashAttention-3.
    _probes(monkeypatch, capability=(8, 0))
    assert kernels.choose_kernel("auto", **cuda)[0] == "flash"
    _probes(monkeypatch, capability=(10, 0), te="no te", cudnn="no cudnn")
    assert kernels.choose_kernel("auto", **cuda)[0] == "torch-fa4"
    # Not CUDA, or not half precision: the tiled kernel, and the reason says which.
    _probes(monkeypatch)
    name, why = kernels.choose_kernel("auto", device="cpu", dtype=torch.bfloat16)
    assert name == "torch" and "CUDA" in why
    name, why = kernels.choose_kernel("auto", device="cuda:0", dtype=torch.float32)
    assert name == "torch" and "float32" in why


def test_auto_follows_measured_speed_where_given(monkeypatch) -> None:
    cuda = {"device": "cuda:0", "dtype": torch.bfloat16}
    _probes(monkeypatch, te="TransformerEngine is not installed")
    measured = (["te", "torch-flash", "cudnn", "no-such-kernel"], "calibration h100.json")
    name, why = kernels.choose_kernel("auto", measured=measured, **cuda)
    assert name == "torch-flash"
    assert "measured speed (calibration h100.json)" in why and "te: TransformerEngine" in why
    # Kernels the calibration did not measure come after, in the fixed order.
    _probes(monkeypatch, torch_flash="x", cudnn="y", te="z")
    assert kernels.choose_kernel("auto", measured=measured, **cuda)[0] == "flash3"


def test_a_kernel_named_but_missing_is_one_clear_error(monkeypatch) -> None:
    _probes(monkeypatch, flash="flash-attn is not installed (pip install flash-attn)")
    with pytest.raises(ValueError, match="'flash' cannot run here: flash-attn is not installed"):
        kernels.choose_kernel("flash", device="cuda:0", dtype=torch.bfloat16)
    monkeypatch.setattr(kernels, "_INSTANCES", {})
    with pytest.raises(ValueError, match="use 'auto'"):
        kernels.get_kernel("flash")
    assert kernels.choose_kernel("torch-flash", device="cuda:0")[0] == "torch-flash"


def test_a_window_keeps_kernels_without_one_away(monkeypatch, fake_hopper) -> None:  # noqa: ANN001
    """Sliding-window calls: ``auto`` skips a kernel that has no window mask and says so; named,
    such a kernel is refused; without a window it stays the first choice."""

    class NoWindow(TorchKernel):
        supports_window = False

    _probes(monkeypatch, torch_fa3="not installed", torch_fa4="not installed")
    for name, factory in (("flash3", NoWindow), ("flash", TorchKernel), ("torch-flash", NoWindow)):
        monkeypatch.setitem(kernels._FACTORIES, name, factory)
    cuda = {"device": "cuda:0", "dtype": torch.bfloat16}
    assert kernels.choose_kernel("auto", **cuda)[0] == "te"
    name, why = kernels.choose_kernel("auto", **cuda, window=True)
    assert name == "flash"
    for skipped in ("te", "cudnn", "flash3"):
        assert f"'{skipped}' has no sliding-window mask" in why
    assert kernels.get_kernel("auto", **cuda, window=True).supports_window
    with pytest.raises(ValueError, match="'torch-flash' cannot run here: .*sliding-window"):
        kernels.choose_kernel("torch-flash", **cuda, window=True)
    with pytest.raises(ValueError, match="sliding-window"):
        kernels.get_kernel("flash3", **cuda, window=True)
    assert kernels.get_kernel("flash3", **cuda).name == "torch"  # the stand-in, no window asked


def test_the_flag_offers_every_registered_kernel() -> None:
    assert list(KERNELS) == kernels.available_kernels()
