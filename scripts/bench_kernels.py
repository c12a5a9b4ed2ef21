"""Attention kernels on one GPU: accuracy against float64, and throughput against dense SDPA.

    python scripts/bench_kernels.py [--json FILE] [--tokens 131072] [--kernels te,cudnn,torch]

1. Accuracy: every kernel that runs here (``attention/kernels/kernels.py``), in bfloat16, on the
   block shapes a ring produces (diagonal, suffix, off-diagonal; ``testing/kernel_check.py``), head
   dims 64 and 128, grouped-query K/V: the relative error of output, log-sum-exp and gradients
   against dense float64 attention on the same rounded inputs.
2. Throughput: ``--tokens`` tokens cut into documents of one length (1K to 128K), causal,
   32 query and 8 key/value heads of dim 128 (Llama-3-8B's shape), bfloat16. Each kernel's
   varlen call over all documents against PyTorch's dense ``scaled_dot_product_attention`` on
   the same documents as a batch, forward and forward+backward. TFLOP/s count the causal
   half: forward ``2 * 2 * docs * L * (L + 1) / 2 * d * heads``, backward 2.5 times that.
   Times are medians of CUDA-event-timed repeats after a warm-up.
3. Ring blocks: the same tokens as the blocks a zigzag ring computes beside whole documents, per
   document of length ``L``: a *suffix* block (the last ``L/2`` queries against all ``L`` keys,
   causal aligned bottom-right: where ``cudnn`` runs its cut) and an *unmasked* block (``L/2``
   queries against ``L/2`` earlier keys), forward+backward TFLOP/s over the visible pairs. No
   dense SDPA call computes these shapes, so there is no reference column.

Needs CUDA; prints three tables and, with ``--json``, writes every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.kernels.kernels import CUDA_KERNELS, choose_kernel, get_kernel
from megatron_zeppelin.planner.cost.costmodel import causal_pairs
from megatron_zeppelin.testing.kernel_check import BLOCKS, kernel_errors

KERNELS = (*CUDA_KERNELS, "torch")
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def runnable(names: list[str]) -> list[str]:
    """The kernels of ``names`` that run on this GPU in bfloat16 (each skipped one is said)."""
    keep = []
    for name in names:
        try:
            choose_kernel(name, device="cuda", dtype=torch.bfloat16)
            keep.append(name)
        except ValueError as exc:
            print(f"skipped {name}: {exc}", file=sys.stderr)
    return keep


def accuracy(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        for block, case in BLOCKS.items():
            for d in (64, 128):
                errors = kernel_errors(
                    get_kernel(name),
                    case.with_head_dim(d),
                    device="cuda",
                    dtype=torch.bfloat16,
                    seed=d,
                )
                rows.append({"kernel": name, "block": block, "head_dim": d, **errors})
    return rows


def median_ms(fn, repeats: int) -> float:  # noqa: ANN001
    """Median CUDA-event time of ``fn`` after one warm-up call (fewer repeats for slow ones)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if sum(times) > 3000:
            break
    return statistics.median(times)


def throughput_row(kernel: str, length: int, tokens: int, repeats: int) -> dict:
    docs = tokens // length
    gen = torch.Generator(device="cuda").manual_seed(length)

    def draw(heads: int) -> torch.Tensor:
        x = torch.randn(docs * length, heads, HEAD_DIM, generator=gen, device="cuda")
        return x.to(torch.bfloat16)

    q, k, v, dout = draw(HEADS), draw(KV_HEADS), draw(KV_HEADS), draw(HEADS)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    if kernel == "sdpa":
        qb, kb, vb, db = (
            x.view(docs, length, -1, HEAD_DIM).transpose(1, 2) for x in (q, k, v, dout)
        )
        leaves = [x.detach().requires_grad_() for x in (qb, kb, vb)]

        def fwd() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                *leaves, is_causal=True, scale=scale, enable_gqa=True
            )

        def fwd_bwd() -> None:
            torch.autograd.grad(fwd(), leaves, db)
    else:
        impl, batch = get_kernel(kernel), VarlenBatch([length] * docs, [length] * docs, causal=True)
        out, lse = impl.forward(q, k, v, batch, softmax_scale=scale)

        def fwd() -> torch.Tensor:
            return impl.forward(q, k, v, batch, softmax_scale=scale)[0]

        def fwd_bwd() -> None:
            o, s = impl.forward(q, k, v, batch, softmax_scale=scale)
            impl.backward(dout, q, k, v, o, s, batch, softmax_scale=scale)

    flops = 4.0 * docs * length * (length + 1) / 2 * HEAD_DIM * HEADS
    fwd_ms, total_ms = median_ms(fwd, repeats), median_ms(fwd_bwd, repeats)
    return {
        "kernel": kernel,
        "length": length,
        "documents": docs,
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": total_ms,
        "fwd_tflops": flops / fwd_ms / 1e9,
        "fwd_bwd_tflops": 3.5 * flops / total_ms / 1e9,
    }


