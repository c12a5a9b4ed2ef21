"""Train a small Megatron GPT with Zeppelin on CPU processes that emulate a GPU cluster.

    torchrun --nproc-per-node 4 -m megatron_zeppelin.job.train_cpu      # or: zeppelin train

Four gloo processes stand for 2 nodes x 2 GPUs. The model is megatron-core's own ``GPTModel``
(2 layers, hidden 64, vocabulary 512) with Zeppelin's layer spec; the data is a synthetic
variable-length corpus (``synthetic.py``, patterned tokens so the loss can fall) written into
the run directory on first use. Every step the sampler draws whole documents, every rank plans
the same plan, reads its own tokens, runs forward and backward with the per-token loss; the
gradients are summed over the Zeppelin ranks and Adam steps. Rank 0 shows progress, the loss,
tokens/s and the plan (tiers, imbalance, ring bytes per link class); ``--json`` writes the
per-step figures; ``--save`` / ``--load`` checkpoint model, optimizer and sampler
(``job_checkpoint.py``: atomic rank files, a manifest written last, a ``latest`` pointer).

Every collective of a step is bounded by ``--zeppelin-comm-timeout-s`` (``comm.watch``): a peer
that stalls ends the job with an error naming it, the step and the layer. A step whose loss or
gradient norm is not finite stops the job before the optimizer uses it (``check_finite``).
How a worker starts and ends is ``worker.py``.

The ``--zeppelin-*`` flags are the same as in Megatron-LM; their defaults here suit the tiny
emulated cluster (thresholds of a few hundred tokens, so all three tiers show up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

# Known third-party warnings would bury the progress bar: hide them before megatron-core is
# imported below (``--verbose`` shows them).
from megatron_zeppelin.launch.quiet import quiet_unless_verbose  # noqa: E402

quiet_unless_verbose()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_zeppelin.comm.watch import CommWatch  # noqa: E402
from megatron_zeppelin.config import ZeppelinConfig  # noqa: E402
from megatron_zeppelin.fileio import atomic_write_text, format_bytes  # noqa: E402
from megatron_zeppelin.job import job_checkpoint  # noqa: E402
from megatron_zeppelin.job.synthetic import write_synthetic_dataset  # noqa: E402
from megatron_zeppelin.launch.worker import check_finite, run_worker  # noqa: E402
from megatron_zeppelin.megatron.args import resolve_topology  # noqa: E402
from megatron_zeppelin.megatron.documents.data import DocumentDataset  # noqa: E402
from megatron_zeppelin.megatron.documents.sampler import DocumentCost, DocumentSampler  # noqa: E402
from megatron_zeppelin.megatron.model.loss import (  # noqa: E402
    finish_gradients,
    global_mean_loss,
    token_loss_sum,
)
from megatron_zeppelin.megatron.plans.feed import MicroBatchFeed  # noqa: E402
from megatron_zeppelin.megatron.precision import (  # noqa: E402
    DEVICES,
    DTYPES,
    job_device,
    make_optimizer,
)
from megatron_zeppelin.megatron.report import (  # noqa: E402
    chosen_kernel,
    plan_line,
    planning_text,
    startup_lines,
)
from megatron_zeppelin.megatron.runtime import (  # noqa: E402
    ModelDims,
    build_cost_model,
    build_gpt,
    create_plan_share,
    create_transport,
    init_megatron_parallel,
    plan_summary,
)
from megatron_zeppelin.megatron.step import StepRuntime, run_micro_batch  # noqa: E402
from megatron_zeppelin.planner.cost.calibration import load_calibration, normalize_dtype  # noqa: E402
from megatron_zeppelin.planner.cost.costmodel import CostModel  # noqa: E402

CPU_DEFAULTS = {
    "zeppelin": True,
    "zeppelin_topology": "custom",
    "zeppelin_nodes": 2,
    "zeppelin_capacity": 2048,
    "zeppelin_intra_threshold": "256",
    "zeppelin_inter_threshold": "1024",
    "zeppelin_kernel": "auto",
    "zeppelin_log_plan_every": 5,
    "zeppelin_max_document_length": 2048,
    "zeppelin_comm_timeout_s": 120.0,
}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The CPU job's flags (also used by ``zeppelin train``)."""
    job = parser.add_argument_group("CPU training job")
    job.add_argument("--run-dir", default="runs/cpu", help="Where the synthetic data lives.")
    job.add_argument("--steps", type=int, default=24, help="Total optimizer steps.")
    job.add_argument("--tokens-per-step", type=int, default=4096, help="Token budget of a step.")
    job.add_argument("--micro-batches", type=int, default=1, help="Micro-batches per step.")
    job.add_argument("--tensor-parallel", type=int, default=1, help="Megatron TP size.")
    job.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's sequence parallelism inside each tensor-parallel group.",
    )
    job.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu: gloo processes; cuda: one GPU per process (NCCL).",
    )
    job.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="Model precision; bf16 keeps float32 main weights in Adam.",
    )
    job.add_argument("--seed", type=int, default=1234, help="Model, data and sampler seed.")
    job.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate.")
    job.add_argument("--dataset", default=None, help="PREFIX of a .bin/.idx dataset to train on.")
    job.add_argument("--distribution", default="wikipedia", help="Lengths of synthetic data.")
    job.add_argument("--dataset-tokens", type=int, default=300_000, help="Synthetic data size.")
    job.add_argument("--save", default=None, help="Checkpoint directory to write.")
    job.add_argument("--save-every", type=int, default=0, help="Also save every N steps.")
    job.add_argument("--load", default=None, help="Checkpoint directory to resume from.")
    job.add_argument("--json", default=None, help="Write per-step figures to this file.")
    job.add_argument("--quiet", action="store_true", help="No progress bar or plan lines.")
    job.add_argument(
        "--verbose", action="store_true", help="Also show known third-party library warnings."
    )
    job.add_argument(
        "--no-calibration",
        action="store_true",
        help="Plan with datasheet figures even where a calibration file for this machine exists.",
    )
    dims = parser.add_argument_group("model")
    for name, default in vars(ModelDims()).items():
        if name == "dtype":
            continue  # --dtype, above
        kind = type(default)
        dims.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    ZeppelinConfig.add_arguments(parser)
    parser.set_defaults(**CPU_DEFAULTS)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_zeppelin.job.train_cpu", description=__doc__.split("\n")[0]
    )
    return add_arguments(parser)


