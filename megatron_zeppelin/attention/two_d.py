"""The engine for plans with 2-D documents: the flat rings plus heads split inside each node.

``planner/plan/heads.py`` describes the scheme, ``head_layout.py`` the buffers and where rows go.
One forward, per rank (every rank runs it, with or without 2-D rows of its own):

1. post the head all-to-all of Q, K, V to the head layout (NVLink, inside each node);
2. post step 0 of every flat tier (inter-node first), as ``RingRuntime`` does;
3. wait for the head all-to-all and post step 0 of the column rings (one ring per rail);
4. compute 0 of both buffers (local documents and own blocks; each node's own zigzag chunks of
   every 2-D document over its group's heads);
5. the ring steps, the flat tiers and the column rings taking turns (``ring.interleave``);
6. move the output of the head buffer back to the token buffer (second all-to-all).

The backward saves the head buffer's Q, K, V, output and lse from the forward, moves dO to the
head layout (posted before the flat rings' step 0), runs both backward passes interleaved the
same way, and moves dQ, dK, dV back, adding the dK, dV of a replicated K/V head over the ranks
that shared it. The output travels in the input dtype (it is cast to it anyway), gradients in
the compute dtype. A sink joins both buffers' rows once their rings are merged, the head
buffer's with its group's query heads; its gradient sums both buffers' rows (a 2-D row's lse is
``-inf`` in the token buffer, so it counts once, in the head buffer).

Letters: t rows of the token buffer, h rows of the head buffer; ``nq``/``nkv`` heads of the
inputs, ``gq``/``gkv`` heads of one group, d head dim.
"""

from __future__ import annotations

import torch

from megatron_zeppelin.attention.head_layout import HeadLayout
from megatron_zeppelin.attention.merge import add_sink_, sink_gradient
from megatron_zeppelin.attention.ring import Buffers, Forward, RingRuntime, interleave
from megatron_zeppelin.comm.heads import HeadAllToAll
from megatron_zeppelin.comm.protocol import Exchanger
from megatron_zeppelin.planner.plan.heads import HeadGroups, head_groups

__all__ = ["TwoDRuntime"]

_TAG = "zeppelin/2d"


class TwoDRuntime:
    """``RingRuntime``'s ``forward``/``backward`` for a plan with 2-D documents."""

    def __init__(self, flat: RingRuntime, heads: HeadLayout, exchanger: Exchanger) -> None:
        self.flat = flat
        self.heads = heads
        self.columns = RingRuntime(
            heads.ring,
            exchanger,
            kernel=flat.kernel_name,
            softmax_scale=flat.softmax_scale,
            tag=_TAG,
            timer=flat.timer,  # the column rings' figures come as "2d inter", "2d own"
            label="2d ",
        )
        gpus = heads.num_groups
        self.all_to_all = HeadAllToAll(exchanger, heads.rank, lambda rank: rank % gpus)
        self._groups: dict[tuple[int, int], HeadGroups] = {}

    def groups(self, num_heads: int, num_kv_heads: int) -> HeadGroups:
        """The head groups of ``num_heads`` query heads over ``num_kv_heads`` K/V heads."""
        key = (num_heads, num_kv_heads)
        if key not in self._groups:
            try:
                self._groups[key] = head_groups(num_heads, num_kv_heads, self.heads.num_groups)
            except ValueError:
                raise ValueError(
                    f"the plan splits some documents' heads over the {self.heads.num_groups} "
                    f"GPUs of each node, but {num_heads} query heads over {num_kv_heads} K/V "
                    "heads do not split that way: plan with the model's head counts in the cost "
                    "model, or with every ring flat (--no-2d, PlannerOptions(two_d=False))"
                ) from None
        return self._groups[key]

    def _group_heads(self, g: HeadGroups) -> slice:
        """This rank's query heads in the head layout, as a slice of the full heads."""
        start, end = g.q[self.heads.group]
        return slice(start, end)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink_n: torch.Tensor | None = None,
    ) -> Forward:
        """``out_tnd``, ``lse_tn`` of the token buffer (the 2-D rows' lse is not kept: their
        backward runs on the head buffer) and the head buffer's tensors to save; ``sink_n``:
        per-head sink logits (optional)."""
        g = self.groups(q.shape[1], k.shape[1])
        heads, a2a = self.heads, self.all_to_all
        inbound = a2a.start(heads.to_heads, (q, k, v), g.of, tag=f"{_TAG}/qkv")
        tokens = Buffers(q, k, v)
        flat_runs = self.flat.forward_runs(tokens)
        for run in flat_runs:
            next(run)
        head = Buffers(*(q.new_empty((heads.num_rows, n, q.shape[2])) for n in g.widths))
        a2a.finish(inbound, (head.q, head.k, head.v), lambda group: g.whole)
        column_runs = self.columns.forward_runs(head)
        for run in column_runs:
            next(run)
        self.flat.forward_own(tokens)
        self.columns.forward_own(head)
        interleave([*reversed(flat_runs), *reversed(column_runs)])
        if sink_n is not None:
            add_sink_(tokens.out, tokens.lse, sink_n)
            add_sink_(head.out, head.lse, sink_n[self._group_heads(g)])
        out_h = head.out.to(q.dtype)
        outbound = a2a.start(
            heads.to_tokens, (out_h,), lambda group: [(0, g.num_q)], tag=f"{_TAG}/out"
        )
        a2a.finish(outbound, (tokens.out,), lambda group: [g.q[group]])
        return tokens.out, tokens.lse, (head.q, head.k, head.v, out_h, head.lse)

    def backward(self, dout, q, k, v, out, lse, saved, sink_n=None):  # noqa: ANN001
        """``dq``, ``dk``, ``dv`` of the token buffer, in the compute dtype, and the gradient of
        ``sink_n`` from this rank's rows of both buffers (``None`` without a sink)."""
        g = self.groups(q.shape[1], k.shape[1])
        heads, a2a = self.heads, self.all_to_all
        inbound = a2a.start(heads.to_heads, (dout,), lambda group: [g.q[group]], tag=f"{_TAG}/dout")
        tokens = self.flat.backward_grads(Buffers(q, k, v, out, lse, dout))
        flat_runs = self.flat.backward_runs(tokens)
        for run in flat_runs:
            next(run)
        dout_h = dout.new_empty((heads.num_rows, g.num_q, dout.shape[2]))
        a2a.finish(inbound, (dout_h,), lambda group: [(0, g.num_q)])
        head = self.columns.backward_grads(Buffers(*saved, dout=dout_h))
        column_runs = self.columns.backward_runs(head)
        for run in column_runs:
            next(run)
        self.flat.backward_own(tokens)
        self.columns.backward_own(head)
        interleave([*reversed(flat_runs), *reversed(column_runs)])
        dq, dk, dv = tokens.dq.result(), tokens.dk.result(), tokens.dv.result()
        # dQ, dK, dV of the head buffer back to the tokens' owners; the 2-D rows of the token
        # buffer hold nothing yet (no flat call touches them), so adding is exact.
        dqkv = (head.dq.result(), head.dk.result(), head.dv.result())
        outbound = a2a.start(heads.to_tokens, dqkv, lambda group: g.whole, tag=f"{_TAG}/dqkv")
        a2a.finish(outbound, (dq, dk, dv), g.of, add=True)
        dsink = None
        if sink_n is not None:
            dsink = sink_gradient(dout, out, lse, sink_n)
            heads = self._group_heads(g)
            _, _, _, out_h, lse_h = saved
            dsink[heads] += sink_gradient(dout_h, out_h, lse_h, sink_n[heads])
        return dq, dk, dv, dsink
