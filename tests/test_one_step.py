"""One micro-batch step: the CPU job and the check run the model through ``step.py`` exactly as
the Megatron hooks do (``tests/test_hooks.py`` covers the hooks), core attention works out its
remap once per micro-batch, and padding rows change nothing (tier: threads, a one-rank gloo
group; the remap test is pure)."""

from __future__ import annotations

import pytest
import torch

from megatron_zeppelin.megatron import step as step_module
from megatron_zeppelin.megatron.model.core_attention import ZeppelinPackedSeqParams
from megatron_zeppelin.planner.plan.plan import Plan, SequencePlan, Span, Tier, TokenRange
from megatron_zeppelin.topology.model import Topology


@pytest.fixture
def forward_calls(monkeypatch) -> list[dict]:
    """Every ``step.forward_batch`` call: what went into the model."""
    calls: list[dict] = []
    real = step_module.forward_batch

    def record(model, batch, params):
        calls.append({"batch": batch, "params": params})
        return real(model, batch, params)

    monkeypatch.setattr(step_module, "forward_batch", record)
    return calls


@pytest.fixture
def dataset(tmp_path) -> str:
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset

    prefix = str(tmp_path / "docs")
    write_synthetic_dataset(prefix, lengths=[50, 30, 20, 41, 7], vocab_size=512)
    return prefix


def _zeppelin_calls(calls: list[dict]) -> list[dict]:
    return [c for c in calls if isinstance(c["params"], ZeppelinPackedSeqParams)]


@pytest.mark.threads
def test_the_cpu_job_runs_the_one_step_and_reports_planning(
    tmp_path, dataset, one_process_group, forward_calls
) -> None:
    from megatron_zeppelin.job.train_cpu import build_parser, summary_text, train

    args = build_parser().parse_args(
        [
            "--run-dir",
            str(tmp_path),
            "--dataset",
            dataset,
            "--quiet",
            "--no-calibration",
            "--steps",
            "2",
            "--micro-batches",
            "2",
            "--tokens-per-step",
            "120",
            "--zeppelin-max-document-length",
            "64",
            "--zeppelin-nodes",
            "1",
            "--zeppelin-plan-workers",
            "0",  # this tier starts no process: the CPU job's planner processes are the dist tier's
        ]
    )
    result = train(args)
    calls = _zeppelin_calls(forward_calls)
    assert len(calls) == sum(1 for r in result["steps"] for mb in r["documents"] if mb)
    for call in calls:
        # Per-document positions reach the model as position_ids too, as in the hooks.
        assert torch.equal(call["params"].positions, call["batch"].position_ids_t)
    planning = result["summary"]["planning"]
    assert planning["num_plans"] == len(calls)
    assert 0.0 <= planning["hidden_s"] <= planning["planning_s"]
    assert "planning" in summary_text(result["summary"])


@pytest.mark.threads
def test_the_check_runs_the_one_step(tmp_path, one_process_group, forward_calls) -> None:
    from megatron_zeppelin.job.check import CheckOptions, _check_rank
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset

    options = CheckOptions(lengths=(40, 9), tensor_parallels=(1,), world_size=1, nodes=1)
    prefix = str(tmp_path / "docs")
    write_synthetic_dataset(prefix, lengths=list(options.lengths), vocab_size=512)
    report = _check_rank(0, options, prefix)
    assert report["runs"]["tp1"]["loss_rel_error"] <= 1e-5
    (call,) = _zeppelin_calls(forward_calls)
    assert torch.equal(call["params"].positions, call["batch"].position_ids_t)


