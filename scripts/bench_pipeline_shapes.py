"""Activations between pipeline stages: a shape per micro-batch, or one padded shape?

Under pipeline parallelism with Zeppelin a rank sends the next stage its linear layout's rows,
a count that changes with every micro-batch. Megatron's schedules carry that in one of two ways:

- ``variable_seq_lengths`` (what the plugin uses): before every activation or gradient a
  stage sends, the two ranks exchange its shape (3 integers, one point-to-point message each
  way it goes) and, on GPUs, the host waits for the device (``torch.cuda.synchronize`` in
  ``p2p_communication._communicate_shapes``);
- a fixed shape of ``--seq-length`` rows (Megatron's default), every rank's rows padded up to
  it: the padding runs through every linear module of every stage, forward and backward.

The script makes a run's micro-batches as the plugin does (the sampler over a length
distribution, ``--global-batch-size / DP`` micro-batches a step filled to DP x capacity
tokens, each planned), and for each micro-batch counts its rows per rank against the fixed
shape, and prices both with the cost model (datasheet figures of the cluster):

- padding: a stage's layers (``--layers / --pp``) of linear modules, forward and backward, on
  the busiest rank's rows against ``--seq-length`` rows (the step waits for its busiest rank);
- shape messages: per micro-batch and stage, one message forward and one backward, each a
  point-to-point latency on the link between stages (NVLink when the stages share a node, else
  a NIC). The host's wait for the device is not priced: it costs what the host would have
  queued meanwhile, which is nothing where the stage's kernels are already queued.

Next to them the stage's predicted micro-batch (the plan's ``predicted_step_s`` for its
layers). Nothing is timed: it counts rows and prices them, the same on any machine.

    python scripts/bench_pipeline_shapes.py
    python scripts/bench_pipeline_shapes.py --dist wikipedia --seq-length 8192
"""

from __future__ import annotations

import argparse
import statistics

from megatron_zeppelin.megatron.documents.sampler import DocumentCost, DocumentSampler
from megatron_zeppelin.planner.baselines.distributions import DISTRIBUTIONS, sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import ModelSpec, get_model
from megatron_zeppelin.planner.search.partition import plan_batch
from megatron_zeppelin.topology.presets import get_topology

SHAPE_BYTES = 3 * 8  # the shape message: 3 int64


def _stage_model(model: str, layers_per_stage: int) -> ModelSpec:
    spec = get_model(model)
    return ModelSpec(**{**spec.to_dict(), "num_layers": layers_per_stage})


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Rows and prices over ``args.steps`` steps of micro-batches (see the module docstring)."""
    topology = get_topology(args.cluster, num_nodes=args.nodes)
    spec = _stage_model(args.model, get_model(args.model).num_layers // args.pp)
    cost = CostModel.default(spec, topology)
    micro_batch_tokens = args.seq_length * topology.world_size
    lengths = sample_lengths(args.dist, num_tokens=args.corpus_tokens, seed=args.seed)
    sampler = DocumentSampler(
        lengths,
        tokens_per_step=micro_batch_tokens * args.micro_batches,
        num_micro_batches=args.micro_batches,
        seed=args.seed,
        max_length=micro_batch_tokens,
        micro_batch_capacity=micro_batch_tokens,
        cost=DocumentCost.from_model(spec),
    )
    link = "nvlink" if args.stages_share_node else "nic"
    shapes_s = 2 * cost.transfer_time(SHAPE_BYTES, link)
    fill, padding, stage = [], [], []
    for _ in range(args.steps):
        step = sampler.next_step()
        for index in range(len(step.micro_batches)):
            plan = plan_batch(
                step.lengths(index), topology=topology, cost_model=cost, capacity=args.seq_length
            )
            rows = [plan.num_linear_tokens(r) for r in range(topology.world_size)]
            fill.append(sum(rows) / (len(rows) * args.seq_length))
            busiest = cost.linear_time(max(rows))
            padding.append(spec.num_layers * (cost.linear_time(args.seq_length) - busiest))
            stage.append(plan.meta["predicted_step_s"])
    return {
        "micro_batches": len(fill),
        "mean_fill": statistics.mean(fill),
        "min_fill": min(fill),
        "padding_ms": 1e3 * statistics.mean(padding),
        "shapes_ms": 1e3 * shapes_s,
        "stage_ms": 1e3 * statistics.mean(stage),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", choices=sorted(DISTRIBUTIONS), default="prolong")
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--cluster", default="dgx-h100")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of one stage's Zeppelin world")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--seq-length", type=int, default=16384, help="tokens per GPU")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--corpus-tokens", type=int, default=20_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stages-share-node", action="store_true", help="stages talk over NVLink (else a NIC)"
    )
    args = parser.parse_args()
    out = measure(args)
    print(
        f"{args.dist}, {args.model} / PP {args.pp} on {args.nodes} x {args.cluster} per stage, "
        f"{args.seq_length} tokens per GPU, {out['micro_batches']} micro-batches:\n"
        f"  rows per rank / seq-length: mean {out['mean_fill']:.3f}, lowest {out['min_fill']:.3f}\n"
        f"  padded shape: {out['padding_ms']:.3f} ms more linear work per micro-batch and stage\n"
        f"  shape messages: {out['shapes_ms']:.4f} ms per micro-batch and stage\n"
        f"  the stage's predicted micro-batch: {out['stage_ms']:.1f} ms"
    )


if __name__ == "__main__":
    main()