def model_dims(args: argparse.Namespace) -> ModelDims:
    """The model the flags describe."""
    return ModelDims(**{name: getattr(args, name) for name in vars(ModelDims())})


def _dataset(args: argparse.Namespace, rank: int, watch: CommWatch):
    """Open the dataset; write the synthetic one first (rank 0) when it is missing."""

    prefix = args.dataset or os.path.join(args.run_dir, "data", f"synthetic-{args.seed}")
    if args.dataset is None and rank == 0 and not os.path.exists(prefix + ".idx"):
        write_synthetic_dataset(
            prefix,
            distribution=args.distribution,
            num_tokens=args.dataset_tokens,
            max_length=args.zeppelin_max_document_length,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    watch.barrier(what="dataset ready", timeout_s=max(watch.timeout_s, 120.0))
    return DocumentDataset(prefix)


def build_sampler(
    args: argparse.Namespace,
    config: ZeppelinConfig,
    lengths,
    cost_model: CostModel,
    zeppelin_world: int,
):
    """The job's document sampler over ``lengths``. With a capacity, no micro-batch gets more
    tokens than the Zeppelin ranks hold together, so every micro-batch can be planned."""

    return DocumentSampler(
        lengths,
        tokens_per_step=args.tokens_per_step,
        num_micro_batches=args.micro_batches,
        seed=args.seed,
        max_length=config.max_document_length,
        long_documents=config.long_documents,
        micro_batch_capacity=config.capacity * zeppelin_world if config.capacity else None,
        cost=DocumentCost.from_model(cost_model.model),
    )


def train(args: argparse.Namespace, *, watch: CommWatch | None = None) -> dict[str, Any]:
    """Run the job on an initialized gloo world; returns the run's figures (every rank).
    ``watch`` bounds its collectives (default: one without a progress board)."""
    config = ZeppelinConfig.from_args(args)
    device, dtype = job_device(args.device), DTYPES[args.dtype]
    if watch is None:
        watch = CommWatch(
            rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=config.comm_timeout_s
        )
    ctx = init_megatron_parallel(args.tensor_parallel)
    topology = resolve_topology(config, ctx.zeppelin_world, tensor_parallel=ctx.tensor_parallel)
    dims = model_dims(args)
    calibration, why = pick_calibration(args, config)
    cost_model = job_cost_model(dims, topology, ctx.tensor_parallel, calibration, why, args)
    exchanger, counters = create_transport(topology, ctx, config)
    # As Megatron does, sequence parallelism is off without tensor parallelism.
    sequence_parallel = args.sequence_parallel and ctx.tensor_parallel > 1
    kernel = chosen_kernel(
        config.kernel,
        device=device.type,
        dtype=dtype,
        calibration=calibration,
        model=cost_model.model,
    )
    runtime = StepRuntime.create(
        config=config,
        topology=topology,
        cost_model=cost_model,
        exchanger=exchanger,
        zeppelin_rank=ctx.zeppelin_rank,
        remap_group=ctx.dp_group,
        tensor_parallel=ctx.tensor_parallel,
        sequence_parallel=sequence_parallel,
        watch=watch,
        kernel=kernel.name,
        plan_share=create_plan_share(topology, ctx, config),
    )
    dataset = _dataset(args, dist.get_rank(), watch)
    sampler = build_sampler(args, config, dataset.lengths, cost_model, ctx.zeppelin_world)
    model = build_gpt(dims, seed=args.seed, sequence_parallel=sequence_parallel)
    # Every parameter in the run's dtype, norms included (Megatron's Float16Module does the same).
    model.to(device=device, dtype=dtype)
    optimizer = make_optimizer(model, lr=args.lr, dtype=dtype)
    start = 0
    if args.load:
        state = job_checkpoint.load(args.load)
        start = job_checkpoint.restore(
            state, model, optimizer, sampler, dtype=args.dtype, where=args.load
        )
    watch.bound_groups([None, ctx.dp_group, _tensor_parallel_group()])
    # Plans of the next micro-batches are made in planner processes while one trains; the feed
    # stands in for the sampler when a checkpoint saves where the stream stands.
    feed = MicroBatchFeed.for_run(sampler, runtime.recipe, runtime.plan_share)
    is_main = dist.get_rank() == 0
    show = is_main and not args.quiet
    if show:
        lines = startup_lines(
            runtime, tensor_parallel=ctx.tensor_parallel, kernel=kernel, calibration_why=why
        )
        print("\n".join(lines), flush=True)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=args.steps, initial=start, disable=not show, unit="step", file=sys.stdout)
    begin = time.perf_counter()
    try:
        for step in range(start, args.steps):
            watch.at(step=step)
            record = _train_step(step, model, optimizer, feed, runtime, dataset, counters, ctx)
            records.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            if show and config.log_plan_every and (step + 1) % config.log_plan_every == 0:
                bar.write(plan_line(step, record["plans"][0]))
            if args.save and args.save_every and (step + 1) % args.save_every == 0:
                _save(args, model, optimizer, feed, step + 1, watch)
    finally:
        feed.close()
    bar.close()
    saved_last = args.save_every and args.steps % args.save_every == 0
    if args.save and start < args.steps and not saved_last:
        _save(args, model, optimizer, feed, args.steps, watch)
    result = _summary(records, time.perf_counter() - begin, config, dims, ctx)
    result["summary"]["cost_model_sources"] = dict(cost_model.sources)
    result["summary"]["planning"] = feed.stats.to_dict()
    result["summary"]["parameter_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    if is_main:
        if not args.quiet:
            print(summary_text(result["summary"]))
        if args.json:
            atomic_write_text(args.json, json.dumps(result, indent=1))
    return result


def _train_step(step: int, model, optimizer, feed, runtime, dataset, counters, ctx) -> dict:
    """One optimizer step: every micro-batch through ``step.run_micro_batch``, backward of the
    loss sums, the gradients summed over the Zeppelin ranks; returns the step's record."""

    t0 = time.perf_counter()
    if counters is not None:
        counters.reset()
    loss_sum, loss_count, summaries = torch.zeros(()), torch.zeros((), dtype=torch.long), []
    for _ in range(feed.sampler.num_micro_batches):
        item = feed.next()
        assert item.step.step == step, "the feed and the step loop disagree"
        if item.plan is None:
            continue
        run = run_micro_batch(model, item.slices, item.plan, runtime, dataset)
        total, count = token_loss_sum(run.losses_bs, run.loss_mask_bs)
        total.backward()  # the sum: dividing by the global count comes after the all-reduce
        loss_sum, loss_count = loss_sum + total.detach(), loss_count + count
        spec = runtime.cost_model.model
        summaries.append(plan_summary(item.plan, spec, routing=runtime.config.routing))
    watch = runtime.watch
    loss, num_tokens = global_mean_loss(loss_sum, loss_count, ctx.dp_group, watch=watch)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    finish_gradients(model.parameters(), num_tokens, ctx.dp_group, tp_group=tp_group, watch=watch)
    check_finite(step, loss, model.parameters())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    measured = counters.all_reduce(ctx.dp_group, watch=watch) if counters is not None else None
    seconds = time.perf_counter() - t0
    step_batch = item.step
    return {
        "step": step,
        "loss": loss,
        "loss_tokens": num_tokens,
        "tokens": step_batch.num_tokens,
        "seconds": seconds,
        "tokens_per_s": step_batch.num_tokens / seconds,
        "documents": [[[s.doc, s.start, s.end] for s in mb] for mb in step_batch.micro_batches],
        "plans": summaries,
        "measured_link_bytes": measured,
    }


MACHINE_CALIBRATION = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs",
    "calibration",
    "cpu-gloo-tiny.json",
)
"""Figures measured on the project's CPU machine for the default model (``tiny``, float32);
the job plans with them by default when the file is there (a source checkout)."""


