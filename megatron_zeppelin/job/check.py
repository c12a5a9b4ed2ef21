"""Equivalence check: Zeppelin training equals single-process training, loss and gradients.

Four gloo processes (2 emulated nodes x 2 GPUs) run one forward and backward of a small
Megatron ``GPTModel`` with Zeppelin's layer spec on a micro-batch whose plan has documents in all
three tiers. The reference is the same model with the same weights in one process, every
document back to back, with plain per-document causal attention and the same per-document RoPE
(``ReferenceCoreAttention``). The check compares the global per-token loss and every
parameter's gradient (after the Zeppelin ranks' all-reduce) in float32, with tensor parallelism
1 (Zeppelin world of 4) and 2 (two Zeppelin worlds of 2), the latter also with Megatron's
sequence parallelism (each rank's linear rows padded to a multiple of 2). The Zeppelin side runs
the very micro-batch step of the CPU job and the Megatron hooks (``step.py``).

The error of a gradient is ``max |g - g_ref| / max |g_ref|`` over the parameter (a TP rank
compares its shard with the matching slice of the reference gradient); the check passes when
the loss and every gradient are within ``tolerance`` (1e-5).

Every process computes the reference itself (the model is tiny), so no gradient travels for the
comparison; only the maxima are reduced.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

# Spawned workers import this module first: hide megatron-core's known import-time warnings
# before it is imported (``ZEPPELIN_VERBOSE=1`` shows them).
from megatron_zeppelin.launch.quiet import quiet_unless_verbose

quiet_unless_verbose()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from megatron_zeppelin.config import ZeppelinConfig  # noqa: E402
from megatron_zeppelin.job.synthetic import write_synthetic_dataset  # noqa: E402
from megatron_zeppelin.launch.ranks import (  # noqa: E402
    DistributedRunError,
    run_distributed,
    whole_run_timeout,
)
from megatron_zeppelin.megatron.args import resolve_topology  # noqa: E402
from megatron_zeppelin.megatron.documents.batch import build_reference_batch  # noqa: E402
from megatron_zeppelin.megatron.documents.data import DocumentDataset  # noqa: E402
from megatron_zeppelin.megatron.documents.sampler import DocumentSlice  # noqa: E402
from megatron_zeppelin.megatron.model.loss import (  # noqa: E402
    finish_gradients,
    global_mean_loss,
    token_loss_sum,
)
from megatron_zeppelin.megatron.model.rotary import Rope, apply_rotary  # noqa: E402
from megatron_zeppelin.megatron.plans.shared_plans import SharedPlanner  # noqa: E402
from megatron_zeppelin.megatron.runtime import (  # noqa: E402
    ModelDims,
    build_cost_model,
    build_gpt,
    create_plan_share,
    create_transport,
    init_megatron_parallel,
    plan_summary,
)
from megatron_zeppelin.megatron.spec import zeppelin_layer_spec  # noqa: E402
from megatron_zeppelin.megatron.step import StepRuntime, forward_batch, run_micro_batch  # noqa: E402
from megatron_zeppelin.testing.reference import reference_attention  # noqa: E402

# Documents that land in every tier on 2 x 2 ranks with the thresholds below. The longest is
# over one node's capacity (2 x 1024), so it crosses nodes whatever the threshold policy.
CHECK_LENGTHS = (2100, 520, 333, 260, 90, 41, 17, 5, 2)


@dataclass
class CheckOptions:
    """What the check runs; defaults finish in well under a minute on two cores."""

    lengths: tuple[int, ...] = CHECK_LENGTHS
    tensor_parallels: tuple[int, ...] = (1, 2)
    sequence_parallel: bool = True
    """Also run every tensor-parallel size above 1 with Megatron's sequence parallelism."""
    seed: int = 7
    tolerance: float = 1e-5
    world_size: int = 4
    nodes: int = 2
    dims: ModelDims = field(default_factory=ModelDims)
    intra_threshold: str = "64"
    inter_threshold: str = "600"
    capacity: int = 1024
    routing: bool = True
    timeout_s: float = 300.0
    share_plans: bool = False
    """Plan as a run shares plans (``--zeppelin-share-plans``): the first rank of each node in a
    planner process, the micro-batch's owner sending the plan to every rank; else every rank
    plans the micro-batch itself."""


class ReferencePackedSeqParams(PackedSeqParams):
    """The reference batch: document lengths and per-token positions (one process holds all)."""

    def __init__(self, lengths: list[int], positions: torch.Tensor) -> None:
        super().__init__(qkv_format="sbhd")
        self.lengths = lengths
        self.positions = positions


