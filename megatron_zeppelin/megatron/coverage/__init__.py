"""Every Megatron-LM flag that can change the model's maths or the data, and what ``--zeppelin``
does with it: supported (with the test that shows it), refused at start-up, or irrelevant to
Zeppelin (``answers.py`` says what each means). No flag gets a fourth answer.

The flags are those of the argument groups of Megatron's parser (megatron-core 0.19's
``megatron/training/arguments.py``) named in ``COVERED_GROUPS``: a host test walks the real
parser and fails on a flag of these groups without an answer, so a Megatron release with a new
model flag cannot be silently ignored (``tests/host/test_megatron_flags.py``). The other groups
(logging, profiling, checkpoint I/O, the optimizer's hyper-parameters and schedule, inference,
RL, other model families, fault tolerance) act outside the model's maths and the data.

``first_refusal`` runs every answer's check on Megatron's parsed arguments; the plugin's
start-up (``args.validate_megatron_args``) stops a run with it in one line, exit code 2.
``docs/MEGATRON.md``'s table is generated from ``ANSWERS`` (``scripts/gen_flag_docs.py``).
"""

from __future__ import annotations

import argparse

from megatron_zeppelin.megatron.coverage.answers import (
    IRRELEVANT,
    KINDS,
    REFUSED,
    SUPPORTED,
    Answer,
)
from megatron_zeppelin.megatron.coverage.model_flags import MODEL_ANSWERS
from megatron_zeppelin.megatron.coverage.run_flags import RUN_ANSWERS

__all__ = [
    "ANSWERS",
    "COVERED_GROUPS",
    "IRRELEVANT",
    "KINDS",
    "REFUSED",
    "SUPPORTED",
    "Answer",
    "answer_of",
    "first_refusal",
]

COVERED_GROUPS = (
    "transformer configuration",
    "network size",
    "training",
    "RNG and initialization",
    "mixed precision",
    "distributed init",
    "validation",
    "data and dataloader",
    "tokenizer",
    "moe",
    "mla",
    "experimental_attention_variant",
    "heterogeneous architecture",
    "Transformer-Engine",
    "experimental",
    "sft",
    "Logits Distillation",
)
"""Megatron's argument groups (their parser titles) whose every flag has an answer."""

ANSWERS: tuple[Answer, ...] = (*MODEL_ANSWERS, *RUN_ANSWERS)

_BY_FLAG = {answer.flag: answer for answer in ANSWERS}
if len(_BY_FLAG) != len(ANSWERS):
    raise AssertionError("a flag has two answers")  # import-time: the registry is data


def answer_of(flag: str) -> Answer | None:
    """The answer for ``flag`` (as Megatron's parser spells it), or ``None``."""
    return _BY_FLAG.get(flag)


def first_refusal(args: argparse.Namespace) -> str | None:
    """The first refusal Megatron's parsed ``args`` meet (one line: the flag, what is wrong,
    what to change), or ``None`` when every flag is fine."""
    for answer in ANSWERS:
        refusal = answer.refusal(args)
        if refusal:
            return refusal
    return None
