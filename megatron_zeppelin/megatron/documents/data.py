"""Document-level view of a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

Megatron's ``IndexedDataset`` stores *sequences* (``sequence_lengths``, ``sequence_pointers``)
grouped into *documents* by ``document_indices``: document ``d`` is sequences
``document_indices[d]`` to ``document_indices[d + 1]``. ``preprocess_data.py`` writes one
sequence per document unless ``--split-sentences`` is given; either way the sequences of a
document sit back to back in the ``.bin``, so a document is one contiguous run of tokens and
any ``[start, end)`` of it is one read.

Zeppelin plans documents, not fixed-length samples, so this module exposes exactly that:
``lengths`` (tokens per document, what every rank plans from) and ``read(doc, start, end)``
(the tokens one rank needs). Reads go through megatron-core's own ``IndexedDataset.get`` so the
memory-mapped ``.bin`` is shared with everything else Megatron does.

A missing or damaged file raises ``ValueError`` naming the file and what is wrong, checked here
before megatron-core opens it (its own checks are bare asserts deep in the reader): the header,
the document table, and every sequence pointer against the lengths before it and the ``.bin``
size (a damaged pointer table would otherwise train on the wrong tokens, silently). The format
cannot tell a ``.bin`` from another dataset of the same size; ``zeppelin make-dataset`` writes a
checksum sidecar ``PREFIX.checksum.json`` (sizes and SHA-256 of both files) that is checked
whenever it is present (``write_checksum`` / ``verify_checksum``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from megatron_zeppelin.fileio import atomic_write_text

# The .idx layout (megatron/core/datasets/indexed_dataset.py): a 9-byte magic, a u64 version
# (1), a u8 dtype code, u64 sequence count, u64 document count, then int32 sequence lengths,
# int64 sequence pointers (byte offsets into the .bin) and int64 document indices.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""The token dtype of each megatron-core ``DType`` code."""
_DTYPE_SIZES = {code: np.dtype(dtype).itemsize for code, dtype in _DTYPES.items()}


def indexed_dataset_module() -> ModuleType:
    """megatron-core's ``indexed_dataset`` module, imported on first use.

    Imported lazily because megatron-core pulls in torch and most of its own package; its
    warnings about missing TransformerEngine/Apex kernels say nothing about reading a dataset,
    so they are silenced for this import only.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # lazy: keeps megatron-core and torch out of `zeppelin make-dataset`.
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def strip_suffix(path_prefix: str) -> str:
    """The dataset's path prefix, whether given as ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``."""
    path_prefix = os.fspath(path_prefix)
    for suffix in (".bin", ".idx"):
        if path_prefix.endswith(suffix):
            return path_prefix[: -len(suffix)]
    return path_prefix


def _require_files(path_prefix: str) -> None:
    for path in (path_prefix + ".idx", path_prefix + ".bin"):
        if not os.path.isfile(path):
            raise ValueError(
                f"dataset file {path} does not exist: pass the path prefix of a Megatron "
                "indexed dataset (PREFIX.bin and PREFIX.idx, as written by preprocess_data.py "
                "or `zeppelin make-dataset`)"
            )


@dataclass(frozen=True)
class IndexHeader:
    """What the first bytes of an ``.idx`` say."""

    dtype: np.dtype
    """Token dtype on disk."""
    num_sequences: int
    num_documents: int


def index_header(path_prefix: str) -> IndexHeader:
    """The header of ``PREFIX.idx`` (34 bytes read; both files must exist): cheap enough for
    start-up checks of every dataset of a blend. Raises ``ValueError`` naming the file."""
    path_prefix = strip_suffix(path_prefix)
    _require_files(path_prefix)
    code, num_sequences, num_doc_indices = _read_header(path_prefix + ".idx")
    return IndexHeader(np.dtype(_DTYPES[code]), num_sequences, num_doc_indices - 1)


