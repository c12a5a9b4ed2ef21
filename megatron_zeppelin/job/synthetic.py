"""Synthetic variable-length datasets in Megatron's indexed format (``PREFIX.bin`` / ``.idx``).

Document lengths come from the embedded length distributions
(``planner.baselines.distributions.sample_lengths``: Wikipedia, ProLong, WLB-LLM, real-world mixes)
or from an explicit list, so the data path, the planner and the engine see the same long tail as
real corpora without downloading any.

Token ids are either uniformly random (``tokens="random"``: nothing to learn, for throughput
runs) or ``"patterned"``: every document starts at a random token and then counts up with a
stride of its own (1 to 4) modulo the vocabulary. The next token follows from the previous two,
so a tiny model can drive its loss well below ``log(vocab)`` only by attending inside its own
document: a loss that falls is evidence that attention sees the right tokens.

Files are written by megatron-core's own ``IndexedDatasetBuilder`` (one sequence per document),
so ``preprocess_data.py`` datasets and these load through the same code; a checksum sidecar
(``PREFIX.checksum.json``, ``data.write_checksum``) follows them, so a reader can tell when a
file was damaged or swapped for another dataset's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.megatron.documents.data import (
    checksum_path,
    indexed_dataset_module,
    write_checksum,
)
from megatron_zeppelin.planner.baselines.distributions import sample_lengths

TOKEN_PATTERNS = ("patterned", "random")
_MAX_STRIDE = 4


@dataclass(frozen=True)
class SyntheticSummary:
    """What ``write_synthetic_dataset`` wrote."""

    path_prefix: str
    num_documents: int
    num_tokens: int
    max_length: int
    vocab_size: int
    tokens: str
    source: str
    """Where the lengths came from: a distribution name or ``"explicit"``."""


def document_tokens(length: int, *, vocab_size: int, rng: np.random.Generator, tokens: str):
    """Token ids of one synthetic document (``int64``); see the module docstring."""
    if tokens == "random":
        return rng.integers(0, vocab_size, size=length, dtype=np.int64)
    first = int(rng.integers(0, vocab_size))
    stride = int(rng.integers(1, _MAX_STRIDE + 1))
    return (first + stride * np.arange(length, dtype=np.int64)) % vocab_size


def draw_lengths(
    distribution: str, *, num_tokens: int, seed: int, max_length: int | None = None
) -> list[int]:
    """Document lengths from an embedded distribution, summing to about ``num_tokens``."""
    return [
        int(n)
        for n in sample_lengths(
            distribution, num_tokens=num_tokens, seed=seed, max_length=max_length
        )
    ]


def write_synthetic_dataset(
    path_prefix: str,
    *,
    lengths: Sequence[int] | None = None,
    distribution: str | None = None,
    num_tokens: int | None = None,
    max_length: int | None = None,
    vocab_size: int = 512,
    tokens: str = "patterned",
    seed: int = 0,
) -> SyntheticSummary:
    """Write ``PREFIX.bin`` / ``PREFIX.idx`` and return what was written.

    Give either ``lengths`` or ``distribution`` with ``num_tokens`` (and optionally
    ``max_length``, the longest document drawn). Same arguments, same bytes.
    """

    megatron_io = indexed_dataset_module()
    if tokens not in TOKEN_PATTERNS:
        raise ValueError(f"tokens must be one of {TOKEN_PATTERNS}, got {tokens!r}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    if (lengths is None) == (distribution is None):
        raise ValueError("give either explicit lengths or a distribution name, not both")
    if distribution is not None:
        if num_tokens is None or num_tokens < 1:
            raise ValueError("drawing lengths from a distribution needs num_tokens >= 1")
        lengths = draw_lengths(
            distribution, num_tokens=num_tokens, seed=seed, max_length=max_length
        )
        source = distribution
    else:
        lengths = [int(n) for n in lengths]
        source = "explicit"
        if max_length is not None and any(n > max_length for n in lengths):
            raise ValueError(f"a given length exceeds max_length {max_length}")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError("document lengths must be a non-empty list of positive integers")

    path_prefix = os.fspath(path_prefix)
    parent = os.path.dirname(path_prefix)
    if parent:
        os.makedirs(parent, exist_ok=True)
    if os.path.exists(checksum_path(path_prefix)):
        os.remove(checksum_path(path_prefix))  # it describes the files about to be replaced
    dtype = megatron_io.DType.optimal_dtype(vocab_size)
    # Token ids use their own stream so the same lengths give the same tokens whatever drew them.
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x70CE45]))
    builder = megatron_io.IndexedDatasetBuilder(path_prefix + ".bin", dtype=dtype)
    for length in lengths:
        doc = document_tokens(length, vocab_size=vocab_size, rng=rng, tokens=tokens)
        builder.add_document(doc, [length])
    builder.finalize(path_prefix + ".idx")
    write_checksum(path_prefix)
    return SyntheticSummary(
        path_prefix=path_prefix,
        num_documents=len(lengths),
        num_tokens=int(sum(lengths)),
        max_length=int(max(lengths)),
        vocab_size=vocab_size,
        tokens=tokens,
        source=source,
    )
