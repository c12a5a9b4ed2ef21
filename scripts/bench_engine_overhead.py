"""CPU-side overhead of the attention engine for a plan of many documents.

The engine's own work (index gathers, merges, payload assembly, Python bookkeeping) must stay
small next to the attention kernels. This script separates the two on one rank of a planned
micro-batch: it times

* building ``ZeppelinAttention`` (the per-micro-batch precompute of the ring layout);
* forward and backward with a no-op kernel and a transport that delivers zeros at once, which
  leaves the engine's bookkeeping (per call and per ring step) plus what the stubs themselves
  cost: on the host, a stub's fresh output buffers (zeros of the whole attention buffer) cost
  milliseconds of page faults, which on a GPU are device work. The time spent inside the stubs
  is clocked and reported apart, so "engine" is the bookkeeping alone;
* the same with the real ``torch`` kernel, to put the bookkeeping next to kernel time.

One forward and backward run untimed first (the autograd engine starts, and the allocator
settles: the first pass's page faults are not a per-layer cost), and the inputs' gradients are
reset before each timed backward (in a model q, k, v are activations, nothing accumulates).

Usage (defaults: 997 Wikipedia-like documents up to 1K tokens plus three of 64K, 32K and 32K,
2 nodes x 4 GPUs, 2 query heads of 16, every ring flat)::

    python scripts/bench_engine_overhead.py --num-docs 1000 --repeats 5
    python scripts/bench_engine_overhead.py --two-d --heads 4   # inter-node documents 2-D
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch, compute_dtype
from megatron_zeppelin.attention.kernels.kernels import register_kernel
from megatron_zeppelin.planner.baselines.distributions import distribution_mean, sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.schemes import every_two_d
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.topology.model import Topology


class StubClock:
    """Seconds spent inside the stub kernel and the stub transport (``inside``: one is running;
    ``clock``: the clock they are read on)."""

    seconds = 0.0
    inside = 0
    clock = time.perf_counter

    def __enter__(self) -> None:
        StubClock.inside += 1
        self._start = StubClock.clock()

    def __exit__(self, *exc: object) -> None:
        StubClock.seconds += StubClock.clock() - self._start
        StubClock.inside -= 1


class NoopKernel:
    """Returns fresh zeros of the right shapes, on the inputs' device (the engine may write into
    a kernel's outputs): what is left of a call is the engine's own work."""

    name = "noop"

    def forward(self, q, k, v, batch: VarlenBatch, *, softmax_scale: float):  # noqa: ANN001
        with StubClock():
            dtype = compute_dtype(q.dtype)
            return q.new_zeros(q.shape, dtype=dtype), q.new_zeros(q.shape[:2], dtype=dtype)

    def backward(self, dout, q, k, v, out, lse, batch, *, softmax_scale):  # noqa: ANN001
        with StubClock():
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class InstantPending:
    def __init__(self, received: list, device: torch.device) -> None:
        self._received, self._device = received, device

    def wait(self) -> dict:
        with StubClock():
            return {
                key: torch.zeros(shape, dtype=dtype, device=self._device)
                for key, (shape, dtype) in self._received
            }


class InstantExchanger:
    """Delivers zeros for every message to this rank at once (no peers, no waiting), on
    ``device``."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu") -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)

    def start(self, messages, payload, *, row_shape, dtype, tag):  # noqa: ANN001
        with StubClock():  # finding this rank's messages is the transport's work, not the engine's
            received = [
                ((m.src, m.dst), ((m.num_tokens, *row_shape), dtype))
                for m in messages
                if m.dst == self.rank
            ]
        return InstantPending(received, self.device)


def _median_ms(fn, repeats: int) -> float:  # noqa: ANN001
    return _median_ms_and_engine_ms(fn, repeats)[0]