def ring_block_row(kernel: str, length: int, tokens: int, repeats: int, block: str) -> dict:
    """Forward+backward of one varlen call over ``tokens // length`` ring blocks (docstring)."""
    docs, half = tokens // length, length // 2
    keys, causal = (length, True) if block == "suffix" else (half, False)
    gen = torch.Generator(device="cuda").manual_seed(length + 7)

    def draw(rows: int, heads: int) -> torch.Tensor:
        x = torch.randn(rows, heads, HEAD_DIM, generator=gen, device="cuda")
        return x.to(torch.bfloat16)

    q, dout = draw(docs * half, HEADS), draw(docs * half, HEADS)
    k, v = draw(docs * keys, KV_HEADS), draw(docs * keys, KV_HEADS)
    impl, batch = get_kernel(kernel), VarlenBatch([half] * docs, [keys] * docs, causal=causal)
    scale = 1.0 / math.sqrt(HEAD_DIM)

    def fwd_bwd() -> None:
        o, s = impl.forward(q, k, v, batch, softmax_scale=scale)
        impl.backward(dout, q, k, v, o, s, batch, softmax_scale=scale)

    pairs = causal_pairs(length - half, length, 0, length) if causal else half * half
    flops = 3.5 * 4.0 * docs * pairs * HEAD_DIM * HEADS
    total_ms = median_ms(fwd_bwd, repeats)
    return {"kernel": kernel, "length": length, "block": block, "fwd_bwd_ms": total_ms,
            "fwd_bwd_tflops": flops / total_ms / 1e9}  # fmt: skip


def print_ring_blocks(names: list[str], lengths: list[int], args: argparse.Namespace) -> list:
    print(f"\nring blocks ({args.tokens} tokens as L/2-query blocks, forward+backward)")
    print(f"{'length':>7} {'kernel':12} {'suffix TF/s':>12} {'unmasked TF/s':>14}")
    rows = []
    for length in lengths:
        for kernel in names:
            if kernel == "torch" and length > args.tiled_max_length:
                continue
            pair = [ring_block_row(kernel, length, args.tokens, args.repeats, block)
                    for block in ("suffix", "unmasked")]  # fmt: skip
            rows += pair
            print(f"{length:>7} {kernel:12} {pair[0]['fwd_bwd_tflops']:12.1f} "
                  f"{pair[1]['fwd_bwd_tflops']:14.1f}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=131072, help="tokens per call")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="kernels to measure")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls (median)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument(
        "--tiled-max-length",
        type=int,
        default=16384,
        help="longest document the tiled kernel is timed on",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU and none is visible", file=sys.stderr)
        return 2
    names = runnable(args.kernels.split(","))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kernels {names}")
    acc = accuracy(names)
    print("\naccuracy (bfloat16 against float64, relative error)")
    print(
        f"{'kernel':12} {'block':13} {'d':>4} "
        + " ".join(f"{k:>8}" for k in ("out", "lse", "dq", "dk", "dv"))
    )
    for r in acc:
        print(
            f"{r['kernel']:12} {r['block']:13} {r['head_dim']:>4} "
            + " ".join(f"{r[k]:8.1e}" for k in ("out", "lse", "dq", "dk", "dv"))
        )
    lengths = [1 << p for p in range(10, 18) if (1 << p) <= args.tokens]
    rows = []
    print(f"\nthroughput ({args.tokens} tokens, causal, {HEADS}/{KV_HEADS} heads, d {HEAD_DIM})")
    print(
        f"{'length':>7} {'kernel':12} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9}"
    )
    for length in lengths:
        for kernel in ["sdpa", *names]:
            if kernel == "torch" and length > args.tiled_max_length:
                continue
            r = throughput_row(kernel, length, args.tokens, args.repeats)
            rows.append(r)
            print(
                f"{length:>7} {kernel:12} {r['fwd_ms']:8.2f} {r['fwd_tflops']:9.1f} "
                f"{r['fwd_bwd_ms']:8.2f} {r['fwd_bwd_tflops']:9.1f}",
                flush=True,
            )
    blocks = print_ring_blocks(names, lengths, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "accuracy": acc,
                    "throughput": rows,
                    "ring_blocks": blocks,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
