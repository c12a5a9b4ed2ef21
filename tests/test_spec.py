"""Zeppelin's layer specs and core attention inside Megatron's GPTModel (tier: processes, one
in-process gloo rank: Megatron needs an initialized process group, nothing is spawned)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, import_module

from megatron_zeppelin.megatron import spec as spec_module
from megatron_zeppelin.megatron.model.core_attention import (
    ZeppelinCoreAttention,
    ZeppelinPackedSeqParams,
)
from megatron_zeppelin.megatron.model.rotary import Rope
from megatron_zeppelin.megatron.spec import (
    core_attention_of,
    has_transformer_engine,
    zeppelin_layer_spec,
)
from megatron_zeppelin.planner.plan.plan import Plan


class _Received:
    """A finished exchange: ``wait`` hands over the received tensors once."""

    def __init__(self, received: dict[tuple[int, int], torch.Tensor]) -> None:
        self._received: dict[tuple[int, int], torch.Tensor] | None = received

    def wait(self) -> dict[tuple[int, int], torch.Tensor]:
        if self._received is None:
            raise RuntimeError("wait() called twice on one exchange")
        received, self._received = self._received, None
        return received


class GroupExchanger:
    """``Exchanger`` running each ring step as one ``all_to_all_single`` on ``group`` (group
    rank ``i`` is plan rank ``i``). Synchronous: ``start`` returns after the step has moved.

    No routing, overlap or counters: enough to run a model in one process without building
    ``ZeppelinGroups``; jobs use ``create_transport``."""

    def __init__(self, group: dist.ProcessGroup, *, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        assert dist.get_rank(group) == rank, "group rank must be the Zeppelin rank"

    def set_plan(self, plan: Plan) -> GroupExchanger:
        if plan.world_size != self.world_size:
            raise ValueError(
                f"the plan is for {plan.world_size} ranks but the group has {self.world_size}"
            )
        return self

    def start(self, messages, payload, *, row_shape, dtype, tag: str) -> _Received:
        send_counts, recv_counts = [0] * self.world_size, [0] * self.world_size
        outgoing, incoming = [], []
        for msg in messages:  # at most one message per edge and step
            if msg.src == self.rank and msg.num_tokens:
                send_counts[msg.dst] = msg.num_tokens
                outgoing.append((msg.dst, payload[(msg.src, msg.dst)]))
            if msg.dst == self.rank:
                recv_counts[msg.src] = msg.num_tokens
                incoming.append(msg.src)
        outgoing.sort(key=lambda item: item[0])  # all_to_all lays rows out by peer rank
        empty = torch.empty((0, *row_shape), dtype=dtype)
        send = torch.cat([t.to(dtype) for _, t in outgoing]) if outgoing else empty
        recv = torch.empty((sum(recv_counts), *row_shape), dtype=dtype)
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        offsets = [sum(recv_counts[:src]) for src in range(self.world_size)]
        return _Received(
            {
                (src, self.rank): recv[offsets[src] : offsets[src] + recv_counts[src]]
                for src in incoming
            }
        )


def _types(spec: ModuleSpec) -> dict[str, object]:
    """Module of every leaf of a layer spec, by path."""
    out: dict[str, object] = {}

    def walk(node: object, path: str) -> None:
        if isinstance(node, ModuleSpec):
            out[path] = node.module
            walk(node.submodules, path)
        elif node is not None and hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                walk(getattr(node, name), f"{path}.{name}")
        elif isinstance(node, type):
            out[path] = node

    walk(spec, "layer")
    return out


@pytest.mark.pure
def test_local_spec_is_megatrons_with_only_core_attention_replaced() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    ours, theirs = _types(zeppelin_layer_spec("local")), _types(megatron_spec)
    core = "layer.self_attention.core_attention"
    assert ours.pop(core) is ZeppelinCoreAttention
    assert theirs.pop(core) is not ZeppelinCoreAttention
    assert ours == theirs
    # Building a spec never edits Megatron's (shared) spec objects.
    assert core_attention_of(megatron_spec) is not ZeppelinCoreAttention


@pytest.mark.pure
def test_spec_attributes_work_with_megatrons_spec_flag() -> None:
    local = import_module(("megatron_zeppelin.megatron.spec", "local"))
    assert core_attention_of(local).module is ZeppelinCoreAttention
    assert hasattr(spec_module, "te") == has_transformer_engine()
    params = core_attention_of(zeppelin_layer_spec("local", rope=Rope(base=500.0))).params
    assert params["rope"] == Rope(base=500.0)


@pytest.mark.pure
def test_unknown_or_unavailable_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="local"):
        zeppelin_layer_spec("flash")
    if not has_transformer_engine():
        with pytest.raises(ValueError, match="TransformerEngine"):
            zeppelin_layer_spec("te")


@pytest.mark.threads
def test_gpt_with_zeppelin_core_attention_matches_plain_attention(one_rank) -> None:
    from megatron_zeppelin.job.check import ReferencePackedSeqParams, reference_spec
    from megatron_zeppelin.megatron.model.rotary import positions_of_ranges
    from megatron_zeppelin.megatron.runtime import ModelDims, build_gpt
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.search.partition import plan_batch
    from megatron_zeppelin.topology.model import Topology

    dims = ModelDims(hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=64)
    lengths = [7, 1, 12, 3]
    topology = Topology(num_nodes=1, gpus_per_node=1, nics_per_node=1)
    cost = CostModel.default(dims.model_spec(), topology)
    plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=2 * sum(lengths))
    tokens = torch.randint(0, dims.vocab_size, (1, sum(lengths)))
    labels = torch.randint(0, dims.vocab_size, (1, sum(lengths)))
    ranges = plan.linear_ranges(0)
    # Linear buffer order may differ from document order: build the reference in that order.
    order = torch.cat([torch.arange(r.start, r.end) + sum(lengths[: r.seq]) for r in ranges])
    positions = positions_of_ranges(ranges)

    model = build_gpt(dims, seed=3)
    params = ZeppelinPackedSeqParams(
        plan=plan, rank=0, exchanger=GroupExchanger(dist.group.WORLD, rank=0), positions=positions
    )
    losses = model(tokens[:, order], None, None, labels=labels[:, order], packed_seq_params=params)
    losses.sum().backward()

    reference = build_gpt(dims, seed=3, layer_spec=reference_spec(dims))
    ref_params = ReferencePackedSeqParams(lengths, torch.cat([torch.arange(n) for n in lengths]))
    ref_losses = reference(tokens, None, None, labels=labels, packed_seq_params=ref_params)
    ref_losses.sum().backward()

    torch.testing.assert_close(losses[0], ref_losses[0, order], rtol=1e-5, atol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="ZeppelinPackedSeqParams"):
        model(tokens, None, None, labels=labels)


@pytest.mark.pure
def test_every_parameter_of_megatrons_spec_builders_is_set_from_the_config() -> None:
    unknown = spec_module.unknown_builder_parameters()
    assert set(unknown) >= {"get_gpt_layer_local_spec", "get_gpt_decoder_block_spec"}
    assert not any(unknown.values()), unknown


@pytest.mark.threads
def test_a_moe_config_gets_megatrons_block_spec_with_zeppelin_attention_in_every_layer(
    one_rank,
) -> None:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    fields = dict(num_layers=3, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    moe = TransformerConfig(
        **fields, num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0, 1], qk_layernorm=True
    )
    block = spec_module.model_spec(moe, kind="local", rope=Rope(base=500.0))
    assert isinstance(block, TransformerBlockSubmodules)
    mlps = [layer.submodules.mlp for layer in block.layer_specs]
    assert [getattr(m, "module", None) is MoELayer for m in mlps] == [True, False, True]
    for layer in block.layer_specs:
        assert core_attention_of(layer).module is ZeppelinCoreAttention
        assert core_attention_of(layer).params["rope"] == Rope(base=500.0)
        assert layer.submodules.self_attention.submodules.q_layernorm is not IdentityOp
    dense = spec_module.model_spec(TransformerConfig(**fields), kind="local", rope=None)
    assert (
        isinstance(dense, ModuleSpec) and core_attention_of(dense).module is ZeppelinCoreAttention
    )
