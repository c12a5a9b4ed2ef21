"""Megatron's data flags as Zeppelin's document sets: ``--split`` by documents, and blends.

Megatron-LM names its data one of two ways (``megatron/training/utils``,
``get_blend_and_blend_per_split``, and ``megatron/core/datasets``):

* ``--data-path`` (or the same list in the file ``--data-args-path`` names): one blend, cut
  into train, validation and test by ``--split`` (Megatron's default ``969, 30, 1`` where
  ``--split`` is not given);
* ``--train-data-path``, ``--valid-data-path``, ``--test-data-path`` (or the JSON file
  ``--per-split-data-args-path`` names, with ``train``, ``valid`` and ``test`` keys): one blend
  per split, each split every document of its datasets.

A blend is ``PREFIX`` ..., or ``WEIGHT PREFIX`` pairs. With weights, every split draws tokens
from its datasets in proportion to them; without, in proportion to the datasets' own tokens in
that split (Megatron weighs them by their sample counts, i.e. tokens). ``stream.py`` says how.

**The split rule** is Megatron's, so the documents a run holds out are the ones Megatron's own
split holds out: the proportions are normalized into bounds ``[lo, hi)`` of ``[0, 1]``
(``blended_megatron_dataset_config.py``), and split ``i`` of a dataset of ``n`` sequences takes
sequences ``int(round(lo * n))`` to ``int(round(hi * n))`` (``blended_megatron_dataset_builder
.py``; GPT datasets count sequences, ``gpt_dataset.py``), separately in every dataset of the
blend. A document belongs to the split that holds its first sequence: with one sequence per
document (``preprocess_data.py`` without ``--split-sentences``, and ``zeppelin make-dataset``)
that is exactly Megatron's split.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_zeppelin.megatron.documents.data import DocumentDataset, index_header, strip_suffix

SPLITS = ("train", "valid", "test")
SPLIT_NAMES = {"train": "training", "valid": "validation", "test": "test"}
DEFAULT_SPLIT = "969, 30, 1"
"""What Megatron's ``validate_args`` sets ``--split`` to when ``--data-path`` comes without it."""


# --- the split rule ------------------------------------------------------------------------
def split_fractions(split: str) -> list[float]:
    """``--split``'s proportions, normalized: the numbers in the string (Megatron reads
    ``[.0-9]+``), padded with zeros to three."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    if len(values) > len(SPLITS) or not any(values):
        raise ValueError(
            f"--split {split!r}: give up to three proportions for training, validation and "
            "test, not all zero (e.g. --split 98,1,1)"
        )
    vector = np.array(values + [0.0] * (len(SPLITS) - len(values)), dtype=np.float64)
    return (vector / np.sum(vector)).tolist()


def split_bounds(split: str) -> list[tuple[float, float] | None]:
    """Each split's ``[lo, hi)`` within ``[0, 1]``, ``None`` for a split of proportion 0."""
    edges = list(itertools.accumulate([0.0, *split_fractions(split)]))
    return [(lo, hi) if hi > lo else None for lo, hi in zip(edges, edges[1:])]


def sequence_range(bounds: tuple[float, float], num_sequences: int) -> tuple[int, int]:
    """The sequences ``[begin, end)`` a split of ``bounds`` takes from a dataset."""
    lo, hi = bounds
    return int(round(lo * float(num_sequences))), int(round(hi * float(num_sequences)))


def split_documents(
    first_sequences: np.ndarray, num_sequences: int, bounds: tuple[float, float] | None
) -> np.ndarray:
    """Ids of the documents whose first sequence lies in the split's sequence range."""
    if bounds is None:
        return np.zeros(0, dtype=np.int64)
    begin, end = sequence_range(bounds, num_sequences)
    first = np.asarray(first_sequences, dtype=np.int64)
    return np.flatnonzero((first >= begin) & (first < end)).astype(np.int64)


# --- what the flags name -------------------------------------------------------------------
@dataclass(frozen=True)
class Blend:
    """The datasets of one split: prefixes and their weights (``None``: by their tokens)."""

    flag: str
    """The flag that named them, for messages."""
    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None
    bounds: tuple[float, float]
    """The split's share of every dataset (``(0, 1)`` for a per-split flag)."""
    split: str | None = None
    """The ``--split`` it was cut with; ``None`` for a per-split flag."""


