"""Path arguments of the stage functions called from Python."""

from __future__ import annotations

import os
from typing import Iterable

__all__ = ["path_list"]


def path_list(value: str | os.PathLike | Iterable[str | os.PathLike]) -> list:
    """``value`` as a list of paths: one path (str, bytes or os.PathLike) is a list of one, so a stage given a
    single path from Python (``tile_slides("slides/", ...)``) does not walk through its characters or fail
    with "not iterable"; any other iterable is listed as it is."""
    if isinstance(value, (str, bytes, os.PathLike)):
        return [value]
    return list(value)
