"""Host work of the attention engine on the shapes a user runs, next to the GPU time of the layer.

A GPU waits whenever the host takes longer to queue a layer's kernels than the GPU takes to run
them. For each case this script plans one micro-batch and times, on the rank with the most ring
steps (then the most tokens), what the host does per layer in ``ZeppelinAttention``: build (once
per micro-batch), forward and backward, with a no-op kernel and an instant transport whose own
time is clocked and taken out (``bench_engine_overhead.py``'s stubs), except the bookkeeping
``DistExchanger.start`` does with the messages it is handed before it posts anything (the
payload's check and every message's legs, ``check_payload`` and ``step_legs``), which is counted
in: it grows with the messages the engine hands the transport. It puts that next to the
GPU time the H100 calibration predicts for the same rank's layer (its linear modules and its
attention compute, forward and backward, as the simulator prices them); the host must stay
below a quarter of it.

Cases: LLaMA-7B heads (32 query and 32 K/V heads of dim 128), ``dgx-h100`` with 2 nodes of 8
GPUs, 4K, 8K and 16K tokens per GPU, Wikipedia-like
(``wikipedia``) and long-tail (``prolong``) batches, every ring flat, and 2-D: the same batch with
one document of ``--long-share`` of its tokens, which no node can hold, run with the 2-D scheme
(heads split over each node's GPUs). With ``--scale``, instead, ``bench_plan_scale.py``'s
shapes at 512 and 1024 GPUs as the planner plans them by default, each priced with its own
model's datasheet cost model: what a rank of a thousand-GPU run does per layer.

``--device cpu`` (the default) runs the engine on CPU tensors of the rank's real token counts
with ``--heads`` heads of dim ``--head-dim`` (8 and 0: every operator is dispatched, with its
Python, its shape checks and its allocations, over rows that hold no elements but the
log-sum-exp), which is what the host pays per operator on a GPU short of the launch. Each pass
also counts the operators that are not views (each launches at least one kernel on a GPU), and
the table adds ``--launch-us`` per operator for the launches; the times are the thread's CPU time
(``time.thread_time``), so a shared machine's other processes do not inflate them. ``--device
cuda`` times it on a GPU with the model's real heads, on the wall clock: what the calls take to
return, the launches included, the kernels not waited for. (Meta tensors would compute nothing
too, but several operators shape meta tensors through Python references that cost more than the
CUDA path they stand for.)

    python scripts/bench_host_overhead.py [--device cpu|cuda] [--tokens-per-gpu 4096 8192 16384]
    python scripts/bench_host_overhead.py --scale --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.kernels.kernels import register_kernel
from megatron_zeppelin.comm.pending import step_legs
from megatron_zeppelin.comm.protocol import check_payload
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.calibration import apply_calibration, load_calibration
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.schemes import every_two_d
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.presets import get_topology

# The stubs of the engine-overhead benchmark, beside this script (found however it is run).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_overhead import InstantExchanger, NoopKernel, StubClock  # noqa: E402
from bench_plan_scale import SHAPES  # noqa: E402


class CheckingExchanger(InstantExchanger):
    """``InstantExchanger`` that first does what ``DistExchanger.start`` does with the messages
    before posting anything: check the payload and cut every message into its legs over the
    plan's routes (counted as host work: it is the transport's share of every exchange)."""

    def __init__(self, plan, rank: int, device: torch.device) -> None:  # noqa: ANN001
        super().__init__(rank, plan.world_size, device)
        self.routes = plan.route_index

    def start(self, messages, payload, *, row_shape, dtype, tag):  # noqa: ANN001
        check_payload(messages, payload, rank=self.rank, row_shape=row_shape, dtype=dtype, tag=tag)
        legs = step_legs(messages, self.routes)
        self.mine = [leg for _, leg in legs if self.rank in leg.path]
        return super().start(messages, payload, row_shape=row_shape, dtype=dtype, tag=tag)


ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = "configs/calibration/h100-bf16-llama-7b.json"


class OperatorCount(TorchDispatchMode):
    """Counts the engine's operators that are not views (each launches a kernel on a GPU); the
    stubs' own are not the engine's."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not func.is_view and not StubClock.inside:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _batch(dist: str, per_gpu: int, world: int, long_share: float | None, seed: int) -> list[int]:
    total = per_gpu * world
    if long_share is None:
        return sample_lengths(dist, num_tokens=total, seed=seed)
    long = int(total * long_share)
    return [long, *sample_lengths(dist, num_tokens=total - long, seed=seed)]


