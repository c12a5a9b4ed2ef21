"""Known third-party warnings the CPU job and the check hide unless asked.

Every worker process prints them at import or on the first forward (Apex/TransformerEngine absent
on CPU, deprecations inside megatron-core), four times over with four processes, burying the
progress bar and the one-line errors. ``ZEPPELIN_VERBOSE=1`` in the environment (``--verbose``)
shows them again. Every other warning still shows.
"""

from __future__ import annotations

import os
import warnings

THIRD_PARTY_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Apex is not installed", UserWarning),
    ("full scope is deprecated", UserWarning),
    ("Warning: tp_group is None", DeprecationWarning),
    ("When using async grad allreduce it is recommended", UserWarning),
    ("When using sequence parallelism it is recommended", UserWarning),
    # Megatron's sequence-parallel gather and reduce-scatter call torch's older names.
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning),
)
"""``(message prefix, category)`` of every warning the job hides unless ``--verbose``."""


def quiet_third_party_warnings() -> None:
    """Hide ``THIRD_PARTY_WARNINGS`` in this process (every other warning still shows)."""
    for prefix, category in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=prefix, category=category)


def quiet_unless_verbose() -> None:
    """``quiet_third_party_warnings`` unless ``ZEPPELIN_VERBOSE=1``."""
    if os.environ.get("ZEPPELIN_VERBOSE") != "1":
        quiet_third_party_warnings()
