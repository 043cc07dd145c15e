"""Per-slide outcome of a tile run and the run's ``tile_status.csv``."""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from wsi_milssl.atomic import atomic_write_text

__all__ = ["TileResult", "STATUS_COLUMNS", "STATUS_FILENAME", "write_status_csv", "read_status_csv"]

STATUS_COLUMNS = ("slide", "status", "n_patches", "seconds", "error")
STATUS_FILENAME = "tile_status.csv"


@dataclass(frozen=True)
class TileResult:
    """What happened to one slide: ``status`` is 'ok', 'failed' or 'skipped' (a complete store with
    the same settings was already there); ``seconds`` is wall time; ``error`` is empty unless failed."""

    slide: str
    slide_path: str
    status: str
    n_patches: int
    seconds: float
    error: str = ""
    store_path: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "failed"


def write_status_csv(results: Iterable[TileResult], path: str | os.PathLike) -> Path:
    """Write ``slide,status,n_patches,seconds,error`` rows atomically to ``path``."""
    path = Path(path)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(STATUS_COLUMNS)
    for r in results:
        writer.writerow([r.slide, r.status, r.n_patches, f"{r.seconds:.2f}", " ".join(r.error.split())])
    return atomic_write_text(path, buf.getvalue())


def read_status_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a ``tile_status.csv`` as dicts."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))
