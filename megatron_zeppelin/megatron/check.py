"""Equivalence check: Zeppelin training equals single-process training, loss and gradients.

Four gloo processes (2 emulated nodes x 2 GPUs) run one forward and backward of a small
Megatron ``GPTModel`` with Zeppelin's layer spec on a micro-batch whose plan has documents in all
three tiers. The reference is the same model with the same weights in one process, every
document back to back, with plain per-document causal attention and the same per-document RoPE
(``ReferenceCoreAttention``). The check compares the global per-token loss and every
parameter's gradient (after the Zeppelin ranks' all-reduce) in float32, with tensor parallelism
1 (Zeppelin world of 4) and 2 (two Zeppelin worlds of 2).

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
from megatron_zeppelin.megatron.quiet import quiet_unless_verbose

quiet_unless_verbose()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from megatron_zeppelin.config import ZeppelinConfig  # noqa: E402
from megatron_zeppelin.megatron.args import resolve_topology  # noqa: E402
from megatron_zeppelin.megatron.core_attention import ZeppelinPackedSeqParams  # noqa: E402
from megatron_zeppelin.megatron.loss import finish_gradients, global_mean_loss  # noqa: E402
from megatron_zeppelin.megatron.rotary import apply_rotary  # noqa: E402
from megatron_zeppelin.megatron.runtime import (  # noqa: E402
    ModelDims,
    build_cost_model,
    build_gpt,
    create_transport,
    forward_micro_batch,
    init_megatron_parallel,
    plan_micro_batch,
    plan_summary,
)

# Documents that land in every tier on 2 x 2 ranks with the thresholds below. The longest is
# over one node's capacity (2 x 1024), so it crosses nodes whatever the threshold policy.
CHECK_LENGTHS = (2100, 520, 333, 260, 90, 41, 17, 5, 2)


@dataclass
class CheckOptions:
    """What the check runs; defaults finish in well under a minute on two cores."""

    lengths: tuple[int, ...] = CHECK_LENGTHS
    tensor_parallels: tuple[int, ...] = (1, 2)
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


class ReferencePackedSeqParams(PackedSeqParams):
    """The reference batch: document lengths and per-token positions (one process holds all)."""

    def __init__(self, lengths: list[int], positions: torch.Tensor) -> None:
        super().__init__(qkv_format="sbhd")
        self.lengths = lengths
        self.positions = positions


class ReferenceCoreAttention(MegatronModule):
    """Dense causal attention per document (``testing.reference``, float64) with the same
    per-document RoPE."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self",
                 cp_comm_type=None, softmax_scale=None, pg_collection=None, *,
                 rotary_base: float = 10000.0, **unused: Any) -> None:  # fmt: skip
        super().__init__(config=config)
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.rotary_base = rotary_base

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):  # fmt: skip
        from megatron_zeppelin.testing.reference import reference_attention

        params = packed_seq_params
        s, _, n, d = query.shape
        q_snd = apply_rotary(query[:, 0], params.positions, base=self.rotary_base)
        k_snd = apply_rotary(key[:, 0], params.positions, base=self.rotary_base)
        out_snd = reference_attention(
            q_snd, k_snd, value[:, 0], params.lengths, softmax_scale=self.softmax_scale
        )
        return out_snd.to(query.dtype).reshape(s, 1, n * d)


def reference_spec(dims: ModelDims) -> ModuleSpec:
    from megatron_zeppelin.megatron.spec import zeppelin_layer_spec

    spec = zeppelin_layer_spec("local", rotary_base=dims.rotary_base)
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
        resolve_topology(zeppelin_config(options, tp), options.world_size // tp,
                         tensor_parallel=tp)  # fmt: skip


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


