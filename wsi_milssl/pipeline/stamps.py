"""Stage stamps: how ``wsi-milssl run`` knows that a stage's outputs are up to date.

After a stage finishes, a stamp ``OUT/.pipeline/<stage>.json`` records the stage's settings, the
fingerprints of its inputs (the stamps of the stages it reads from, or file sizes and modification
times for inputs from outside the pipeline) and its output paths: those inside OUT relative to OUT (so a
folder moved or copied elsewhere checks its own files), others absolute; earlier versions' relative ones
are found below OUT too (:func:`_output_exists`). A stage is skipped when a stamp
with the same digest exists and every recorded output still exists. Stamps also record what the digest
covered (``settings``: {name: value}, every setting with the defaults spelled out, ``settings_form`` "all";
``inputs``: the upstream digests and the fingerprints), so that a stage that runs again can say why
(:func:`stale_reason`) and a default that a later version changes runs it again; stamps of earlier versions
record the settings that differed from their defaults (no ``settings_form``), or only the digest.
Stamps also record the identity (size and modification time: one ``stat`` per file) of each output file when the
stage finished (``output_ids``) and of the output files of the stages it reads from as it left them (``input_ids``:
after it ran, with the SHA-256 of each, so that a file whose modification time alone changed, as in a folder
copied by ``cp -r``, is compared by its bytes). The runner records those of generated slides, the model and the
heatmap files only (``_CHECKED_FILES`` in :mod:`wsi_milssl.pipeline.runner`). An output changed since (``train --resume OUT/model``, a heatmap
file replaced by hand) makes every stage that reads it run again ("input changed: model/best.pt"), while the
stage that wrote it keeps it and says so (:func:`changed_outputs`); stamps without these records (earlier
versions') are not checked.
A stage that starts running marks the stamps of every later stage as out of date (:func:`mark_outdated`): a
stage that ran again with the same settings and inputs (``--force``, an output missing) writes the same
digest, so without the mark a later stage that this run does not reach (``--until``, a kill, an error)
would still match its stamp while it was made from the earlier outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from wsi_milssl.atomic import atomic_write_json
from wsi_milssl.hashing import file_sha256, kept_file_read

__all__ = ["StageStamp", "fingerprint_paths", "stamp_digest", "recorded_digest", "by_file_name",
           "same_files_moved", "read_stamp", "write_stamp",
           "mark_running", "mark_outdated", "stale_reason", "changed_outputs", "shown_paths", "SETTINGS_FORM"]

StageStamp = dict[str, Any]

#: the stamp key naming the earlier stage that ran since this stage's stamp was written (:func:`mark_outdated`)
OUTDATED_BY = "outdated_by"

#: the stamp key saying that its relative outputs are relative to OUT (stamps of earlier versions: relative to
#: the folder their run started in, or absolute)
OUTPUTS_BELOW = "outputs_below"


#: the stamp key naming which of the stage's settings its ``settings`` record holds: "all" (every setting, defaults
#: spelled out); absent in stamps of earlier versions, which held those that differed from their defaults
SETTINGS_FORM = "settings_form"

#: the stamp key of its output files' identities ({recorded output: [size, mtime_ns]}) when the stage finished
OUTPUT_IDS = "output_ids"

#: the stamp key of the identities of the output files of the stages it reads from ({stage: {recorded output:
#: [size, mtime_ns]}}), as the stage left them
INPUT_IDS = "input_ids"


#: files up to this size are fingerprinted by their content (labels, annotations, slide lists, feature files of
#: up to 16 MiB: a file written again with the same bytes, or touched, is the same input; each hashed once per
#: run, :func:`wsi_milssl.hashing.file_reads_kept`); larger ones (slides, large feature files) by size and
#: modification time
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
                out.append([str(f), st.st_size, kept_file_read("sha256", f, st, lambda f=f: file_sha256(f))])
            else:
                out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


def stamp_digest(settings: Any, inputs: Any) -> str:
    blob = json.dumps({"settings": settings, "inputs": inputs}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def recorded_digest(state_dir: str | os.PathLike, stage: str, digest: str, settings: Any, inputs: Any) -> str:
    """``digest`` (of ``settings`` and ``inputs``), or the digest the stamp of ``stage`` holds when it recorded the
    same settings and inputs by value: an int and a float of one value (``10``, ``10.0``: a stamp written before
    configs made ints of float settings floats, or a setting spelled otherwise) digest differently but are the
    same, and so are input files recorded in another folder under the same name, size and time or content
    (:func:`same_files_moved`: slides moved). The runner uses this digest for the stage and in the chain of the
    stages after it."""
    stamp = read_stamp(state_dir, stage)
    if not stamp or stamp.get("digest") == digest or not isinstance(stamp.get("digest"), str):
        return digest
    if stamp.get("settings") == _plain(settings) and same_files_moved(stamp.get("inputs"), _plain(inputs)):
        return stamp["digest"]
    return digest


def _is_file_row(value: Any) -> bool:
    """Whether ``value`` is a file fingerprint row of :func:`fingerprint_paths`: [absolute path, size, modification
    time or SHA-256]."""
    return (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and os.path.isabs(value[0])
            and (value[1] is None or type(value[1]) is int) and (value[2] is None or type(value[2]) in (int, str)))


def by_file_name(value: Any) -> Any:
    """``value`` (a stamp's inputs, a training run's record) with every file fingerprint row of
    :func:`fingerprint_paths` ([absolute path, size, modification time or SHA-256]) keyed by the file's name
    instead of its path (see :func:`same_files_moved`)."""
    if isinstance(value, dict):
        return {k: by_file_name(v) for k, v in value.items()}
    if not isinstance(value, list):
        return value
    if _is_file_row(value):
        return [os.path.basename(value[0]), *value[1:]]
    return [by_file_name(v) for v in value]


def _file_paths(value: Any) -> list[str]:
    """The paths of the file rows in ``value``, in the order :func:`by_file_name` meets them."""
    if isinstance(value, dict):
        return [p for k in value for p in _file_paths(value[k])]
    if not isinstance(value, list):
        return []
    return [value[0]] if _is_file_row(value) else [p for v in value for p in _file_paths(v)]


def same_files_moved(recorded: Any, now: Any) -> bool:
    """Whether two records (a stamp's inputs, a training run's record) name the same input files, wherever their
    folders are now: equal, or equal with the files by name (:func:`by_file_name`: the same name, size and
    modification time or content) where every folder of ``recorded`` went to one folder of its own (``mv``,
    ``cp -a``, ``rsync -a`` of whole folders: a cohort moved to another disk). A file that went to another folder
    than its neighbours (a slide moved from the training folder into the test folder, whose rows the records
    list one after the other) is a change."""
    if recorded == now:
        return True
    if by_file_name(recorded) != by_file_name(now):
        return False
    went: dict[str, str] = {}
    for before, after in zip(_file_paths(recorded), _file_paths(now)):
        if went.setdefault(os.path.dirname(before), os.path.dirname(after)) != os.path.dirname(after):
            return False
    return len(set(went.values())) == len(went)


def _stamp_path(state_dir: Path, stage: str) -> Path:
    return state_dir / f"{stage}.json"


def read_stamp(state_dir: str | os.PathLike, stage: str) -> StageStamp | None:
    """The stamp of ``stage``, or None where there is none or it is damaged (not UTF-8, not JSON, not a JSON
    object: review BW), so that the stage runs again."""
    path = _stamp_path(Path(state_dir), stage)
    try:
        stamp = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return stamp if isinstance(stamp, dict) else None


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists, paths as strings): how a stamp records it."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def write_stamp(state_dir: str | os.PathLike, stage: str, *, digest: str, outputs: list[str],
                settings: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None,
                reads: Iterable[str] = (), settings_form: str | None = None, output_sha256: bool = False) -> None:
    """Write the stamp of ``stage``; ``settings`` ({name: value}) and ``inputs`` ({"upstream": {stage:
    digest}, "external": fingerprints}) are what ``digest`` covered, recorded for :func:`stale_reason`
    (``settings_form``: which of the stage's settings ``settings`` holds, recorded as ``settings_form``); the
    identities of ``outputs`` and of the outputs of the stages in ``reads`` (those whose files the stage reads),
    as they are now, for :func:`stale_reason` and :func:`changed_outputs` (with ``output_sha256`` the outputs'
    identities hold their SHA-256 too: outputs that no later stage reads, and so no reader records by content, are
    then not changed by a copy without modification times)."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    out_dir = Path(os.path.abspath(state_dir)).parent
    stamp: StageStamp = {"stage": stage, "digest": digest,
                         "outputs": [_recorded(p, out_dir) for p in outputs], OUTPUTS_BELOW: "OUT"}
    if settings is not None:
        stamp["settings"] = _plain(settings)
    if settings_form is not None:
        stamp[SETTINGS_FORM] = settings_form
    if inputs is not None:
        stamp["inputs"] = _plain(inputs)
    stamp[OUTPUT_IDS] = _identities(stamp, out_dir, with_sha256=output_sha256)
    read_ids = {}
    for upstream in reads:
        recorded = read_stamp(state_dir, upstream)
        if recorded is not None and upstream != stage:
            read_ids[upstream] = _identities(recorded, out_dir, with_sha256=True)
    stamp[INPUT_IDS] = read_ids
    atomic_write_json(_stamp_path(state_dir, stage), stamp)


def _file_identity(path: Path, with_sha256: bool = False) -> list | None:
    """[size in bytes, modification time in ns] of the regular file ``path``, and the SHA-256 of its bytes with
    ``with_sha256``; None when it is not one (gone, a folder)."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_size, st.st_mtime_ns] + ([file_sha256(path)] if with_sha256 else [])


def _same_file(identity: list, path: Path) -> bool:
    """Whether ``path`` is the file whose identity was recorded: the same size and modification time, or, where
    only the modification time differs and the identity holds a SHA-256 (the files a stage read), the same bytes
    (a folder copied without its times, ``cp -r``, is not a change)."""
    now = _file_identity(path)
    if now is None or not isinstance(identity, list) or len(identity) < 2:
        return False
    if now == identity[:2]:
        return True
    return now[0] == identity[0] and len(identity) > 2 and file_sha256(path) == identity[2]


def _identities(stamp: StageStamp, out_dir: Path, with_sha256: bool = False) -> dict[str, list]:
    """{recorded output: [size, mtime_ns] (and its SHA-256 with ``with_sha256``)} of the output files a stamp of
    this version records (relative ones below ``out_dir``), as they are now; {} for a stamp of an earlier version
    (its relative paths may be relative to another folder)."""
    if stamp.get(OUTPUTS_BELOW) != "OUT":
        return {}
    ids = {}
    for recorded in stamp.get("outputs", []):
        identity = _file_identity(_located(recorded, out_dir), with_sha256)
        if identity is not None:
            ids[recorded] = identity
    return ids


def _located(recorded: str, out_dir: Path) -> Path:
    """Where an output that a stamp of this version records is: an absolute path as it is, a relative one
    below ``out_dir``."""
    path = Path(recorded)
    return path if path.is_absolute() else out_dir.joinpath(*path.parts)


def _changed(recorded: dict, out_dir: Path) -> list[str]:
    """The outputs among ``recorded`` ({recorded output: [size, mtime_ns]}) whose identity differs now (a file
    gone counts)."""
    return [p for p, identity in recorded.items() if not _same_file(identity, _located(p, out_dir))]


def shown_paths(paths: list[str]) -> str:
    """The first three of ``paths`` and how many more, for a message."""
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def changed_outputs(state_dir: str | os.PathLike, stage: str) -> list[str]:
    """The output files of ``stage`` (as its stamp records them: relative to OUT when inside it) that changed
    outside the pipeline: they are not the files its stamp recorded when the stage finished (size and
    modification time) nor those a stamp of a stage that read them recorded (:func:`_same_file`: also by
    content). A stage whose outputs changed so stays up to date (``train
    --resume OUT/model`` continued the pipeline's model: it is kept), while the stages that read them run again
    (:func:`stale_reason`). [] for a stamp without these records (an earlier version's)."""
    state_dir = Path(state_dir)
    stamp = read_stamp(state_dir, stage)
    if not stamp or stamp.get(OUTPUTS_BELOW) != "OUT" or not isinstance(stamp.get(OUTPUT_IDS), dict):
        return []
    out_dir = Path(os.path.abspath(state_dir)).parent
    changed = _changed(stamp[OUTPUT_IDS], out_dir)
    if not changed:
        return []
    readers = []  # what each stage that read the outputs recorded of them
    for path in sorted(state_dir.glob("*.json")):
        other = read_stamp(state_dir, path.stem) if path.stem != stage else None
        if other and isinstance(other.get(INPUT_IDS), dict):
            readers.append(other[INPUT_IDS].get(stage) or {})
    return [p for p in changed if not any(p in ids and _same_file(ids[p], _located(p, out_dir)) for ids in readers)]


def mark_running(state_dir: str | os.PathLike, stage: str) -> None:
    """Mark the stamp of ``stage`` as belonging to a run in progress, before the stage changes its outputs:
    until :func:`write_stamp` replaces it at the end, the stage is never up to date. A run stopped inside
    the stage (a kill, a crash) then makes the next run redo it, also with the settings of the stamp (a
    stage killed while it rewrote its files with other settings had left a stamp that still matched them)."""
    stamp = read_stamp(state_dir, stage)
    if stamp is not None and not stamp.get("running"):
        atomic_write_json(_stamp_path(Path(state_dir), stage), {**stamp, "running": True})


def mark_outdated(state_dir: str | os.PathLike, stages: Iterable[str], *, by: str) -> None:
    """Mark the stamps of ``stages`` (those after ``by``) as out of date, before ``by`` changes its outputs:
    they were made from what ``by`` made before, so they are never up to date again until each runs and
    :func:`write_stamp` replaces its stamp. A stamp already marked keeps its mark (the earliest stage that
    ran since)."""
    for stage in stages:
        stamp = read_stamp(state_dir, stage)
        if stamp is not None and not stamp.get(OUTDATED_BY):
            atomic_write_json(_stamp_path(Path(state_dir), stage), {**stamp, OUTDATED_BY: by})


def stale_reason(state_dir: str | os.PathLike, stage: str, digests: Iterable[str], *,
                 settings: dict[str, Any], inputs: dict[str, Any], ran: Sequence[str] = ()) -> str | None:
    """None when ``stage`` is up to date: its stamp holds one of ``digests`` (this version's, an earlier
    version's), is not marked running (:func:`mark_running`) nor out of date (:func:`mark_outdated`) and every
    output it records exists (those inside OUT checked below the stamp's own OUT, wherever it is now:
    :func:`_output_exists`) and no output file of the stages it read changed since it read them (size or
    modification time, as the stamp recorded them: ``input changed: model/best.pt``). Else why not, in one line:
    no stamp, a run that did not finish, an output missing, an output of a stage it read changed since,
    the names of the settings that changed, the inputs that changed (a stage read from, a file or slide
    added, removed or changed), an earlier stage that ran since ("the tile stage ran since its last run"; "the
    label stage ran before it" when it, or the last of ``ran``, the stages this run ran, did), or, from a
    stamp that records no details (an earlier version's), "settings or inputs changed since <time the stamp
    was written>". ``settings`` and ``inputs`` as :func:`write_stamp` takes them."""
    path = _stamp_path(Path(state_dir), stage)
    stamp = read_stamp(state_dir, stage)
    if stamp is None:
        return "first run (no stamp)" if not path.exists() else f"{path} cannot be read"
    if stamp.get("running"):
        return "its last run did not finish (stopped inside the stage)"
    if stamp.get("digest") in set(digests):
        if stamp.get(OUTDATED_BY):
            return (f"the {ran[-1]} stage ran before it" if ran
                    else f"the {stamp[OUTDATED_BY]} stage ran since its last run")
        out_dir = Path(os.path.abspath(state_dir)).parent
        below = stamp.get(OUTPUTS_BELOW) == "OUT"
        missing = [p for p in stamp.get("outputs", []) if not _output_exists(p, out_dir, below_out=below)]
        if missing:
            return f"output missing: {out_dir / missing[0] if below else missing[0]}"
        # the files of the stages it read, changed since it read them (train --resume OUT/model, a heatmap file
        # replaced by hand); a stamp without the record (an earlier version's) is not checked
        read_ids = stamp.get(INPUT_IDS) if below and isinstance(stamp.get(INPUT_IDS), dict) else {}
        changed = [p for upstream in sorted(read_ids) for p in _changed(read_ids[upstream], out_dir)]
        if changed:
            return f"input changed: {shown_paths(changed)}"
        return None
    detailed = isinstance(stamp.get("settings"), dict) and isinstance(stamp.get("inputs"), dict)
    if (detailed and stamp.get(SETTINGS_FORM) != "all" and (ran or stamp.get(OUTDATED_BY))
            and _only_upstream_differs(stamp, settings, inputs)):
        # a stamp of the earlier form after an earlier stage ran again: that stage's new stamp is of this version's
        # form, so its digest differs whether or not its settings and inputs did
        return (f"the {ran[-1]} stage ran before it" if ran
                else f"the {stamp[OUTDATED_BY]} stage ran since its last run")
    changes = _changes(stamp["settings"], _plain(settings), stamp["inputs"], _plain(inputs)) if detailed else []
    if changes:
        return "; ".join(changes)
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    earlier = "" if detailed else " (a stamp of an earlier version, which records no details)"
    return f"settings or inputs changed since {written}{earlier}"


def _only_upstream_differs(stamp: StageStamp, settings: dict[str, Any], inputs: dict[str, Any]) -> bool:
    """Whether ``stamp`` recorded the same settings and files from outside the pipeline as ``settings`` and
    ``inputs``, so that only the digests of the stages it reads differ."""
    now = _plain(inputs)
    return (stamp["settings"] == _plain(settings)
            and (stamp["inputs"].get("external") or []) == (now.get("external") or []))


def _recorded(output: str | os.PathLike, out_dir: Path) -> str:
    """How a stamp records ``output``: relative to ``out_dir`` when it lies inside it, else absolute."""
    path, out_dir = Path(os.path.abspath(output)), Path(os.path.abspath(out_dir))
    return str(path.relative_to(out_dir)) if path.is_relative_to(out_dir) else str(path)


def _output_exists(recorded: str, out_dir: Path, *, below_out: bool = False) -> bool:
    """Whether an output a stamp records exists below ``out_dir`` (the stamp folder's parent, wherever the folder
    is now). An absolute path (outside OUT) counts where it is. A relative one is below ``out_dir``: as it is
    (``below_out``: this version's stamps), or, for earlier versions' stamps, which recorded it as the run spelled
    its output folder from the folder it started in (``ci/stores/train/x.h5`` for ``--out ci``,
    ``model/best.pt`` for ``--out .``), once the leading parts that may name ``out_dir`` are taken off, and an
    absolute one (made with an absolute ``--out``) only inside ``out_dir``. A file of that name elsewhere (beside
    the current folder, in the folder a copy was made from) does not count."""
    path = Path(recorded)
    if path.is_absolute():
        if below_out or not path.exists():
            return path.exists()
        # an earlier version's absolute path (its run had an absolute --out) lies inside the OUT it was made
        # in: one inside another folder is the original's file, seen from a copy of it
        return path.resolve().is_relative_to(out_dir.resolve())
    parts = path.parts
    if below_out:
        return ".." not in parts and out_dir.joinpath(*parts).exists()
    return any(_may_name(parts[:k], out_dir) and ".." not in parts[k:] and out_dir.joinpath(*parts[k:]).exists()
               for k in range(len(parts)))


def _may_name(parts: tuple[str, ...], folder: Path) -> bool:
    """Whether the relative path of ``parts`` can name ``folder`` from some folder: nothing (``.``), ``..`` parts
    alone, or ``..`` parts then the last parts of ``folder``'s path (``ci``, ``runs/ci``, ``../ci`` name
    ``/tmp/w/runs/ci``)."""
    names = list(parts)
    while names and names[0] == "..":
        names.pop(0)
    if not names:
        return True
    tail = folder.parts[1:]
    return ".." not in names and len(names) <= len(tail) and list(tail[-len(names):]) == names


def _changes(old_settings: dict, settings: dict, old_inputs: dict, inputs: dict) -> list[str]:
    """What differs between a stamp's record and this run's: "settings changed: NAMES", "input changed:
    the STAGE stage's settings or inputs" (its digest) and FILES (changed, new, no longer an input, gone),
    in one line."""
    missing = object()
    out = []
    names = sorted(k for k in set(old_settings) | set(settings)
                   if old_settings.get(k, missing) != settings.get(k, missing))
    if names:
        out.append("settings changed: " + ", ".join(names))
    old_up, up = old_inputs.get("upstream") or {}, inputs.get("upstream") or {}
    changed = [f"the {u} stage's settings or inputs" for u in sorted(set(old_up) | set(up))
               if old_up.get(u) != up.get(u)]
    old_files = {row[0]: row[1:] for row in old_inputs.get("external") or []}
    files = {row[0]: row[1:] for row in inputs.get("external") or []}
    # a file moved or copied to another folder with its time (the same name, size and time or content) is no change
    # where its whole folder went there (see same_files_moved); one moved away from its neighbours is
    sources = {json.dumps([Path(f).name, v]): f for f, v in old_files.items() if f not in files}
    moved = {f: sources[json.dumps([Path(f).name, v])] for f, v in files.items()
             if f not in old_files and json.dumps([Path(f).name, v]) in sources}
    went: dict[str, set] = {}
    for before, after in [*((f, f) for f in files if f in old_files), *((old, new) for new, old in moved.items())]:
        went.setdefault(os.path.dirname(before), set()).add(os.path.dirname(after))
    new = [f for f in files if f not in old_files and f not in moved]
    left = [f for f in old_files if f not in files and f not in moved.values()]
    # one that moved and changed (a slide list rewritten with the new paths) is changed, not new and gone
    renamed = {Path(f).name for f in new} & {Path(f).name for f in left}
    changed += [f if f in old_files or Path(f).name in renamed else f"{f} (new)" for f in files
                if f in new or (f in old_files and old_files[f] != files[f])]
    changed += [f"{f} (moved from {moved[f]})" for f in files
                if f in moved and len(went[os.path.dirname(moved[f])]) > 1]
    # a file no longer among the inputs may still be on disk (taken off a slide list)
    changed += [f"{f} ({'no longer an input' if Path(f).exists() else 'gone'})" for f in left
                if Path(f).name not in renamed]
    if changed:
        shown = shown_paths(changed)
        out.append(f"input changed: {shown}")
    return out
