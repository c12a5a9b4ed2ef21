"""``zeppelin train``: the CPU training job on emulated nodes, launched like torchrun.

    zeppelin train                       # 4 processes = 2 nodes x 2 GPUs, 24 steps
    zeppelin train --steps 40 --json runs/cpu/train.json --save runs/cpu/ckpt

Every flag of ``python -m megatron_zeppelin.megatron.train_cpu`` is accepted and passed on;
``--nproc`` sets the process count (tensor parallel x Zeppelin ranks). Known third-party
warnings (Apex / TransformerEngine missing on CPU, megatron-core deprecations) are hidden in the
workers; ``--verbose`` shows them.

Bad input fails before any process starts (``check_before_launch``): the process count against
the tensor-parallel size and the topology, the Zeppelin flags, the model dimensions, the token
budget, the dataset, the checkpoint to resume and the calibration file. Each problem is one line
``zeppelin train: error: ...`` and exit status 2. Input that only a worker can find wrong (a
document the data check could not see) ends the same way: the first worker to fail prints the
line, every worker stops, exit status 2. Any other failure is a bug; its traceback stays.

The workers start through torchrun's own launcher (``elastic_launch``, what ``torchrun
--standalone`` runs), in this process, so that a failed run ends with our line instead of
torchrun's report; ``command_line(args)`` gives the equivalent torchrun command.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Iterator

from megatron_zeppelin.megatron import train_cpu

USER_ERROR_EXIT = 2
"""Exit status of a worker stopped by bad input (it printed the reason)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="Processes to start (default 4).")
    train_cpu.add_arguments(parser)


def worker_arguments(args: argparse.Namespace) -> list[str]:
    """The job's flags that differ from its defaults, as a worker's command line."""
    forwarded: list[str] = []
    probe = train_cpu.build_parser()
    for action in probe._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue  # the job's own default applies
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false: the flag flips the default
            forwarded.append(flag)
        elif value is not None:
            forwarded += [flag, str(value)]
    return forwarded


def command_line(args: argparse.Namespace) -> list[str]:
    """The torchrun command that runs the job with ``args``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", "-m", "megatron_zeppelin.megatron.train_cpu",
        *worker_arguments(args),
    ]  # fmt: skip


def one_line(message: object) -> str:
    """``message`` with its line breaks and runs of spaces folded: an error is one line."""
    return " ".join(str(message).split())


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_before_launch(args: argparse.Namespace) -> None:
    """Everything about ``args`` that can be checked without starting a process; raises
    ``ValueError`` with the flag to change (see ``check_job``)."""
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    # The workers see torchrun's variables; 'auto' topologies read them, so show them the same.
    with _environment(WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc)):
        check_job(args, world_size=args.nproc)


def _check_device(args: argparse.Namespace, config, world_size: int) -> None:  # noqa: ANN001
    """One GPU per process with ``--device cuda``, and a kernel that runs on the job's device."""
    from megatron_zeppelin.attention.kernels import choose_kernel, requires_cuda
    from megatron_zeppelin.megatron.precision import DTYPES, job_device

    if args.device == "cpu":
        if requires_cuda(config.kernel):
            raise ValueError(
                f"--zeppelin-kernel {config.kernel} needs CUDA, but this job runs on CPU "
                "processes: use --zeppelin-kernel torch (or auto), or --device cuda"
            )
        return
    job_device("cuda")
    if world_size > torch_cuda_count():
        raise ValueError(
            f"--device cuda runs one process per GPU: --nproc {world_size} needs {world_size} "
            f"GPUs and {torch_cuda_count()} are visible"
        )
    choose_kernel(config.kernel, device="cuda", dtype=DTYPES[args.dtype])


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_job(args: argparse.Namespace, *, world_size: int) -> None:
    """Check the job's flags for ``world_size`` processes the way the workers will use them;
    raise ``ValueError`` naming the flag or file to change."""
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.megatron.args import resolve_topology

    for flag, value, least in (
        ("--steps", args.steps, 0), ("--tokens-per-step", args.tokens_per_step, 1),
        ("--micro-batches", args.micro_batches, 1), ("--save-every", args.save_every, 0),
        ("--dataset-tokens", args.dataset_tokens, 1),
    ):  # fmt: skip
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    tp = args.tensor_parallel
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"--tensor-parallel {tp} does not divide the {world_size} processes: make --nproc "
            "a multiple of the tensor-parallel size"
        )
    zeppelin_world = world_size // tp
    config = ZeppelinConfig.from_args(args)
    _check_device(args, config, world_size)
    topology = resolve_topology(config, zeppelin_world, tensor_parallel=tp)
    dims = train_cpu.model_dims(args)
    _check_dims(dims, tp)
    _check_budget(args, config, zeppelin_world)
    path, why = train_cpu.pick_calibration(args, config)
    cost_model = train_cpu.job_cost_model(dims, topology, tp, path, why, args)
    lengths = _check_data(args, dims)
    if lengths is not None:
        train_cpu.build_sampler(args, config, lengths, cost_model, zeppelin_world)
    if args.load:
        _check_checkpoint(args.load, world_size)
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise ValueError(f"--json {args.json}: the directory {parent} does not exist")


