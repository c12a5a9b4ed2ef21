"""Bytes per link class, counted from the sends a rank actually makes.

The keys are those of ``planner.plan.schedule.link_bytes``: ``nvlink`` (sender and receiver on one
node), ``nic`` (across nodes, all NICs together) and ``nic:<node>.<nic>`` for the NIC next to the
sending GPU. Every transfer is counted once, by its sender, at the moment it is posted; a routed
message therefore shows up as its NVLink hops plus its source proxy's NIC, exactly as the plan
predicts. Summing the counters of all ranks (``all_reduce``) gives the figures to compare with the
prediction.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from megatron_zeppelin.topology.model import Topology

__all__ = ["LinkCounters", "comparable"]


def comparable(link_bytes: Mapping[str, int]) -> dict[str, int]:
    """Drop per-NIC entries that are zero, so a measured and a predicted dict compare equal when
    they agree on every byte (``link_bytes`` lists a NIC that sent an empty message)."""
    return {
        key: int(value) for key, value in link_bytes.items() if value or not key.startswith("nic:")
    }


class LinkCounters:
    """Per-rank byte counters by link class. ``record`` may be called from the exchanger's relay
    threads as well as the main thread, so it takes a lock."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.reset()

    def keys(self) -> list[str]:
        """Every key a transfer on this topology can hit, in a fixed order."""
        topo = self.topology
        nics = [
            f"nic:{node}.{nic}"
            for node in range(topo.num_nodes)
            for nic in range(topo.nics_per_node)
        ]
        return ["nvlink", "nic", *nics]

    def reset(self) -> None:
        self._bytes = dict.fromkeys(self.keys(), 0)

    def record(self, src: int, dst: int, num_bytes: int) -> None:
        """Count a transfer of ``num_bytes`` from Zeppelin rank ``src`` to ``dst``."""
        assert num_bytes >= 0 and src != dst, (src, dst, num_bytes)
        topo = self.topology
        with self._lock:
            if topo.same_node(src, dst):
                self._bytes["nvlink"] += num_bytes
            else:
                self._bytes["nic"] += num_bytes
                self._bytes[f"nic:{topo.node_of(src)}.{topo.nic_of(src)}"] += num_bytes

    def add(self, other: Mapping[str, int]) -> None:
        """Add another set of counts (e.g. a dict from ``to_dict``) into this one."""
        for key, value in other.items():
            if key not in self._bytes:
                raise ValueError(f"unknown link class {key!r}; known: {self.keys()}")
            self._bytes[key] += int(value)

    def to_dict(self) -> dict[str, int]:
        """Counts in ``link_bytes``' shape: ``nvlink`` and ``nic`` always, NICs that sent."""
        return comparable(self._bytes)

    @classmethod
    def merged(cls, topology: Topology, parts: Iterable[Mapping[str, int]]) -> LinkCounters:
        """Sum several ranks' ``to_dict()`` results, e.g. gathered by a test harness."""
        total = cls(topology)
        for part in parts:
            total.add(part)
        return total

    def all_reduce(self, group: dist.ProcessGroup | None = None, *, watch=None) -> dict[str, int]:
        """Sum of every rank's counts over ``group`` (a collective: every rank calls it).

        int64 on CPU for gloo; NCCL needs the tensor on this rank's GPU. ``watch`` (a
        ``comm.watch.CommWatch``) bounds the all-reduce by the Zeppelin timeout.
        """
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        keys = self.keys()
        counts = torch.tensor([self._bytes[k] for k in keys], dtype=torch.int64, device=device)
        if watch is None:
            dist.all_reduce(counts, group=group)
        else:
            watch.all_reduce(counts, group, what="link counters")
        return comparable(dict(zip(keys, (int(v) for v in counts.tolist()))))
