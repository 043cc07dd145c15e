"""Path arguments of the stage functions called from Python, and what a path is (a loop of links)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Iterable

__all__ = ["path_list", "link_loops", "folder_place", "read_bounded", "FileTooLarge", "escaped_text"]


def path_list(value: str | os.PathLike | Iterable[str | os.PathLike]) -> list:
    """``value`` as a list of paths: one path (str, bytes or os.PathLike) is a list of one, so a stage given a
    single path from Python (``tile_slides("slides/", ...)``) does not walk through its characters or fail
    with "not iterable"; any other iterable is listed as it is."""
    if isinstance(value, (str, bytes, os.PathLike)):
        return [value]
    return list(value)


def escaped_text(text: str) -> str:
    """``text`` with a file name of another encoding than UTF-8 in it (a surrogate escape, as Python decodes such a
    name) written escaped, ``\\udce9``, so that any UTF-8 stream or file takes it (review EY, FA)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class FileTooLarge(OSError):
    """A file :func:`read_bounded` stopped reading: far larger than any file of its kind."""


def read_bounded(path: str | os.PathLike, limit_bytes: int) -> bytes:
    """The bytes of the file ``path``, of which at most ``limit_bytes`` are read: a device or pipe (``/dev/zero``
    reports size 0) never ends, and memory grew until a traceback (review ES, EU). :class:`FileTooLarge` (an
    OSError whose ``strerror`` says why, for the callers' "cannot read" errors) past the limit."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        if stat.S_ISREG(st.st_mode):  # a file says its size: read whole, as read() sizes it
            if st.st_size > limit_bytes:
                raise _too_large(limit_bytes)
            raw = fh.read()
        else:  # in pieces: read(n) allocates n bytes first, the whole bound for every small pipe
            parts, size = [], 0
            while size <= limit_bytes:
                part = fh.read(min(1 << 20, limit_bytes + 1 - size))
                if not part:
                    break
                parts.append(part)
                size += len(part)
            raw = b"".join(parts)
    if len(raw) > limit_bytes:  # (a file that grew while read)
        raise _too_large(limit_bytes)
    return raw


def _too_large(limit_bytes: int) -> FileTooLarge:
    size = f"{limit_bytes >> 20} MiB" if limit_bytes >= 1 << 20 else f"{limit_bytes} bytes"
    return FileTooLarge(errno.EFBIG, f"more than {size}, far larger than any such file")


def link_loops(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a link in a loop of links (following it never reaches a file), as opposed to a link
    whose target is gone."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def folder_place(path: str | os.PathLike) -> Path:
    """Where the folder ``path`` is: an absolute path with the links among the folders above it followed, and
    ``path``'s own name kept even where it is a link itself (a run folder linked to scratch space is where its
    link is, and moves with the folder that holds the link)."""
    if ".." in Path(path).parts:  # ".." as the system resolves it: after following the links before it (review EH, EI)
        place = Path(os.path.join(os.getcwd(), path))
        if place.name in ("", ".", ".."):
            return place.resolve()
        return place.parent.resolve() / place.name
    place = Path(os.path.normpath(os.path.join(_working_folder(), path)))
    return place.parent.resolve() / place.name


def _working_folder() -> str:
    """The working folder as the shell names it (``$PWD``, which keeps a link ``cd`` went through: review EB, a run
    folder that is a link given as "." from inside it), else the resolved one."""
    cwd = os.getcwd()
    shell = os.environ.get("PWD", "")
    try:
        if os.path.isabs(shell) and os.path.samefile(shell, cwd):
            return shell
    except OSError:
        pass
    return cwd
