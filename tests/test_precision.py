"""The training job's precision: float32 main weights behind a bf16 model (tier: pure)."""

from __future__ import annotations

import pytest
import torch

from megatron_zeppelin.megatron.precision import MainWeightsAdam, job_device, make_optimizer

pytestmark = pytest.mark.pure


def _bf16_param(value: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((4,), value, dtype=torch.bfloat16))


def test_updates_below_bf16_resolution_accumulate_in_the_main_weights() -> None:
    # Adam moves each weight by about lr per step: 1e-3 is under half a bf16 step of 1.0
    # (2**-8), so Adam on the bf16 weights themselves never moves them.
    plain, main = _bf16_param(1.0), _bf16_param(1.0)
    adam, kept = torch.optim.Adam([plain], lr=1e-3), MainWeightsAdam([main], lr=1e-3)
    for _ in range(20):
        for p, opt in ((plain, adam), (main, kept)):
            opt.zero_grad()
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.bfloat16))
    assert kept.main_params[0].dtype == torch.float32
    assert kept.main_params[0][0].item() == pytest.approx(1.0 - 20e-3, abs=1e-4)
    assert main.detach()[0].item() == pytest.approx(0.98, abs=2**-7)


def test_state_dict_restores_the_exact_main_weights() -> None:
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = make_optimizer(model, lr=1e-2, dtype=torch.bfloat16)
    assert isinstance(opt, MainWeightsAdam)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state_dict()
    other = torch.nn.Linear(3, 2).to(torch.bfloat16)
    restored = make_optimizer(other, lr=1e-2, dtype=torch.bfloat16)
    restored.load_state_dict(state)
    for a, b in zip(opt.main_params, restored.main_params):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    smaller = make_optimizer(
        torch.nn.Linear(3, 2, bias=False).to(torch.bfloat16), lr=1e-2, dtype=torch.bfloat16
    )
    with pytest.raises(ValueError, match="resume with the model flags"):
        smaller.load_state_dict(state)


def test_float32_keeps_torch_adam_and_cuda_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(
        make_optimizer(torch.nn.Linear(2, 2), lr=1e-3, dtype=torch.float32), torch.optim.Adam
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="use --device cpu"):
        job_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="at most one process per GPU"):
        job_device("cuda")
