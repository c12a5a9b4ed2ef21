"""Zeppelin training equals single-process training (tier: processes; one spawn of 4 gloo
ranks running tensor parallel 1 x Zeppelin 4, then tensor parallel 2 x Zeppelin 2).

The check itself lives in ``megatron_zeppelin.megatron.check`` (``zeppelin check`` runs it too):
same Megatron GPTModel and weights, same documents; loss and every parameter's gradient must
agree within 1e-5 relative in float32.
"""

from __future__ import annotations

import pytest

from megatron_zeppelin.megatron.check import CheckOptions, run_check

pytestmark = pytest.mark.dist


def test_loss_and_gradients_match_the_single_process_reference() -> None:
    report = run_check(CheckOptions(tensor_parallels=(1, 2)))
    runs = report["runs"]
    assert set(runs) == {"tp1", "tp2"}
    for name, run in runs.items():
        assert run["loss_rel_error"] <= 1e-5, (name, run["loss_rel_error"])
        assert run["max_grad_rel_error"] <= 1e-5, (name, run["max_grad_rel_error"])
        # Every parameter was compared (embedding, every layer, output layer).
        assert len(run["grad_rel_error"]) >= 4 + 5 * report["options"]["model"]["num_layers"]
    assert report["passed"]
    # The TP 1 plan puts documents in all three tiers, so rings and routing are exercised.
    assert all(n > 0 for n in runs["tp1"]["plan"]["tiers"].values())
    assert runs["tp2"]["zeppelin_world"] == 2
