"""``comm.watch``: bounded collectives and the progress board that names a stalled rank.

Tier: pure (one process, no process group: the board lives in an in-memory c10d ``HashStore``
shared by several watches standing for ranks; collectives are stand-ins for gloo ``Work``
objects with the same ``wait(timeout)`` contract: raise or return ``False`` on timeout).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from megatron_zeppelin.comm.protocol import ZeppelinCommError
from megatron_zeppelin.comm.watch import (
    NO_STORE_ANSWER,
    STORE_ANSWER_S,
    Beat,
    CommStallError,
    CommWatch,
    Position,
    is_comm_failure,
)

pytestmark = pytest.mark.pure


BEAT_S = 0.05
SETTLE_S = 6 * BEAT_S  # a diagnosis sees several beats of every live rank
ANSWER_S = 0.2  # how long a stuck store is waited for


def _watches(world: int, **kwargs) -> list[CommWatch]:
    store = dist.HashStore()
    return [
        CommWatch(
            rank=r,
            world_size=world,
            timeout_s=1.0,
            store=store,
            beat_s=BEAT_S,
            settle_s=SETTLE_S,
            **kwargs,
        )
        for r in range(world)
    ]


def _stuck_watch(store, world_size: int) -> CommWatch:
    """A watch over a store that never answers, waiting for it ``ANSWER_S`` at most."""
    return CommWatch(
        rank=0,
        world_size=world_size,
        timeout_s=1.0,
        store=store,
        beat_s=BEAT_S,
        settle_s=SETTLE_S,
        store_answer_s=ANSWER_S,
    )


def _publish_once(watch: CommWatch, **position) -> None:
    """A rank that published its position and then froze (no heartbeat after)."""
    watch.position = Position(**position)
    watch.board.publish(watch.rank, Beat(1, "running", watch.position))


def test_a_frozen_rank_is_named_with_where_it_was():
    me, alive, frozen = _watches(3)
    where = dict(step=5, layer=1, phase="forward", what="remap linear->attention")
    _publish_once(frozen, op=7, **where)
    for w in (alive, me):
        w.start()
        w.position = Position(op=8, **where)
    error = me.explain(None)
    text = str(error)
    assert isinstance(error, CommStallError) and error.stalled == (2,) and error.behind == ()
    assert text.startswith(
        "rank 0 at step 5, layer 1 (forward), remap linear->attention: no "
        "answer within 1 s; rank 2 stopped responding"
    )
    assert "last seen at step 5, layer 1 (forward), remap linear->attention" in text
    assert "rank 1" not in text  # waiting with us, not the cause
    for w in (me, alive):
        w.close()


def test_a_live_rank_behind_and_a_failed_rank_are_told_apart():
    me, slow, failed = _watches(3)
    for w in (me, slow, failed):
        w.start()
    me.at(step=3, what="gradient all-reduce", op=12)
    slow.at(step=3, layer=0, phase="backward", what="remap attention->linear", op=10)
    failed.close("failed", note="ValueError: document 9 is longer than the capacity")
    error = me.explain(RuntimeError("Connection closed by peer"))
    text = str(error)
    assert error.stalled == () and error.failed == (2,) and error.behind == (1,)
    assert "RuntimeError: Connection closed by peer" in text
    assert "rank 2 failed (ValueError: document 9 is longer than the capacity)" in text
    assert "rank 1 is alive but behind, at step 3, layer 0 (backward)" in text
    for w in (me, slow):
        w.close()


def test_a_store_that_does_not_answer_is_said_so_without_hanging():
    class StuckStore:
        def check(self, keys):
            time.sleep(3600)

        def set(self, key, value):
            time.sleep(3600)

    watch = _stuck_watch(StuckStore(), world_size=2)
    error = watch.explain(None)
    assert NO_STORE_ANSWER in str(error)


class _Work:
    """A gloo ``Work`` stand-in whose peer never answers."""

    def __init__(self, how: str):
        self.how = how
        self.timeout = None

    def wait(self, timeout):
        self.timeout = timeout.total_seconds()
        if self.how == "raise":  # what gloo's wait(timeout) does
            raise RuntimeError("Operation timed out!")
        return False


@pytest.mark.parametrize("how", ["raise", "false"])
def test_run_bounds_the_wait_and_raises_a_stall_error(how):
    (watch,) = _watches(1)
    work = _Work(how)
    watch.at(step=4)  # one move
    expected = r"rank 0 at step 4, layer 2 \(backward\), remap attention->linear: no answer within"
    with pytest.raises(CommStallError, match=expected):
        watch.run("remap attention->linear", lambda async_op: work, layer=2, phase="backward")
    assert work.timeout == 1.0 and watch.position.op == 2


def test_run_lets_bad_arguments_through_and_posts_synchronously_on_nccl():
    (watch,) = _watches(1)

    def bad(async_op):
        raise ValueError("split sizes do not add up")

    with pytest.raises(ValueError, match="split sizes"):
        watch.run("remap", bad)
    calls = []
    nccl = CommWatch(rank=0, world_size=1, timeout_s=1.0, backend="nccl")
    nccl.run("loss all-reduce", lambda async_op: calls.append(async_op))
    assert calls == [False]  # stream-ordered; NCCL's watchdog holds the bound
    # The training job's --device cuda world: host tensors on gloo, CUDA tensors on NCCL.
    mixed = CommWatch(rank=0, world_size=1, timeout_s=1.0, backend="cpu:gloo,cuda:nccl")
    mixed.run("loss all-reduce", lambda async_op: calls.append(async_op), cuda=True)
    assert calls == [False, False]
    posted = []

    class Done:
        def wait(self, timeout):
            posted.append(timeout.total_seconds())
            return True

    mixed.run("counters", lambda async_op: (calls.append(async_op), Done())[1])
    assert calls == [False, False, True] and posted == [1.0]  # a host tensor keeps its bound


def test_comm_failures_are_told_from_bad_input_and_bugs():
    assert is_comm_failure(ZeppelinCommError("exchange 'x' failed"))
    assert is_comm_failure(RuntimeError("[gloo/tcp/pair.cc:534] Connection closed by peer"))
    assert is_comm_failure(RuntimeError("Operation timed out!"))
    assert not is_comm_failure(ValueError("--tp must be positive"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_the_heartbeat_never_blocks_the_caller_on_a_stuck_store():
    class StuckStore:
        def set(self, key, value):
            time.sleep(3600)

    watch = _stuck_watch(StuckStore(), world_size=1).start()
    done = threading.Event()

    def training():
        for step in range(100):
            watch.at(step=step)
        watch.close()
        done.set()

    threading.Thread(target=training, daemon=True).start()
    assert done.wait(10.0), "position updates or close() waited on the store"


def test_the_helper_thread_is_the_only_writer_and_the_board_ends_at_the_last_position():
    class RecordingStore(dist.HashStore):
        """A store that notes which thread wrote each entry."""

        def __init__(self):
            super().__init__()
            self.writers: set[str] = set()

        def set(self, key, value):
            self.writers.add(threading.current_thread().name)
            super().set(key, value)

    store = RecordingStore()
    watch = CommWatch(rank=0, world_size=1, timeout_s=1.0, store=store, beat_s=BEAT_S).start()
    for step in range(20):
        watch.at(step=step)
        watch.run("loss all-reduce", lambda async_op: _Done(), layer=3, phase="backward")
    watch.close("failed", note="ValueError: bad document")
    last = Beat.from_json(store.get("zeppelin/progress/0").decode())
    assert store.writers == {"zeppelin-heartbeat"}
    assert last.state == "failed" and last.note == "ValueError: bad document"
    assert last.position == Position(
        op=40, step=19, layer=3, phase="backward", what="loss all-reduce"
    )


def test_a_collective_that_times_out_on_a_stuck_store_still_raises_in_bounded_time():
    class StuckStore:
        def set(self, key, value):
            time.sleep(3600)

        def check(self, keys):
            time.sleep(3600)

    watch = _stuck_watch(StuckStore(), world_size=2).start()
    raised: list[BaseException] = []

    def training():
        try:
            watch.run("remap linear->attention", lambda async_op: _Work("false"), layer=0)
        except CommStallError as exc:
            raised.append(exc)
        watch.close()

    worker = threading.Thread(target=training, daemon=True)
    worker.start()
    worker.join(15.0)
    assert not worker.is_alive(), "the collective or its diagnosis waited on the store"
    assert len(raised) == 1 and NO_STORE_ANSWER in str(raised[0])


class _Done:
    """A gloo ``Work`` stand-in that finished."""

    def wait(self, timeout):
        return True


def test_a_store_whose_host_is_gone_is_no_answer_not_a_partial_board():
    class GoneStore(dist.HashStore):
        """Answers for rank 0's entry, then fails as a TCPStore whose host died does."""

        def check(self, keys):
            if keys != ["zeppelin/progress/0"]:
                raise dist.DistNetworkError("Broken pipe")
            return super().check(keys)

    store = GoneStore()
    watch = CommWatch(
        rank=1, world_size=3, timeout_s=1.0, store=store, beat_s=BEAT_S, settle_s=SETTLE_S
    )
    store.set("zeppelin/progress/0", Beat(1, "running", Position(op=3)).to_json())
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        assert watch.board.read() is None
        text = str(watch.explain(None))
    finally:
        threading.excepthook = previous
    assert NO_STORE_ANSWER in text and errors == []


def test_a_diagnosis_waits_several_beats_and_at_least_a_second_unless_told():
    for beat_s in (0.05, 0.2, 2.0):
        watch = CommWatch(
            rank=0, world_size=2, timeout_s=30.0, store=dist.HashStore(), beat_s=beat_s
        )
        assert watch.settle_s >= max(3 * beat_s, 1.0)
        assert watch.board.answer_s == STORE_ANSWER_S
    told = CommWatch(
        rank=0,
        world_size=2,
        timeout_s=30.0,
        store=dist.HashStore(),
        settle_s=0.3,
        store_answer_s=0.1,
    )
    assert told.settle_s == 0.3 and told.board.answer_s == 0.1
