"""Pure model of a GPU cluster: nodes, GPUs, NICs and rails.

A *rank* is a global GPU index; rank ``r`` sits on node ``r // gpus_per_node`` at local index
``r % gpus_per_node``. A *rail* is one local GPU index across all nodes: GPU ``j`` of every node
talks to GPU ``j`` of every other node through the NIC it sits next to, so rail traffic never
crosses a PCIe switch. Several GPUs may share one NIC (``nic_of_gpu``); they then share its line
rate.

Nothing here reads the machine: see ``probe.py`` for the one place that does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Shape and link speeds of a cluster; validated on construction."""

    num_nodes: int
    """Number of nodes (hosts)."""
    gpus_per_node: int
    """GPUs in each node; all nodes are alike."""
    nics_per_node: int
    """Inter-node NICs per node (compute fabric only)."""
    nic_of_gpu: tuple[int, ...] = ()
    """For each local GPU index, the NIC it sits next to. Empty: spread GPUs evenly over NICs."""
    nvlink_gbps: float = 450.0
    """NVLink bandwidth per GPU per direction, GB/s."""
    nic_gbit: float = 400.0
    """Line rate of one NIC per direction, Gbit/s."""
    gpu_name: str = "H100-SXM"
    """GPU model, for reports and calibration checks."""
    gpu_tflops: float = 989.0
    """Dense bf16 peak of one GPU, TFLOP/s."""
    hbm_gib: float = 80.0
    """GPU memory, GiB."""
    name: str = "custom"
    """Preset name or ``custom``."""

    def __post_init__(self) -> None:
        for label, value in (
            ("num_nodes", self.num_nodes),
            ("gpus_per_node", self.gpus_per_node),
            ("nics_per_node", self.nics_per_node),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if self.nics_per_node > self.gpus_per_node:
            raise ValueError(
                f"nics_per_node ({self.nics_per_node}) exceeds gpus_per_node "
                f"({self.gpus_per_node}): give each NIC at least one GPU next to it"
            )
        if self.nic_of_gpu:
            nic_of_gpu = tuple(int(n) for n in self.nic_of_gpu)
            if len(nic_of_gpu) != self.gpus_per_node:
                raise ValueError(
                    f"nic_of_gpu lists {len(nic_of_gpu)} GPUs but gpus_per_node is "
                    f"{self.gpus_per_node}: give one NIC index per GPU"
                )
            if sorted(set(nic_of_gpu)) != list(range(self.nics_per_node)):
                raise ValueError(
                    f"nic_of_gpu {list(nic_of_gpu)} must use every NIC index 0.."
                    f"{self.nics_per_node - 1} and no other"
                )
        else:
            if self.gpus_per_node % self.nics_per_node:
                raise ValueError(
                    f"{self.gpus_per_node} GPUs per node do not spread evenly over "
                    f"{self.nics_per_node} NICs: give nic_of_gpu explicitly"
                )
            per_nic = self.gpus_per_node // self.nics_per_node
            nic_of_gpu = tuple(g // per_nic for g in range(self.gpus_per_node))
        # Store the resolved map so that equal topologies compare equal.
        object.__setattr__(self, "nic_of_gpu", nic_of_gpu)
        for label, value in (
            ("nvlink_gbps", self.nvlink_gbps),
            ("nic_gbit", self.nic_gbit),
            ("gpu_tflops", self.gpu_tflops),
            ("hbm_gib", self.hbm_gib),
        ):
            if not value > 0:
                raise ValueError(f"{label} must be positive, got {value!r}")

    # --- shape -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.gpus_per_node + local

    def ranks_of_node(self, node: int) -> range:
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def nic_of(self, rank: int) -> int:
        """NIC index (within its node) next to ``rank``."""
        return self.nic_of_gpu[self.local_of(rank)]

    def gpus_of_nic(self, nic: int) -> tuple[int, ...]:
        """Local GPU indices that sit next to NIC ``nic``."""
        return tuple(g for g, n in enumerate(self.nic_of_gpu) if n == nic)

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    # --- speeds (bytes per second) ---------------------------------------------------------
    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbps * 1e9

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbit * 1e9 / 8

    @property
    def gpu_flops(self) -> float:
        return self.gpu_tflops * 1e12

    def with_nodes(self, num_nodes: int) -> Topology:
        """The same node design with another node count."""
        return Topology(
            num_nodes=num_nodes,
            gpus_per_node=self.gpus_per_node,
            nics_per_node=self.nics_per_node,
            nic_of_gpu=self.nic_of_gpu,
            nvlink_gbps=self.nvlink_gbps,
            nic_gbit=self.nic_gbit,
            gpu_name=self.gpu_name,
            gpu_tflops=self.gpu_tflops,
            hbm_gib=self.hbm_gib,
            name=self.name,
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "gpus_per_node": self.gpus_per_node,
            "nics_per_node": self.nics_per_node,
            "nic_of_gpu": list(self.nic_of_gpu),
            "nvlink_gbps": self.nvlink_gbps,
            "nic_gbit": self.nic_gbit,
            "gpu_name": self.gpu_name,
            "gpu_tflops": self.gpu_tflops,
            "hbm_gib": self.hbm_gib,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        known = {
            "name", "num_nodes", "gpus_per_node", "nics_per_node", "nic_of_gpu", "nvlink_gbps",
            "nic_gbit", "gpu_name", "gpu_tflops", "hbm_gib",
        }  # fmt: skip
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown topology fields {sorted(unknown)}; known: {sorted(known)}")
        kwargs = dict(data)
        if "nic_of_gpu" in kwargs:
            kwargs["nic_of_gpu"] = tuple(kwargs["nic_of_gpu"])
        return cls(**kwargs)