def pick_calibration(args: argparse.Namespace, config: ZeppelinConfig) -> tuple[str | None, str]:
    """The calibration file to plan with and why: the flag's, else ``RUN_DIR/calibration.json``,
    else this machine's shipped file; none with ``--no-calibration``."""
    if config.calibration:
        return config.calibration, "given"
    if getattr(args, "no_calibration", False):
        return None, "off"
    found = os.path.join(args.run_dir, "calibration.json")
    if os.path.exists(found):
        return found, "run directory"
    if os.path.exists(MACHINE_CALIBRATION) and (args.device, args.dtype) == ("cpu", "float32"):
        return MACHINE_CALIBRATION, "default"
    return None, "none found"


def job_cost_model(
    dims: ModelDims, topology, tensor_parallel: int, path: str | None, why: str, args
) -> CostModel:
    """The cost model; a calibration must be for this job's device kind and dtype and this
    model's dimensions, otherwise the job stops and says what to do."""
    if path is None:
        return build_cost_model(dims, topology, tensor_parallel=tensor_parallel, calibration=None)

    hint = (
        " (picked by default for this machine: pass --no-calibration to plan with datasheet "
        "figures, or --zeppelin-calibration FILE)"
        if why == "default"
        else ""
    )
    cal = load_calibration(path)
    same_device = cal.device.lower().startswith("cpu") == (args.device == "cpu")
    if normalize_dtype(cal.dtype) != normalize_dtype(args.dtype) or not same_device:
        raise ValueError(
            f"calibration {path} was measured on {cal.device!r} in {cal.dtype}, but this job "
            f"runs {args.dtype} on {args.device}: profile this machine (zeppelin profile){hint}"
        )
    try:
        return build_cost_model(dims, topology, tensor_parallel=tensor_parallel, calibration=path)
    except ValueError as exc:
        raise ValueError(f"{exc}{hint}") from exc