class ReferenceCoreAttention(MegatronModule):
    """Dense causal attention per document (``testing.reference``, float64) with the same
    per-document RoPE."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=None,
        *,
        rotary_base: float = 10000.0,
        **unused: Any,
    ) -> None:
        super().__init__(config=config)
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.rotary_base = rotary_base

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        params = packed_seq_params
        s, _, n, d = query.shape
        rope = Rope(base=self.rotary_base)
        q_snd = apply_rotary(query[:, 0], params.positions, rope)
        k_snd = apply_rotary(key[:, 0], params.positions, rope)
        out_snd = reference_attention(
            q_snd, k_snd, value[:, 0], params.lengths, softmax_scale=self.softmax_scale
        )
        return out_snd.to(query.dtype).reshape(s, 1, n * d)


def reference_spec(dims: ModelDims) -> ModuleSpec:
    spec = zeppelin_layer_spec("local", rope=Rope(base=dims.rotary_base))
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=ReferenceCoreAttention, params={"rotary_base": dims.rotary_base}
    )
    return spec


def shard_of(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp: int) -> torch.Tensor:
    """The slice of a full (TP 1) tensor that ``param`` holds on TP rank ``tp_rank``, as
    Megatron's CPU initialization cuts it (``partition_dim`` and ``partition_stride``)."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp], dim=dim)


def zeppelin_config(options: CheckOptions, tp: int) -> ZeppelinConfig:
    """The Zeppelin settings of the run with tensor parallelism ``tp`` (validated)."""
    return ZeppelinConfig(
        enabled=True,
        topology="custom",
        nodes=options.nodes,
        capacity=options.capacity * tp,  # a Zeppelin rank of tp GPUs holds tp times more
        intra_threshold=options.intra_threshold,
        inter_threshold=options.inter_threshold,
        routing=options.routing,
        kernel="torch",
        comm_timeout_s=options.timeout_s,
    ).validate()


