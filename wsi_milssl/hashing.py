"""The SHA-256 of a file: the one helper every stage uses for file digests (the hex digest of the bytes)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["file_sha256"]

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