def _save(args: argparse.Namespace, model, optimizer, sampler, step: int, watch: CommWatch) -> None:
    state = job_checkpoint.training_state(model, optimizer, sampler, step, dtype=args.dtype)
    job = job_checkpoint.job_settings(vars(model_dims(args)), args.tensor_parallel)
    job_checkpoint.save(args.save, step, state, job=job, watch=watch)


def _tensor_parallel_group():

    return parallel_state.get_tensor_model_parallel_group()


def _summary(records, seconds, config, dims, ctx) -> dict[str, Any]:
    head = [r["loss"] for r in records[:3]]
    tail = [r["loss"] for r in records[-3:]]
    tiers: dict[str, int] = {}
    measured: dict[str, int] = {}
    for r in records:
        for s in r["plans"]:
            for k, v in s["tiers"].items():
                tiers[k] = tiers.get(k, 0) + v
        for k, v in (r["measured_link_bytes"] or {}).items():
            measured[k] = measured.get(k, 0) + v
    tokens = sum(r["tokens"] for r in records)
    return {
        "summary": {
            "steps": len(records),
            "first_loss": sum(head) / len(head) if head else None,
            "last_loss": sum(tail) / len(tail) if tail else None,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "documents_per_tier": tiers,
            "measured_link_bytes": measured,
            "zeppelin_world": ctx.zeppelin_world,
            "tensor_parallel": ctx.tensor_parallel,
        },
        "config": config.to_dict(),
        "model": vars(dims),
        "steps": records,
    }


