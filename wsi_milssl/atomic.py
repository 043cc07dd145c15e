"""Atomic file output: write a temporary file in the same folder, fsync, rename.

A killed process never leaves a file under the final name that looks complete.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_open"]


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on success fsync and rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
