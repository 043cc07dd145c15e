"""Per-slide outcome of a tile run and the folder's ``tile_status.csv`` (one row per slide, sorted by
slide; the shards of a run merge their rows into one file)."""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from wsi_milssl.atomic import atomic_write_text, merge_csv_rows

__all__ = ["TileResult", "STATUS_COLUMNS", "STATUS_FILENAME", "write_status_csv", "merge_status_csv",
           "read_status_csv"]

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


def _row(r: TileResult) -> dict[str, str]:
    return {"slide": r.slide, "status": r.status, "n_patches": str(r.n_patches), "seconds": f"{r.seconds:.2f}",
            "error": " ".join(r.error.split())}


def write_status_csv(results: Iterable[TileResult], path: str | os.PathLike) -> Path:
    """Write ``slide,status,n_patches,seconds,error`` rows (in the order given) atomically to ``path``."""
    path = Path(path)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=STATUS_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(_row(r) for r in results)
    return atomic_write_text(path, buf.getvalue())


def merge_status_csv(results: Iterable[TileResult], path: str | os.PathLike) -> Path:
    """Add or replace the rows of ``results`` in the status CSV at ``path``, keeping the rows of other
    slides (other shards, earlier runs), sorted by slide; safe while other runs update it
    (:func:`wsi_milssl.atomic.merge_csv_rows`)."""
    return merge_csv_rows(path, [_row(r) for r in results], columns=STATUS_COLUMNS)


def read_status_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a ``tile_status.csv`` as dicts."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))
