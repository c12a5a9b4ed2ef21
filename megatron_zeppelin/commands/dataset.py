"""``zeppelin make-dataset``: write a synthetic Megatron dataset, or describe an existing one.

Examples::

    zeppelin make-dataset --output data/wiki --dist wikipedia --tokens 2000000 --seed 0
    zeppelin make-dataset --output data/tiny --lengths lengths.txt --tokens-pattern random
    zeppelin make-dataset --inspect data/wiki

The lengths file holds integers separated by white space or commas, or a JSON list. A written
dataset gets a checksum sidecar (``PREFIX.checksum.json``) that training and ``--inspect`` check.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from megatron_zeppelin.job.synthetic import write_synthetic_dataset
from megatron_zeppelin.megatron.documents.data import DocumentDataset
from megatron_zeppelin.planner.baselines.distributions import MAX_DOCUMENT_LENGTH

DEFAULT_TOKENS = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write a synthetic variable-length dataset (PREFIX.bin/.idx) or inspect one."
    )
    parser.add_argument("--output", metavar="PREFIX", help="path prefix of the files to write")
    parser.add_argument(
        "--inspect",
        metavar="PREFIX",
        help="describe an existing dataset (documents, tokens, length percentiles) and exit",
    )
    parser.add_argument(
        "--dist",
        default="wikipedia",
        help="embedded length distribution to draw from (wikipedia, prolong, wlbllm, "
        "magi_realworld)",
    )
    parser.add_argument("--lengths", metavar="FILE", help="explicit document lengths instead")
    parser.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, help="about this many tokens in total"
    )
    parser.add_argument("--max-length", type=int, default=None, help="longest document drawn")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument(
        "--tokens-pattern",
        choices=("patterned", "random"),
        default="patterned",
        help="patterned: learnable counting sequences; random: uniform token ids",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the description as JSON")


def _read_lengths(path: str) -> list[int]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the lengths file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ValueError(
            f"{path} is not a text file: give document lengths as text (white space, commas or "
            "a JSON list)"
        ) from None
    try:
        values = (
            json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        )
        lengths = [int(v) for v in values]
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{path} must hold integer document lengths (white space, commas or a JSON list)"
        ) from exc
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{path} must list at least one length, all positive")
    if max(lengths) > MAX_DOCUMENT_LENGTH:
        raise ValueError(
            f"{path} lists a document of {max(lengths)} tokens; Megatron's index stores lengths "
            f"as 32-bit integers, so at most {MAX_DOCUMENT_LENGTH}"
        )
    return lengths


def describe(lengths: np.ndarray) -> dict:
    """Counts, percentiles and where the attention work sits (it grows with ``L^2``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        return {"documents": 0, "tokens": 0}
    squares = lengths.astype(np.float64) ** 2
    long_docs = lengths > 32768
    return {
        "documents": int(lengths.size),
        "tokens": int(lengths.sum()),
        "min": int(lengths.min()),
        "p50": int(np.percentile(lengths, 50)),
        "p90": int(np.percentile(lengths, 90)),
        "p99": int(np.percentile(lengths, 99)),
        "max": int(lengths.max()),
        "share_under_1k": float((lengths < 1024).mean()),
        "attention_share_over_32k": float(squares[long_docs].sum() / squares.sum()),
    }


def _print(title: str, info: dict) -> None:
    print(title)
    for key, value in info.items():
        shown = f"{value:.1%}" if isinstance(value, float) else f"{value:,}"
        print(f"  {key:<26} {shown}")


def run(args: argparse.Namespace) -> int:

    if args.inspect:
        dataset = DocumentDataset(args.inspect)
        info = describe(dataset.lengths)
        _print(f"dataset {dataset.path_prefix} (tokens stored as {dataset.dtype})", info)
    else:
        if not args.output:
            raise ValueError("give --output PREFIX to write a dataset, or --inspect PREFIX")
        if args.lengths:
            summary = write_synthetic_dataset(
                args.output,
                lengths=_read_lengths(args.lengths),
                max_length=args.max_length,
                vocab_size=args.vocab_size,
                tokens=args.tokens_pattern,
                seed=args.seed,
            )
        else:
            summary = write_synthetic_dataset(
                args.output,
                distribution=args.dist,
                num_tokens=args.tokens,
                max_length=args.max_length,
                vocab_size=args.vocab_size,
                tokens=args.tokens_pattern,
                seed=args.seed,
            )
        # Read back through the same loader training uses: a file that cannot be read fails here.
        info = describe(DocumentDataset(summary.path_prefix).lengths)
        _print(
            f"wrote {summary.path_prefix}.bin/.idx ({summary.source} lengths, "
            f"{summary.tokens} tokens, vocabulary {summary.vocab_size})",
            info,
        )
        info = {"lengths_from": summary.source, "vocab_size": summary.vocab_size, **info}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0
