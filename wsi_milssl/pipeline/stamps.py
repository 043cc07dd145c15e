"""Stage stamps: how ``wsi-milssl run`` knows that a stage's outputs are up to date.

After a stage finishes, a stamp ``OUT/.pipeline/<stage>.json`` records the stage's settings, the
fingerprints of its inputs (the stamps of the stages it reads from, or file sizes and modification
times for inputs from outside the pipeline) and its output paths. A stage is skipped when a stamp
with the same digest exists and every recorded output still exists.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

from wsi_milssl.atomic import atomic_write_json

__all__ = ["StageStamp", "fingerprint_paths", "stamp_digest", "read_stamp", "write_stamp", "is_up_to_date"]

StageStamp = dict[str, Any]


def fingerprint_paths(paths: Iterable[str | os.PathLike]) -> list[list]:
    """[path, size, mtime_ns] of every file under ``paths`` (folders walked, sorted)."""
    out: list[list] = []
    for path in paths:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if f.exists():
                st = f.stat()
                out.append([str(f), st.st_size, st.st_mtime_ns])
            else:
                out.append([str(f), None, None])
    return out


def stamp_digest(settings: Any, inputs: Any) -> str:
    blob = json.dumps({"settings": settings, "inputs": inputs}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _stamp_path(state_dir: Path, stage: str) -> Path:
    return state_dir / f"{stage}.json"


def read_stamp(state_dir: str | os.PathLike, stage: str) -> StageStamp | None:
    path = _stamp_path(Path(state_dir), stage)
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_stamp(state_dir: str | os.PathLike, stage: str, *, digest: str, outputs: list[str]) -> None:
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(_stamp_path(state_dir, stage), {"stage": stage, "digest": digest, "outputs": outputs})


def is_up_to_date(state_dir: str | os.PathLike, stage: str, digest: str) -> bool:
    stamp = read_stamp(state_dir, stage)
    if stamp is None or stamp.get("digest") != digest:
        return False
    return all(Path(p).exists() for p in stamp.get("outputs", []))
