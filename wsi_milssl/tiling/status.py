"""Per-slide outcome of a tile run and the folder's ``tile_status.csv`` (one row per slide, sorted by
slide; the shards of a run merge their rows into one file), and the mark a ``tile`` or ``features`` run
leaves in its folder while it runs (:func:`marking_unfinished`), which tells a reader of the folder
(``train``) that its last run stopped before every slide was done."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import secrets
import shlex
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from wsi_milssl.atomic import atomic_write_json, merge_csv_rows
from wsi_milssl.paths import escaped_text

__all__ = ["TileResult", "STATUS_COLUMNS", "STATUS_FILENAME", "merge_status_csv",
           "read_status_csv", "finished_slides", "marking_unfinished", "unfinished_runs"]

logger = logging.getLogger(__name__)

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
    """A result's status row, a name of another encoding escaped as the file holds it (review FA: written escaped and
    read back so, it no longer matched its row, and each run added one more)."""
    return {"slide": escaped_text(r.slide), "status": r.status, "n_patches": str(r.n_patches),
            "seconds": f"{r.seconds:.2f}", "error": escaped_text(" ".join(r.error.split()))}


def merge_status_csv(results: Iterable[TileResult], path: str | os.PathLike) -> Path:
    """Add or replace the rows of ``results`` in the status CSV at ``path``, keeping the rows of other
    slides (other shards, earlier runs), sorted by slide; safe while other runs update it
    (:func:`wsi_milssl.atomic.merge_csv_rows`)."""
    return merge_csv_rows(path, [_row(r) for r in results], columns=STATUS_COLUMNS)


def read_status_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a ``tile_status.csv`` as dicts."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# ----------------------------------------------------------------------------------------------
# Runs that did not finish
# ----------------------------------------------------------------------------------------------

def _unfinished_re(stage: str) -> re.Pattern:
    return re.compile(rf"^\.wsi-milssl\.unfinished-{re.escape(stage)}\.[0-9]+-[0-9a-f]{{8}}\.json$")


def _unfinished_markers(folder: Path, stage: str) -> list[Path]:
    pattern = _unfinished_re(stage)
    try:
        return sorted(folder / n for n in os.listdir(folder) if pattern.match(n))
    except OSError:
        return []


def _read_marker(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        data = {}
    return data if isinstance(data, dict) else {}


def finished_slides(folder: str | os.PathLike) -> set[str]:
    """Stems of the slides that some tile run into ``folder`` finished: those with a store there (either
    format) and those that failed (a 'failed' row in its ``tile_status.csv``; a slide whose row says 'ok'
    but whose store is gone is missing, not finished)."""
    from wsi_milssl.store import find_stores

    folder = Path(folder)
    try:
        done = {p.stem for p in find_stores(folder)}
    except (OSError, ValueError):
        done = set()
    try:
        rows = read_status_csv(folder / STATUS_FILENAME)
    except (OSError, ValueError, csv.Error):
        rows = []
    return done | {r["slide"] for r in rows if r.get("status") == "failed" and r.get("slide")}


@contextmanager
def marking_unfinished(folder: str | os.PathLike, stage: str, stems: Iterable[str], *,
                       shard: tuple[int, int] | None = None,
                       finished: Callable[[], Iterable[str]] | None = None) -> Iterator[Path]:
    """Mark ``folder`` as holding an unfinished ``stage`` run ('tile' or 'features') for the ``with``
    block: ``DIR/.wsi-milssl.unfinished-<stage>.<pid>-<random>.json`` records the run (command, pid,
    host, start time, ``shard`` I/N) and the ``stems`` of the slides it is to make. Written before the
    first slide, removed only when the block returns (a run that finished with failed slides finished:
    those are in its status CSV), so a run stopped in any way (Ctrl-C, SIGTERM, a crash, kill -9) leaves
    it behind for :func:`unfinished_runs`. Every run has its own mark, so the shards of one run never
    remove each other's. A run that finishes also removes the marks of earlier runs whose slides are all
    done: among its own, or (``finished``: a function giving the stems of the slides finished in the
    folder by any run, e.g. :func:`finished_slides`) finished by this or another run, so that a stopped
    run's marks go once a run of another world size or other shards (each shard removing what it can)
    has done its slides; never the mark of a shard that writes the folder now. Call it while holding the
    folder's lock."""
    folder = Path(folder)
    stems = sorted(set(stems))
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if program in ("__main__.py", "wsi-milssl"):
        program = "wsi-milssl"
    path = folder / f".wsi-milssl.unfinished-{stage}.{os.getpid()}-{secrets.token_hex(4)}.json"
    atomic_write_json(path, {"stage": stage, "command": shlex.join([program, *sys.argv[1:]]), "pid": os.getpid(),
                             "host": socket.gethostname(), "started": time.time(),
                             "shard": None if shard is None else f"{shard[0]}/{shard[1]}", "slides": stems})
    yield path
    # reached only when the run returned: an exception (Ctrl-C, a crash) or a kill leaves the mark
    mine = set(stems)
    done: set[str] | None = None if finished is not None else mine  # read once, when a mark needs it
    running: set[str] = set()  # the other shards writing the folder now ('I/N'): their marks are kept
    for other in _unfinished_markers(folder, stage):
        record = _read_marker(other) if other != path else {"slides": []}
        if record is None or not isinstance(record.get("slides"), list):
            continue
        slides = set(record["slides"])
        if not slides <= mine:
            if done is None:
                done = mine | set(finished())
                running = _running_shards(folder, shard)
            if not slides <= done or record.get("shard") in running:
                continue
        try:
            other.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("%s: cannot remove the mark of an unfinished run (%s); `wsi-milssl train` on this "
                           "folder will warn that a run did not finish.", other, exc)


def _running_shards(folder: Path, shard: tuple[int, int] | None) -> set[str]:
    """'I/N' of the shards other than ``shard`` that hold their lock in ``folder`` now (none for an
    unsharded run, which holds the folder alone): a running shard's slides may have stores of an earlier
    run (skipped, or being replaced with --overwrite), so they look finished while its mark is still due."""
    if shard is None:
        return set()
    from wsi_milssl.locks import other_shards_writing

    return {f"{i}/{n}" for i, n in other_shards_writing(folder, shard)}


def unfinished_runs(folder: str | os.PathLike, stage: str) -> list[dict]:
    """What the marks of ``stage`` runs that did not finish in ``folder`` record (see
    :func:`marking_unfinished`), oldest first: dicts with ``command``, ``pid``, ``host``, ``started``,
    ``shard`` and ``slides`` (the stems the run was to make); an unreadable mark gives a dict without
    them. Empty when every run into the folder finished (or the folder holds none)."""
    records = [r for r in (_read_marker(p) for p in _unfinished_markers(Path(folder), stage)) if r is not None]
    started = [r.get("started") if isinstance(r.get("started"), (int, float)) else 0.0 for r in records]
    return [r for _, r in sorted(zip(started, records), key=lambda t: t[0])]
