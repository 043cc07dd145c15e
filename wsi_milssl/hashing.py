"""The SHA-256 of a file: the one helper every stage uses for file digests (the hex digest of the bytes)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["file_sha256", "cached_file_sha256"]

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
