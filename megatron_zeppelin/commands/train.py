"""``zeppelin train``: the CPU training job on emulated nodes, launched like torchrun.

    zeppelin train                       # 4 processes = 2 nodes x 2 GPUs, 24 steps
    zeppelin train --steps 40 --json runs/cpu/train.json --save runs/cpu/ckpt

Every flag of ``python -m megatron_zeppelin.job.train_cpu`` is accepted and passed on;
``--nproc`` sets the process count (tensor parallel x Zeppelin ranks). Known third-party
warnings (Apex / TransformerEngine missing on CPU, megatron-core deprecations) are hidden in the
workers; ``--verbose`` shows them.

Bad input fails before any process starts (``check_before_launch``): the process count against
the tensor-parallel size and the topology, the Zeppelin flags, the model dimensions, the token
budget, the dataset, the checkpoint to resume (verified against its manifest, and against this
run's model and process count) and the calibration file. Each problem is one line
``zeppelin train: error: ...`` and exit status 2.

The workers start through ``launch.standalone.launch`` (this host, torchrun's variables, a session
of their own each, stderr into ``RUN_DIR/logs/<run>/rankNNN.log``). When the job fails, the launcher
stops every worker and this command prints one line per failed rank, the first cause first (a rank
killed by a signal or found stopped, then what the workers reported: bad input, a stalled peer
named with its step and layer, a diverged loss, a bug), each naming the log file that holds its
traceback; what several ranks reported alike (bad input, a shared plan's error) is one line
naming them all. Exit status 2 when the first cause is bad input, 130 when interrupted, else 1.
``command_line(args)`` gives the equivalent torchrun command.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Iterator

import numpy as np

from megatron_zeppelin import checkpoint
from megatron_zeppelin.attention.kernels.kernels import choose_kernel, requires_cuda
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.devices import require_gpus
from megatron_zeppelin.job import train_cpu
from megatron_zeppelin.launch.standalone import launch
from megatron_zeppelin.launch.worker import USER_ERROR_EXIT
from megatron_zeppelin.megatron.args import resolve_topology
from megatron_zeppelin.megatron.documents.data import DocumentDataset
from megatron_zeppelin.megatron.precision import DTYPES, job_device
from megatron_zeppelin.planner.baselines.distributions import distribution_mean


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
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "megatron_zeppelin.job.train_cpu",
        *worker_arguments(args),
    ]


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
    if args.device == "cpu":
        if requires_cuda(config.kernel):
            raise ValueError(
                f"--zeppelin-kernel {config.kernel} needs CUDA, but this job runs on CPU "
                "processes: use --zeppelin-kernel torch (or auto), or --device cuda"
            )
        return
    job_device("cuda")
    require_gpus(world_size, fix="lower --nproc")
    choose_kernel(config.kernel, device="cuda", dtype=DTYPES[args.dtype])


def check_job(args: argparse.Namespace, *, world_size: int) -> None:
    """Check the job's flags for ``world_size`` processes the way the workers will use them;
    raise ``ValueError`` naming the flag or file to change."""

    for flag, value, least in (
        ("--steps", args.steps, 0),
        ("--tokens-per-step", args.tokens_per_step, 1),
        ("--micro-batches", args.micro_batches, 1),
        ("--save-every", args.save_every, 0),
        ("--dataset-tokens", args.dataset_tokens, 1),
    ):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a positive finite number, got {args.lr}")
    if args.steps == 0 and not args.load:
        raise ValueError("--steps 0 trains no step: give the number of steps to train")
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
    if args.load:  # before the calibration: a resumed run's model is the checkpoint's
        _check_checkpoint(args, world_size, dims)
    _check_budget(args, config, zeppelin_world)
    path, why = train_cpu.pick_calibration(args, config)
    cost_model = train_cpu.job_cost_model(dims, topology, tp, path, why, args)
    lengths = _check_data(args, dims)
    if lengths is not None:
        train_cpu.build_sampler(args, config, lengths, cost_model, zeppelin_world)
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

    if args.dataset is None:
        prefix = os.path.join(args.run_dir, "data", f"synthetic-{args.seed}")
        if os.path.exists(prefix + ".idx"):
            return DocumentDataset(prefix).lengths

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


def _check_checkpoint(args: argparse.Namespace, world_size: int, dims) -> None:
    """``--load`` names a complete checkpoint (every file as its manifest recorded it) of this
    run's model, written by as many processes as this run starts, not past ``--steps``."""

    directory = checkpoint.resolve(args.load)
    try:
        manifest = checkpoint.verify(directory)
    except ValueError as exc:
        raise ValueError(f"--load {args.load}: {exc}") from None
    if manifest.world_size != world_size:
        raise ValueError(
            f"--load {args.load} was saved by {manifest.world_size} processes but this run "
            f"starts {world_size}: resume with the same --nproc"
        )
    saved = manifest.job.get("model", {})
    for name, value in vars(dims).items():
        if name in saved and saved[name] != value:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(
                f"--load {args.load} was saved with {flag} {saved[name]} but this run has "
                f"{flag} {value}: resume with the model flags it was saved with"
            )
    tp = manifest.job.get("tensor_parallel", args.tensor_parallel)
    if tp != args.tensor_parallel:
        raise ValueError(
            f"--load {args.load} was saved with --tensor-parallel {tp} but this run has "
            f"--tensor-parallel {args.tensor_parallel}: resume with the same size"
        )
    if manifest.step > args.steps:
        raise ValueError(
            f"--load {args.load} is at step {manifest.step}, past --steps {args.steps}: raise "
            "--steps to train on from it"
        )
    args.resume_step = manifest.step


