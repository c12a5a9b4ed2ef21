"""Megatron's data flags as document sets: ``--split`` holds out the documents Megatron's own
split holds out, blends read as Megatron reads them, and bad data is refused in one line.

The split is checked against megatron-core's own code (0.16.1 here): its split parsing
(``blended_megatron_dataset_config.py``) and its dataset builder, which builds the real
``GPTDataset`` of every split of a dataset written to disk and exposes the sequences it took.

Tier: pure (files in a tmp dir, megatron-core's builder in this process; no process group).
"""

from __future__ import annotations

import argparse
import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.job.synthetic import write_synthetic_dataset
from megatron_zeppelin.megatron.documents.blend import (
    DEFAULT_SPLIT,
    check_data_flags,
    data_blends,
    open_document_sets,
    parse_blend,
    split_bounds,
    split_documents,
)

pytestmark = pytest.mark.pure


def _megatron_split_matrix(split: str):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def _args(**kwargs) -> argparse.Namespace:
    fields = dict(data_path=None, split=None, eval_iters=0)
    fields.update(kwargs)
    return argparse.Namespace(**fields)


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(st.integers(0, 1000), min_size=1, max_size=3).filter(any),
    separator=st.sampled_from([",", ", ", "/", " "]),
)
def test_split_bounds_are_megatrons(parts, separator):
    split = separator.join(map(str, parts))
    assert split_bounds(split) == _megatron_split_matrix(split)


@pytest.mark.parametrize("split", [DEFAULT_SPLIT, "98,1,1", "0.6 0.3 0.1", "100,0,0", "2,0,1"])
def test_split_bounds_of_common_splits_are_megatrons(split):
    assert split_bounds(split) == _megatron_split_matrix(split)


class _Tokenizer:
    """What megatron-core's ``GPTDatasetConfig`` reads of a tokenizer for these datasets."""

    eod, pad, vocab_size = 0, -1, 100
    unique_identifiers = {"class": "_Tokenizer"}