def parse_blend(
    values: Sequence[str], flag: str
) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """Megatron's reading of a blend list: ``WEIGHT PREFIX`` pairs when the count is even and
    every other item is a number, else prefixes only. Raises ``ValueError`` naming ``flag``."""
    values = [str(v).strip() for v in values]
    if not values:
        raise ValueError(f"{flag} names no dataset: give PREFIX ... or WEIGHT PREFIX pairs")
    weights = [_number(v) for v in values[::2]] if len(values) % 2 == 0 else [None]
    if all(w is None for w in weights):
        return tuple(strip_suffix(v) for v in values), None
    if any(w is None for w in weights):
        raise ValueError(
            f"{flag} {' '.join(values)}: mixes weights and prefixes; give WEIGHT PREFIX pairs "
            "for every dataset, or prefixes only"
        )
    if any(not np.isfinite(w) or w < 0 for w in weights) or not sum(weights):
        raise ValueError(
            f"{flag}: weights {' '.join(values[::2])} must be non-negative numbers, not all zero"
        )
    return tuple(strip_suffix(v) for v in values[1::2]), tuple(weights)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def data_blends(args: Any) -> tuple[Blend | None, ...]:
    """Per split (train, valid, test), the blend Megatron's flags in ``args`` name, or ``None``
    where a split has none. Raises ``ValueError`` with the flag to change."""
    if getattr(args, "mock_data", False):
        raise ValueError("--zeppelin trains on the documents of a dataset: drop --mock-data")
    data_path = getattr(args, "data_path", None)
    args_path = getattr(args, "data_args_path", None)
    per_split = {s: getattr(args, f"{s}_data_path", None) for s in SPLITS}
    per_split_path = getattr(args, "per_split_data_args_path", None)
    if data_path and args_path:
        raise ValueError("give --data-path or --data-args-path, not both")
    if (data_path or args_path) and (any(per_split.values()) or per_split_path):
        raise ValueError(
            "give --data-path (split by --split) or --train/valid/test-data-path, not both"
        )
    if data_path or args_path:
        flag = "--data-path" if data_path else f"--data-args-path {args_path}"
        values = data_path or _read_text(args_path, "--data-args-path").split()
        prefixes, weights = parse_blend(values, flag)
        split = getattr(args, "split", None) or DEFAULT_SPLIT
        return tuple(
            Blend(flag, prefixes, weights, b, split) if b is not None else None
            for b in split_bounds(split)
        )
    if per_split_path:
        per_split = _per_split_file(per_split_path)
    elif not any(per_split.values()):
        raise ValueError(
            "--zeppelin reads the documents of a Megatron dataset: give --data-path PREFIX "
            "(or --train-data-path and --valid-data-path)"
        )
    if getattr(args, "split", None):
        raise ValueError(
            "--split cuts --data-path into splits; with --train/valid/test-data-path drop it"
        )
    blends = []
    for split in SPLITS:
        flag = f"--{split}-data-path"
        if per_split_path:
            flag = f"--per-split-data-args-path {per_split_path} ({split})"
        values = per_split[split]
        blends.append(Blend(flag, *parse_blend(values, flag), (0.0, 1.0)) if values else None)
    return tuple(blends)


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path} ({exc.strerror})") from None


def _per_split_file(path: str) -> dict[str, list[str] | None]:
    """``--per-split-data-args-path``: a JSON object whose ``train``, ``valid`` and ``test``
    each hold a blend (a list, or one string of whitespace-separated items); a missing key or
    ``null`` is a split without data."""
    flag = "--per-split-data-args-path"
    try:
        content = json.loads(_read_text(path, flag))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: {path} is not JSON ({exc})") from None
    if not isinstance(content, dict) or not set(content) <= set(SPLITS):
        raise ValueError(f"{flag}: {path} must hold an object with keys train, valid and test")
    return {s: _items(content.get(s)) for s in SPLITS}


def _items(value: Any) -> list[str] | None:
    return value.split() if isinstance(value, str) else value


