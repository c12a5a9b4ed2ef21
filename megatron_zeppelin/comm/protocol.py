"""What the attention engine asks of a ring transport, and the checks every transport shares.

The engine (``attention/ring.py``) types its transport as ``Exchanger``: ``start`` takes one
ring step's messages, in the one order of every rank's (sorted by ``(src, dst)``), and this
rank's outgoing rows, and returns a ``Pending`` whose ``wait`` returns what this rank received.
The list is every rank's or only the messages this rank sends, receives or relays (what the
engine hands it: ``schedule.ring_schedule``'s ``rank``); a transport acts on no others.
Two transports implement it: ``comm.exchange.DistExchanger`` (torch.distributed point-to-point)
and ``comm.threads.ThreadExchanger`` (ranks as threads of one process). Both refuse bad
payloads the same way, with ``check_payload``, before anything is sent.

This module calls nothing in torch.distributed, so the attention code imports it without
depending on how the transfers are made. Shapes: ``payload[(src, dst)]`` is
``(t, *row_shape)``, ``t`` the message's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from megatron_zeppelin.planner.plan.schedule import Message

__all__ = ["Exchanger", "Pending", "ZeppelinCommError", "check_payload"]


class ZeppelinCommError(RuntimeError):
    """A ring exchange was misused, timed out or lost a peer. The message names the tag.

    The root of the package's communication errors: ``comm.watch.CommStallError``, raised for a
    collective or transfer that stalled, is one too and names the rank that stalled."""


class Pending(Protocol):
    """One ring step in flight; ``wait`` once."""

    def wait(self) -> dict[tuple[int, int], torch.Tensor]:
        """``{(src, this rank): rows}`` for every message this rank receives in the step."""
        ...


class Exchanger(Protocol):
    """A rank's ring transport: ``rank`` among ``world_size`` Zeppelin ranks."""

    rank: int
    world_size: int

    def start(
        self,
        messages: Sequence[Message],
        payload: Mapping[tuple[int, int], torch.Tensor],
        *,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: str,
    ) -> Pending:
        """Post this rank's part of one ring step (``messages``: the step's, or those this rank
        sends, receives or relays, in the order of every rank's)."""
        ...


def check_payload(
    messages: Sequence[Message],
    payload: Mapping[tuple[int, int], torch.Tensor],
    *,
    rank: int,
    row_shape: tuple[int, ...],
    dtype: torch.dtype,
    tag: str,
    device: torch.device | None = None,
) -> dict[tuple[int, int], Message]:
    """The messages ``rank`` sends in this step, keyed by edge, after checking that ``payload``
    holds exactly their rows: one ``(num_tokens, *row_shape)`` tensor of ``dtype`` per message
    (a message of no tokens may be left out), on ``device`` when given. Raises
    ``ZeppelinCommError`` naming ``tag`` otherwise; nothing has been posted then, so every rank
    can check alone."""
    sends = {(m.src, m.dst): m for m in messages if m.src == rank}
    extra = sorted(key for key in payload if key not in sends)
    if extra:
        raise ZeppelinCommError(
            f"exchange {tag!r}: payload for {extra[0]} but rank {rank} sends no such message in "
            "this step"
        )
    for key, msg in sends.items():
        tensor = payload.get(key)
        expected = (msg.num_tokens, *row_shape)
        if tensor is None:
            if msg.num_tokens:
                raise ZeppelinCommError(f"exchange {tag!r}: no payload for message {key}")
            continue
        if tuple(tensor.shape) != expected or tensor.dtype != dtype:
            raise ZeppelinCommError(
                f"exchange {tag!r}: payload {key} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"the message needs {expected} {dtype}"
            )
        if device is not None and tensor.device != device:
            raise ZeppelinCommError(
                f"exchange {tag!r}: payload {key} is on {tensor.device}, the exchanger sends "
                f"from {device}"
            )
    return sends