def _check_files(path_prefix: str) -> None:
    """Validate ``PREFIX.idx`` against ``PREFIX.bin`` with plain reads; raise ``ValueError``."""
    idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
    _require_files(path_prefix)
    code, num_sequences, num_doc_indices = _read_header(idx_path)
    idx_size = os.path.getsize(idx_path)
    needed = _IDX_HEADER_BYTES + 4 * num_sequences + 8 * num_sequences + 8 * num_doc_indices
    if idx_size < needed:
        raise ValueError(
            f"{idx_path} is truncated: its header promises {num_sequences} sequences and "
            f"{num_doc_indices - 1} documents ({needed} bytes) but the file has {idx_size} bytes"
        )
    lengths = np.fromfile(idx_path, dtype=np.int32, count=num_sequences, offset=_IDX_HEADER_BYTES)
    doc_index = np.fromfile(
        idx_path,
        dtype=np.int64,
        count=num_doc_indices,
        offset=_IDX_HEADER_BYTES + 12 * num_sequences,
    )
    if (lengths < 0).any():
        raise ValueError(f"{idx_path} lists a negative sequence length: the file is damaged")
    if doc_index[0] != 0 or doc_index[-1] != num_sequences or (np.diff(doc_index) < 0).any():
        raise ValueError(
            f"{idx_path} has a document index that does not cover its {num_sequences} "
            "sequences in order: the file is damaged"
        )
    expected_bin = int(lengths.sum(dtype=np.int64)) * _DTYPE_SIZES[code]
    bin_size = os.path.getsize(bin_path)
    if bin_size != expected_bin:
        raise ValueError(
            f"{bin_path} has {bin_size} bytes but {idx_path} describes {expected_bin}: the two "
            "files do not belong together or one was cut short; rebuild the dataset"
        )
    if expected_bin == 0:
        raise ValueError(
            f"the dataset {path_prefix} holds no tokens ({num_doc_indices - 1} documents): "
            "train on a dataset with documents in it"
        )
    pointers = np.fromfile(
        idx_path, dtype=np.int64, count=num_sequences, offset=_IDX_HEADER_BYTES + 4 * num_sequences
    )
    _check_pointers(idx_path, lengths.astype(np.int64) * _DTYPE_SIZES[code], pointers, doc_index)


def _read_header(idx_path: str) -> tuple[int, int, int]:
    """The token dtype code, the sequence count and the document-index count of an .idx."""
    with open(idx_path, "rb") as f:
        header = f.read(_IDX_HEADER_BYTES)
    if len(header) < _IDX_HEADER_BYTES or header[:9] != _IDX_MAGIC:
        raise ValueError(
            f"{idx_path} is not a Megatron index file (missing the MMIDIDX header): "
            "rebuild it with preprocess_data.py or `zeppelin make-dataset`"
        )
    (version,) = struct.unpack("<Q", header[9:17])
    (code,) = struct.unpack("<B", header[17:18])
    num_sequences, num_doc_indices = struct.unpack("<QQ", header[18:34])
    if version != 1:
        raise ValueError(f"{idx_path} has index version {version}; only version 1 is supported")
    if code not in _DTYPE_SIZES:
        raise ValueError(f"{idx_path} names an unknown token dtype code {code}")
    if num_doc_indices < 1:
        raise ValueError(f"{idx_path} has no document index table: the file is damaged")
    return code, num_sequences, num_doc_indices


def _check_pointers(
    idx_path: str, nbytes: np.ndarray, pointers: np.ndarray, doc_index: np.ndarray
) -> None:
    """Sequence ``i`` must start where sequence ``i - 1`` ends (the first at byte 0): that makes
    the pointers monotone, consistent with the lengths and, the lengths summing to the ``.bin``
    size, in range. Raise ``ValueError`` naming the first document whose pointer is wrong."""
    expected = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    bad = np.flatnonzero(pointers != expected)
    if bad.size == 0:
        return
    seq = int(bad[0])
    doc = int(np.searchsorted(doc_index, seq, side="right")) - 1
    raise ValueError(
        f"{idx_path}: the pointer table is damaged from document {doc} on (sequence {seq} "
        f"points at byte {int(pointers[seq])} of the .bin, but the lengths before it end at "
        f"byte {int(expected[seq])}): rebuild the dataset"
    )


# --- checksum sidecar --------------------------------------------------------------------------
CHECKSUM_FORMAT = "zeppelin-dataset-checksum/1"


def checksum_path(path_prefix: str) -> str:
    return path_prefix + ".checksum.json"


def _file_digest(path: str) -> dict[str, object]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 23), b""):
            digest.update(block)
    return {"size": os.path.getsize(path), "sha256": digest.hexdigest()}


def write_checksum(path_prefix: str) -> str:
    """Write ``PREFIX.checksum.json`` (size and SHA-256 of the ``.bin`` and the ``.idx``)."""
    sums = {"format": CHECKSUM_FORMAT}
    for suffix in ("bin", "idx"):
        sums[suffix] = _file_digest(f"{path_prefix}.{suffix}")
    path = checksum_path(path_prefix)
    atomic_write_text(path, json.dumps(sums, indent=1))
    return path