def _check_dims(dims: train_cpu.ModelDims, tp: int) -> None:
    """Shapes megatron-core would refuse with a bare assert deep inside the model."""
    for name, value in vars(dims).items():
        if name != "dtype" and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if dims.hidden_size % dims.num_heads:
        raise ValueError(
            f"--hidden-size {dims.hidden_size} is not a multiple of --num-heads {dims.num_heads}"
        )
    if dims.num_heads % dims.num_kv_heads:
        raise ValueError(
            f"--num-heads {dims.num_heads} is not a multiple of --num-kv-heads "
            f"{dims.num_kv_heads} (grouped-query attention shares each KV head evenly)"
        )
    for name in ("num_kv_heads", "ffn_hidden_size", "vocab_size"):
        if getattr(dims, name) % tp:
            raise ValueError(
                f"--{name.replace('_', '-')} {getattr(dims, name)} does not split over "
                f"--tensor-parallel {tp}: pick a multiple of it"
            )


def _check_budget(args: argparse.Namespace, config, zeppelin_world: int) -> None:
    """Every document piece fits in a step, and a step fits in the GPUs' capacity."""
    longest = config.max_document_length
    if longest is not None and longest > args.tokens_per_step:
        raise ValueError(
            f"--zeppelin-max-document-length {longest} exceeds --tokens-per-step "
            f"{args.tokens_per_step}: a document piece must fit in one step; lower the one or "
            "raise the other"
        )
    if config.capacity is not None:
        held = config.capacity * zeppelin_world * args.micro_batches
        if args.tokens_per_step > held:
            raise ValueError(
                f"--tokens-per-step {args.tokens_per_step} does not fit in {args.micro_batches} "
                f"micro-batch(es) of {zeppelin_world} ranks x --zeppelin-capacity "
                f"{config.capacity} tokens ({held}): lower --tokens-per-step or raise "
                "--zeppelin-capacity or --micro-batches"
            )


def _check_data(args: argparse.Namespace, dims) -> object | None:
    """Open ``--dataset`` (its tokens must fit the vocabulary) and return its document
    lengths; ``None`` when the synthetic data is still to be written (its distribution must
    exist)."""
    import numpy as np

    from megatron_zeppelin.megatron.data import DocumentDataset

    if args.dataset is None:
        prefix = os.path.join(args.run_dir, "data", f"synthetic-{args.seed}")
        if os.path.exists(prefix + ".idx"):
            return DocumentDataset(prefix).lengths
        from megatron_zeppelin.planner.distributions import distribution_mean

        distribution_mean(args.distribution)  # raises on an unknown name
        return None
    dataset = DocumentDataset(args.dataset)
    if dataset.num_tokens:
        tokens = np.memmap(dataset.path_prefix + ".bin", dtype=dataset.dtype, mode="r")
        top = int(tokens.max())
        if top >= dims.vocab_size:
            raise ValueError(
                f"--dataset {args.dataset} holds token id {top}, outside the model's vocabulary "
                f"(--vocab-size {dims.vocab_size}): raise --vocab-size above {top}"
            )
    return dataset.lengths


def _check_checkpoint(directory: str, world_size: int) -> None:
    """``--load`` names a checkpoint written by as many processes as this run starts."""
    if not os.path.isdir(directory):
        raise ValueError(f"--load {directory}: no such directory (write one with --save)")
    saved = sorted(f for f in os.listdir(directory) if f.startswith("rank") and f.endswith(".pt"))
    if not saved:
        raise ValueError(
            f"--load {directory} holds no checkpoint (rank*.pt): write one with --save"
        )
    wanted = [os.path.basename(train_cpu.checkpoint_path(directory, r)) for r in range(world_size)]
    if saved != wanted:
        raise ValueError(
            f"--load {directory} was saved by {len(saved)} processes but this run starts "
            f"{world_size}: resume with the same --nproc"
        )


def _launch(args: argparse.Namespace) -> int:
    """Start ``--nproc`` workers on this host and wait; the status as described above."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone picks
        max_restarts=0,
        monitor_interval=0.1,  # a failed worker stops the others within a tenth of a second
    )
    # The agent logs every failure as a multi-line report; the worker already said what failed.
    elastic_logger = logging.getLogger("torch.distributed.elastic")
    level = elastic_logger.level
    if not args.verbose:
        elastic_logger.setLevel(logging.CRITICAL)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.verbose:
        env["ZEPPELIN_VERBOSE"] = "1"  # the workers then keep third-party warnings on
    try:
        with _environment(**env):
            elastic_launch(config, sys.executable)(
                "-m", "megatron_zeppelin.megatron.train_cpu", *worker_arguments(args)
            )
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        if USER_ERROR_EXIT in codes.values():
            return USER_ERROR_EXIT  # the first worker to fail printed the reason
        rank, failure = exc.get_first_failure()
        print(
            f"zeppelin train: error: worker rank {rank} failed with exit code "
            f"{failure.exitcode} (its traceback is above)",
            file=sys.stderr,
        )
        return 1
    except SignalException:
        print("zeppelin train: interrupted", file=sys.stderr)
        return 130
    finally:
        elastic_logger.setLevel(level)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        check_before_launch(args)
    except ValueError as exc:
        raise ValueError(one_line(exc)) from exc
    return _launch(args)
