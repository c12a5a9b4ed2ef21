"""Resuming the document sampler: restoring its saved state against replaying it step by step.

    python scripts/bench_resume.py [--tokens 50000000] [--tokens-per-step 4194304] [--steps 200]

A Megatron run saves the sampler's state next to its checkpoint (``megatron/documents/resume.py``);
a resume without it replays every step since the start. Prints the replay time per step (the
sampler's own work, no training) and the time to restore the state, after checking that both
give the same next batch.
"""

from __future__ import annotations

import argparse
import time

from megatron_zeppelin.megatron.documents.sampler import DocumentSampler
from megatron_zeppelin.planner.baselines.distributions import sample_lengths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dist", default="wikipedia", help="document length distribution")
    parser.add_argument("--tokens", type=int, default=50_000_000, help="corpus size")
    parser.add_argument("--tokens-per-step", type=int, default=4_194_304)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200, help="steps replayed and timed")
    args = parser.parse_args(argv)
    lengths = sample_lengths(args.dist, num_tokens=args.tokens, seed=0)

    def sampler() -> DocumentSampler:
        return DocumentSampler(
            lengths,
            tokens_per_step=args.tokens_per_step,
            num_micro_batches=args.micro_batches,
            seed=1,
        )

    replayed = sampler()
    start = time.perf_counter()
    for _ in range(args.steps):
        replayed.next_step()
    replay_s = (time.perf_counter() - start) / args.steps
    restored = sampler()
    start = time.perf_counter()
    restored.load_state_dict(replayed.state_dict())
    restore_s = time.perf_counter() - start
    assert restored.next_step() == replayed.next_step(), "restored state gives another batch"
    print(
        f"{len(lengths):,} documents, {args.tokens_per_step:,} tokens per step: replay "
        f"{replay_s * 1e3:.1f} ms per step, restore {restore_s * 1e3:.3f} ms; 50,000 steps "
        f"replayed: {replay_s * 50_000 / 60:.0f} min"
    )


if __name__ == "__main__":
    main()
