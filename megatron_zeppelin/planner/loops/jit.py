"""numba for the planner's innermost loops, where it is installed.

A few loops of the planner run round after round over every GPU (the refinement's changes,
``loops/local_changes.py``; the pool's search for a ring's GPUs, ``loops/ring_search.py``). Each
is written twice: with numpy, and as a plain loop that numba compiles. Both do the same float
operations in the same order and break ties alike, so a plan is the same with numba or without
(their tests compare the two); with numba it comes sooner.

numba is optional (the ``fast`` extra; NVIDIA's PyTorch containers ship it). A loop is compiled
on its first use in a process (seconds) and cached on disk for the next (numba's own cache,
beside the module or in the user's cache directory). ``ZEPPELIN_PLANNER_JIT=0`` keeps numpy.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType

__all__ = ["compile_loops", "enabled", "turned_off", "version"]


def turned_off() -> bool:
    """Whether ``ZEPPELIN_PLANNER_JIT=0`` keeps numpy's loops, numba installed or not."""
    return os.environ.get("ZEPPELIN_PLANNER_JIT", "1") == "0"


@functools.cache
def _numba() -> ModuleType | None:
    if turned_off():
        return None
    try:
        # lazy: numba is optional (the fast extra), takes half a second to load, and is not
        # loaded at all where ZEPPELIN_PLANNER_JIT=0.
        import numba
    except ImportError:
        return None
    return numba


def enabled() -> bool:
    """Whether the planner's loops run compiled in this process."""
    return _numba() is not None


def version() -> str | None:
    """numba's version where the loops run compiled, else ``None``."""
    numba = _numba()
    return None if numba is None else str(numba.__version__)


def compile_loops(namespace: dict, *names: str) -> Callable | None:
    """The functions ``names`` of a module (its ``globals()``) compiled, each put back under its
    name so that the loops calling it call the compiled one; the last of them, or ``None``
    without numba. Helpers come first: a loop is compiled against what its names hold then."""
    numba = _numba()
    if numba is None:
        return None
    for name in names:
        namespace[name] = numba.njit(cache=True)(namespace[name])
    return namespace[names[-1]]
