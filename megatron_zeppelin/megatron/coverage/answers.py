"""The three answers a Megatron flag can get with ``--zeppelin``, and how a refusal is checked.

* ``SUPPORTED``: Zeppelin trains what the flag asks, and ``Answer.test`` names the test that
  shows it (a run equal to one process, or the model Megatron itself builds). Some values of a
  supported flag may still be refused (``Answer.check``).
* ``REFUSED``: a run that sets the flag to anything but ``Answer.allowed`` (default: unset, off,
  zero) stops at start-up with one line naming the flag and what to change.
* ``IRRELEVANT``: the flag means the same with and without Zeppelin. Zeppelin changes only which
  rank holds a token and how core attention runs, so this covers a flag that reaches Megatron's
  own modules through its config and acts on each token alone, on the weights or on the
  optimizer, one that picks a kernel, an overlap or a memory strategy for the same maths, one
  only read together with a refused flag, and one only read by other models or programs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED = "supported"
REFUSED = "refused"
IRRELEVANT = "irrelevant"
KINDS = (SUPPORTED, REFUSED, IRRELEVANT)

Check = Callable[[argparse.Namespace], "str | None"]
"""What a run's arguments get from a flag's check: the refusal (what is wrong and what to
change), or ``None`` when the run may go on."""


def flag_dest(flag: str) -> str:
    """The ``args`` attribute argparse gives ``--some-flag``: ``some_flag``."""
    return flag.lstrip("-").replace("-", "_")


def is_unset(value: Any) -> bool:
    """Unset, off or zero: what a refused flag may be left at."""
    return value is None or value is False or value == 0 or value in ("", [], ())


@dataclass(frozen=True)
class Answer:
    """One Megatron flag and what ``--zeppelin`` does with it."""

    flag: str
    """The flag as Megatron's parser spells it (its first long option)."""
    kind: str
    reason: str
    test: str = ""
    """``SUPPORTED``: the test that shows it, ``path::name``."""
    change: str = ""
    """``REFUSED``: what to change instead."""
    allowed: tuple[Any, ...] = ()
    """``REFUSED``: values that are fine besides unset, off and zero."""
    dest: str = ""
    """The ``args`` attribute, where the flag's name does not spell it."""
    check: Check | None = None
    """A check of its own, for a supported flag with refused values or a refusal that needs
    more than the flag's value."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.flag}: unknown answer {self.kind!r}")
        if self.kind == SUPPORTED and not self.test:
            raise ValueError(f"{self.flag}: a supported flag names the test that shows it")
        if self.kind == REFUSED and not (self.change or self.check):
            raise ValueError(f"{self.flag}: a refusal says what to change")

    @property
    def attribute(self) -> str:
        return self.dest or flag_dest(self.flag)

    def refusal(self, args: argparse.Namespace) -> str | None:
        """Why ``args`` cannot run with this flag, in one line, or ``None``."""
        if not hasattr(args, self.attribute):
            return None  # a Megatron release without the flag
        if self.check is not None:
            return self.check(args)
        if self.kind != REFUSED:
            return None
        value = getattr(args, self.attribute)
        if is_unset(value) or value in self.allowed:
            return None
        return f"{self.flag} {shown(value)}: {self.reason}: {self.change}"


def shown(value: Any) -> str:
    """A flag's value as a user would have typed it."""
    if value is True:
        return "(on)"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    return str(value)


def supported(flag: str, reason: str, *, test: str, check: Check | None = None, dest: str = ""):
    """A flag Zeppelin supports, with the test that shows it."""
    return [Answer(flag, SUPPORTED, reason, test=test, check=check, dest=dest)]


def refused(
    flag: str,
    reason: str,
    *,
    change: str = "",
    allowed: tuple[Any, ...] = (),
    dest: str = "",
    check: Check | None = None,
):
    """A flag refused at start-up unless left at ``allowed`` (or unset, off, zero)."""
    return [Answer(flag, REFUSED, reason, change=change, allowed=allowed, dest=dest, check=check)]


def irrelevant(flags: str, reason: str):
    """Flags (whitespace-separated) that mean the same with and without Zeppelin."""
    return [Answer(flag, IRRELEVANT, reason) for flag in flags.split()]
