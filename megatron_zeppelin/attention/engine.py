"""``ZeppelinAttention``: one rank's causal, per-document attention for one micro-batch's plan.

Construct it once per micro-batch (the plan changes every micro-batch) and call it from every
layer: the constructor precomputes this rank's whole ring schedule, kernel pairs and index
tensors (``layout.py``), so a call only moves tensors. The call runs the concurrent ring engine
(``ring.py``): inter-node transfers are posted first, intra-node next, local documents are
computed while both travel, then every ring step's blocks are computed (one varlen call per tier
and mask kind) while the next step's blocks travel. Backward sends dK/dV back around the rings.
Documents the plan runs with the 2-D scheme (heads split inside each node, one ring per rail
across nodes) add a head all-to-all before and after, and their column rings take turns with
the flat tiers (``two_d.py``).

Two of Megatron's attention variants are arguments of a call, since a model may use them in
some layers only: ``window`` (sliding-window attention, ``--window-size window,0``; the calls of
each window are derived once per micro-batch from the same ring schedule,
``RankLayout.windowed``) and ``sink_n`` (per-head sink logits, ``--softmax-type``; gradients
flow to it).

Transport is the ``exchanger``, a ``comm.protocol.Exchanger`` (``comm.exchange.DistExchanger``
across processes, ``comm.threads.ThreadExchanger`` across threads); the engine only calls its
``start``. When the exchanger has ``for_plan`` (the routed transports do), the engine keeps a
view of it bound to the plan, made at construction, so routes always match the plan being
executed, in the backward too, whatever micro-batches ran in between (a transport with only
``set_plan`` is handed the plan instead). ``timer`` (a
``step_timing.RingTimer``, optional) records compute and communication per tier and ring step.
On CUDA every kernel runs on the caller's current stream (``ring.py`` says how the transfers
overlap it).

Shapes: ``q_tnd`` ``(t, nq, d)``, ``k_tnd``/``v_tnd`` ``(t, nkv, d)``: t tokens of this rank's
attention buffer (``plan.attention_ranges(rank)`` order), nq query heads grouped over nkv K/V
heads, d head dim.
"""

from __future__ import annotations

import torch

from megatron_zeppelin.attention.head_layout import HeadLayout
from megatron_zeppelin.attention.kernels.kernels import available_kernels
from megatron_zeppelin.attention.layout import RankLayout
from megatron_zeppelin.attention.ring import RingAttentionFunction, RingRuntime
from megatron_zeppelin.attention.step_timing import RingTimer
from megatron_zeppelin.attention.two_d import TwoDRuntime
from megatron_zeppelin.comm.protocol import Exchanger
from megatron_zeppelin.planner.plan.plan import AttentionComm, Plan

__all__ = ["ZeppelinAttention"]


