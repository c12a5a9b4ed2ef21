"""Megatron-LM's GPT pretraining with Zeppelin: ``python -m megatron_zeppelin.pretrain_gpt``.

Takes every Megatron-LM flag plus ``--zeppelin`` and the ``--zeppelin-*`` flags:

    torchrun --nproc-per-node 8 --nnodes 2 ... -m megatron_zeppelin.pretrain_gpt \\
        MODEL, TRAINING AND DATA FLAGS --zeppelin --zeppelin-topology dgx-h100

(a whole command, tested against Megatron's own parser: docs/MEGATRON.md, "Running it").

Needs ``megatron.training``: megatron-core 0.19 wheels ship it; for 0.16.1 use the Docker image
or put a Megatron-LM checkout on ``PYTHONPATH``. The hooks are in ``megatron/hooks.py``; this
file only hands them to ``pretrain()``, in whichever of the two calling conventions the
installed release has:

* core_v0.16.1: ``pretrain(datasets_provider, model_provider, model_type, forward_step,
  extra_args_provider=, args_defaults=)``; ``pretrain()`` parses and validates the arguments;
* megatron-core 0.19: the caller parses and validates (``parse_and_validate_args``), builds
  the config container (``pretrain_cfg_container_from_args``) and calls ``pretrain(container,
  datasets_provider, model_type, forward_step, model_provider=)``.

With the 0.19 wheel (rather than a source checkout) two things are handled here (the others are
documented in docs/MEGATRON.md, "What the megatron-core 0.19 wheel needs on a cluster"): the
wheel ships the compiled dataset helper but not the Makefile Megatron's start-up runs ``make``
on (``use_shipped_dataset_helpers``), and checkpoint saving needs ``psutil``, which the wheel
does not declare (``require_checkpoint_packages``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable

import megatron.core.datasets as datasets
from megatron.core.datasets import utils
from megatron.core.enums import ModelType

from megatron_zeppelin.megatron import evaluation, hooks
from megatron_zeppelin.megatron.args import validate_megatron_args

# What upstream pretrain_gpt.py passes: the tokenizer used when --tokenizer-type is not given.
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
PARSES_ARGS = "pretrain parses the arguments"  # core_v0.16.1
TAKES_CONTAINER = "caller parses, pretrain takes a config container"  # megatron-core 0.19


def _require_megatron_training():
    try:
        training = importlib.import_module("megatron.training")
    except ImportError as exc:
        raise SystemExit(
            "megatron_zeppelin.pretrain_gpt needs Megatron-LM's megatron.training, which is not "
            f"importable here ({exc}). Install megatron-core 0.19 (its wheel ships it), use the "
            "project's Docker image, or put a Megatron-LM core_v0.16.1 checkout on PYTHONPATH."
        ) from exc
    return training


def calling_convention(pretrain: Callable) -> str:
    """Which of the two supported ``pretrain()`` signatures ``pretrain`` has."""
    params = list(inspect.signature(pretrain).parameters)
    if "extra_args_provider" in params:
        return PARSES_ARGS
    if params and params[0] == "cfg_container" and "model_provider" in params:
        return TAKES_CONTAINER
    raise SystemExit(
        f"megatron_zeppelin.pretrain_gpt does not know this megatron.training's pretrain"
        f"({', '.join(params[:5])}, ...): use megatron-core 0.16.1 or 0.19.x"
    )


def use_shipped_dataset_helpers() -> bool:
    """Megatron's start-up runs ``make`` in ``megatron/core/datasets`` to build its C++ dataset
    helper; the 0.19 wheel ships that helper compiled but not the Makefile, so ``make`` fails and
    Megatron exits. When the Makefile is absent and the compiled helper imports, start-up uses
    the shipped helper instead of compiling; a source checkout (Makefile present) compiles as
    upstream does. Returns whether the shipped helper is used."""
    if os.path.exists(os.path.join(os.path.dirname(datasets.__file__), "Makefile")):
        return False
    try:
        # lazy: probed: the compiled helper may be missing.
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False  # neither a Makefile nor a built helper: Megatron's own error explains
    utils.compile_helpers = lambda: None
    return True


def require_checkpoint_packages(args) -> None:
    """Refuse a run that saves checkpoints without ``psutil`` before it trains: megatron-core
    0.19's checkpoint writer imports it (``dist_checkpointing/strategies/filesystem_async.py``)
    and fails at the first save otherwise, yet its wheel does not declare it."""
    if not getattr(args, "save", None):
        return
    try:
        # lazy: probed: the 0.19 wheel does not install psutil.
        import psutil  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--save needs psutil (megatron-core's checkpoint writer uses it; its wheel does not "
            "install it): pip install psutil"
        ) from None


def check_plugin_args(args) -> None:
    """The plugin's start-up checks on Megatron's parsed and validated arguments (every flag's
    answer in ``megatron.coverage``, then Zeppelin's own), before Megatron initializes
    (``hooks.setup`` runs them again once the process groups exist); raises ``ValueError``
    saying which flag to change."""
    validate_megatron_args(args, world_size=args.world_size)
    evaluation.check_flags(args)  # the data and evaluation flags, and the datasets' headers


def _pretrain_with_container(training, model_type) -> None:
    """megatron-core 0.19: parse and validate here, then hand ``pretrain()`` the container."""
    # lazy: megatron.training exists only beside Megatron-LM (tests install a stand-in).
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(
        extra_args_provider=hooks.extra_args_provider, args_defaults=ARGS_DEFAULTS
    )
    try:
        check_plugin_args(args)
    except ValueError as exc:  # bad flags: one line, before any process group exists
        print(f"megatron_zeppelin.pretrain_gpt: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    require_checkpoint_packages(args)
    with warnings.catch_warnings():
        # The container's model config stays empty on purpose: hooks.model_provider builds
        # GPTModel with Zeppelin's layer spec, which a ModelConfig builder cannot express.
        warnings.filterwarnings("ignore", message=r"[\s\S]*recommended to use a ModelConfig")
        container = pretrain_cfg_container_from_args(args)
    training.pretrain(
        container,
        hooks.train_valid_test_datasets_provider,
        model_type,
        hooks.forward_step,
        model_provider=hooks.model_provider,
    )


def main() -> int:
    training = _require_megatron_training()

    if "--zeppelin" not in sys.argv[1:]:
        raise SystemExit("megatron_zeppelin.pretrain_gpt runs Zeppelin: add --zeppelin")
    convention = calling_convention(training.pretrain)
    # Megatron's loader builds the (tiny) marker dataset on every rank, not only on TP rank 0.
    hooks.train_valid_test_datasets_provider.is_distributed = True
    use_shipped_dataset_helpers()
    # The model provider runs hooks.setup on its first call: after Megatron's initialization,
    # before the model and the data, which both need the groups and the cost model.
    if convention == PARSES_ARGS:
        training.pretrain(
            hooks.train_valid_test_datasets_provider,
            hooks.model_provider,
            ModelType.encoder_or_decoder,
            hooks.forward_step,
            extra_args_provider=hooks.extra_args_provider,
            args_defaults=ARGS_DEFAULTS,
        )
    else:
        _pretrain_with_container(training, ModelType.encoder_or_decoder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
