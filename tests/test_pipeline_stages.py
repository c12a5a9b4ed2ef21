"""Pipeline parallelism's pieces on their own: the layers a stage runs (Megatron's own split),
each micro-batch handed to every model chunk in the order Megatron's schedules call
``forward_step``, and micro-batches in flight at once keeping their own plan's routes (a
1F1B schedule runs forwards ahead of their backwards). The whole of it runs in Megatron's
real ``pretrain()`` in the host tier (``tests/host/test_pipeline.py``).

Tier: pure.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.transformer import TransformerConfig

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.comm.threads import ThreadExchanger, ThreadHub
from megatron_zeppelin.megatron.pipeline import ChunkCursors, pipeline_stage
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure


def _config(**pipeline: object) -> TransformerConfig:
    return TransformerConfig(
        num_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        **pipeline,
    )


@pytest.mark.parametrize(
    ("pipeline", "vp_size", "layers"),
    [
        (dict(pipeline_model_parallel_size=2), None, [(0, 1, 2, 3), (4, 5, 6, 7)]),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            2,
            [(0, 1, 4, 5), (2, 3, 6, 7)],
        ),
        (
            dict(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=3),
            None,
            [(0, 1, 2, 3, 4), (5, 6, 7)],
        ),
        (
            dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
            2,
            [(0, 4), (1, 5), (2, 6), (3, 7)],
        ),
    ],
)
def test_a_stage_holds_the_layers_megatron_builds_there(pipeline, vp_size, layers) -> None:
    config = _config(**pipeline)
    stages = [pipeline_stage(config, pp_rank=rank, vp_size=vp_size) for rank in range(len(layers))]
    assert [s.layers for s in stages] == layers
    assert [s.embedding for s in stages] == [True] + [False] * (len(layers) - 1)
    assert [s.output_layer for s in stages] == [False] * (len(layers) - 1) + [True]
    assert pipeline_stage(_config(), pp_rank=0, vp_size=None) is None


@pytest.mark.parametrize(("micro_batches", "chunks", "group"), [(4, 2, 2), (6, 3, 2), (3, 1, 3)])
def test_every_chunk_takes_every_micro_batch_in_the_schedules_order(
    micro_batches: int, chunks: int, group: int
) -> None:
    """Megatron's interleaved schedule runs forwards in its table's order (micro-batch, chunk);
    each chunk's k-th call must get micro-batch k, drawn from the feed once."""
    drawn: list[int] = []
    cursors = ChunkCursors(lambda: (drawn.append(len(drawn)), drawn[-1])[1], chunks)
    seen: dict[int, list[int]] = {c: [] for c in range(chunks)}
    most_held = 0
    for micro_batch, chunk in get_schedule_table(micro_batches, chunks, group):
        item, was_drawn = cursors.next(chunk)
        assert item == micro_batch
        assert was_drawn == (chunk == 0)  # the first chunk always comes first
        seen[chunk].append(item)
        most_held = max(most_held, cursors.num_held)
    assert drawn == list(range(micro_batches))
    assert all(items == list(range(micro_batches)) for items in seen.values())
    assert cursors.num_held == 0  # a step's last forward releases everything
    assert most_held <= group  # only the micro-batches the later chunks have still to run
    with pytest.raises(ValueError, match="model chunk"):
        cursors.next(chunks)


def _routed(lengths: list[int]) -> Plan:
    """The plan of ``lengths`` on 2 nodes x 2 GPUs, flat rings only: a document over one node's
    capacity rings across nodes, its cross-node edges routed over both NICs."""
    topology = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
    cost = CostModel.default(get_model("tiny"), topology)
    options = PlannerOptions(two_d=False)
    plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=64, options=options)
    assert plan.routes
    return plan


def test_micro_batches_in_flight_keep_their_own_plans_routes() -> None:
    """Under 1F1B the first stage runs micro-batch 2's forward before micro-batch 1's backward;
    the engine of micro-batch 1 must still send along plan 1's routes then."""
    first, second = _routed([200, 30]), _routed([180, 9, 7, 40])
    shared = ThreadExchanger(ThreadHub(4), 0)
    engines = [ZeppelinAttention(plan, 0, shared, kernel="torch") for plan in (first, second)]
    assert engines[0].exchanger.plan is first and engines[1].exchanger.plan is second
    assert engines[0].exchanger._routes == {(r.src, r.dst): r for r in first.routes}
    assert engines[0].exchanger._routes != engines[1].exchanger._routes
    assert shared.plan is None  # the shared transport itself is never bound to one plan
