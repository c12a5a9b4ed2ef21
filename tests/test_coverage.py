"""Tier: pure. The registry of Megatron flags (``megatron.coverage``): every flag one of three
answers, a supported flag names a test that exists, a refused one stops the start-up checks in
one line naming the flag and what to change, and docs/MEGATRON.md's table is generated from it.
Megatron's real parser is walked in the host tier (``tests/host/test_megatron_flags.py``)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from megatron_zeppelin.megatron import coverage
from megatron_zeppelin.megatron.args import extra_args_provider, validate_megatron_args
from megatron_zeppelin.megatron.coverage import checks

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]


def _args(**megatron: object) -> argparse.Namespace:
    """A run with ``--zeppelin`` on 4 ranks of 2 nodes and the given Megatron fields."""
    argv = ["--zeppelin", "--zeppelin-topology", "custom", "--zeppelin-nodes", "2"]
    args = extra_args_provider(argparse.ArgumentParser()).parse_args(argv)
    fields = dict(
        tensor_model_parallel_size=1,
        micro_batch_size=1,
        num_attention_heads=4,
        hidden_size=64,
        calculate_per_token_loss=False,
    )
    for key, value in {**fields, **megatron}.items():
        setattr(args, key, value)
    return args


def test_every_flag_has_exactly_one_of_three_answers() -> None:
    flags = [a.flag for a in coverage.ANSWERS]
    assert len(flags) == len(set(flags)) and len(flags) > 400
    assert {a.kind for a in coverage.ANSWERS} == set(coverage.KINDS)
    assert all(a.flag.startswith("--") and a.reason for a in coverage.ANSWERS)


def test_every_supported_flag_names_a_test_that_exists() -> None:
    missing = []
    for answer in coverage.ANSWERS:
        if answer.kind != coverage.SUPPORTED:
            assert not answer.test, answer.flag
            continue
        path, _, name = answer.test.partition("::")
        source = ROOT / path
        if not source.exists() or f"def {name}(" not in source.read_text():
            missing.append((answer.flag, answer.test))
    assert not missing, missing


@pytest.mark.parametrize(
    "answer",
    [a for a in coverage.ANSWERS if a.kind == coverage.REFUSED and a.check is None],
    ids=lambda a: a.flag,
)
def test_a_refused_flag_stops_the_run_in_one_line_naming_it(answer: coverage.Answer) -> None:
    for value in (None, False, 0, *answer.allowed):
        assert answer.refusal(argparse.Namespace(**{answer.attribute: value})) is None, value
    refusal = answer.refusal(argparse.Namespace(**{answer.attribute: "on"}))
    assert refusal and "\n" not in refusal
    assert refusal.startswith(f"{answer.flag} on: ") and refusal.endswith(answer.change)
    # Megatron releases without the flag have no attribute for it: nothing to refuse.
    assert answer.refusal(argparse.Namespace()) is None


def test_the_start_up_checks_enforce_the_registry() -> None:
    assert validate_megatron_args(_args(num_moe=None), world_size=4).enabled
    # Attention variants Zeppelin runs pass: a causal left window, sinks, Llama 3 scaling.
    variants = {"window_size": [64, 0], "softmax_type": "learnable", "use_rope_scaling": True}
    assert validate_megatron_args(_args(**variants), world_size=4).enabled
    cases = {
        "moe_expert_capacity_factor": (1.25, "--moe-expert-capacity-factor 1.25: "),
        "mtp_num_layers": (1, "--mtp-num-layers 1: "),
        "multi_latent_attention": (True, "--multi-latent-attention (on): "),
        "window_size": ([64, 8], "--window-size 64,8: "),
        "multiple_validation_sets": (True, "--multiple-validation-sets (on): "),
    }
    for field, (value, start) in cases.items():
        with pytest.raises(ValueError) as refused:
            validate_megatron_args(_args(**{field: value}), world_size=4)
        assert str(refused.value).startswith(start), refused.value
    # Without --zeppelin nothing is checked.
    plain = _args(mtp_num_layers=1)
    plain.zeppelin = False
    assert not validate_megatron_args(plain, world_size=4).enabled


def test_moe_dispatchers_cope_with_token_counts_that_differ_per_rank() -> None:
    def refusal(**fields):
        return checks.token_dispatcher(_args(num_experts=8, **fields))

    assert checks.token_dispatcher(_args(pipeline_model_parallel_size=2)) is None  # dense

    assert refusal(moe_token_dispatcher_type="alltoall", expert_model_parallel_size=4) is None
    assert refusal(moe_token_dispatcher_type="allgather", expert_model_parallel_size=1) is None
    assert (
        refusal(
            moe_token_dispatcher_type="allgather",
            tensor_model_parallel_size=2,
            sequence_parallel=True,
        )
        is None
    )  # expert tensor parallelism defaults to TP: one Zeppelin rank's TP ranks
    for fields in (
        dict(expert_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1),
    ):
        message = refusal(moe_token_dispatcher_type="allgather", **fields)
        assert message.startswith("--moe-token-dispatcher-type allgather")
        assert message.endswith("use --moe-token-dispatcher-type alltoall")
    assert "alltoall" in refusal(moe_token_dispatcher_type="flex")
    # Pipeline stages exchange rows whose count changes per micro-batch (variable_seq_lengths).
    message = refusal(moe_token_dispatcher_type="allgather", pipeline_model_parallel_size=2)
    assert "pipeline parallelism" in message and message.endswith("alltoall")
    assert refusal(moe_token_dispatcher_type="alltoall", pipeline_model_parallel_size=2) is None


def test_moe_load_balancing_is_refused_where_it_depends_on_a_ranks_tokens() -> None:
    assert checks.aux_loss_coefficient(_args(moe_aux_loss_coeff=0.0)) is None
    assert checks.aux_loss_coefficient(_args(moe_aux_loss_coeff=[0.0, 0.0])) is None
    message = checks.aux_loss_coefficient(_args(moe_aux_loss_coeff=[0.0, 1e-2]))
    assert message.startswith("--moe-aux-loss-coeff 0.0 0.01: ")
    assert message.endswith("set --moe-aux-loss-coeff 0")
    for kinds in ("aux_loss", "none", ["seq_aux_loss", "global_aux_loss"]):
        assert checks.load_balancing(_args(moe_router_load_balancing_type=kinds)) is None
    message = checks.load_balancing(_args(moe_router_load_balancing_type="sinkhorn"))
    assert message.startswith("--moe-router-load-balancing-type sinkhorn: sinkhorn balances")


def test_limits_of_supported_flags_are_refused_and_their_defaults_are_not() -> None:
    assert checks.kv_channels(_args(kv_channels=16)) is None  # 64 / 4
    assert checks.kv_channels(_args(kv_channels=32)).endswith("drop --kv-channels")
    assert checks.eval_micro_batch_size(_args(eval_micro_batch_size=None)) is None
    assert "set --eval-micro-batch-size 1" in checks.eval_micro_batch_size(
        _args(eval_micro_batch_size=2)
    )
    assert checks.dataloader_type(_args(dataloader_type="cyclic")) is None
    assert checks.dataloader_type(_args(dataloader_type="external")).endswith("external")
    assert checks.rank_mapping(_args(use_tp_pp_dp_mapping=True)) is None  # no pipeline
    mapped = _args(use_tp_pp_dp_mapping=True, pipeline_model_parallel_size=2)
    assert checks.rank_mapping(mapped).endswith("drop --use-tp-pp-dp-mapping")
    assert checks.eval_interval(_args(eval_interval=None)).startswith("--eval-interval: ")


def test_the_megatron_doc_tables_are_generated_from_the_code() -> None:
    # The script's own rewrite, in this process (``scripts/gen_flag_docs.py --check`` does the
    # same comparison; tests/test_scripts.py runs the script itself).
    spec = importlib.util.spec_from_file_location(
        "gen_flag_docs", ROOT / "scripts/gen_flag_docs.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = (ROOT / "docs/MEGATRON.md").read_text()
    assert gen.rewritten(doc) == doc, "run python scripts/gen_flag_docs.py --write"
    table = doc.split("<!-- BEGIN generated: megatron flags -->", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    named = {flag for row in rows for flag in row.split("|")[1].replace("`", "").split(", ")}
    assert {flag.strip() for flag in named} == {a.flag for a in coverage.ANSWERS}
