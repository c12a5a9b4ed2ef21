"""Zeppelin's settings: one dataclass, validated once; the command-line flags come from it.

Every field of ``ZeppelinConfig`` becomes one flag: ``enabled`` is ``--zeppelin`` and every other
field ``foo_bar`` is ``--zeppelin-foo-bar`` (a boolean field that defaults to on becomes
``--zeppelin-no-foo-bar``). The help text of a flag is the docstring under its field, so the two
can never drift apart. ``from_args`` reads a parsed namespace back (Megatron's ``args`` included,
where the flags arrive through ``extra_args_provider``) and validates the result.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from megatron_zeppelin.planner.search.partition import PlannerOptions, tier_thresholds

THRESHOLD_WORDS = ("auto", "off")
NEVER_SPLIT = 1 << 40
"""The threshold of a tier that is ``off``: no document reaches it, so the tier splits only what
capacity forces."""
KERNELS = (
    "auto", "cudnn", "flash", "flash3", "te", "torch", "torch-fa3", "torch-fa4", "torch-flash",
)  # fmt: skip
"""The attention kernels of ``attention.kernels.kernels`` (a test keeps the two lists equal)."""
LONG_DOCUMENTS = ("split", "truncate")


@dataclass
class ZeppelinConfig:
    """Everything Zeppelin needs besides the model and the data. See the module docstring."""

    enabled: bool = False
    """Partition each micro-batch's documents over the data-parallel GPUs with Zeppelin
    (hierarchical sequence partitioning, ring attention, routing, remapping)."""
    topology: str = "auto"
    """Cluster model: a preset name, a topology YAML file, 'auto' to read the launcher's shape,
    or 'custom' to build one from --zeppelin-nodes / --zeppelin-gpus-per-node (one NIC per GPU
    unless --zeppelin-nics-per-node says otherwise)."""
    nodes: int | None = None
    """Number of nodes; overrides the preset's. Default: the processes / GPUs per node."""
    gpus_per_node: int | None = None
    """GPUs per node (physical); overrides the preset's. With tensor parallelism a node holds
    GPUs / TP Zeppelin ranks, each talking through the NIC next to its GPUs."""
    nics_per_node: int | None = None
    """Inter-node NICs per node (physical); overrides the preset's."""
    capacity: int | None = None
    """Most tokens one GPU may hold in either layout (memory). Longer documents are always
    split over several GPUs. Default: no limit beyond the balance the planner seeks."""
    intra_threshold: str = "auto"
    """Shortest document worth splitting over an intra-node ring, in tokens; 'auto' derives it
    from the cost model, 'off' never splits inside a node unless capacity forces it."""
    inter_threshold: str = "auto"
    """Shortest document worth splitting across nodes, in tokens; 'auto' derives it from the
    cost model, 'off' never splits across nodes unless capacity forces it."""
    kernel: str = field(default="auto", metadata={"choices": KERNELS})
    """Attention kernel: 'te' (TransformerEngine's cuDNN fused attention), 'cudnn' (PyTorch's
    cuDNN attention), 'flash3' (FlashAttention-3, Hopper), 'torch-fa3' / 'torch-fa4'
    (FlashAttention-3/4 through PyTorch's switch), 'flash' (flash-attn 2), 'torch-flash'
    (PyTorch's own flash kernels), 'torch' (tiled, runs everywhere, CPU included), or 'auto':
    the first that runs here in the order of measured speed where --zeppelin-calibration
    measured kernels on this GPU, else cuDNN-class kernels first on Hopper and newer,
    flash-attn first before; torch where none runs. The start-up summary says which and why.
    A kernel named here that cannot run stops with an error."""
    routing: bool = True
    """Split inter-node ring messages over proxy GPUs so that every NIC carries a share."""
    remap: bool = True
    """Run the linear modules on a token-balanced layout and move tokens to the attention layout
    and back around core attention; off: linear modules run on the attention layout."""
    two_d: bool = True
    """Let documents that span nodes use the 2-D scheme (heads spread over a node by an
    all-to-all, then rings across nodes per head group) where the planner predicts it faster
    than one flat ring; off: flat rings only."""
    pool: bool = True
    """Let the planner also place the batch over all GPUs as one pool (rings sized to a target
    load, across nodes over part of a node's GPUs too): first where the long documents' rings
    set the batch's least load (a placement within 2.5% of it ends the search), and where its
    staged placement leaves GPUs uneven, keeping whichever the simulator times faster; off:
    staged placement only (faster planning where the packing sets the step, slower where long
    documents do: 30-40 ms on against 50-180 ms off at 1024 GPUs and 4M tokens)."""
    calibration: str | None = field(default=None, metadata={"aliases": ("cost-model",)})
    """Cost-model file of measured kernel and link figures (from 'zeppelin profile');
    default: datasheet figures."""
    log_plan_every: int = 0
    """Log the plan summary (tiers, imbalance, bytes per link) every N steps; 0: never."""
    comm_timeout_s: float = 600.0
    """Seconds a ring transfer, or a Zeppelin collective given a CommWatch (remap all-to-all,
    loss and gradient all-reduces: the CPU job), may wait for a peer before failing with an error
    that names the rank that stalled; on NCCL, the process groups' watchdog timeout."""
    max_document_length: int | None = None
    """Longest document the sampler hands to the planner, in tokens; longer ones are split into
    pieces or truncated (--zeppelin-long-documents). Default: no limit."""
    long_documents: str = field(default="split", metadata={"choices": LONG_DOCUMENTS})
    """What happens to a document over --zeppelin-max-document-length: 'split' trains on every
    piece as its own document, 'truncate' keeps only its first piece."""
    plan_ahead: int = 6
    """Micro-batches planned ahead while the current one trains (a plan may take up to that many
    micro-batches' time to make and still come in time); 0 plans each micro-batch when it
    starts."""
    plan_workers: int | None = None
    """Processes that plan ahead, each planning every Nth micro-batch; 0 plans ahead in a thread
    of the training process, which holds the interpreter lock the thread launching kernels
    needs. Default: 1 (none with --zeppelin-plan-ahead 0)."""
    share_plans: bool = True
    """Plan each micro-batch once: the first rank of every node runs the planner processes and
    plans every Nth micro-batch (N: the nodes), and every rank receives each plan over a CPU
    (gloo) group as soon as it is made; off: every rank plans every micro-batch itself. Only
    with planner processes (not with --zeppelin-plan-workers 0 or --zeppelin-plan-ahead 0)."""

    @property
    def planner_processes(self) -> int:
        """How many processes plan ahead (``plan_workers``, resolved; 0: a thread or none)."""
        if not self.plan_ahead:
            return 0
        return 1 if self.plan_workers is None else self.plan_workers

    # --- validation ------------------------------------------------------------------------
    def validate(self) -> ZeppelinConfig:
        """Raise ``ValueError`` with the flag to change on a bad or contradictory setting."""
        for name in ("nodes", "gpus_per_node", "nics_per_node", "capacity", "max_document_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag_of(name)} must be a positive integer, got {value!r}")
        if self.plan_ahead < 0:
            raise ValueError(f"{flag_of('plan_ahead')} must be >= 0 (0 plans in the step)")
        if self.plan_workers is not None:
            if not isinstance(self.plan_workers, int) or self.plan_workers < 0:
                raise ValueError(
                    f"{flag_of('plan_workers')} must be >= 0 (0 plans ahead in a thread), got "
                    f"{self.plan_workers!r}"
                )
            if self.plan_workers > max(self.plan_ahead, 1) or (
                self.plan_workers and not self.plan_ahead
            ):
                raise ValueError(
                    f"{flag_of('plan_workers')} {self.plan_workers} plans at most "
                    f"{flag_of('plan_ahead')} ({self.plan_ahead}) micro-batches at once: raise "
                    f"{flag_of('plan_ahead')} to at least {self.plan_workers}, or lower "
                    f"{flag_of('plan_workers')}"
                )
        if self.log_plan_every < 0:
            raise ValueError(f"{flag_of('log_plan_every')} must be >= 0 (0 turns logging off)")
        if not self.comm_timeout_s > 0:
            raise ValueError(f"{flag_of('comm_timeout_s')} must be positive seconds")
        for name in ("kernel", "long_documents"):
            choices = _field(name).metadata["choices"]
            if getattr(self, name) not in choices:
                got = getattr(self, name)
                raise ValueError(
                    f"{flag_of(name)} must be one of {', '.join(choices)}, got {got!r}"
                )
        intra, inter = self.threshold("intra"), self.threshold("inter")
        if isinstance(intra, int) and isinstance(inter, int) and inter < intra:
            raise ValueError(
                f"{flag_of('inter_threshold')} ({inter}) is below {flag_of('intra_threshold')} "
                f"({intra}): a document worth a slow cross-node ring is worth a fast NVLink one; "
                "raise the inter-node threshold or lower the intra-node one"
            )
        if self.topology == "custom" and self.gpus_per_node is None and self.nodes is None:
            raise ValueError(
                "--zeppelin-topology custom needs --zeppelin-nodes or --zeppelin-gpus-per-node "
                "(the other follows from the data-parallel size); --zeppelin-nics-per-node "
                "defaults to one NIC per GPU"
            )
        if self.gpus_per_node and self.nics_per_node and self.nics_per_node > self.gpus_per_node:
            raise ValueError(
                f"{flag_of('nics_per_node')} ({self.nics_per_node}) exceeds "
                f"{flag_of('gpus_per_node')} ({self.gpus_per_node}): give each NIC a GPU"
            )
        if intra == "off" and inter == "off" and self.capacity is not None:
            # No ring at all: every document must fit on one GPU.
            if self.max_document_length is None:
                raise ValueError(
                    "with both tier thresholds 'off' and a capacity set, documents are never "
                    "split, so set --zeppelin-max-document-length to at most the capacity "
                    f"({self.capacity}) or turn a threshold back on"
                )
            if self.max_document_length > self.capacity:
                raise ValueError(
                    f"--zeppelin-capacity ({self.capacity}) is smaller than the longest document "
                    f"(--zeppelin-max-document-length {self.max_document_length}) while splitting "
                    "is off (both thresholds 'off'): raise the capacity, lower the maximum "
                    "document length, or let documents split"
                )
        return self

    def threshold(self, tier: str) -> int | str:
        """The intra- or inter-node threshold as tokens, or the word 'auto' / 'off'."""
        name = f"{tier}_threshold"
        raw = str(getattr(self, name)).strip().lower()
        if raw in THRESHOLD_WORDS:
            return raw
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"{flag_of(name)} must be 'auto', 'off' or a token count, got {raw!r}"
            ) from None
        if value < 1:
            raise ValueError(f"{flag_of(name)} must be a positive token count, got {value}")
        return value

    def planner_options(
        self,
        cost_model: Any,
        *,
        allow_split: bool = True,
        linear_layout: str = "auto",
        two_d: bool | None = None,
        pool: bool | None = None,
    ) -> Any:
        """``planner.search.partition.PlannerOptions`` of these settings: the one path from flags to
        the planner (the Megatron hooks, the CPU job, the check and ``zeppelin plan`` use it).

        Thresholds: both ``auto`` leave them to the planner; both ``off`` turn balance
        splitting off; otherwise ``auto`` takes the cost model's value and ``off`` is
        ``NEVER_SPLIT``. A token count given on the command line is kept as given, and the
        other threshold moves to respect ``intra <= inter`` (a document worth a cross-node ring
        is worth an NVLink one): an automatic or ``off`` intra threshold comes down to an
        explicit inter one, an automatic inter threshold goes up to an explicit intra one.
        """
        two_d = self.two_d if two_d is None else two_d
        pool = self.pool if pool is None else pool
        intra, inter = self.threshold("intra"), self.threshold("inter")
        common = dict(
            routing=self.routing,
            remap=self.remap,
            linear_layout=linear_layout,
            two_d=two_d,
            pool=pool,
        )
        if intra == "off" and inter == "off":
            return PlannerOptions(allow_split=False, **common)
        if intra == "auto" and inter == "auto":
            return PlannerOptions(allow_split=allow_split, **common)
        auto_intra, auto_inter = tier_thresholds(cost_model)
        low = auto_intra if intra == "auto" else NEVER_SPLIT if intra == "off" else intra
        high = auto_inter if inter == "auto" else NEVER_SPLIT if inter == "off" else inter
        if low > high:
            if isinstance(inter, int) or intra == "off":
                low = high
            else:
                high = low
        return PlannerOptions(thresholds=(low, high), allow_split=allow_split, **common)

    # --- command line ----------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add ``--zeppelin`` and one ``--zeppelin-*`` flag per field to ``parser``."""
        group = parser.add_argument_group("zeppelin", "Zeppelin sequence partitioning")
        docs = field_docs()
        for f in dataclasses.fields(cls):
            kind, optional = _base_type(f.name)
            help_text = docs[f.name]
            if kind is bool and f.default is True:
                group.add_argument(
                    flag_of(f.name, negated=True),
                    dest=dest_of(f.name),
                    action="store_false",
                    help=f"Turn off: {help_text}",
                )
            elif kind is bool:
                group.add_argument(
                    flag_of(f.name), dest=dest_of(f.name), action="store_true", help=help_text
                )
            else:
                default = f.default
                suffix = "" if default is None else f" (default: {default})"
                aliases = [f"--zeppelin-{a}" for a in f.metadata.get("aliases", ())]
                group.add_argument(
                    flag_of(f.name),
                    *aliases,
                    dest=dest_of(f.name),
                    type=kind,
                    default=default,
                    choices=f.metadata.get("choices"),
                    help=help_text + suffix,
                )
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ZeppelinConfig:
        """Read the flags back from a parsed namespace (missing ones keep their defaults)."""
        values = {}
        for f in dataclasses.fields(cls):
            if hasattr(args, dest_of(f.name)):
                values[f.name] = getattr(args, dest_of(f.name))
        return cls(**values).validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def dest_of(name: str) -> str:
    """Attribute name of a field on a parsed namespace (``args.zeppelin_capacity``)."""
    return "zeppelin" if name == "enabled" else f"zeppelin_{name}"


def flag_of(name: str, *, negated: bool = False) -> str:
    """Command-line flag of a field (``--zeppelin-capacity``, ``--zeppelin-no-routing``)."""
    if name == "enabled":
        return "--zeppelin"
    return f"--zeppelin-{'no-' if negated else ''}{name.replace('_', '-')}"


def field_docs() -> dict[str, str]:
    """The docstring under each field, read from the class source (one line each)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(ZeppelinConfig)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    missing = {f.name for f in dataclasses.fields(ZeppelinConfig)} - set(docs)
    assert not missing, f"fields without a docstring: {sorted(missing)}"
    return docs


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(ZeppelinConfig) if f.name == name)


def _base_type(name: str) -> tuple[type, bool]:
    """The argparse type of a field and whether it may be ``None``."""
    hint = typing.get_type_hints(ZeppelinConfig)[name]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [a for a in args if a is not type(None)]
        assert len(kinds) == 1, hint
        return kinds[0], True
    return hint, False
