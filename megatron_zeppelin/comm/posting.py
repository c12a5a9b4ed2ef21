"""The order point-to-point batches are posted in, recorded per rank and checked across ranks.

NCCL matches a send with a receive by their order on a communicator (the k-th send from ``a`` to
``b`` meets the k-th receive at ``b`` from ``a``), and a GPU runs the batches of several
communicators one after another when its streams share one hardware queue (Megatron's
``CUDA_DEVICE_MAX_CONNECTIONS=1``, set by ``scripts/slurm/zeppelin_env.sh``). Ranks that post
batches on two communicators in different orders can therefore wait on each other forever,
which gloo (matching by tag, on host threads) never shows. ``comm/pending.py`` posts every
stage's batches in one global communicator order (``ZeppelinGroups.posting_order``) and, when
given a ``PostingLog``, records what it posts.

``check_posting_order`` proves a run's logs consistent by replaying them the way NCCL would run
them: each rank runs its batches in posting order, one at a time; an operation completes when
its match is in the peer's running batch; a batch ends when all of its operations have
completed. The logs are consistent when every operation has a match of the same size and the
replay ends with every batch run. ``zeppelin verify --json`` reports the result per case as
``posting_order_consistent``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Batch", "PostedOp", "PostingLog", "check_posting_order"]

SEND, RECV = "send", "recv"


@dataclass(frozen=True)
class PostedOp:
    """One point-to-point operation: ``direction`` is ``send`` or ``recv``, ``peer`` the
    Zeppelin rank at the other end."""

    peer: int
    direction: str
    num_bytes: int


@dataclass(frozen=True)
class Batch:
    """The operations one rank posted together on one communicator (``("node", n)``,
    ``("rail", j)`` or ``("world", 0)``); ``what`` names the exchange and stage."""

    communicator: tuple[str, int]
    ops: tuple[PostedOp, ...]
    what: str = ""


class PostingLog:
    """The batches one rank posted, in order (``append`` may be called from several threads)."""

    def __init__(self) -> None:
        self._batches: list[Batch] = []
        self._lock = threading.Lock()

    def append(self, batch: Batch) -> None:
        with self._lock:
            self._batches.append(batch)

    @property
    def batches(self) -> list[Batch]:
        with self._lock:
            return list(self._batches)

    def clear(self) -> None:
        with self._lock:
            self._batches = []


def _match_ops(logs: Sequence[Sequence[Batch]]) -> tuple[dict, str | None]:
    """Pair every operation with its match: ``{(rank, batch, op): (peer, batch, op)}``, or the
    first operation without one (or with one of another size)."""
    queues: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
    for rank, batches in enumerate(logs):
        for b, batch in enumerate(batches):
            for o, op in enumerate(batch.ops):
                src, dst = (rank, op.peer) if op.direction == SEND else (op.peer, rank)
                queues[(batch.communicator, src, dst, op.direction)].append((rank, b, o))
    match: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for (comm, src, dst, direction), mine in queues.items():
        if direction != SEND:
            continue
        theirs = queues.get((comm, src, dst, RECV), [])
        if len(mine) != len(theirs):
            return {}, (
                f"{len(mine)} sends {src}->{dst} on {comm[0]} {comm[1]} but {len(theirs)} receives"
            )
        for k, (send, recv) in enumerate(zip(mine, theirs)):
            sent = logs[send[0]][send[1]].ops[send[2]].num_bytes
            got = logs[recv[0]][recv[1]].ops[recv[2]].num_bytes
            if sent != got:
                return {}, (
                    f"send {k} {src}->{dst} on {comm[0]} {comm[1]} carries {sent} bytes, its "
                    f"receive expects {got}"
                )
            match[send], match[recv] = recv, send
    for (comm, src, dst, direction), theirs in queues.items():
        if direction == RECV and (comm, src, dst, SEND) not in queues:
            return {}, f"{len(theirs)} receives {src}->{dst} on {comm[0]} {comm[1]} but no send"
    return match, None


def check_posting_order(logs: Sequence[Sequence[Batch]]) -> tuple[bool, str]:
    """Whether the ranks' posting logs (``logs[rank]``) run to the end under NCCL's rules (see
    the module docstring), and a sentence saying why not (or how much ran)."""
    match, problem = _match_ops(logs)
    if problem is not None:
        return False, problem
    head = [0] * len(logs)
    done: set[tuple[int, int, int]] = set()
    progress = True
    while progress:
        progress = False
        running = {(r, head[r]) for r in range(len(logs)) if head[r] < len(logs[r])}
        for r, b in running:
            for o in range(len(logs[r][b].ops)):
                peer, pb, _ = match[(r, b, o)]
                if (peer, pb) in running:
                    done.add((r, b, o))
        for r, b in running:
            if all((r, b, o) in done for o in range(len(logs[r][b].ops))):
                head[r] += 1
                progress = True
    stuck = [r for r in range(len(logs)) if head[r] < len(logs[r])]
    if stuck:
        r = stuck[0]
        batch = logs[r][head[r]]
        return False, (
            f"ranks {stuck} never finish: rank {r} waits in batch {head[r]} on "
            f"{batch.communicator[0]} {batch.communicator[1]} ({batch.what}) for a peer that "
            "posts its match behind a batch on another communicator"
        )
    total = sum(len(batches) for batches in logs)
    return True, f"{total} batches on {len(logs)} ranks run to the end in posting order"