def summary_text(s: dict) -> str:
    """The run's closing block: a few lines a reader can take in at a glance."""
    if not s["steps"]:
        return "nothing to do: the checkpoint is already at --steps"
    tiers = ", ".join(f"{k} {v}" for k, v in s["documents_per_tier"].items())
    links = s.get("measured_link_bytes") or {}
    nics = " ".join(f"{k[4:]}={format_bytes(v)}" for k, v in links.items() if k.startswith("nic:"))
    sources = s.get("cost_model_sources") or {}
    measured = sorted(k for k, v in sources.items() if v != "default")
    defaults = sorted(k for k, v in sources.items() if v == "default")
    lines = [
        "--- summary ---",
        f"steps        {s['steps']} in {s['seconds']:.1f} s on {s['zeppelin_world']} Zeppelin "
        f"ranks x TP {s['tensor_parallel']}",
        f"throughput   {s['tokens_per_s']:,.0f} tokens/s ({s['tokens']:,} tokens)",
        f"loss         {s['first_loss']:.3f} -> {s['last_loss']:.3f} (mean of first / last 3 "
        "steps)",
        f"documents    {tiers}",
    ]
    if links:
        lines.append(
            f"ring bytes   nvlink {format_bytes(links.get('nvlink', 0))}, nic "
            f"{format_bytes(links.get('nic', 0))} [{nics}] (measured, all steps)"
        )
    if sources:
        lines.append(
            f"cost model   measured: {', '.join(measured) or 'none'}; defaults: "
            f"{', '.join(defaults) or 'none'}"
        )
    planning = s.get("planning")
    if planning and planning["num_plans"]:
        lines.append(f"planning     {planning_text(planning)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """A worker's entry point (``worker.run_worker``): 0 when the job finished, 2 when bad input
    stopped it, 1 for any other failure; the launcher reports why in one line."""
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "train_cpu runs under torchrun: torchrun --nproc-per-node 4 -m "
            "megatron_zeppelin.job.train_cpu (or simply: zeppelin train)",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)  # several processes share few cores
    backend = "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(job_device("cuda"))
        backend = "cpu:gloo,cuda:nccl"  # host tensors (the loss, the counters) on gloo
    return run_worker(
        lambda watch: train(args, watch=watch),
        comm_timeout_s=args.zeppelin_comm_timeout_s,
        backend=backend,
    )


if __name__ == "__main__":
    sys.exit(main())