def _megatron_split_sequences(prefix: str, split: str, cache: str) -> list[list[int] | None]:
    """The sequence indices megatron-core's builder gives each split's ``GPTDataset``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=([prefix], None),
        split=split,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=cache,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = BlendedMegatronDatasetBuilder(GPTDataset, [None] * 3, lambda: True, config).build()
    return [None if ds is None else ds.indices.tolist() for ds in built]


@pytest.mark.parametrize("num_documents", [7, 30, 101])
@pytest.mark.parametrize("split", [DEFAULT_SPLIT, "98,1,1", "6,3,1", "80,20", "1,1,1"])
def test_held_out_documents_are_the_ones_megatrons_builder_holds_out(
    tmp_path, num_documents, split
):
    prefix = str(tmp_path / "docs")
    write_synthetic_dataset(prefix, lengths=[20 + d for d in range(num_documents)], vocab_size=100)
    expected = _megatron_split_sequences(prefix, split, str(tmp_path / "cache"))
    sets = open_document_sets(data_blends(_args(data_path=[prefix], split=split)))
    for ours, megatrons in zip(sets, expected):
        if megatrons is None or not megatrons:
            assert ours is None or ours.lengths.size == 0
            continue
        # One sequence per document (make-dataset, preprocess_data.py's default).
        assert ours.documents[0].tolist() == megatrons


def test_documents_of_several_sequences_go_with_their_first_sequence():
    # 4 documents of 1, 3, 1 and 5 sequences: 10 sequences; bounds (0.3, 0.7) take 3..6.
    first = np.array([0, 1, 4, 5])
    assert split_documents(first, 10, (0.0, 0.3)).tolist() == [0, 1]
    assert split_documents(first, 10, (0.3, 0.7)).tolist() == [2, 3]
    assert split_documents(first, 10, (0.7, 1.0)).tolist() == []
    assert split_documents(first, 10, None).tolist() == []


@pytest.mark.parametrize(
    "values",
    [
        ["a"],
        ["a", "b"],
        ["0.3", "a", "0.7", "b"],
        ["30", "a", "70", "b", "0", "c"],
        ["a", "b", "c"],
    ],
)
def test_blend_lists_read_as_megatron_reads_them(values):
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, weights = get_blend_from_list(values)
    assert parse_blend(values, "--data-path") == (
        tuple(prefixes),
        None if weights is None else tuple(weights),
    )


@pytest.mark.parametrize(
    "values, message",
    [
        (["0.5", "a", "b", "c"], "mixes weights and prefixes"),
        (["-1", "a", "2", "b"], "must be non-negative numbers"),
        (["0", "a", "0", "b"], "not all zero"),
        ([], "names no dataset"),
    ],
)
def test_bad_blend_lists_are_refused_naming_the_flag(values, message):
    with pytest.raises(ValueError, match=f"--train-data-path.*{message}|{message}"):
        parse_blend(values, "--train-data-path")


def test_every_form_of_megatrons_data_flags(tmp_path):
    args_file = tmp_path / "data.txt"
    args_file.write_text("0.25 a\n0.75 b\n")
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": "1 a 3 b", "valid": ["c"], "test": None}))

    train, valid, test = data_blends(_args(data_path=["x.bin"]))  # Megatron's default split
    assert train.prefixes == ("x",) and train.weights is None
    assert [train.bounds, valid.bounds, test.bounds] == split_bounds(DEFAULT_SPLIT)
    train, valid, test = data_blends(_args(data_args_path=str(args_file), split="9,1,0"))
    assert train.prefixes == valid.prefixes == ("a", "b") and train.weights == (0.25, 0.75)
    assert test is None  # a split of proportion 0: Megatron builds no dataset for it
    train, valid, test = data_blends(_args(train_data_path=["a"], valid_data_path=["b", "c"]))
    assert (train.prefixes, valid.prefixes, test) == (("a",), ("b", "c"), None)
    assert train.bounds == valid.bounds == (0.0, 1.0)  # every document of a per-split dataset
    train, valid, test = data_blends(_args(per_split_data_args_path=str(per_split)))
    assert train.weights == (1.0, 3.0) and valid.prefixes == ("c",) and test is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "give --data-path PREFIX"),
        (dict(mock_data=True, data_path=["a"]), "drop --mock-data"),
        (dict(data_path=["a"], data_args_path="f"), "not both"),
        (dict(data_path=["a"], valid_data_path=["b"]), "not both"),
        (dict(train_data_path=["a"], split="9,1,0"), "with --train/valid/test-data-path drop it"),
        (dict(data_path=["a"], split="0,0,0"), "--split '0,0,0': give up to three"),
        (dict(data_path=["a"], split="1,2,3,4"), "up to three proportions"),
        (dict(data_args_path="/nonexistent/list"), "--data-args-path: cannot read"),
    ],
)
def test_contradictory_data_flags_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data_blends(_args(**kwargs))


def _dataset(tmp_path, name: str, num_documents: int, vocab_size: int = 100) -> str:
    prefix = str(tmp_path / name)
    lengths = [10 + d % 7 for d in range(num_documents)]
    write_synthetic_dataset(prefix, lengths=lengths, vocab_size=vocab_size)
    return prefix


def test_the_datasets_are_checked_from_their_headers_in_one_line(tmp_path):
    small, big = _dataset(tmp_path, "small", 10), _dataset(tmp_path, "big", 200)
    check_data_flags(_args(data_path=["0.3", small, "0.7", big], split="9,1,0"))
    with pytest.raises(ValueError, match=r"--data-path: dataset file .*nothing.idx does not exist"):
        check_data_flags(_args(data_path=[small, str(tmp_path / "nothing")]))
    # An odd list read as prefixes only: a missing "prefix" that is a number gets a hint.
    with pytest.raises(ValueError, match="0.3 looks like a weight: give WEIGHT PREFIX pairs"):
        check_data_flags(_args(data_path=["0.3", small, big]))
    # 10 documents: Megatron's default split leaves the validation split empty.
    with pytest.raises(ValueError, match=r"validation split holds no document of .*small"):
        check_data_flags(_args(data_path=["0.5", small, "0.5", big]), splits=["train", "valid"])
    check_data_flags(_args(data_path=["0.5", small, "0.5", big]), splits=["train"])
    wide = _dataset(tmp_path, "wide", 20, vocab_size=70000)  # int32 tokens: another vocabulary
    with pytest.raises(ValueError, match=r"different dtypes.*small \(uint16\).*wide \(int32\)"):
        check_data_flags(_args(data_path=[small, wide]), splits=["train"])


def test_a_document_set_reads_each_document_from_its_own_dataset(tmp_path):
    a, b = _dataset(tmp_path, "a", 10), _dataset(tmp_path, "b", 30)
    train, valid, test = open_document_sets(data_blends(_args(data_path=[a, b], split="8,2")))
    assert test is None
    assert train.source_sizes == [8, 24] and valid.source_sizes == [2, 6]
    # Document 9 of the training set is document 1 of b; the validation set starts at a's 8.
    assert np.array_equal(train.read(9), train.datasets[1].read(1))
    assert np.array_equal(valid.read(0, 2, 5), valid.datasets[0].read(8, 2, 5))
    assert valid.datasets[0] is train.datasets[0]  # each dataset opened once
    assert train.lengths.tolist() == [
        *train.datasets[0].lengths[:8],
        *train.datasets[1].lengths[:24],
    ]
    with pytest.raises(ValueError, match="outside 0..31"):
        train.read(32)
    assert isinstance(torch.as_tensor(train.read(0)), torch.Tensor)
