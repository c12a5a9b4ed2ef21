"""Document-length distributions: the embedded histograms, sampling, and lengths files.

The histograms (``data/length_distributions.json``) give bin edges in tokens (length ``L`` falls
in bin ``i`` when ``edges[i] <= L < edges[i+1]``) and a document count per bin. A length is drawn
by picking a bin by count, then a length uniformly in log space inside the bin, floored to an
integer. ``magi_realworld`` uses the same two fields but its first edge is 0 (its first bin is
"0 to 10 tokens"); lengths are at least 1, so that bin is drawn from ``[1, 11)``.

Besides the embedded histograms, ``STRESS_DISTRIBUTIONS`` are parametric shapes the planner was
not tuned on (``_STRESS``): a lognormal (median 9K tokens, sigma 0.9), a bimodal SFT-like mix,
a power law, uniformly long documents, a tail of 256K-1M documents among web-like ones, and a
mixture of all of these. They are sampled by the same ``sample_lengths``.

``sample_lengths`` draws documents until their total reaches ``num_tokens`` and trims the last
one so the total is exact: a micro-batch of a fixed token budget filled with whole documents.
``max_length`` cuts documents longer than it into pieces of ``max_length`` (and a remainder), as a
data pipeline with a context window does, so the tokens' share of long documents is kept.
"""

from __future__ import annotations

import json
from functools import cache, lru_cache
from importlib import resources

import numpy as np

_DATA_FILE = "data/length_distributions.json"
MAX_DOCUMENT_LENGTH = 2**31 - 1
"""Longest document accepted from a file: Megatron's index stores lengths as int32."""
MAX_BATCH_TOKENS = 2**31 - 1
"""Most tokens one drawn batch may hold (far beyond any cluster's micro-batch)."""


