"""Tier: pure. The predicted bytes per link class, counted without building the schedule.

``schedule.training_link_bytes`` and ``two_d_link_bytes`` count a plan's ring bytes per
document and edge (``ring_link_bytes``) and the head all-to-all's per node row, instead of
walking every message of every step (at 1024 GPUs, hundreds of thousands). The exchangers'
counters are compared with these predictions elsewhere; here each is compared, key for key, with
the count over the messages themselves (``link_bytes`` of ``ring_schedule``,
``gradient_schedule`` and ``exchange_messages``, as the prediction was made before), on plans
with routed edges (one relayed by ranks off the ring, one route part of zero weight), documents
shorter than their ring (empty blocks), 2-D documents over two and three nodes in both token
layouts, and planner plans on 4 nodes of 8 GPUs, routing on and off. The simulator's forward
bytes of the 2-D documents (``stepwise.two_d_forward_bytes``) are counted the same way and
compared with its own messages (``two_d_forward_messages``).
"""

from __future__ import annotations

import pytest
from test_rank_schedule import PLAN_CASES
from test_two_d_threads import PLANS, _all_routes

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.heads import AttentionShape, head_plan
from megatron_zeppelin.planner.plan.plan import Plan, Tier
from megatron_zeppelin.planner.plan.schedule import (
    exchange_messages,
    gradient_schedule,
    link_bytes,
    ring_link_bytes,
    ring_schedule,
    training_link_bytes,
    two_d_link_bytes,
)
from megatron_zeppelin.planner.simulate.stepwise import (
    two_d_forward_bytes,
    two_d_forward_messages,
)

pytestmark = pytest.mark.pure

SHAPE = AttentionShape(num_heads=24, num_kv_heads=24, head_dim=8, value_bytes=2, grad_value_bytes=4)
"""Heads that split over 2, 3, 4 and 8 GPUs of a node."""


def _routed(plan: Plan) -> Plan:
    return Plan(
        topology=plan.topology,
        sequences=plan.sequences,
        linear=plan.linear,
        routes=_all_routes(plan),
    )


def _cases() -> dict[str, Plan]:
    cases = dict(PLAN_CASES)
    for name, make in PLANS.items():
        cases[f"two-d {name}"] = make()
        cases[f"two-d {name} routed"] = _routed(make())
    return cases


CASES = _cases()


def _add(total: dict[str, int], counts: dict[str, int]) -> None:
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


def _by_messages(plan: Plan, *, kv: int, grad: int, routing: bool) -> dict[str, int]:
    """``training_link_bytes`` over the messages themselves."""
    total = {"nvlink": 0, "nic": 0}
    for tier in (Tier.INTER, Tier.INTRA):
        steps = ring_schedule(plan, (tier,))
        _add(total, link_bytes(plan, steps, bytes_per_token=2 * kv, routing=routing))
        grads = gradient_schedule(plan, (tier,), kv_steps=steps)
        _add(total, link_bytes(plan, grads, bytes_per_token=grad, routing=routing))
    return total


def _two_d_by_messages(plan: Plan, shape: AttentionShape, *, routing: bool) -> dict[str, int]:
    """``two_d_link_bytes`` over the messages themselves."""
    heads = head_plan(plan)
    total = {"nvlink": 0, "nic": 0}
    if heads is None:
        return total
    groups = shape.groups(heads.num_groups)
    d, value, grad = shape.head_dim, shape.value_bytes, shape.grad_value_bytes
    qkv, o, kv = (groups.num_q + 2 * groups.num_kv) * d, groups.num_q * d, 2 * groups.num_kv * d
    steps = ring_schedule(heads.plan)
    passes = (
        ([exchange_messages(plan, to_heads=True)], qkv * value + o * value),
        ([exchange_messages(plan, to_heads=False)], o * value + qkv * grad),
        (steps, 2 * kv * value),
        (gradient_schedule(heads.plan, kv_steps=steps), kv * grad),
    )
    for messages, per_token in passes:
        _add(total, link_bytes(plan, messages, bytes_per_token=per_token, routing=routing))
    return total


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("routing", [True, False])
def test_counted_by_edge_equals_counted_by_message(name: str, routing: bool):
    plan = CASES[name]
    got = training_link_bytes(plan, kv_bytes_per_token=12, grad_bytes_per_token=24, routing=routing)
    assert got == _by_messages(plan, kv=12, grad=24, routing=routing)
    if head_plan(plan) is not None:
        assert two_d_link_bytes(plan, SHAPE, routing=routing) == _two_d_by_messages(
            plan, SHAPE, routing=routing
        )
    for gradients in (False, True):
        for tiers in ((Tier.INTER,), (Tier.INTRA,), (Tier.INTRA, Tier.INTER)):
            steps = ring_schedule(plan, tiers)
            if gradients:
                steps = gradient_schedule(plan, tiers, kv_steps=steps)
            by_edge = ring_link_bytes(
                plan, tiers, bytes_per_token=5, routing=routing, gradients=gradients
            )
            assert by_edge == link_bytes(plan, steps, bytes_per_token=5, routing=routing)


def test_the_cases_have_what_the_counting_treats_apart():
    hand = CASES["hand"]
    routed = {(r.src, r.dst) for r in hand.routes}
    kv = ring_schedule(hand)
    assert any((m.src, m.dst) in routed for step in kv for m in step)
    assert any(not seg.num_tokens for step in kv for m in step for seg in m.segments)  # empty
    assert any(w.weight == 0 for r in hand.routes for w in r.parts)
    two_d = CASES["two-d 3x2 routed"]
    heads = head_plan(two_d)
    column_edges = {(m.src, m.dst) for step in ring_schedule(heads.plan) for m in step}
    assert column_edges & {(r.src, r.dst) for r in two_d.routes}
    assert CASES["flat"].routes and CASES["2-D"].has_two_d


TWO_D = [  # no model here has heads that split over 3 GPUs
    n for n, p in CASES.items() if head_plan(p) is not None and p.topology.gpus_per_node != 3
]


@pytest.mark.parametrize("name", TWO_D)
@pytest.mark.parametrize("routing", [True, False])
def test_the_simulators_two_d_forward_bytes_equal_its_messages(name: str, routing: bool):
    plan = CASES[name]
    k = plan.topology.gpus_per_node
    model = get_model("llama-7b" if k == 8 else "tiny")  # heads that split over k GPUs
    cost = CostModel.default(model, plan.topology)
    by_message: dict[str, int] = {}
    for messages, per_token in two_d_forward_messages(plan, cost):
        _add(by_message, link_bytes(plan, [messages], bytes_per_token=per_token, routing=routing))
    assert two_d_forward_bytes(plan, cost, routing) == {"nvlink": 0, "nic": 0, **by_message}
