"""Megatron-LM's hooks driven the way ``pretrain()`` of core_v0.16.1 drives them, without
Megatron-LM's ``megatron.training`` (megatron-core does not ship it): each test installs a small
stand-in module in ``sys.modules`` with only what the hooks import.

Tier: processes (one in-process gloo rank with Megatron's parallel state; nothing is spawned).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import types
import warnings

import pytest
import torch

from megatron_zeppelin.megatron import hooks

VOCAB = 64
SEQ_LENGTH = 96  # tokens per GPU per micro-batch; one rank here, so the micro-batch budget


def _megatron_args(data_prefix: str, *extra: str) -> argparse.Namespace:
    """Megatron's parsed arguments: the flags the hooks add, parsed through
    ``extra_args_provider``, plus the Megatron fields the hooks and the stand-in config read."""
    parser = hooks.extra_args_provider(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--zeppelin",
            "--zeppelin-topology",
            "custom",
            "--zeppelin-nodes",
            "1",
            "--zeppelin-kernel",
            "torch",
            # This tier starts no process: plans ahead in a thread. Planner processes are the
            # dist tier's (tests/test_plan_workers.py) and the host tier's (the default).
            "--zeppelin-plan-workers",
            "0",
            *extra,
        ]
    )
    megatron = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        padded_vocab_size=VOCAB,
        max_position_embeddings=4096,
        seq_length=SEQ_LENGTH,
        micro_batch_size=1,
        global_batch_size=2,
        seed=5,
        iteration=0,
        eval_iters=0,
        eval_interval=1000,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        position_embedding_type="rope",
        rotary_interleaved=False,
        rotary_base=10000,
        rotary_percent=1.0,
        normalization="RMSNorm",
        qk_layernorm=False,
        transformer_impl="local",
        spec=None,
        untie_embeddings_and_output_weights=True,
        fp16_lm_cross_entropy=False,
        calculate_per_token_loss=False,
        data_path=[data_prefix],
    )
    for key, value in megatron.items():
        setattr(args, key, value)
    return args


def _config_from_args(args: argparse.Namespace):
    """Stand-in for ``core_transformer_config_from_args``: the fields it maps for this model,
    with its rule for K/V heads (``num_query_groups`` only with ``--group-query-attention``,
    else ``None``: one per query head) and precision (``bf16`` / ``fp16`` / ``params_dtype``)."""
    from megatron.core.transformer import TransformerConfig

    gqa = getattr(args, "group_query_attention", True)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if gqa else None,
        bf16=getattr(args, "bf16", False),
        fp16=getattr(args, "fp16", False),
        ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=getattr(args, "params_dtype", torch.float32),
        calculate_per_token_loss=args.calculate_per_token_loss,
    )


@pytest.fixture
def megatron_training(monkeypatch):
    """Install the stand-in ``megatron.training``; yields a setter for its ``get_args``."""
    holder: dict[str, argparse.Namespace] = {}
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: holder["args"]
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.core_transformer_config_from_args = _config_from_args
    training.arguments = arguments
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)
    hooks.reset()
    yield lambda args: holder.__setitem__("args", args)
    hooks.reset()


@pytest.fixture
def dataset_prefix(tmp_path) -> str:
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset

    prefix = str(tmp_path / "docs")
    write_synthetic_dataset(prefix, lengths=[40, 7, 55, 13, 30, 2, 61, 24], vocab_size=VOCAB)
    return prefix


@pytest.mark.pure
def test_hook_signatures_accept_megatrons_calls() -> None:
    # get_model: model_provider_func(pre_process=, post_process=, [vp_stage=,] config=,
    # pg_collection=); the data builder asserts vp_stage is a parameter under virtual pipelining.
    model_params = inspect.signature(hooks.model_provider).parameters
    for name in ("pre_process", "post_process", "vp_stage", "config", "pg_collection"):
        assert name in model_params, name
    assert "vp_stage" in inspect.signature(hooks.train_valid_test_datasets_provider).parameters
    step_params = list(inspect.signature(hooks.forward_step).parameters)
    assert step_params[:2] == ["data_iterator", "model"]


@pytest.mark.threads
def test_hooks_build_train_and_return_megatrons_per_token_loss(
    megatron_training, one_rank, dataset_prefix
) -> None:
    from megatron_zeppelin.megatron.model.core_attention import ZeppelinCoreAttention

    args = _megatron_args(dataset_prefix)
    args.spec = ["megatron_zeppelin.megatron.spec", "local"]  # the --spec the docs give
    megatron_training(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hooks.model_provider(
            pre_process=True, post_process=True, config=None, pg_collection=None
        )
    # setup ran inside the first model build and switched Megatron to the per-token loss.
    assert args.calculate_per_token_loss and model.config.calculate_per_token_loss
    cores = [m for m in model.modules() if isinstance(m, ZeppelinCoreAttention)]
    assert len(cores) == args.num_layers

    markers, valid, test = hooks.train_valid_test_datasets_provider([6, 0, 0])
    assert (len(markers), valid, test) == (6, None, None)
    loader = iter(torch.utils.data.DataLoader(markers, batch_size=1))

    # Peek at the step the hooks draw next, then rewind the sampler to it.
    sampler = hooks._STATE.feed.sampler
    before = sampler.state_dict()
    step = sampler.next_step()
    sampler.load_state_dict(before)
    expected = [sum(s.num_tokens for s in mb) - len(mb) for mb in step.micro_batches]
    assert len(expected) == args.global_batch_size  # one optimizer step = all its micro-batches

    for micro_batch, expected_count in enumerate(expected):
        output, loss_func = hooks.forward_step(loader, model)
        loss, num_tokens, report = loss_func(output)
        # Megatron's contract: (loss sum, int token count, {"lm loss": [sum, count]}).
        assert loss.dim() == 0 and loss.requires_grad
        assert num_tokens.dtype == torch.int and int(num_tokens) == expected_count
        torch.testing.assert_close(report["lm loss"][0], loss.detach())
        assert int(report["lm loss"][1]) == expected_count
        # Labels never cross a document: one unlabelled token per document in the micro-batch.
        assert output.shape == (1, expected_count + len(step.micro_batches[micro_batch]))
        loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.threads
def test_a_micro_batch_without_documents_gives_zero_loss_and_zero_gradients(
    megatron_training, one_rank, dataset_prefix, monkeypatch
) -> None:
    from megatron_zeppelin.megatron.documents.sampler import StepBatch
    from megatron_zeppelin.megatron.plans.feed import FedMicroBatch

    args = _megatron_args(dataset_prefix)
    megatron_training(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hooks.model_provider(pre_process=True, post_process=True)
    hooks.train_valid_test_datasets_provider([4, 0, 0])
    # What the sampler hands over when a step has too few documents: an empty micro-batch.
    feed = hooks._STATE.feed
    empty = FedMicroBatch(StepBatch(step=0, epoch=0, micro_batches=((),)), 0, None)
    monkeypatch.setattr(feed, "next", lambda: (monkeypatch.undo(), empty)[1])
    output, loss_func = hooks.forward_step(None, model)
    loss, num_tokens, report = loss_func(output)
    assert int(num_tokens) == 0 and float(loss.detach()) == 0.0
    assert report["lm loss"].tolist() == [0.0, 0.0]
    loss.backward()
    # Every parameter gets a (zero) gradient, so Megatron's gradient reduction still runs.
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and not g.any() for g in grads)
    # The next micro-batch comes from the sampler and runs the model as usual.
    output, loss_func = hooks.forward_step(None, model)
    assert int(loss_func(output)[1]) > 0


@pytest.mark.threads
def test_under_pipeline_parallelism_a_micro_batch_without_documents_still_runs_every_stage(
    megatron_training, one_rank, dataset_prefix, monkeypatch
) -> None:
    """Megatron's pipeline schedules pass activations between the stages for every
    micro-batch, so a micro-batch without documents runs each stage's model on one padding row:
    the first stage sends a hidden state, the last returns a loss that counts no token."""
    from megatron_zeppelin.megatron.documents.sampler import StepBatch
    from megatron_zeppelin.megatron.plans.feed import FedMicroBatch

    args = _megatron_args(dataset_prefix)
    megatron_training(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        last = hooks.model_provider(pre_process=True, post_process=True)
        first = hooks.model_provider(pre_process=True, post_process=False)
    hooks.train_valid_test_datasets_provider([4, 0, 0])
    hooks._STATE.pipeline_parallel = 2  # what setup records for a pipeline-parallel run
    empty = FedMicroBatch(StepBatch(step=0, epoch=0, micro_batches=((), ())), 0, None)
    feed = hooks._STATE.feed
    monkeypatch.setattr(feed, "next", lambda: empty)
    hidden, _ = hooks.forward_step(None, first)
    assert hidden.shape == (1, 1, args.hidden_size) and hidden.requires_grad
    output, loss_func = hooks.forward_step(None, last)
    loss, num_tokens, report = loss_func(output)
    assert output.shape == (1, 1) and int(num_tokens) == 0 and float(loss.detach()) == 0.0
    loss.backward()
    grads = [p.grad for p in last.parameters() if p.requires_grad]
    assert all(g is not None and not g.any() for g in grads)


@pytest.mark.threads
def test_megatron_flags_the_hooks_cannot_honour_are_refused(
    megatron_training, one_rank, dataset_prefix
) -> None:
    args = _megatron_args(dataset_prefix)
    args.eval_iters, args.multiple_validation_sets = 10, True
    megatron_training(args)
    with pytest.raises(ValueError, match="drop --multiple-validation-sets"):
        hooks.model_provider(pre_process=True, post_process=True)
    args = _megatron_args(dataset_prefix)
    args.eval_iters = 10  # 8 documents: Megatron's default split holds none out
    megatron_training(args)
    with pytest.raises(ValueError, match="the validation split holds no document .*--split 969"):
        hooks.model_provider(pre_process=True, post_process=True)
    args = _megatron_args(dataset_prefix)
    args.eval_interval = None  # Megatron's default: train_iters // eval_interval would fail
    megatron_training(args)
    with pytest.raises(ValueError, match="add --eval-interval"):
        hooks.model_provider(pre_process=True, post_process=True)
    args = _megatron_args(dataset_prefix)
    args.zeppelin_kernel = "torch-flash"  # needs CUDA: refused here, never only printed
    megatron_training(args)
    with pytest.raises(ValueError, match="--zeppelin-kernel torch-flash: .*cannot run here"):
        hooks.model_provider(pre_process=True, post_process=True)
    args = _megatron_args(dataset_prefix)
    args.spec = ["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"]
    megatron_training(args)
    hooks.reset()
    with pytest.raises(ValueError, match="core attention"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks.model_provider(pre_process=True, post_process=True)


@pytest.mark.threads
def test_the_plan_prices_megatrons_model_and_the_startup_summary_says_so(
    megatron_training, one_rank, dataset_prefix, capsys
) -> None:
    # Megatron's defaults: --num-query-groups 1 means nothing without --group-query-attention.
    args = _megatron_args(dataset_prefix)
    args.group_query_attention, args.num_query_groups = False, 1
    args.bf16, args.params_dtype = True, torch.bfloat16
    megatron_training(args)
    hooks.setup(args)
    spec = hooks._STATE.runtime.cost_model.model
    assert (spec.num_heads, spec.num_kv_heads, spec.dtype_bytes) == (4, 4, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("zeppelin: node shape 1 nodes x 1 Zeppelin ranks")
    assert "4 heads, 4 K/V heads, 16-bit (bf16/fp16)" in out[1]
    assert "datasheet figures" in out[1]
    assert out[2] == "zeppelin: attention kernel torch (requested with --zeppelin-kernel)"
    hooks.reset()
    args.group_query_attention, args.num_query_groups = True, 2
    hooks.setup(args)
    assert hooks._STATE.runtime.cost_model.model.num_kv_heads == 2


def _draw(model, num: int) -> list:
    """Run ``forward_step`` ``num`` times; the document slices each micro-batch trained on."""
    seen = []
    feed = hooks._STATE.feed
    real = feed.next

    def record():
        item = real()
        seen.append(item.slices)
        return item

    feed.next = record
    for _ in range(num):
        hooks.forward_step(None, model)
    return seen


@pytest.mark.threads
def test_resume_restores_the_sampler_saved_beside_the_checkpoint_or_replays_it(
    megatron_training, one_rank, dataset_prefix, tmp_path, capsys, monkeypatch
) -> None:
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset
    from megatron_zeppelin.megatron.documents.resume import sampler_state_path
    from megatron_zeppelin.megatron.documents.sampler import DocumentSampler

    save = str(tmp_path / "ckpt")
    other = str(tmp_path / "other")  # a blend of two datasets: the state holds both places
    write_synthetic_dataset(other, lengths=[9, 33, 4, 70, 18, 26], vocab_size=VOCAB)

    def start(**extra):
        hooks.reset()
        args = _megatron_args(dataset_prefix)
        args.data_path = ["0.4", dataset_prefix, "0.6", other]
        args.save, args.save_interval, args.train_iters = save, 2, 3
        for key, value in extra.items():
            setattr(args, key, value)
        megatron_training(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = hooks.model_provider(pre_process=True, post_process=True)
        hooks.train_valid_test_datasets_provider([8, 0, 0])
        return model

    whole = _draw(start(), 8)  # 4 steps of 2 micro-batches
    sources = {hooks._STATE.dataset.locate(s.doc)[0].path_prefix for mb in whole for s in mb}
    assert sources == {dataset_prefix, other}
    # Written for the iterations Megatron saves at: every 2nd and the last (--train-iters 3).
    for iteration, there in ((1, False), (2, True), (3, True), (4, True)):
        assert os.path.exists(sampler_state_path(save, iteration)) == there

    drawn = []
    real_next_step = DocumentSampler.next_step
    monkeypatch.setattr(
        DocumentSampler, "next_step", lambda self: (drawn.append(1), real_next_step(self))[1]
    )
    capsys.readouterr()
    model = start(load=save, iteration=2)
    assert not drawn, "the sampler state is restored, not replayed"
    assert f"sampler restored at iteration 2 from {sampler_state_path(save, 2)}" in (
        capsys.readouterr().out
    )
    assert _draw(model, 4) == whole[4:]

    # A checkpoint without the file (a signal or time-limit save): replayed, and said so.
    os.remove(sampler_state_path(save, 2))
    drawn.clear()
    model = start(load=save, iteration=2, save=None)
    assert len(drawn) >= 2
    assert "no sampler state for iteration 2" in capsys.readouterr().out
    assert _draw(model, 4) == whole[4:]


@pytest.mark.threads
def test_forward_step_is_the_one_micro_batch_step(
    megatron_training, one_rank, dataset_prefix, monkeypatch
) -> None:
    """The hooks run the model through ``step.forward_batch``, as the CPU job and the check do
    (``tests/test_one_step.py``), so all three pass the same tokens, positions and labels."""
    from megatron_zeppelin.megatron import step as step_module
    from megatron_zeppelin.megatron.model.core_attention import ZeppelinPackedSeqParams

    calls = []
    real = step_module.forward_batch
    monkeypatch.setattr(
        step_module,
        "forward_batch",
        lambda model, batch, params: (calls.append((batch, params)), real(model, batch, params))[1],
    )
    args = _megatron_args(dataset_prefix)
    megatron_training(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hooks.model_provider(pre_process=True, post_process=True)
    hooks.train_valid_test_datasets_provider([2, 0, 0])
    output, _ = hooks.forward_step(None, model)
    ((batch, params),) = calls
    assert isinstance(params, ZeppelinPackedSeqParams) and params.plan is not None
    assert torch.equal(params.positions, batch.position_ids_t)
    assert output.shape == (1, batch.num_tokens)
