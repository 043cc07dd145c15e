"""Path arguments of the stage functions called from Python, and what a path is (a loop of links)."""

from __future__ import annotations

import errno
import os
from typing import Iterable

__all__ = ["path_list", "link_loops"]


def path_list(value: str | os.PathLike | Iterable[str | os.PathLike]) -> list:
    """``value`` as a list of paths: one path (str, bytes or os.PathLike) is a list of one, so a stage given a
    single path from Python (``tile_slides("slides/", ...)``) does not walk through its characters or fail
    with "not iterable"; any other iterable is listed as it is."""
    if isinstance(value, (str, bytes, os.PathLike)):
        return [value]
    return list(value)


def link_loops(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a link in a loop of links (following it never reaches a file), as opposed to a link
    whose target is gone."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False