def check_options(options: CheckOptions) -> None:
    """Refuse options the workers could not run, before any process starts (``ValueError``)."""
    if not options.tensor_parallels:
        raise ValueError("--tensor-parallel needs at least one size")
    if not options.tolerance > 0:
        raise ValueError(f"--tolerance must be positive, got {options.tolerance}")
    if not options.timeout_s > 0:
        raise ValueError(f"--timeout-s must be positive seconds, got {options.timeout_s}")
    for tp in options.tensor_parallels:
        if tp < 1 or options.world_size % tp:
            raise ValueError(
                f"--tensor-parallel {tp} does not divide the check's {options.world_size} "
                f"processes: use divisors of {options.world_size}"
            )
        for name in ("num_kv_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(options.dims, name) % tp:
                raise ValueError(
                    f"--tensor-parallel {tp} does not split the model's {name} "
                    f"({getattr(options.dims, name)}): use a smaller tensor-parallel size"
                )
        resolve_topology(zeppelin_config(options, tp), options.world_size // tp, tensor_parallel=tp)


def _check_worker(
    rank: int, world_size: int, options: CheckOptions, prefix: str, error_dir: str
) -> dict:
    """One rank of the check; bad input it meets is left in ``error_dir`` for the parent,
    which raises it as one ``ValueError`` instead of a traceback per rank."""
    quiet_unless_verbose()  # a spawned process starts with Python's default warning filters
    try:
        return _check_rank(rank, options, prefix)
    except ValueError as exc:
        path = os.path.join(error_dir, f"rank{rank}.error")
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(str(exc).split()))
        os.replace(path + ".tmp", path)
        raise


def _first_error(error_dir: str, world_size: int) -> str | None:
    """Rank 0's bad-input message, else the first one written."""
    found = [os.path.join(error_dir, f"rank{r}.error") for r in range(world_size)]
    found = [p for p in found if os.path.exists(p)]
    if not found:
        return None
    first = found[0] if found[0].endswith("rank0.error") else min(found, key=os.path.getmtime)
    with open(first) as f:
        return f.read()


def check_runs(options: CheckOptions) -> list[tuple[str, int, bool]]:
    """``(name, tensor-parallel size, sequence parallel)`` of every run the check makes."""
    runs = [(f"tp{tp}", tp, False) for tp in options.tensor_parallels]
    if options.sequence_parallel:
        runs += [(f"tp{tp}+sp", tp, True) for tp in options.tensor_parallels if tp > 1]
    return runs


def _check_rank(rank: int, options: CheckOptions, prefix: str) -> dict:
    dataset = DocumentDataset(prefix)
    slices = [DocumentSlice(i, 0, n) for i, n in enumerate(options.lengths)]
    reference = _reference(options, slices, dataset)
    report: dict[str, Any] = {"reference_loss": reference["loss"], "runs": {}}
    for name, tp, sequence_parallel in check_runs(options):
        report["runs"][name] = _zeppelin_run(
            options, slices, dataset, reference, tp=tp, sequence_parallel=sequence_parallel
        )
    return report


def _reference(options: CheckOptions, slices, dataset) -> dict[str, Any]:
    """The single-process reference, computed on every rank (no communication)."""
    dims = options.dims
    init_megatron_parallel(1)
    model = build_gpt(dims, seed=options.seed, layer_spec=reference_spec(dims))
    batch = build_reference_batch(slices, dataset)
    params = ReferencePackedSeqParams(list(options.lengths), batch.position_ids_t)
    total, count = token_loss_sum(
        forward_batch(model, batch, params), batch.loss_mask_t.unsqueeze(0)
    )
    (total / count).backward()
    return {
        "loss": float(total.detach() / count),
        "state": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
    }


def _zeppelin_run(
    options: CheckOptions, slices, dataset, reference: dict, *, tp: int, sequence_parallel: bool
) -> dict[str, Any]:
    """One forward and backward with Zeppelin through the training step, compared with the
    reference: the very weights, sliced as TP cuts them."""
    dims = options.dims
    ctx = init_megatron_parallel(tp)
    config = zeppelin_config(options, tp)
    topology = resolve_topology(config, ctx.zeppelin_world, tensor_parallel=tp)
    cost = build_cost_model(dims, topology, tensor_parallel=tp, calibration=None)
    exchanger, _ = create_transport(topology, ctx, config)
    runtime = StepRuntime.create(
        config=config,
        topology=topology,
        cost_model=cost,
        exchanger=exchanger,
        zeppelin_rank=ctx.zeppelin_rank,
        remap_group=ctx.dp_group,
        tensor_parallel=tp,
        sequence_parallel=sequence_parallel,
    )
    model = build_gpt(dims, seed=options.seed, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_of(reference["state"][name], p, ctx.tp_rank, tp))
    plan, planners = _plan(options, runtime, ctx, config)
    step = run_micro_batch(model, slices, plan, runtime, dataset)
    total, count = token_loss_sum(step.losses_bs, step.loss_mask_bs)
    total.backward()
    loss, num_tokens = global_mean_loss(total, count, ctx.dp_group)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    finish_gradients(model.parameters(), num_tokens, ctx.dp_group, tp_group=tp_group)
    errors = {}
    for name, p in model.named_parameters():
        ref = shard_of(reference["grads"][name], p, ctx.tp_rank, tp)
        scale = ref.abs().max().clamp_min(1e-30)
        errors[name] = float((p.grad - ref).abs().max() / scale)
    ref_loss = reference["loss"]
    figures = [abs(loss - ref_loss) / abs(ref_loss), max(errors.values()), step.batch.num_padding]
    worst = torch.tensor(figures, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {
        "tensor_parallel": tp,
        "sequence_parallel": sequence_parallel,
        "zeppelin_world": ctx.zeppelin_world,
        "loss": loss,
        "loss_rel_error": float(worst[0]),
        "max_grad_rel_error": float(worst[1]),
        "max_padding_rows": int(worst[2]),
        "min_linear_tokens": min(plan.num_linear_tokens(r) for r in range(plan.world_size)),
        "grad_rel_error": errors,
        "plan": plan_summary(plan, cost.model, routing=config.routing),
        "planner_processes": planners,
    }


def _plan(options: CheckOptions, runtime: StepRuntime, ctx, config: ZeppelinConfig):
    """The micro-batch's plan, and how many planner processes each Zeppelin rank ran for it
    (none: planned here in the step). With ``share_plans`` it comes from its owner
    (``shared_plans.SharedPlanner``), as a run's first micro-batch does."""
    lengths = list(options.lengths)
    share = create_plan_share(runtime.topology, ctx, config) if options.share_plans else None
    if share is None:
        plan, processes = runtime.recipe(lengths), 0
    else:
        planner = SharedPlanner(runtime.recipe, 1, share, lambda seconds: None)
        try:
            plan = planner.submit(lengths).result(timeout=config.comm_timeout_s)
            processes = len(planner.pids)
        finally:
            planner.close()
    counts = [None] * ctx.zeppelin_world
    dist.all_gather_object(counts, processes, group=ctx.dp_group)
    return plan, counts


def run_check(options: CheckOptions | None = None) -> dict[str, Any]:
    """Run the check (spawns ``world_size`` gloo processes); returns the figures and ``passed``."""
    options = options or CheckOptions()
    check_options(options)
    with tempfile.TemporaryDirectory(prefix="zeppelin-check-") as tmp:
        prefix = os.path.join(tmp, "docs")
        write_synthetic_dataset(
            prefix,
            lengths=list(options.lengths),
            vocab_size=options.dims.vocab_size,
            seed=options.seed,
        )
        try:
            reports = run_distributed(
                _check_worker,
                options.world_size,
                timeout_s=whole_run_timeout(options.timeout_s),
                comm_timeout_s=options.timeout_s,
                args=(options, prefix, tmp),
            )
        except DistributedRunError:
            message = _first_error(tmp, options.world_size)
            if message is None:
                raise  # not bad input: a bug, whose traceback the error carries
            raise ValueError(message) from None
    report = reports[0]
    runs = report["runs"]
    report["passed"] = all(
        r["loss_rel_error"] <= options.tolerance and r["max_grad_rel_error"] <= options.tolerance
        for r in runs.values()
    )
    report["tolerance"] = options.tolerance
    report["options"] = {k: v for k, v in asdict(options).items() if k != "dims"}
    report["options"]["model"] = asdict(options.dims)
    return report
