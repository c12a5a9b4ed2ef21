"""Plans on the wire (``planner/plan/plan_wire.py``): a decoded plan is the plan encoded, in every
field the engine, the remap and the schedule read, with every kind of record; its records are
left to reference counting alone; anything but a plan's bytes (cut short, another format,
counts that do not add up, ranks off the topology, reversed ranges) is a ``ValueError`` naming
what is wrong. Tier: pure."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import struct

import numpy as np
import pytest

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.plans.plan_workers import PlanRecipe
from megatron_zeppelin.planner.baselines.baselines import llama3_allgather_cp
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.heads import AttentionShape
from megatron_zeppelin.planner.plan.plan import (
    AttentionComm,
    Plan,
    Scheme,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
)
from megatron_zeppelin.planner.plan.plan_wire import FORMAT, decode, encode
from megatron_zeppelin.planner.plan.remap_layout import (
    attention_to_linear_layout,
    linear_to_attention_layout,
)
from megatron_zeppelin.planner.plan.schedule import engine_link_bytes, ring_schedule
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

TOPOLOGY = get_topology("zeppelin-C", num_nodes=4)


def _plan(cluster: str, capacity: int, lengths: list[int]) -> Plan:
    topology = get_topology(cluster, num_nodes=4)
    config = ZeppelinConfig(capacity=capacity)
    cost_model = CostModel.default(get_model("llama-7b"), topology)
    return PlanRecipe(topology, cost_model, config, config.planner_options(cost_model))(lengths)


# 4 nodes of 8: local documents, rings inside and across nodes with routes over every NIC; and
# the batch of ``test_schemes.py`` whose longest document runs faster in 2-D.
WIDE = _plan("zeppelin-C", 32768, sample_lengths("prolong", num_tokens=1 << 20, seed=1))
TWO_D = _plan(
    "zeppelin-B",
    16384,
    sample_lengths("magi_realworld", num_tokens=int(0.7 * 32 * 16384), seed=0, max_length=131072),
)


def _same(copy: Plan, plan: Plan) -> None:
    assert copy == plan and copy.to_json() == plan.to_json() and copy.meta == plan.meta
    for old, new in zip(plan.sequences, copy.sequences, strict=True):
        assert (new.id, new.length, new.ring, new.attention) == (
            old.id,
            old.length,
            old.ring,
            old.attention,
        )
        assert new.tier is Tier(old.tier) and new.scheme is Scheme(old.scheme)
    assert copy.linear == plan.linear and copy.routes == plan.routes
    assert all(copy.route_of(r.src, r.dst) == r for r in plan.routes)
    assert copy.attention_comm is AttentionComm(plan.attention_comm)
    assert (copy.capacity, copy.name, copy.topology) == (plan.capacity, plan.name, plan.topology)


@pytest.mark.parametrize("plan", [WIDE, TWO_D], ids=["routes", "2-D"])
def test_a_plan_with_every_record_kind_comes_back_whole(plan: Plan) -> None:
    assert {Tier(s.tier) for s in plan.sequences} == set(Tier)
    assert plan.routes if plan is WIDE else plan.has_two_d
    copy = decode(encode(plan))
    _same(copy, plan)
    assert {type(s) for s in copy.sequences} == {SequencePlan}
    assert {type(a) for s in copy.sequences for a in s.attention} == {Span}
    assert {type(r) for ranges in copy.linear for r in ranges} == {TokenRange}
    assert copy.two_d_sequences == plan.two_d_sequences
    copy.validate()  # the invariants hold: the plan was not built around them
    # What a rank builds from it: the remap's rows, the ring schedule, the bytes it sends.
    for rank, remap in itertools.product(
        (0, 9, 31), (linear_to_attention_layout, attention_to_linear_layout)
    ):
        got, want = remap(copy, rank), remap(plan, rank)
        assert (got.send_counts, got.recv_counts) == (want.send_counts, want.recv_counts)
        assert (got.send_index == want.send_index).all()
        assert (got.recv_index == want.recv_index).all()
    assert ring_schedule(copy) == ring_schedule(plan)
    shape = AttentionShape(32, 8, 128, value_bytes=2, grad_value_bytes=4)
    assert engine_link_bytes(copy, shape, routing=True) == engine_link_bytes(
        plan, shape, routing=True
    )
    with pytest.raises(AttributeError):
        copy.sequences[0].attention[0].start = 3  # type: ignore[misc]


def test_plans_of_other_builders_and_shapes_come_back_whole() -> None:
    lengths = sample_lengths("wlbllm", num_tokens=1 << 18, seed=2)
    allgather = llama3_allgather_cp(lengths, topology=TOPOLOGY, capacity=32768)[0]
    assert allgather.attention_comm == AttentionComm.ALLGATHER
    topology = Topology(num_nodes=3, gpus_per_node=1, nics_per_node=1)
    sparse = Plan(  # ranks without a range, ids with gaps, no capacity, tuples in meta
        topology=topology,
        sequences=(
            SequencePlan(4, 6, Tier.INTER, (2, 0), (Span(2, 0, 3), Span(0, 3, 6))),
            SequencePlan(9, 1, Tier.LOCAL, (1,), (Span(1, 0, 1),)),
        ),
        linear=((TokenRange(9, 0, 1), TokenRange(4, 0, 6)), (), ()),
        name="by hand",
        meta={"note": [1, 2], "nested": {"a": None}},
    )
    for plan in (allgather, sparse):
        _same(decode(encode(plan)), plan)
    # numpy numbers in meta travel as the plain values they are.
    numbers = dataclasses.replace(sparse, meta={"s": np.float64(0.5), "n": np.arange(2)})
    assert decode(encode(numbers)).meta == {"s": 0.5, "n": [0, 1]}


def test_decoded_records_are_freed_by_reference_counting_alone() -> None:
    """Left out of the collector (they hold no cycles): decoding and dropping plans leaves
    nothing for ``gc.collect()`` and no object behind."""
    data = encode(WIDE)
    copy = decode(data)
    assert not gc.is_tracked(copy.sequences[0]) and not gc.is_tracked(copy.linear[0][0])
    assert not gc.is_tracked(copy.sequences[0].attention)
    del copy
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for _ in range(3):
            decode(data)
        assert gc.collect() == 0
        assert len(gc.get_objects()) <= before + 5
    finally:
        (gc.enable if enabled else gc.disable)()


def _parts(data: bytes) -> tuple[dict, np.ndarray]:
    size = struct.unpack_from("<I", data, 8)[0]
    return json.loads(data[12 : 12 + size]), np.frombuffer(data[12 + size :], dtype="<i4").copy()


def _join(header: dict, body: np.ndarray) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 4)
    return struct.pack("<4sHHI", b"ZPLN", FORMAT, 0, len(text)) + text + body.tobytes()


def _with(data: bytes, column: int, index: int, value: int) -> bytes:
    """``data`` with the ``index``-th value of the ``column``-th column set to ``value``."""
    header, body = _parts(data)
    n_seq, n_members, n_spans, world, n_ranges, n_routes, n_parts = header["counts"]
    sizes = [n_seq] * 6 + [n_members] + [n_spans] * 3 + [world] + [n_ranges] * 3
    body[sum(sizes[:column]) + index] = value
    return _join(header, body)


def _counts(data: bytes, counts: list[int]) -> bytes:
    header, body = _parts(data)
    return _join({**header, "counts": counts}, body)


def _on_three_nodes(data: bytes) -> bytes:
    header, body = _parts(data)
    return _join({**header, "topology": {**header["topology"], "num_nodes": 3}}, body)


SMALL = Plan(
    topology=Topology(num_nodes=2, gpus_per_node=1, nics_per_node=1),
    sequences=(
        SequencePlan(0, 8, Tier.INTER, (0, 1), (Span(0, 0, 4), Span(1, 4, 8))),
        SequencePlan(1, 5, Tier.LOCAL, (1,), (Span(1, 0, 5),)),
    ),
    linear=((TokenRange(0, 0, 4),), (TokenRange(0, 4, 8), TokenRange(1, 0, 5))),
)
DATA = encode(SMALL)
COUNTS = [2, 3, 3, 2, 3, 0, 0]


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"", "too short"),
        (b"PK\x03\x04" + DATA[4:], "not a plan"),
        (DATA[:4] + struct.pack("<H", FORMAT + 1) + DATA[6:], f"this version reads {FORMAT}"),
        (DATA[:-4], "cut short or padded"),
        (DATA + b"\0\0\0\0", "cut short or padded"),
        (DATA[:12] + b"[" + DATA[13:], "header is not a plan's"),
        (_counts(DATA, COUNTS[:6]), "header counts"),
        (_on_three_nodes(DATA), "ranges of a rank listed for 2 ranks on a topology of 3"),
        (_with(DATA, 2, 0, 7), "tier outside [0, 3)"),
        (_with(DATA, 6, 1, 2), "ring member outside [0, 2)"),
        (_with(DATA, 7, 0, -1), "span rank outside"),
        (_with(DATA, 4, 0, 1), "ring size add up to 2, not 3"),
        (_with(DATA, 5, 1, 0), "spans of a document add up to 2, not 3"),
        (_with(DATA, 8, 1, 8), "span start negative, or not before its end"),
        (_with(DATA, 9, 2, 6), "span end past its document's length"),
        (_with(DATA, 12, 0, 4), "range start negative, or not before its end"),
    ],
)
def test_anything_but_a_plan_is_refused_with_what_is_wrong(payload: bytes, words: str) -> None:
    with pytest.raises(ValueError, match="plan payload") as caught:
        decode(payload)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_header_field_of_the_wrong_kind_is_named() -> None:
    header, body = _parts(DATA)
    for field, value in (("topology", {"num_nodes": "two"}), ("capacity", 1.5), ("meta", 3)):
        with pytest.raises(ValueError, match="malformed header field"):
            decode(_join({**header, field: value}, body))
    assert decode(_join(header, body)) == SMALL


def test_a_number_past_int32_has_no_wire_form() -> None:
    plan = Plan(
        topology=SMALL.topology,
        sequences=(SequencePlan(2**31, 3, Tier.LOCAL, (0,), (Span(0, 0, 3),)),),
        linear=((TokenRange(2**31, 0, 3),), ()),
    )
    with pytest.raises(ValueError, match="outside int32"):
        encode(plan)