def _log_dir(args: argparse.Namespace) -> str:
    """A fresh directory for this launch's per-rank logs and outcomes."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(args.run_dir, "logs", f"train-{stamp}-{os.getpid()}")


def _launch(args: argparse.Namespace) -> int:
    """Start ``--nproc`` workers on this host and wait; the status as described above."""

    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.verbose:
        env["ZEPPELIN_VERBOSE"] = "1"  # the workers then keep third-party warnings on
    timeout = args.zeppelin_comm_timeout_s
    result = launch(
        "megatron_zeppelin.job.train_cpu",
        worker_arguments(args),
        nproc=args.nproc,
        log_dir=_log_dir(args),
        verbose=args.verbose,
        env=env,
        # Workers name a stalled peer themselves after the timeout; the launcher steps in only
        # for a worker stopped while no peer waits on it (start-up, a single process).
        stall_s=2 * timeout,
    )
    if result.ok:
        return 0
    lines, status = failure_report(result)
    for line in lines:
        print(f"zeppelin train: {line}", file=sys.stderr)
    return status


def failure_report(result) -> tuple[list[str], int]:
    """One line per failure, the first cause first, and the exit status (module docstring);
    ``result`` is a ``launch.standalone.LaunchResult``. Bad input (the same on every rank), and an
    error several ranks raised alike (a shared plan's: ``megatron/plans/shared_plans.py``), are said
    once."""
    found = [line for line in map(_rank_line, result.ends) if line is not None]
    found.sort(key=lambda line: line[0])
    alike: dict[str, list[tuple[int, str]]] = {}
    for _, text, _, rank, log in found:
        alike.setdefault(text, []).append((rank, log))
    lines = []
    for text, ranks in alike.items():
        if ranks[0][0] < 0:  # bad input, or a line that names its rank already
            lines.append(f"error: {text}")
            continue
        numbers = ", ".join(str(rank) for rank, _ in sorted(ranks))
        lines.append(
            f"error: rank{'s' if len(ranks) > 1 else ''} {numbers}: {text} (log: {ranks[0][1]})"
        )
    if result.interrupted:
        return [*lines, "interrupted"], 130
    if not lines:
        logs = _shown_path(result.log_dir)
        return [f"error: the workers stopped without saying why (logs: {logs})"], 1
    return lines, USER_ERROR_EXIT if found[0][2] else 1


def _shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    relative = os.path.relpath(path)
    return os.path.abspath(path) if relative.startswith("..") else relative


def _rank_line(end) -> tuple[float, str, bool, int, str] | None:
    """``(when, line, is bad input, rank, log)`` for a rank that failed on its own, the rank
    ``-1`` where the line is whole (bad input, or it names the rank itself); ``None`` otherwise.
    A rank found stopped is the first cause of whatever its peers then reported."""
    outcome, log = end.outcome, _shown_path(end.log)
    if end.stopped:
        text = (
            f"rank {end.rank} stopped responding: its process was found stopped (SIGSTOP or "
            "a debugger) and was killed"
        )
        return -1.0, text, False, -1, log
    if outcome is not None:
        if outcome.kind == "input":
            return outcome.time, outcome.message, True, -1, log
        return outcome.time, outcome.message, False, end.rank, log
    if end.ended_by_launcher or not end.exit_code:
        return None
    if end.exit_code < 0:
        name = signal.Signals(-end.exit_code).name
        text = f"rank {end.rank} was killed by {name} (from outside: it left no traceback)"
    else:
        text = f"rank {end.rank} exited with status {end.exit_code} (log: {log})"
    return end.ended_at or 0.0, text, False, -1, log


def run(args: argparse.Namespace) -> int:
    args.resume_step = 0
    try:
        check_before_launch(args)
    except ValueError as exc:
        raise ValueError(one_line(exc)) from exc
    if args.load and args.resume_step == args.steps:
        print(f"nothing to do: --load {args.load} is already at step {args.steps} (--steps)")
        return 0
    return _launch(args)
