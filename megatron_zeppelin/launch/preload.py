"""What ``launch.ranks``'s fork server imports once, so every rank it forks starts with torch and
megatron-core loaded instead of importing them anew (seconds per rank). megatron-core's known
import-time warnings are hidden first, as the CPU job hides them (``launch/quiet.py``)."""

from megatron_zeppelin.launch.quiet import quiet_unless_verbose

quiet_unless_verbose()

import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401

try:
    import megatron.core.models.gpt  # noqa: E402, F401
except ImportError:  # megatron-core is optional for the harness
    pass
