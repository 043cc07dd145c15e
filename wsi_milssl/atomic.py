"""Atomic file output: write a temporary file in the same folder, fsync, rename.

A killed process never leaves a file under the final name that looks complete. Every stage writes
its small outputs (JSON, CSV, PNG, XML, checkpoints, the generated TIFF) through :func:`atomic_open`
or the helpers built on it; patch stores have their own commit step (:mod:`wsi_milssl.store`).
"""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

__all__ = ["atomic_open", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "atomic_write_csv"]


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on success fsync and rename it to ``path``.

    The temporary name is unique per call (process id and a random token), and the file gets the
    usual permissions (0666 minus the umask). Text modes write UTF-8 with newlines untranslated (as
    the csv module expects). On an exception nothing is left behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    text = {} if "b" in mode else {"encoding": "utf-8", "newline": ""}
    try:
        with open(tmp, mode, **text) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as UTF-8 to ``path`` atomically; returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, data: Any, *, sort_keys: bool = False) -> Path:
    """Write ``data`` as indented JSON (NaN is not allowed: use None)."""
    return atomic_write_text(path, json.dumps(data, indent=2, allow_nan=False, sort_keys=sort_keys) + "\n")


def atomic_write_csv(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], *, columns: Sequence[str]) -> Path:
    """Write ``rows`` as a CSV with a header of ``columns`` (None becomes an empty cell)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return atomic_write_text(path, buf.getvalue())
