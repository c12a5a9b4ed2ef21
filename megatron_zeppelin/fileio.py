"""Files that appear whole or not at all, and byte counts printed one way.

``atomic_write(path, write)`` is the one way the package writes a file a reader (a resumed run,
another rank, the parent of a worker, a user's next command) may open while or after it is
written: the bytes go to a temporary file in the same directory, are flushed and fsynced, and
the file is renamed over ``path`` (``os.replace`` is atomic on POSIX), after which the directory
is fsynced so that the rename itself survives a crash. A kill at any moment leaves the previous
file or the whole new one, never a torn one, and no temporary file behind on an error.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO

FILE_MODE = 0o644
"""Mode of a written file (``mkstemp`` would leave it private, 0600)."""


def atomic_write(path: str, write: Callable[[IO[bytes]], object], *, mode: int = FILE_MODE) -> None:
    """Call ``write(f)`` on a binary temporary file, then move it over ``path`` atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_directory(directory)


def atomic_write_text(path: str, text: str, *, mode: int = FILE_MODE) -> None:
    """``atomic_write`` of a UTF-8 string."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), mode=mode)


def fsync_directory(directory: str) -> None:
    """Make a rename or a new file in ``directory`` durable (a no-op where the OS cannot)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def format_bytes(num_bytes: float) -> str:
    """``512 B``, ``1.50 KB``, ``2.00 MB``, ``3.10 GB``: powers of 1000, as link bandwidths are
    quoted (GB/s), in every log and table of the package."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"