def _median_host_ms(fn, repeats: int, device: torch.device) -> float:  # noqa: ANN001
    """Median host milliseconds of ``fn`` less the stubs' own time, on ``StubClock.clock``."""
    clock = StubClock.clock
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()  # an empty queue: the timed call never waits for room
        stub = StubClock.seconds
        start = clock()
        fn()
        samples.append((clock() - start - (StubClock.seconds - stub)) * 1e3)
    return statistics.median(samples)


def busiest_rank(plan) -> int:  # noqa: ANN001
    """The rank on the longest ring (a 2-D document's: its nodes), then with the most
    attention tokens; the lowest of equals."""
    topo = plan.topology
    steps = [0] * plan.world_size
    tokens = [0] * plan.world_size
    for seq in plan.sequences:
        size = len({topo.node_of(r) for r in seq.ring}) if seq.is_two_d else seq.ring_size
        for rank in seq.ring:
            steps[rank] = max(steps[rank], size - 1)
        for span in seq.attention:
            tokens[span.rank] += span.end - span.start
    return max(range(plan.world_size), key=lambda r: (steps[r], tokens[r], -r))


def measure_case(plan, cost: CostModel, device: torch.device, heads, repeats: int) -> dict:  # noqa: ANN001
    """Host figures of the busiest rank of ``plan`` with ``heads`` ``(query, K/V, head dim)``,
    and the rank's GPU time per layer predicted by ``cost``."""

    def engine(rank: int) -> ZeppelinAttention:
        exchanger = CheckingExchanger(plan, rank, device)
        return ZeppelinAttention(plan, rank, exchanger, kernel="noop", softmax_scale=0.1)

    rank = busiest_rank(plan)
    build_ms = _median_host_ms(lambda: engine(rank), repeats, device)
    attention = engine(rank)
    model = cost.model
    t, (nq, nkv, d) = attention.num_tokens, heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (
        torch.zeros(t, n, d, device=device, dtype=dtype, requires_grad=True) for n in (nq, nkv, nkv)
    )
    out = attention(q, k, v)  # warm-up: index tensors on the device, the autograd engine
    dout = torch.zeros_like(out)
    out.backward(dout, retain_graph=True)
    fwd_ms = _median_host_ms(lambda: attention(q, k, v), repeats, device)

    def backward() -> None:
        q.grad = k.grad = v.grad = None
        out.backward(dout, retain_graph=True)

    bwd_ms = _median_host_ms(backward, repeats, device)
    with OperatorCount() as ops:
        attention(q, k, v).backward(dout)
    sim = simulate(plan, cost).per_rank[rank]
    gpu_ms = (sim.linear_s + sim.attention_s) / model.num_layers * 1e3
    return {
        "rank": rank,
        "tokens": t,
        "steps": attention.num_steps,
        "build_ms": build_ms,
        "fwd_ms": fwd_ms,
        "bwd_ms": bwd_ms,
        "ops": ops.count,
        "gpu_ms": gpu_ms,
    }


def _user_cases(args: argparse.Namespace) -> Iterator[tuple[str, Plan | None, CostModel]]:
    """The cases of the module docstring on ``dgx-h100`` 2x8, priced with the H100
    calibration of LLaMA-7B."""
    topo = get_topology("dgx-h100", num_nodes=2)
    cost = apply_calibration(
        CostModel.default(get_model("llama-7b"), topo), load_calibration(str(ROOT / CALIBRATION)),
        source=CALIBRATION,
    )  # fmt: skip
    for per_gpu in args.tokens_per_gpu:
        for dist in args.distributions:
            for scheme in args.schemes:
                share = args.long_share if scheme == "2-D" else None
                lengths = _batch(dist, per_gpu, topo.world_size, share, args.seed)
                options = PlannerOptions(two_d=False)
                plan: Plan | None = plan_batch(lengths, topology=topo, cost_model=cost,
                                  capacity=int(per_gpu * 1.25), options=options)  # fmt: skip
                if scheme == "2-D":
                    plan = every_two_d(plan)
                    plan = plan if plan.has_two_d else None
                yield f"{per_gpu} | {dist} | {scheme}", plan, cost