def _check_rank(rank: int, options: CheckOptions, prefix: str) -> dict:
    from megatron_zeppelin.megatron.batch import build_linear_batch, build_reference_batch
    from megatron_zeppelin.megatron.data import DocumentDataset
    from megatron_zeppelin.megatron.sampler import DocumentSlice

    dims = options.dims
    dataset = DocumentDataset(prefix)
    slices = [DocumentSlice(i, 0, n) for i, n in enumerate(options.lengths)]
    # --- the single-process reference (computed on every rank; no communication) ---------
    init_megatron_parallel(1)
    ref_model = build_gpt(dims, seed=options.seed, layer_spec=reference_spec(dims))
    ref_batch = build_reference_batch(slices, dataset)
    params = ReferencePackedSeqParams(list(options.lengths), ref_batch.position_ids_t)
    total, count = forward_micro_batch(ref_model, ref_batch, params)
    (total / count).backward()
    ref_loss = float(total.detach() / count)
    ref_state = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}
    report: dict[str, Any] = {"reference_loss": ref_loss, "runs": {}}
    for tp in options.tensor_parallels:
        ctx = init_megatron_parallel(tp)
        config = zeppelin_config(options, tp)
        topology = resolve_topology(config, ctx.zeppelin_world, tensor_parallel=tp)
        cost = build_cost_model(dims, topology, tensor_parallel=tp, calibration=None)
        exchanger, _ = create_transport(topology, ctx, config)
        model = build_gpt(dims, seed=options.seed)
        with torch.no_grad():  # the very weights of the reference, sliced as TP cuts them
            for name, p in model.named_parameters():
                p.copy_(shard_of(ref_state[name], p, ctx.tp_rank, tp))
        plan = plan_micro_batch(list(options.lengths), topology=topology, cost_model=cost,
                                config=config)  # fmt: skip
        batch = build_linear_batch(plan, ctx.zeppelin_rank, slices, dataset)
        params = ZeppelinPackedSeqParams(
            plan=plan, rank=ctx.zeppelin_rank, exchanger=exchanger.set_plan(plan),
            remap_group=ctx.dp_group, positions=batch.position_ids_t, kernel="torch",
        )  # fmt: skip
        total, count = forward_micro_batch(model, batch, params)
        total.backward()
        loss, num_tokens = global_mean_loss(total, count, ctx.dp_group)
        finish_gradients(model.parameters(), num_tokens, ctx.dp_group)
        errors = {}
        for name, p in model.named_parameters():
            ref = shard_of(ref_grads[name], p, ctx.tp_rank, tp)
            scale = ref.abs().max().clamp_min(1e-30)
            errors[name] = float((p.grad - ref).abs().max() / scale)
        worst = torch.tensor([abs(loss - ref_loss) / abs(ref_loss), max(errors.values())],
                             dtype=torch.float64)  # fmt: skip
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        report["runs"][f"tp{tp}"] = {
            "tensor_parallel": tp,
            "zeppelin_world": ctx.zeppelin_world,
            "loss": loss,
            "loss_rel_error": float(worst[0]),
            "max_grad_rel_error": float(worst[1]),
            "grad_rel_error": errors,
            "plan": plan_summary(plan, cost.model, routing=config.routing),
        }
    return report


def run_check(options: CheckOptions | None = None) -> dict[str, Any]:
    """Run the check (spawns ``world_size`` gloo processes); returns the figures and ``passed``."""
    from megatron_zeppelin.megatron.synthetic import write_synthetic_dataset
    from megatron_zeppelin.testing.dist import (
        DistributedRunError,
        run_distributed,
        whole_run_timeout,
    )

    options = options or CheckOptions()
    check_options(options)
    with tempfile.TemporaryDirectory(prefix="zeppelin-check-") as tmp:
        prefix = os.path.join(tmp, "docs")
        write_synthetic_dataset(prefix, lengths=list(options.lengths),
                                vocab_size=options.dims.vocab_size, seed=options.seed)  # fmt: skip
        try:
            reports = run_distributed(_check_worker, options.world_size,
                                      timeout_s=whole_run_timeout(options.timeout_s),
                                      comm_timeout_s=options.timeout_s,
                                      args=(options, prefix, tmp))  # fmt: skip
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