@lru_cache(maxsize=1)
def _histograms() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per distribution: bin lower bounds, upper bounds (exclusive) and probabilities."""
    text = resources.files("megatron_zeppelin").joinpath(_DATA_FILE).read_text()
    data = json.loads(text)
    out = {}
    for name, hist in data["distributions"].items():
        edges = np.asarray(hist["bin_edges"], dtype=np.float64)
        counts = np.asarray(hist["counts"], dtype=np.float64)
        assert len(edges) == len(counts) + 1, name
        lo, hi = np.maximum(edges[:-1], 1.0), edges[1:]
        keep = (counts > 0) & (hi > lo)
        out[name] = (lo[keep], hi[keep], counts[keep] / counts[keep].sum())
    return out


DISTRIBUTIONS: tuple[str, ...] = tuple(_histograms())
"""Names of the embedded histograms."""


def _lognormal(median: float, sigma: float, lo: int, hi: int):
    def draw(rng: np.random.Generator, count: int) -> np.ndarray:
        return np.clip(rng.lognormal(np.log(median), sigma, count), lo, hi)

    return draw


def _uniform(lo: int, hi: int):
    def draw(rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(lo, hi + 1, count)

    return draw


def _power_law(alpha: float, lo: int, hi: int):
    """Pareto ``P(L > x) ~ x^-alpha`` on ``[lo, hi]`` (inverse transform)."""

    def draw(rng: np.random.Generator, count: int) -> np.ndarray:
        u = rng.random(count)
        a, b = lo**-alpha, hi**-alpha
        return (a - u * (a - b)) ** (-1.0 / alpha)

    return draw


def _mix(*parts: tuple[float, object]):
    """Documents drawn from ``parts`` with the given probabilities (per document)."""

    def draw(rng: np.random.Generator, count: int) -> np.ndarray:
        weights = np.asarray([w for w, _ in parts], dtype=np.float64)
        which = rng.choice(len(parts), size=count, p=weights / weights.sum())
        out = np.empty(count)
        for i, (_, part) in enumerate(parts):
            chosen = which == i
            out[chosen] = part(rng, int(chosen.sum()))  # type: ignore[operator]
        return out

    return draw


_STRESS = {
    "lognormal": _lognormal(9_000, 0.9, 1, 131_072),
    "sft-bimodal": _mix((0.85, _lognormal(350, 0.7, 16, 4_096)),
                        (0.15, _lognormal(6_000, 0.5, 1_024, 32_768))),
    "power-law": _power_law(0.8, 128, 262_144),
    "uniform-long": _uniform(32_768, 131_072),
    "long-tail": _mix((0.995, _lognormal(1_500, 1.2, 16, 65_536)),
                      (0.005, _uniform(262_144, 1_048_576))),
    "mixture": _mix((0.45, _lognormal(350, 0.7, 16, 4_096)),
                    (0.35, _lognormal(9_000, 0.9, 1, 131_072)),
                    (0.197, _power_law(0.8, 128, 262_144)),
                    (0.003, _uniform(262_144, 1_048_576))),
}  # fmt: skip
STRESS_DISTRIBUTIONS: tuple[str, ...] = tuple(_STRESS)
"""Names of the parametric stress shapes (module docstring)."""


@cache
def distribution_mean(name: str) -> float:
    """Mean document length of a distribution (tokens): exact for the histograms under the
    in-bin log-uniform rule, over a fixed sample of 200,000 documents for the stress shapes."""
    if name in _STRESS:
        return float(_draw_stress(name, np.random.default_rng(12345), 200_000).mean())
    lo, hi, prob = _get(name)
    # Mean of exp(U) for U uniform on [log lo, log hi): (hi - lo) / log(hi / lo).
    means = np.where(hi > lo, (hi - lo) / np.log(hi / lo), lo)
    return float((prob * means).sum())


def _draw_stress(name: str, rng: np.random.Generator, count: int) -> np.ndarray:
    return np.maximum(1, np.floor(_STRESS[name](rng, count))).astype(np.int64)


def _get(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hists = _histograms()
    if name not in hists:
        known = ", ".join([*hists, *_STRESS])
        raise ValueError(f"unknown length distribution {name!r}; known: {known}")
    return hists[name]


def _draw(rng: np.random.Generator, lo, hi, prob, count: int) -> np.ndarray:
    bins = rng.choice(len(prob), size=count, p=prob)
    u = rng.random(count)
    log_lo, log_hi = np.log(lo[bins]), np.log(hi[bins])
    lengths = np.floor(np.exp(log_lo + u * (log_hi - log_lo)))
    # Keep inside [lo, hi): floating-point rounding may land exactly on the upper edge.
    return np.clip(lengths, lo[bins], hi[bins] - 1).astype(np.int64)


def sample_lengths(
    name: str, *, num_tokens: int, seed: int, max_length: int | None = None
) -> list[int]:
    """Document lengths from distribution ``name`` summing to exactly ``num_tokens``."""
    if name not in _STRESS:
        lo, hi, prob = _get(name)
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    if num_tokens > MAX_BATCH_TOKENS:
        raise ValueError(
            f"a batch of {num_tokens} tokens is beyond any cluster's micro-batch: draw at most "
            f"{MAX_BATCH_TOKENS} tokens"
        )
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    rng = np.random.default_rng(seed)
    mean = distribution_mean(name)
    chunks, total = [], 0
    while total < num_tokens:
        # Draw a batch expected to cover what is missing; more batches only if unlucky.
        count = int((num_tokens - total) / mean * 1.2) + 16
        if name in _STRESS:
            batch = _draw_stress(name, rng, count)
        else:
            batch = _draw(rng, lo, hi, prob, count)
        if max_length is not None:
            batch = _cut(batch, max_length)
        chunks.append(batch)
        total += int(batch.sum())
    lengths = np.concatenate(chunks)
    ends = np.cumsum(lengths)
    last = int(np.searchsorted(ends, num_tokens))  # first document reaching the budget
    lengths = lengths[: last + 1].copy()
    lengths[last] -= int(ends[last]) - num_tokens
    assert lengths[last] >= 1 and int(lengths.sum()) == num_tokens
    return [int(x) for x in lengths]


def _cut(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Cut every length over ``max_length`` into full pieces and a remainder, in place order."""
    if int(lengths.max(initial=0)) <= max_length:
        return lengths
    pieces = []
    for length in lengths.tolist():
        while length > max_length:
            pieces.append(max_length)
            length -= max_length
        pieces.append(length)
    return np.asarray(pieces, dtype=np.int64)


def read_lengths_file(path: str) -> list[int]:
    """Document lengths from a text file: one positive integer per line; ``#`` starts a comment;
    blank lines are skipped."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise ValueError(f"cannot read lengths file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ValueError(
            f"lengths file {path} is not a text file: give one document length per line"
        ) from None
    lengths = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"{path}, line {number}: {text!r} is not an integer; give one document "
                "length per line"
            ) from None
        if value < 1:
            raise ValueError(f"{path}, line {number}: length {value} must be at least 1 token")
        if value > MAX_DOCUMENT_LENGTH:
            raise ValueError(
                f"{path}, line {number}: length {value} is longer than any document Megatron "
                f"can index (at most {MAX_DOCUMENT_LENGTH} tokens)"
            )
        lengths.append(value)
    if not lengths:
        raise ValueError(f"lengths file {path} lists no document lengths")
    return lengths