def _scale_cases(args: argparse.Namespace) -> Iterator[tuple[str, Plan, CostModel]]:
    """``bench_plan_scale.py``'s shapes at 512 and 1024 GPUs, seed ``--seed``, planned with the
    default options (the 2-D scheme where the planner picks it), priced with each shape's
    datasheet cost model."""
    for shape in SHAPES:
        lengths = sample_lengths(
            shape.dist,
            num_tokens=shape.tokens,
            seed=args.seed,
            max_length=min(shape.tokens // 2, 1 << 20),
        )
        topology = get_topology(shape.cluster, num_nodes=shape.gpus // 8)
        cost = CostModel.default(get_model(shape.model), topology)
        plan = plan_batch(
            lengths,
            topology=topology,
            cost_model=cost,
            capacity=shape.capacity,
            options=PlannerOptions(),
        )
        per_gpu = round(shape.fill * shape.capacity)
        batch = f"{shape.dist}, {shape.gpus} GPUs, {shape.model}"
        yield f"{per_gpu} | {batch} | planner's", plan, cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (host work alone) or cuda")
    parser.add_argument(
        "--scale", action="store_true", help="bench_plan_scale.py's shapes (512-1024 GPUs)"
    )
    parser.add_argument("--heads", type=int, default=8, help="cpu: query and K/V heads")
    parser.add_argument("--head-dim", type=int, default=0, help="cpu: head dim")
    parser.add_argument("--tokens-per-gpu", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--distributions", nargs="+", default=["wikipedia", "prolong"])
    parser.add_argument("--schemes", nargs="+", default=["flat", "2-D"], choices=["flat", "2-D"])
    parser.add_argument("--long-share", type=float, default=0.7, help="2-D: the long document")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--launch-us", type=float, default=5.0, help="cpu: host cost per launch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    # On the CPU the thread's own CPU time: the host's work, not the time other processes of a
    # shared machine hold its core. On a GPU the wall clock: a host that waits shows.
    StubClock.clock = time.perf_counter if device.type == "cuda" else time.thread_time
    if device.type == "cuda":
        print(f"host work per layer on {device} with the model's heads, wall clock")
    else:
        print(f"host work per layer on cpu with {args.heads} heads of dim {args.head_dim}, "
              f"{args.launch_us:g} us per launch added")  # fmt: skip
    register_kernel("noop", NoopKernel)
    on_gpu = device.type == "cuda"
    launch = 0.0 if on_gpu else args.launch_us / 1e3
    if args.scale:
        print("GPU time of each shape's layer from its model's datasheet cost model")
        cases = _scale_cases(args)
    else:
        print(f"GPU time of LLaMA-7B's layer from {CALIBRATION}; dgx-h100 2x8")
        cases = _user_cases(args)
    print("| tokens/GPU | batch | scheme | rank: tokens, steps | build ms | host fwd / bwd ms "
          "| ops | host ms per layer | GPU ms per layer | host / GPU |")  # fmt: skip
    print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for columns, plan, cost in cases:
        if plan is None:
            print(f"| {columns} | no document spans whole nodes |")
            continue
        model = cost.model
        heads = (
            (model.num_heads, model.num_kv_heads, model.head_dim)
            if on_gpu
            else (args.heads, args.heads, args.head_dim)
        )
        r = measure_case(plan, cost, device, heads, args.repeats)
        host = r["fwd_ms"] + r["bwd_ms"] + r["ops"] * launch
        worst = max(worst, host / r["gpu_ms"])
        print(
            f"| {columns} | {r['rank']}: {r['tokens']}, {r['steps']} "
            f"| {r['build_ms']:.1f} | {r['fwd_ms']:.1f} / {r['bwd_ms']:.1f} | {r['ops']} "
            f"| {host:.1f} | {r['gpu_ms']:.1f} | {host / r['gpu_ms']:.2f} |",
            flush=True,
        )
    print(f"largest host / GPU: {worst:.2f} (must stay below 0.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