def _median_ms_and_engine_ms(fn, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """Median milliseconds of ``fn``, and of ``fn`` less the time spent inside the stubs."""
    times, engine = [], []
    for _ in range(repeats):
        stub_s = StubClock.seconds
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        times.append(elapsed * 1e3)
        engine.append((elapsed - (StubClock.seconds - stub_s)) * 1e3)
    return statistics.median(times), statistics.median(engine)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-docs", type=int, default=1000)
    parser.add_argument("--distribution", default="wikipedia")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument(
        "--long-lengths",
        type=int,
        nargs="*",
        default=[65536, 32768, 32768],
        help="documents added to the sample, long enough to be split",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2, help="query heads (K/V: half)")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--thresholds",
        type=int,
        nargs=2,
        default=(64, 256),
        help="intra-node and inter-node split thresholds, tokens",
    )
    parser.add_argument(
        "--no-kernel-timing", action="store_true", help="skip the run with the real torch kernel"
    )
    parser.add_argument(
        "--two-d",
        action="store_true",
        help="run the plan's inter-node documents with the 2-D "
        "scheme (heads split inside each node; --heads must split over --gpus-per-node)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: bookkeeping is single-threaded anyway, "
        "and more threads than free cores distort every figure)",
    )
    return parser.parse_args()


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)

    topo = Topology(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, nics_per_node=1)
    mean = distribution_mean(args.distribution)
    num_long = len(args.long_lengths)
    lengths = sample_lengths(
        args.distribution, num_tokens=int(args.num_docs * mean), seed=0, max_length=args.max_length
    )[: args.num_docs - num_long]
    # A few long documents that no single GPU should hold, so the plan has real rings.
    lengths += args.long_lengths
    capacity = int(sum(lengths) / topo.world_size * 1.15) + 1
    cost = CostModel.default(get_model("llama-7b"), topo)
    plan = plan_batch(
        lengths,
        topology=topo,
        cost_model=cost,
        capacity=capacity,
        options=PlannerOptions(thresholds=tuple(args.thresholds), two_d=False),
    )
    if args.two_d:
        plan = every_two_d(plan)
    register_kernel("noop", NoopKernel)
    # The rank with the most ring work shows the worst bookkeeping.
    rank = max(
        range(topo.world_size),
        key=lambda r: (
            ZeppelinAttention(
                plan, r, InstantExchanger(r, topo.world_size), kernel="noop"
            ).num_steps
        ),
    )
    exchanger = InstantExchanger(rank, topo.world_size)
    build_ms = _median_ms(
        lambda: ZeppelinAttention(plan, rank, exchanger, kernel="noop"), args.repeats
    )
    t = plan.num_attention_tokens(rank)
    nq, nkv, d = args.heads, max(1, args.heads // 2), args.head_dim
    print(
        f"plan: {len(lengths)} documents, {sum(lengths)} tokens, tiers {plan.tier_counts()}, "
        f"{topo.num_nodes}x{topo.gpus_per_node} GPUs"
    )
    engine = ZeppelinAttention(plan, rank, exchanger, kernel="noop")
    layouts = [engine.layout] + ([engine.heads.ring] if engine.heads is not None else [])
    computes = len(layouts) + sum(tier.num_steps for lay in layouts for tier in lay.tiers)
    calls = sum(
        len(lay.own_calls) + sum(len(step.calls) for tier in lay.tiers for step in tier.steps)
        for lay in layouts
    )
    print(
        f"rank {rank}: {t} tokens, {len(engine.layout.own_spans)} documents, "
        f"{engine.num_steps} ring steps, {computes} computes, {calls} kernel calls per pass"
    )
    print(f"build ZeppelinAttention (per micro-batch): {build_ms:8.2f} ms")
    runs = [("noop", args.repeats)] + ([] if args.no_kernel_timing else [("torch", 1)])
    for kernel, repeats in runs:
        engine = ZeppelinAttention(plan, rank, exchanger, kernel=kernel)
        (fwd_ms, fwd_engine_ms), (bwd_ms, bwd_engine_ms) = _time_passes(
            engine, (t, nq, nkv, d), repeats
        )
        label = "no-op kernel and transport" if kernel == "noop" else "with torch kernel"
        print(
            f"{label:34s} forward {fwd_ms:9.2f} ms  backward {bwd_ms:9.2f} ms  "
            f"forward per compute step {fwd_ms / computes:7.3f} ms"
        )
        if kernel == "noop":
            print(
                f"{'engine bookkeeping (less stubs)':34s} forward {fwd_engine_ms:9.2f} ms  "
                f"backward {bwd_engine_ms:9.2f} ms"
            )


def _time_passes(
    engine: ZeppelinAttention, shape: tuple[int, ...], repeats: int, device: str = "cpu"
):
    """Median forward and backward milliseconds of ``engine`` on random inputs (and of the
    engine's own work, the stubs' time taken out)."""
    t, nq, nkv, d = shape
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    q, k, v = (
        torch.zeros(t, n, d, device=device, dtype=dtype, requires_grad=True) for n in (nq, nkv, nkv)
    )
    out = engine(q, k, v)  # warm-up: per-device index tensors, kernel tile tables
    out.backward(torch.ones_like(out), retain_graph=True)  # warm-up: the autograd engine
    fwd = _median_ms_and_engine_ms(lambda: engine(q, k, v), repeats)
    dout = torch.ones_like(out)

    def backward() -> None:
        # Fresh leaves' gradients: in a model q, k, v are activations, not accumulated leaves.
        q.grad = k.grad = v.grad = None
        out.backward(dout, retain_graph=True)

    bwd = _median_ms_and_engine_ms(backward, repeats)
    return fwd, bwd


if __name__ == "__main__":
    main()