class ZeppelinAttention:
    """Callable ``out_tnd = attention(q_tnd, k_tnd, v_tnd)`` for ``rank`` of ``plan``."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        exchanger: Exchanger,
        *,
        kernel: str = "auto",
        softmax_scale: float | None = None,
        timer: RingTimer | None = None,
    ) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's ranks 0..{plan.world_size - 1}")
        world = getattr(exchanger, "world_size", None)
        if world != plan.world_size:
            raise ValueError(
                f"the plan is for {plan.world_size} ranks but the exchanger spans {world}: build "
                "the plan with the topology the job runs on"
            )
        if getattr(exchanger, "rank", rank) != rank:
            raise ValueError(f"engine for rank {rank} given the exchanger of rank {exchanger.rank}")
        if kernel not in available_kernels():
            raise ValueError(
                f"unknown attention kernel {kernel!r}; choose one of {available_kernels()}"
            )
        if AttentionComm(plan.attention_comm) != AttentionComm.RING:
            raise ValueError(
                f"plan {plan.name!r} gathers K/V with {plan.attention_comm}; the engine runs "
                "ring plans only (the simulator models the other kinds)"
            )
        if softmax_scale is not None and not softmax_scale > 0:
            raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
        if hasattr(exchanger, "for_plan"):
            # Its own view: the backward of this micro-batch may run after the forwards of later
            # ones (pipeline schedules), and must still send along this plan's routes.
            exchanger = exchanger.for_plan(plan)
        elif hasattr(exchanger, "set_plan") and getattr(exchanger, "plan", None) is not plan:
            exchanger.set_plan(plan)
        self.plan = plan
        self.rank = rank
        self.exchanger = exchanger
        self.kernel = kernel
        self.softmax_scale = softmax_scale
        self.layout = RankLayout(plan, rank)
        self.heads = HeadLayout(plan, self.layout) if plan.has_two_d else None
        """The 2-D documents' head buffer and column rings (``None``: the plan has none)."""
        self.timer = timer
        self._runtimes: dict[int | None, RingRuntime | TwoDRuntime] = {}
        self.runtime(None)  # the plain runtime, built now: most calls use it

    def runtime(self, window: int | None) -> RingRuntime | TwoDRuntime:
        """The runtime of calls with ``window`` (``None``: none), built on first use."""
        if window is not None and window < 0:
            raise ValueError(f"an attention window counts key positions, got {window}")
        if window not in self._runtimes:
            flat = RingRuntime(
                self.layout.windowed(window),
                self.exchanger,
                kernel=self.kernel,
                softmax_scale=self.softmax_scale,
                timer=self.timer,
            )
            runtime: RingRuntime | TwoDRuntime = flat
            if self.heads is not None:
                runtime = TwoDRuntime(flat, self.heads.windowed(window), self.exchanger)
            self._runtimes[window] = runtime
        return self._runtimes[window]

    @property
    def num_tokens(self) -> int:
        """Rows this rank's attention buffer must have."""
        return self.layout.num_tokens

    @property
    def num_steps(self) -> int:
        """Ring steps of the longest ring, flat or across nodes on the head layout (0 when
        every document is local)."""
        column_steps = self.heads.num_steps if self.heads is not None else 0
        return max(self.layout.num_steps, column_steps)

    def __call__(
        self,
        q_tnd: torch.Tensor,
        k_tnd: torch.Tensor,
        v_tnd: torch.Tensor,
        *,
        window: int | None = None,
        sink_n: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention within each document; returns ``out_tnd`` like ``q_tnd``. With
        ``window``, a query sees only the ``window`` key positions before its own and itself;
        ``sink_n`` ``(nq)`` adds one logit per query head to every row's softmax denominator."""
        if q_tnd.dim() != 3 or k_tnd.dim() != 3 or v_tnd.dim() != 3:
            raise ValueError(
                f"expected (tokens, heads, head_dim) tensors, got q {tuple(q_tnd.shape)}, "
                f"k {tuple(k_tnd.shape)}, v {tuple(v_tnd.shape)}"
            )
        t = self.layout.num_tokens
        for name, x in (("q", q_tnd), ("k", k_tnd), ("v", v_tnd)):
            if x.shape[0] != t:
                raise ValueError(
                    f"{name} has {x.shape[0]} tokens but rank {self.rank} holds {t} tokens in "
                    "the plan's attention layout: remap the inputs with this micro-batch's plan"
                )
        if not (q_tnd.dtype == k_tnd.dtype == v_tnd.dtype):
            raise ValueError(
                f"q, k, v must share a dtype, got {q_tnd.dtype}, {k_tnd.dtype}, {v_tnd.dtype}"
            )
        if not (q_tnd.device == k_tnd.device == v_tnd.device):
            raise ValueError("q, k, v must be on one device")
        if k_tnd.shape != v_tnd.shape or q_tnd.shape[2] != k_tnd.shape[2]:
            raise ValueError(
                f"k {tuple(k_tnd.shape)} and v {tuple(v_tnd.shape)} must match each other and "
                f"q's head dim {q_tnd.shape[2]}"
            )
        if q_tnd.shape[1] % k_tnd.shape[1]:
            raise ValueError(
                f"{q_tnd.shape[1]} query heads are not a multiple of {k_tnd.shape[1]} K/V heads"
            )
        if sink_n is not None and tuple(sink_n.shape) != (q_tnd.shape[1],):
            raise ValueError(
                f"the sink holds one logit per query head: expected ({q_tnd.shape[1]},), got "
                f"{tuple(sink_n.shape)}"
            )
        return RingAttentionFunction.apply(
            q_tnd.contiguous(),
            k_tnd.contiguous(),
            v_tnd.contiguous(),
            sink_n,
            self.runtime(window),
        )

    def __repr__(self) -> str:
        return (
            f"ZeppelinAttention(rank={self.rank}, tokens={self.num_tokens}, "
            f"steps={self.num_steps}, kernel={self.kernel!r})"
        )
