"""Tier: pure. Each rank's part of the ring schedule: the messages it sends, receives or relays.

A rank of a thousand builds its engine from its own part of the schedule, not every rank's
(``schedule.ring_schedule`` and ``exchange_messages`` with ``rank``). Checked on hand plans with
routes relayed by ranks outside the ring (``test_comm_exchange.hand_plan``,
``test_two_d_threads.PLANS`` routed over every NIC) and on planner plans with the 2-D scheme and
routing: every rank's part is the whole schedule's messages that name it as sender, receiver or
proxy, with the same segments, in the same order, over as many steps; the gradients follow;
the engine's layout holds the same rows as the plan's attention ranges; and the two ends of
every hop give it the same point-to-point tag from their own parts.
"""

from __future__ import annotations

import pytest
from test_comm_exchange import hand_plan
from test_two_d_threads import PLANS, _all_routes

from megatron_zeppelin.attention.layout import RankLayout
from megatron_zeppelin.comm.pending import EXCHANGE_TAGS, _hop_tags, step_legs
from megatron_zeppelin.comm.protocol import ZeppelinCommError
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.heads import head_plan
from megatron_zeppelin.planner.plan.plan import Plan, Tier
from megatron_zeppelin.planner.plan.schedule import (
    Leg,
    Message,
    exchange_messages,
    gradient_schedule,
    ring_schedule,
)
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def _planned(two_d: bool) -> Plan:
    topology = get_topology("dgx-h100", num_nodes=4)
    cost = CostModel.default(get_model("llama-7b"), topology)
    lengths = sample_lengths("prolong", num_tokens=32 * 8192, seed=3)
    # Documents no node holds: over whole nodes with the 2-D scheme, or flat rings across them.
    lengths = [14 * 8192, 3 * 8192, *lengths[: len(lengths) // 2]]
    options = PlannerOptions(two_d=two_d)  # flat: rings across nodes, routed over the NICs
    return plan_batch(lengths, topology=topology, cost_model=cost, capacity=12288, options=options)


def _plans() -> dict[str, Plan]:
    routed = PLANS["2x2"]()
    routed = Plan(
        topology=routed.topology,
        sequences=routed.sequences,
        linear=routed.linear,
        routes=_all_routes(routed),
    )
    return {
        "hand": hand_plan(),
        "2x2 routed": routed,
        "flat": _planned(False),
        "2-D": _planned(True),
    }


PLAN_CASES = _plans()


def _named(message: Message, rank: int, plan: Plan) -> bool:
    """Whether ``rank`` sends, receives or is a proxy of ``message``."""
    if rank in (message.src, message.dst):
        return True
    route = plan.route_of(message.src, message.dst)
    return route is not None and any(rank in (p.src_proxy, p.dst_proxy) for p in route.parts)


def test_the_cases_route_messages_through_ranks_off_their_rings():
    plan = PLAN_CASES["hand"]
    steps = ring_schedule(plan)
    relayed = [
        (rank, m)
        for step in steps
        for m in step
        for rank in range(plan.world_size)
        if rank not in (m.src, m.dst) and _named(m, rank, plan)
    ]
    off_ring = [
        (rank, m)
        for rank, m in relayed
        if all(rank not in plan.sequence(seg.seq).ring for seg in m.segments)
    ]
    assert off_ring, "no rank relays a message of rings it is not on: the case tests nothing"
    assert PLAN_CASES["2-D"].has_two_d and PLAN_CASES["flat"].routes


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_a_ranks_part_is_the_whole_schedules_messages_that_name_it(name: str):
    plan = PLAN_CASES[name]
    plans = [plan]
    heads = head_plan(plan)
    if heads is not None:
        plans.append(heads.plan)  # its column rings, routed by the plan's edges
    for rings in plans:
        for tiers in ((Tier.INTER,), (Tier.INTRA,), (Tier.INTRA, Tier.INTER)):
            every = ring_schedule(rings, tiers)
            every_grad = gradient_schedule(rings, tiers)
            for rank in range(plan.world_size):
                own = ring_schedule(rings, tiers, rank=rank, routes=plan.route_index)
                assert len(own) == len(every), (name, rank)
                for step, own_step, grad_step in zip(every, own, every_grad):
                    named = [m for m in step if _named(m, rank, plan)]
                    assert own_step == named, (name, tiers, rank)
                    grads = gradient_schedule(rings, tiers, kv_steps=[own_step])[0]
                    by_edge = {(m.src, m.dst): m for m in grad_step}
                    assert grads == [by_edge[(m.src, m.dst)] for m in own_step]
    for to_heads in (True, False):
        every = exchange_messages(plan, to_heads=to_heads)
        for rank in range(plan.world_size):
            own = exchange_messages(plan, to_heads=to_heads, rank=rank)
            assert own == [m for m in every if rank in (m.src, m.dst)]


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_the_engine_layout_holds_the_plans_attention_rows(name: str):
    plan = PLAN_CASES[name]
    steps = {tiers: len(ring_schedule(plan, tiers)) for tiers in ((Tier.INTER,), (Tier.INTRA,))}
    for rank in range(plan.world_size):
        layout = RankLayout(plan, rank)
        ranges = plan.attention_ranges(rank)
        assert layout.num_tokens == sum(r.num_tokens for r in ranges)
        spans = [(seq, s, e) for seq, own in layout.own_spans.items() for s, e, _ in own]
        assert spans == [(r.seq, r.start, r.end) for r in ranges]
        rows = [row for own in layout.own_spans.values() for _, _, row in own]
        assert rows == sorted(rows) and (not rows or rows[0] == 0)
        # Every rank runs as many steps per tier, whatever its part holds.
        counts = {t.tier: t.num_steps for t in layout.tiers}
        for (tier,), num in steps.items():
            assert counts.get(tier, 0) == num


def _tags_by_hop(plan: Plan, steps: list[list[Message]], rank: int) -> dict:
    """``(step, src, dst, leg offset, hop) -> tag`` of the hops ``rank`` sends or receives."""
    out = {}
    for index, step in enumerate(steps):
        legs = step_legs(step, plan.route_index)
        for (leg_index, hop), tag in _hop_tags(legs, 0, rank, "t").items():
            message, leg = legs[leg_index]
            msg = step[message]
            out[(index, msg.src, msg.dst, leg.offset, hop)] = tag
    return out


@pytest.mark.parametrize("name", ["hand", "2x2 routed", "flat"])
def test_both_ends_of_a_hop_give_it_one_tag_from_their_own_parts(name: str):
    plan = PLAN_CASES[name]
    every = ring_schedule(plan)
    tags = {
        rank: _tags_by_hop(plan, ring_schedule(plan, rank=rank), rank)
        for rank in range(plan.world_size)
    }
    checked = 0
    for index, step in enumerate(every):
        for message, leg in step_legs(step, plan.route_index):
            msg = step[message]
            for hop, (a, b) in enumerate(leg.hops):
                key = (index, msg.src, msg.dst, leg.offset, hop)
                assert tags[a][key] == tags[b][key], (name, key)
                checked += 1
    assert checked
    # One rank's hops to one peer never share a tag within a step.
    for rank, by_hop in tags.items():
        seen: dict = {}
        for (index, src, dst, offset, hop), tag in by_hop.items():
            seen.setdefault((index, tag), set()).add((src, dst, offset, hop))
        for (index, tag), hops in seen.items():
            pairs = [
                _hop_of(plan, every[index], src, dst, offset, hop) for src, dst, offset, hop in hops
            ]
            assert len(pairs) == len(set(pairs)), (name, rank, index, tag)


def _hop_of(plan: Plan, step: list[Message], src: int, dst: int, offset: int, hop: int) -> tuple:
    for message, leg in step_legs(step, plan.route_index):
        if (step[message].src, step[message].dst, leg.offset) == (src, dst, offset):
            return leg.hops[hop]
    raise AssertionError((src, dst, offset))


def test_an_exchange_that_runs_out_of_tags_says_so():
    legs = [(i, Leg(0, 1, (0, 1))) for i in range(EXCHANGE_TAGS + 1)]
    assert len(_hop_tags(legs[:-1], 7, 0, "fine")) == EXCHANGE_TAGS
    with pytest.raises(ZeppelinCommError, match="more than 4096 transfers from rank 0 to rank 1"):
        _hop_tags(legs, 0, 1, "full")
