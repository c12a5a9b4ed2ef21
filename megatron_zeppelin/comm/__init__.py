"""The only place torch.distributed is called: groups, ring P2P with routing, remapping, counters.

- ``groups.ZeppelinGroups``: node, rail and world groups of every Zeppelin world (all the
  processes, or the data-parallel ranks of one tensor-parallel index), created once at start-up;
- ``protocol``: the ``Exchanger`` the attention engine calls, and the payload check every
  transport shares (no torch.distributed there);
- ``exchange.DistExchanger``: one ring step's messages, direct or over proxy GPUs;
- ``pending``: how the hops of one step are posted (relays overlapped on gloo, staged on NCCL);
- ``posting``: the order batches are posted in, recorded and checked across ranks;
- ``remap``: all-to-all between the linear and the attention layout (autograd);
- ``heads``: the 2-D scheme's head all-to-all inside each node, over the ring's exchanger;
- ``counters.LinkCounters``: bytes per link class, from the sends actually made;
- ``watch.CommWatch``: collectives bounded by the Zeppelin timeout, and the progress board that
  names a stalled rank (``CommStallError``, a ``ZeppelinCommError``);
- ``plan_share.PlanShare``: each micro-batch's plan broadcast from the rank that made it (the
  first of one node) to every rank, on a gloo group of its own.
- ``threads.ThreadExchanger``: the exchanger protocol across the threads of one process, with
  mailboxes instead of torch.distributed (tests, and one-GPU runs of ``verify`` and
  ``validate-cost-model``).
"""

from megatron_zeppelin.comm.counters import LinkCounters, comparable
from megatron_zeppelin.comm.exchange import DistExchanger
from megatron_zeppelin.comm.groups import ZeppelinGroups
from megatron_zeppelin.comm.posting import PostingLog, check_posting_order
from megatron_zeppelin.comm.protocol import Exchanger, Pending, ZeppelinCommError
from megatron_zeppelin.comm.remap import attention_to_linear, linear_to_attention
from megatron_zeppelin.comm.watch import CommStallError, CommWatch

__all__ = [
    "CommStallError",
    "CommWatch",
    "DistExchanger",
    "Exchanger",
    "LinkCounters",
    "Pending",
    "PostingLog",
    "ZeppelinCommError",
    "ZeppelinGroups",
    "attention_to_linear",
    "check_posting_order",
    "comparable",
    "linear_to_attention",
]
