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


#: files up to this size are fingerprinted by their content (labels, annotations, slide lists: a file
#: written again with the same bytes, or touched, is the same input); larger ones (slides, feature files)
#: by size and modification time
CONTENT_BYTES = 16 << 20


def fingerprint_paths(paths: Iterable[str | os.PathLike], *, content: bool = False) -> list[list]:
    """[path, size, mtime_ns] of every file under ``paths`` (folders walked, sorted); ``content``: files of
    at most :data:`CONTENT_BYTES` as [path, size, SHA-256] instead."""
    out: list[list] = []
    for path in paths:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if not f.exists():
                out.append([str(f), None, None])
                continue
            st = f.stat()
            if content and st.st_size <= CONTENT_BYTES:
                out.append([str(f), st.st_size, hashlib.sha256(f.read_bytes()).hexdigest()])
            else:
                out.append([str(f), st.st_size, st.st_mtime_ns])
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
