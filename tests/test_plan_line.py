"""Tier: pure. The per-micro-batch plan line (``runtime.plan_summary``, ``report.plan_line``)
counts what one layer's attention sends: the flat rings and the 2-D documents' head
all-to-alls and rings across nodes, forward and backward (``schedule.engine_link_bytes``)."""

from __future__ import annotations

import pytest
from test_two_d_plan import TOPO, plan_of, two_d

from megatron_zeppelin.megatron.report import plan_line
from megatron_zeppelin.megatron.runtime import plan_summary
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.heads import AttentionShape
from megatron_zeppelin.planner.plan.plan import SequencePlan, Tier, zigzag_spans
from megatron_zeppelin.planner.plan.schedule import engine_link_bytes

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("routing", [True, False])
def test_a_two_d_document_across_nodes_shows_its_nic_bytes(routing: bool) -> None:
    model = get_model("llama3-8b")  # bf16: gradients travel in float32
    plan = plan_of([two_d(0, 3000, [0, 1, 2])])
    summary = plan_summary(plan, model, routing=routing)
    expected = engine_link_bytes(plan, AttentionShape.as_sent(model), routing=routing)
    assert summary["link_bytes"] == expected
    assert summary["link_bytes"]["nic"] > 0 and summary["link_bytes"]["nvlink"] > 0
    line = plan_line(0, summary)
    assert "nic 0 B" not in line and "attention bytes/layer (fwd+bwd)" in line


def test_flat_rings_count_forward_and_backward_with_float32_gradients() -> None:
    model = get_model("llama3-8b")
    ring = (0, 4, 8)  # one rank on each of three nodes
    flat = SequencePlan(0, 900, Tier.INTER, ring, zigzag_spans(900, ring))
    links = plan_summary(plan_of([flat]), model, routing=False)["link_bytes"]
    # Each of the 3 blocks of 300 tokens travels 2 hops, K/V twice (forward and backward, bf16)
    # and dK/dV once (float32): all across nodes.
    kv_values = 2 * model.num_kv_heads * model.head_dim
    assert links["nic"] == 3 * 300 * 2 * kv_values * (2 * 2 + 4)
    assert links["nvlink"] == 0 and TOPO.world_size == 12