def check_data_flags(args: Any, *, splits: Sequence[str] = SPLITS) -> None:
    """Start-up checks of the datasets the flags name, from each ``.idx`` header alone: every
    file there, one token dtype (one vocabulary) across the blend, and no empty split among
    ``splits`` (a weighted dataset included). Raises ``ValueError`` naming the flag and path."""
    blends = data_blends(args)
    dtypes: dict[str, Any] = {}
    for name, blend in zip(SPLITS, blends):
        if blend is None:
            continue
        counts = []
        for prefix in blend.prefixes:
            try:
                header = index_header(prefix)
            except ValueError as exc:
                raise ValueError(f"{blend.flag}: {_with_hint(str(exc), prefix)}") from None
            dtypes.setdefault(prefix, header.dtype)
            begin, end = sequence_range(blend.bounds, header.num_sequences)
            counts.append(end - begin)
        weights = blend.weights or (1.0,) * len(counts)
        empty = [p for p, n, w in zip(blend.prefixes, counts, weights) if n == 0 and w > 0]
        if name in splits and (empty if blend.weights else not sum(counts)):
            fix = f" (--split {blend.split}): change --split or" if blend.split else ":"
            raise ValueError(
                f"{blend.flag}: the {SPLIT_NAMES[name]} split holds no document of "
                f"{', '.join(empty)}{fix} give a larger dataset"
            )
    if len(set(dtypes.values())) > 1:
        found = ", ".join(f"{p} ({d})" for p, d in dtypes.items())
        raise ValueError(
            f"the datasets store tokens as different dtypes, so they come from different "
            f"vocabularies: {found}; tokenize every dataset with the model's tokenizer"
        )


def _with_hint(message: str, prefix: str) -> str:
    if _number(prefix) is not None:
        return f"{message}; {prefix} looks like a weight: give WEIGHT PREFIX pairs"
    return message


# --- the documents of one split --------------------------------------------------------------
class DocumentSet:
    """The documents of one split of a blend, numbered back to back over its datasets: what a
    sampler draws from (``lengths``, ``source_sizes``, ``weights``) and what the batch builder
    reads (``read(doc, start, end)``, ``doc`` in that numbering)."""

    def __init__(
        self,
        datasets: Sequence[DocumentDataset],
        documents: Sequence[np.ndarray],
        weights: Sequence[float] | None,
    ) -> None:
        self.datasets = list(datasets)
        self.documents = [np.asarray(d, dtype=np.int64) for d in documents]
        self.weights = None if weights is None else tuple(weights)
        self.source_sizes = [int(d.shape[0]) for d in self.documents]
        self.offsets = np.concatenate(([0], np.cumsum(self.source_sizes))).astype(np.int64)
        self.lengths = np.concatenate(
            [ds.lengths[d] for ds, d in zip(self.datasets, self.documents)]
        ).astype(np.int64)

    def locate(self, doc: int) -> tuple[DocumentDataset, int]:
        """The dataset holding document ``doc`` and its id there."""
        if not 0 <= doc < self.lengths.shape[0]:
            raise ValueError(f"document {doc} is outside 0..{self.lengths.shape[0] - 1}")
        source = int(np.searchsorted(self.offsets, doc, side="right")) - 1
        return self.datasets[source], int(self.documents[source][doc - self.offsets[source]])

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        dataset, local = self.locate(doc)
        return dataset.read(local, start, end)

    @property
    def num_tokens_read(self) -> int:
        return sum(ds.num_tokens_read for ds in self.datasets)

    def __repr__(self) -> str:
        names = ", ".join(ds.path_prefix for ds in self.datasets)
        return f"DocumentSet({names}; documents={self.source_sizes}, weights={self.weights})"


def open_document_sets(blends: Sequence[Blend | None]) -> tuple[DocumentSet | None, ...]:
    """Each split's ``DocumentSet`` (``None`` where it has no blend); every dataset is opened
    once, however many splits share it."""
    opened: dict[str, DocumentDataset] = {}
    sets = []
    for blend in blends:
        if blend is None:
            sets.append(None)
            continue
        for prefix in blend.prefixes:
            if prefix not in opened:
                opened[prefix] = DocumentDataset(prefix)
        datasets = [opened[p] for p in blend.prefixes]
        documents = [
            split_documents(ds.first_sequences, ds.num_sequences, blend.bounds) for ds in datasets
        ]
        sets.append(DocumentSet(datasets, documents, blend.weights))
    return tuple(sets)
