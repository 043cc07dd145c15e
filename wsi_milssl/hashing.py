"""The SHA-256 of a file: the one helper every stage uses for file digests (the hex digest of the bytes)."""

from __future__ import annotations

import contextvars
import hashlib
import os
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

__all__ = ["file_sha256", "cached_file_sha256", "file_reads_kept", "kept_file_read"]

T = TypeVar("T")

_BLOCK = 1 << 20


def file_sha256(path: str | os.PathLike, *, limit_bytes: int | None = None) -> str:
    """The hex SHA-256 of the bytes of the file ``path`` (of its first ``limit_bytes`` bytes when given), read
    1 MiB at a time. OSError as ``open`` raises it."""
    digest = hashlib.sha256()
    left = limit_bytes
    with open(path, "rb") as fh:
        while left is None or left > 0:
            chunk = fh.read(_BLOCK if left is None else min(_BLOCK, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest.hexdigest()


_CACHE: dict[tuple[str, int, int], str] = {}


def cached_file_sha256(path: str | os.PathLike) -> str:
    """:func:`file_sha256`, remembered per resolved path, size and modification time within the process (a
    checkpoint or weights file hashed by several stages of one run is read once)."""
    from pathlib import Path

    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        _CACHE[key] = file_sha256(path)
    return _CACHE[key]


#: the reads kept by the innermost :func:`file_reads_kept` of this thread (a context variable: two runs in two
#: threads keep their own, review CL)
_KEPT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("wsi_milssl_file_reads_kept", default=None)


@contextmanager
def file_reads_kept() -> Iterator[None]:
    """Within (one pipeline run): :func:`kept_file_read` computes what it is asked of a file once per identity of
    the file (path, inode, size, modification time), however many checks ask (review CH: every small feature file
    was hashed up to five times by the checks of one run). Nested blocks share the outer one's; after the
    outermost block nothing is kept, so a file written again in place later is read again. Each thread (and
    asyncio task) has its own."""
    token = _KEPT.set({}) if _KEPT.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _KEPT.reset(token)


def kept_file_read(kind: str, path: str | os.PathLike, st: os.stat_result, compute: Callable[[], T]) -> T:
    """``compute()`` (a ``kind`` of value read from the file ``path``, whose ``os.stat`` is ``st``), kept inside
    :func:`file_reads_kept`, computed every time outside it."""
    kept = _KEPT.get()
    if kept is None:
        return compute()
    key = (kind, os.fspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in kept:
        kept[key] = compute()
    return kept[key]  # type: ignore[return-value]
