"""The attention engine across processes: planner plans, real P2P, routing, remapping, bytes.

Tier: processes. 4 gloo ranks emulate 2 nodes x 2 GPUs (one NIC per GPU). Every case runs in ONE
spawned group (``commands.verify.worker``): Q, K, V start in the linear layout, are remapped to
the attention layout, go through ``ZeppelinAttention`` over ``DistExchanger`` and come back, and
the parent compares output and gradients with the dense float64 reference, the bytes counted per
link class with the plan's prediction, and routed with direct runs. The hand batch also runs its
inter-node document with the 2-D scheme (heads split inside each node, a ring per rail).
"""

from __future__ import annotations

import pytest
import torch

from megatron_zeppelin.commands.verify import Case, EngineSpec, build_cases, compare, worker
from megatron_zeppelin.launch.ranks import run_distributed
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import Tier
from megatron_zeppelin.planner.plan.remap_layout import linear_to_attention_layout
from megatron_zeppelin.planner.search.partition import PlannerOptions
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.dist

TOPOLOGY = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
SPEC = EngineSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype="float64", timeout_s=120.0)
# Small thresholds so that batches of a few thousand tokens use every tier; an even linear
# layout so that the remapping moves tokens in every case (the planner's own choice often
# keeps them in place, which would leave the all-to-all untested).
OPTIONS = PlannerOptions(thresholds=(64, 256), linear_layout="even")
# A document longer than a node's share (both nodes), mid-sized ones (one node), short local
# ones, a one-token document; most lengths are not multiples of 2g for any ring size g.
HAND_BATCH = [1203, 1, 601, 45, 533, 7, 97, 230]


def _cases_of(lengths: list[int], *, name: str) -> list[Case]:
    cost = CostModel.default(get_model("llama-7b"), TOPOLOGY)
    capacity = -(-sum(lengths) * 5 // (4 * TOPOLOGY.world_size))
    cases = build_cases(
        lengths, topology=TOPOLOGY, cost_model=cost, capacity=capacity, options=OPTIONS
    )
    return [Case(f"{name}/{c.name}", c.plan, c.routing) for c in cases]


@pytest.fixture(scope="module")
def run() -> dict:
    hand = _cases_of(HAND_BATCH, name="hand")
    routed = hand[0]
    two_d = next(c for c in hand if c.name.endswith("zeppelin-2d"))
    cases = [
        Case(routed.name, routed.plan, True, checks={"bad_input": True}),
        *hand[1:],
        Case(f"{routed.name}/float32", routed.plan, True, dtype="float32"),
        Case(f"{routed.name}/float32-direct", routed.plan, False, dtype="float32"),
        Case(f"{two_d.name}/float32", two_d.plan, True, dtype="float32"),
        Case(f"{routed.name}/bfloat16", routed.plan, True, dtype="bfloat16"),
        Case(f"{routed.name}/float16", routed.plan, True, dtype="float16"),
        Case(f"{two_d.name}/bfloat16", two_d.plan, True, dtype="bfloat16"),
    ]
    for dist, tokens, seed in (("wikipedia", 2048, 0), ("prolong", 1536, 1), ("wlbllm", 1024, 2)):
        lengths = sample_lengths(dist, num_tokens=tokens, seed=seed)
        cases += _cases_of(lengths, name=dist)[:2]  # Zeppelin, routing on and off
    results = run_distributed(worker, TOPOLOGY.world_size, timeout_s=240.0, args=(cases, SPEC))
    return {"cases": cases, "results": results, "report": compare(cases, results, SPEC)}


def test_hand_batch_covers_every_tier_and_odd_lengths(run):
    plan = run["cases"][0].plan
    by_length = {s.length: s for s in plan.sequences}
    nodes = lambda s: {plan.topology.node_of(r) for r in s.ring}  # noqa: E731
    assert Tier(by_length[1203].tier) == Tier.INTER and len(nodes(by_length[1203])) == 2
    assert any(Tier(s.tier) == Tier.INTRA for s in plan.sequences)
    assert Tier(by_length[1].tier) == Tier.LOCAL
    assert any(s.ring_size > 1 and s.length % (2 * s.ring_size) for s in plan.sequences)
    assert plan.routes, "the inter-node ring should be routed over proxies"
    two_d = next(c.plan for c in run["cases"] if c.name == "hand/zeppelin-2d")
    assert [s.length for s in two_d.sequences if s.is_two_d] == [1203]
    assert [s.attention for s in two_d.sequences] == [s.attention for s in plan.sequences]


def test_outputs_and_gradients_match_the_dense_reference(run):
    expected = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 4 * 2**-7, "float16": 4 * 2**-10}
    assert {e["dtype"] for e in run["report"]} == set(expected)
    for entry in run["report"]:
        tol = entry["tolerance"]
        assert tol == pytest.approx(expected[entry["dtype"]])
        for name, err in entry["errors"].items():
            assert err <= tol, f"{entry['case']} routing={entry['routing']}: {name} {err:.2e}"


def test_ring_results_match_one_gpu_in_the_same_dtype(run):
    for entry in run["report"]:
        tol = entry["tolerance_vs_single_gpu"]
        for name, err in entry["errors_vs_single_gpu"].items():
            assert err <= tol, f"{entry['case']}: {name} {err:.2e} against one GPU"
        if entry["dtype"] in ("float64", "float32"):
            assert tol == entry["tolerance"]
        else:  # half precision: rounding differs from one GPU by order of summation only
            assert 0 < max(entry["errors_vs_single_gpu"].values()) <= tol < entry["tolerance"]


def test_every_rank_posts_in_an_order_nccl_can_run(run):
    for entry in run["report"]:
        assert entry["posting_order_consistent"], (entry["case"], entry["posting_order"])
    results = run["results"]
    assert all(r[0]["posting"] for r in results), "rank 0..3 each posted batches"


def test_measured_bytes_per_link_class_equal_the_prediction(run):
    for entry in run["report"]:
        assert entry["bytes_match"], (
            entry["case"],
            entry["measured_bytes"],
            entry["predicted_bytes"],
        )
    routed = next(e for e in run["report"] if e["routing"] and e["measured_bytes"]["nic"])
    # Routing spreads one ring edge's NIC bytes over every NIC of the node.
    assert sum(1 for k, v in routed["measured_bytes"].items() if k.startswith("nic:") and v) == 4


def test_routing_on_and_off_give_identical_results(run):
    cases, results = run["cases"], run["results"]
    pairs = {}
    for index, case in enumerate(cases):
        key = (case.plan, case.dtype)
        pairs.setdefault(key, {})[case.routing] = index
    compared = 0
    for both in pairs.values():
        if len(both) < 2:
            continue
        for per_rank in results:
            on, off = per_rank[both[True]], per_rank[both[False]]
            for name in ("out", "dq", "dk", "dv"):
                assert torch.equal(on[name], off[name]), name
        compared += 1
    assert compared >= 4


def test_remapping_round_trip_is_the_identity_forward_and_backward(run):
    assert all(entry["remap_exact"] for entry in run["report"])
    # The round trips above moved tokens between ranks, not only within them.
    plan = run["cases"][0].plan
    moved = sum(
        linear_to_attention_layout(plan, rank).moved_rows for rank in range(plan.world_size)
    )
    assert moved > 0


def test_bad_input_raises_value_errors(run):
    messages = run["report"][0]["bad_input"]
    assert set(messages) == {"token_count", "dtype", "head_count", "kv_heads", "world_size"}
    for kind, message in messages.items():
        assert message, f"the engine accepted a bad {kind}"
    assert "attention layout" in messages["token_count"]
