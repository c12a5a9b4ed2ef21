"""Zeppelin training equals single-process training (tier: processes; one spawn of 4 gloo
ranks running tensor parallel 1 x Zeppelin 4, then tensor parallel 2 x Zeppelin 2 without and
with Megatron's sequence parallelism).

The check itself lives in ``megatron_zeppelin.job.check`` (``zeppelin check`` runs it too):
same Megatron GPTModel and weights, same documents; loss and every parameter's gradient must
agree within 1e-5 relative in float32.
"""

from __future__ import annotations

import pytest

from megatron_zeppelin.job.check import CheckOptions, run_check

pytestmark = pytest.mark.dist


def test_loss_and_gradients_match_the_single_process_reference() -> None:
    report = run_check(CheckOptions(tensor_parallels=(1, 2)))
    runs = report["runs"]
    assert set(runs) == {"tp1", "tp2", "tp2+sp"}
    for name, run in runs.items():
        assert run["loss_rel_error"] <= 1e-5, (name, run["loss_rel_error"])
        assert run["max_grad_rel_error"] <= 1e-5, (name, run["max_grad_rel_error"])
        # Every parameter was compared (embedding, every layer, output layer).
        assert len(run["grad_rel_error"]) >= 4 + 5 * report["options"]["model"]["num_layers"]
    assert report["passed"]
    # The TP 1 plan puts documents in all three tiers, so rings and routing are exercised.
    assert all(n > 0 for n in runs["tp1"]["plan"]["tiers"].values())
    assert runs["tp2"]["zeppelin_world"] == 2
    # Sequence parallelism: some rank's linear rows were padded to a multiple of TP, and the
    # padding changed neither the loss nor any gradient.
    assert runs["tp2+sp"]["sequence_parallel"] and runs["tp2+sp"]["max_padding_rows"] > 0


@pytest.mark.parametrize(
    "lengths, thresholds",
    [
        ((2,), ("64", "600")),  # fewer tokens than ranks: two ranks hold nothing
        # Fewer documents than ranks; with capacity 256 and automatic thresholds the plan
        # leaves rank 3 empty (412 split over two GPUs of node 0, 201 whole on rank 2).
        ((412, 201), ("auto", "auto")),
    ],
)
def test_ranks_with_few_or_no_tokens_come_through_a_step(lengths, thresholds) -> None:
    intra, inter = thresholds
    options = CheckOptions(
        lengths=lengths, capacity=256, intra_threshold=intra, inter_threshold=inter
    )
    report = run_check(options)
    runs = report["runs"]
    errors = {k: (r["loss_rel_error"], r["max_grad_rel_error"]) for k, r in runs.items()}
    assert report["passed"], errors
    # A rank with no token of the plan still ran Megatron's layers on one padding row.
    assert runs["tp1"]["min_linear_tokens"] == 0 and runs["tp1"]["max_padding_rows"] >= 1
    assert runs["tp1"]["plan"]["num_documents"] < 4
    assert runs["tp2+sp"]["max_padding_rows"] >= 1