def _count_calls(monkeypatch, cls, name: str) -> list[int]:
    counter = [0]
    real = getattr(cls, name)

    def counted(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return counter


@pytest.mark.threads
def test_layers_share_the_micro_batchs_remap_work(one_rank, tmp_path, monkeypatch) -> None:
    """Plan scans per micro-batch do not grow with the number of layers."""
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset
    from megatron_zeppelin.megatron.documents.data import DocumentDataset
    from megatron_zeppelin.megatron.documents.sampler import DocumentSlice
    from megatron_zeppelin.megatron.runtime import ModelDims, build_gpt, create_transport
    from megatron_zeppelin.megatron.step import StepRuntime, run_micro_batch
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.models import get_model

    prefix = str(tmp_path / "docs")
    write_synthetic_dataset(prefix, lengths=[30, 12], vocab_size=512)
    topology = Topology(num_nodes=1, gpus_per_node=1, nics_per_node=1)
    config = ZeppelinConfig(enabled=True, kernel="torch")
    exchanger, _ = create_transport(topology, one_rank, config)
    runtime = StepRuntime.create(
        config=config,
        topology=topology,
        cost_model=CostModel.default(get_model("tiny"), topology),
        exchanger=exchanger,
        zeppelin_rank=0,
        remap_group=one_rank.dp_group,
        tensor_parallel=1,
        sequence_parallel=False,
    )
    slices = [DocumentSlice(0, 0, 30), DocumentSlice(1, 0, 12)]
    plan = runtime.recipe([30, 12])
    scans = []
    for layers in (1, 4):
        model = build_gpt(ModelDims(num_layers=layers), seed=0)
        counter = _count_calls(monkeypatch, Plan, "linear_ranges")
        run_micro_batch(model, slices, plan, runtime, DocumentDataset(prefix))
        scans.append(counter[0])
        monkeypatch.undo()
    assert scans[0] == scans[1], scans


@pytest.mark.pure
def test_remap_layouts_are_worked_out_once_without_hashing_the_plan(monkeypatch) -> None:
    from megatron_zeppelin.megatron.model import core_attention

    topology = Topology(num_nodes=1, gpus_per_node=2, nics_per_node=2)
    doc = SequencePlan(0, 10, Tier.LOCAL, (0,), (Span(0, 0, 10),))
    plan = Plan(topology, (doc,), ((TokenRange(0, 0, 5),), (TokenRange(0, 5, 10),)))
    # The remap group of a two-rank world, as the process sees it (rank 0).
    monkeypatch.setattr(core_attention.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(core_attention.dist, "get_rank", lambda group=None: 0)
    params = ZeppelinPackedSeqParams(plan=plan, rank=0)
    scans = _count_calls(monkeypatch, Plan, "linear_ranges")
    hashes = _count_calls(monkeypatch, Plan, "__hash__")
    first = params.remap_layouts()
    scans_once = scans[0]
    for _ in range(8):  # one call per layer
        assert params.remap_layouts() is first and params.remaps
    there, back = first
    assert there.num_src_rows == 5 and there.num_dst_rows == 10 and back.num_dst_rows == 5
    assert scans[0] == scans_once and hashes[0] == 0


@pytest.mark.pure
def test_the_remap_functions_find_a_plans_layouts_without_hashing_it(monkeypatch) -> None:
    """``comm.remap.linear_to_attention`` / ``attention_to_linear`` (the engine check's path)
    look a plan's layouts up by identity: a repeated call neither rescans nor hashes the plan."""
    from megatron_zeppelin.comm import remap

    topology = Topology(num_nodes=1, gpus_per_node=2, nics_per_node=2)
    doc = SequencePlan(0, 10, Tier.LOCAL, (0,), (Span(0, 0, 10),))
    plan = Plan(topology, (doc,), ((TokenRange(0, 0, 5),), (TokenRange(0, 5, 10),)))
    scans = _count_calls(monkeypatch, Plan, "linear_ranges")
    hashes = _count_calls(monkeypatch, Plan, "__hash__")
    first = remap._layouts(plan, 0)
    scans_once = scans[0]
    for _ in range(8):  # one call per layer and direction
        assert remap._layouts(plan, 0) is first
    assert scans[0] == scans_once and hashes[0] == 0
    there, back = first
    assert there.num_src_rows == 5 and there.num_dst_rows == 10 and back.num_dst_rows == 5
    # Another rank, or an equal plan that is another object, is worked out anew.
    assert remap._layouts(plan, 1)[0].num_src_rows == 5
    twin = Plan(topology, (doc,), ((TokenRange(0, 0, 5),), (TokenRange(0, 5, 10),)))
    again = remap._layouts(twin, 0)
    assert again is not first and again[0].num_dst_rows == there.num_dst_rows


@pytest.mark.pure
def test_the_cpu_job_does_not_import_the_megatron_hooks() -> None:
    """The CPU job and the hooks share ``report.py`` for what they print, not each other."""
    import ast
    import inspect

    from megatron_zeppelin.job import train_cpu

    tree = ast.parse(inspect.getsource(train_cpu))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "megatron_zeppelin.megatron.report" in imported
    assert not any(name.endswith("megatron.hooks") for name in imported)


@pytest.mark.threads
def test_a_planning_error_ahead_of_training_stops_the_cpu_job_with_its_own_line(
    tmp_path, dataset, one_process_group, monkeypatch, capsys
) -> None:
    from megatron_zeppelin.job.train_cpu import build_parser, train
    from megatron_zeppelin.launch.worker import LOG_DIR_ENV, USER_ERROR_EXIT, report_failure
    from megatron_zeppelin.planner.search import partition

    message = "document 2 (65 tokens) finds no room: raise --zeppelin-capacity"
    real, calls = partition.plan_batch, []

    def fails_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(partition, "plan_batch", fails_on_the_third)
    args = build_parser().parse_args(
        [
            "--run-dir",
            str(tmp_path),
            "--dataset",
            dataset,
            "--quiet",
            "--no-calibration",
            "--steps",
            "4",
            "--micro-batches",
            "1",
            "--tokens-per-step",
            "60",
            "--zeppelin-max-document-length",
            "50",
            "--zeppelin-nodes",
            "1",
            "--zeppelin-plan-ahead",
            "3",
            # In a thread of this process: the stand-in above does not reach a planner process
            # (tests/test_plan_workers.py fails a plan there).
            "--zeppelin-plan-workers",
            "0",
        ]
    )
    with pytest.raises(ValueError) as err:
        train(args)
    assert str(err.value) == message
    monkeypatch.delenv(LOG_DIR_ENV, raising=False)  # under torchrun: the first rank says it
    assert report_failure(err.value, 0, None) == USER_ERROR_EXIT
    assert capsys.readouterr().err == f"zeppelin train: error: {message}\n"