def verify_checksum(path_prefix: str) -> bool:
    """Check the dataset against its checksum sidecar; ``False`` when there is none. Raises
    ``ValueError`` naming the file that does not match."""
    path = checksum_path(path_prefix)
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            sums = json.load(f)
        if sums.get("format") != CHECKSUM_FORMAT:
            raise ValueError(f"format {sums.get('format')!r}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a dataset checksum file ({exc})") from None
    for suffix in ("bin", "idx"):
        target = f"{path_prefix}.{suffix}"
        recorded = sums.get(suffix, {})
        if os.path.getsize(target) != recorded.get("size") or _file_digest(target) != recorded:
            raise ValueError(
                f"{target} does not match {path}: the file changed since the dataset was "
                "written, or it belongs to another dataset; rebuild the dataset or remove the "
                "stale checksum file"
            )
    return True


class DocumentDataset:
    """Documents of a Megatron indexed dataset: their lengths and token reads by range.

    ``lengths[d]`` is the token count of document ``d``. ``read(d, start, end)`` returns tokens
    ``[start, end)`` of document ``d`` as ``int64``. ``num_tokens_read`` counts the tokens read
    so far, so callers (and tests) can check that a rank reads only its own share.
    ``checksum``: check the checksum sidecar when there is one (it reads both files once).
    """

    def __init__(self, path_prefix: str, *, mmap: bool = True, checksum: bool = True) -> None:
        IndexedDataset = indexed_dataset_module().IndexedDataset  # noqa: N806

        path_prefix = strip_suffix(path_prefix)
        _check_files(path_prefix)
        if checksum:  # reads both files once: pass checksum=False where it was just checked
            verify_checksum(path_prefix)
        try:
            self._indexed = IndexedDataset(path_prefix, mmap=mmap)
        except (AssertionError, OSError, ValueError) as exc:
            raise ValueError(
                f"megatron-core could not open the dataset {path_prefix}.bin/.idx: {exc}"
            ) from exc
        self.path_prefix = path_prefix
        seq_lengths = self._indexed.sequence_lengths.astype(np.int64)
        doc_index = self._indexed.document_indices.astype(np.int64)
        seq_cumsum = np.concatenate(([0], np.cumsum(seq_lengths)))
        self.lengths: np.ndarray = seq_cumsum[doc_index[1:]] - seq_cumsum[doc_index[:-1]]
        """Tokens per document, ``int64``."""
        self.first_sequences: np.ndarray = doc_index[:-1]
        """Index of each document's first sequence (Megatron's ``--split`` counts sequences)."""
        self.num_sequences = int(seq_lengths.shape[0])
        self.num_tokens_read = 0

    # --- shape -----------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def dtype(self) -> np.dtype:
        """Token dtype on disk (``uint16`` for vocabularies under 65500, else ``int32``)."""
        return np.dtype(self._indexed.index.dtype)

    def __len__(self) -> int:
        return self.num_documents

    def document_length(self, doc: int) -> int:
        self._check_doc(doc)
        return int(self.lengths[doc])

    # --- reads -----------------------------------------------------------------------------
    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Tokens ``[start, end)`` of document ``doc`` (``end`` defaults to its length)."""
        length = self.document_length(doc)
        end = length if end is None else end
        if not 0 <= start <= end <= length:
            raise ValueError(
                f"cannot read tokens [{start}, {end}) of document {doc}: it has {length} tokens"
            )
        self.num_tokens_read += end - start
        if end == start:
            return np.zeros(0, dtype=np.int64)
        # The sequences of a document are contiguous in the .bin, so a read that starts in the
        # first sequence may run on through the following ones.
        tokens = self._indexed.get(int(self.first_sequences[doc]), offset=start, length=end - start)
        return np.asarray(tokens, dtype=np.int64)

    def _check_doc(self, doc: int) -> None:
        if not 0 <= doc < self.num_documents:
            raise ValueError(
                f"document {doc} is outside 0..{self.num_documents - 1} of {self.path_prefix}"
            )

    def __repr__(self) -> str:
        return (
            f"DocumentDataset({self.path_prefix!r}, documents={self.num_documents}, "
            f"tokens={self.num_tokens})"
        )
