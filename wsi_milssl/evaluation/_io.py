"""Atomic file output for the evaluation stage: temp name in the same folder, fsync, rename."""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_csv"]


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that a killed run never leaves a partial file under that name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open with mode 0o666 honours the umask (mkstemp would make the file private, 0600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (NaN is not allowed: use None)."""
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_csv(path: Path, rows: Sequence[Mapping[str, Any]], *, columns: Sequence[str]) -> Path:
    """Write ``rows`` as a CSV with a header of ``columns`` (None becomes an empty cell)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return atomic_write_bytes(path, buf.getvalue().encode("utf-8"))
