"""Training run folders of a pipeline (``OUT/model``, ``OUT/model/grid/<point>``): the record each was started
with (:data:`RUN_MARKER`), whether a folder holds the run asked for (continue from its ``last.pt``) or another
(renamed aside to ``<folder>.replaced-<UTC time>``, never deleted), and bringing back a run set aside when its
settings and data are asked for again."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from wsi_milssl.atomic import atomic_write_json
from wsi_milssl.pipeline.stamps import same_files_moved

log = logging.getLogger(__name__)

#: the record a pipeline's training run folder was started with (its settings, split and data)
RUN_MARKER = "pipeline_run.json"


def replace_aside(folder: Path, why: str) -> Path:
    """Rename ``folder`` to ``<folder>.replaced-<UTC time>`` (kept, never deleted) and say so."""
    aside = _aside_name(folder)
    folder.rename(aside)
    log.warning("%s %s; it is kept as %s", folder, why, aside)
    return aside


def _aside_name(folder: Path) -> Path:
    """``<folder>.replaced-<UTC time>`` (``-2``, ``-3``, ... after it when taken)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = folder.with_name(f"{folder.name}.replaced-{stamp}")
    k = 1
    while aside.exists():
        k += 1
        aside = folder.with_name(f"{folder.name}.replaced-{stamp}-{k}")
    return aside


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds files of a training run: a folder with only its :data:`RUN_MARKER` (a run refused
    before it trained, for its data or settings) holds none."""
    return folder.is_dir() and any(not p.name.startswith(".") and p.name != RUN_MARKER for p in folder.iterdir())


def run_key(record: Any, slide_lists: tuple[str, ...]) -> Any:
    """What a training run's record (:func:`wsi_milssl.pipeline.digests.run_fingerprints`) is compared by: the record without the content of
    the training set's slide list (file names ``slide_lists``), which names the slides by their paths (a cohort
    moved and prepared again rewrites it): the slides it lists count by their own files, their names by the split
    and the rows of the labels."""
    data = record.get("data") if isinstance(record, dict) else None
    if isinstance(data, dict) and isinstance(data.get("external"), list):
        kept = [row for row in data["external"] if not (isinstance(row, list) and len(row) == 3
                                                         and os.path.basename(str(row[0])) in slide_lists)]
        record = {**record, "data": {**data, "external": kept}}
    return record


def read_record(folder: Path) -> Any:
    """The :data:`RUN_MARKER` record a run folder was started with, None when missing or unreadable."""
    try:
        return json.loads((folder / RUN_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


#: the key of a form (:func:`same_record`) that matches only the record of a folder written after the weights file
#: it names was last modified: the form without the weights of records of versions before 2026-11-29
WEIGHTS_BEFORE = "accepted_if_written_after_weights"


def same_record(record: Any, forms: tuple[dict, ...], slide_lists: tuple[str, ...], folder: Path | None = None
                ) -> bool:
    """Whether a run folder's record is one of ``forms`` (this version's fingerprint and earlier versions'), by
    :func:`run_key`, its files wherever their folders moved (:func:`wsi_milssl.pipeline.stamps.same_files_moved`);
    by value, so that an int and a float of one value (10 and 10.0: a record written before
    configs made ints of float settings floats) are the same. A form with :data:`WEIGHTS_BEFORE` matches only
    ``folder``'s record written after that weights file was last modified
    (:func:`wsi_milssl.pipeline.digests.weights_older_than`)."""
    from wsi_milssl.pipeline.digests import weights_older_than

    as_json = lambda value: json.loads(json.dumps(value, sort_keys=True, default=str))  # noqa: E731
    if record is None:
        return False
    for form in forms:
        if not form:
            continue
        if WEIGHTS_BEFORE in form:
            if folder is None or not weights_older_than([form[WEIGHTS_BEFORE]], folder / RUN_MARKER):
                continue
            form = {k: v for k, v in form.items() if k != WEIGHTS_BEFORE}
        if same_files_moved(run_key(record, slide_lists), run_key(as_json(form), slide_lists)):
            return True
    return False


def _epochs_asked(run_dir: Path) -> int | float:
    """The epochs the run in ``run_dir`` was last asked for (its ``config.json``: a ``train --resume --epochs N``
    raises them); infinity when unreadable (nothing continues it)."""
    try:
        return int(json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("inf")


def _extended(record: Any, forms: tuple[dict, ...], slide_lists: tuple[str, ...], folder: Path) -> bool:
    """Whether ``record`` is the run of one of ``forms`` but for fewer ``epochs``, with a constant learning rate
    (scheduler "none"): its epochs are the first of the longer run, which continues from its last.pt (review EM: a
    run of more epochs trained again from scratch, hours at CAMELYON16's scale)."""
    settings = record.get("settings") if isinstance(record, dict) else None
    if not isinstance(settings, dict) or not isinstance(settings.get("epochs"), int):
        return False
    for form in forms:
        now = form.get("settings") if isinstance(form, dict) else None
        if (not isinstance(now, dict) or now.get("scheduler", "none") != "none" or settings.get("scheduler", "none")
                != "none" or not isinstance(now.get("epochs"), int) or now["epochs"] <= settings["epochs"]):
            continue
        if same_record(record, ({**form, "settings": {**now, "epochs": settings["epochs"]}},), slide_lists,
                       folder=folder):
            return True
    return False


def earlier_run(run_dir: Path, forms: tuple[dict, ...], slide_lists: tuple[str, ...]) -> Path | None:
    """The newest ``<run_dir>.replaced-*`` folder (:func:`replace_aside`) that holds the run ``forms`` describe with
    its ``last.pt``: a setting changed and changed back finds the run trained with it."""
    aside = sorted(run_dir.parent.glob(f"{run_dir.name}.replaced-*"), key=lambda p: p.name, reverse=True)
    return next((p for p in aside if (p / "last.pt").is_file() and same_record(read_record(p), forms, slide_lists,
                                                                               folder=p)), None)


def prepare_run_dir(run_dir: Path, fingerprint: dict, *earlier: dict, slide_lists: tuple[str, ...] = (),
                     restore: bool = True) -> bool:
    """Get ``run_dir`` ready for a training run started with ``fingerprint``; True when it holds that
    run's ``last.pt`` to continue from (a finished run continues at its last epoch: nothing to train).
    ``earlier``: the same run's fingerprints as earlier versions recorded it, also accepted (the record is
    then rewritten as ``fingerprint``); records are compared by :func:`same_record` (``slide_lists``: the file
    names of the training set's slide lists).

    A folder holding a run started otherwise (other settings, split or labels; or a folder from
    before this record), or this run without its ``last.pt``, is renamed aside by :func:`replace_aside`, never
    deleted; one holding only the record (a run refused before its first epoch) is used as it is. With
    ``restore`` (not under ``--force``), a folder renamed aside earlier that holds this run (:func:`earlier_run`)
    is renamed back and continued instead of training from scratch.
    """

    forms = (fingerprint, *earlier)
    marker = run_dir / RUN_MARKER
    if holds_run(run_dir):
        previous = read_record(run_dir)
        if same_record(previous, forms, slide_lists, folder=run_dir):
            if json.dumps(previous, sort_keys=True) != json.dumps(fingerprint, sort_keys=True, default=str):
                atomic_write_json(marker, fingerprint, sort_keys=True)
            if (run_dir / "last.pt").is_file():
                return True
            # the same run without its last.pt (deleted to save space) starts again: its trained files (which a
            # fresh run would remove) are kept aside; a run killed in its first epoch has none
            if any((run_dir / name).is_file() for name in ("best.pt", "metrics.jsonl")):
                replace_aside(run_dir, "lacks the last.pt a run continues from, so it trains again")
        elif (run_dir / "last.pt").is_file() and _extended(previous, forms, slide_lists, folder=run_dir) and \
                _epochs_asked(run_dir) <= fingerprint["settings"]["epochs"] and \
                not (restore and earlier_run(run_dir, forms, slide_lists)):
            # (a run continued by hand past the new epochs, `train --resume --epochs`, is not: review EN; nor one
            # whose longer run is aside, brought back below: review EU) the shorter run stays as a copy, brought
            # back when its epochs are (review EN: it trained again)
            aside = _aside_name(run_dir)
            shutil.copytree(run_dir, aside, symlinks=True)
            atomic_write_json(marker, fingerprint, sort_keys=True)
            log.warning("%s: [train] epochs went up from %s to %s, with the learning rate constant (scheduler = "
                        "\"none\"): the run continues from its last.pt, as `train --resume --epochs` does (a run of "
                        "%s epochs from scratch would train the same first epochs); the run of %s epochs is kept as %s",
                        run_dir, previous["settings"]["epochs"], fingerprint["settings"]["epochs"],
                        fingerprint["settings"]["epochs"], previous["settings"]["epochs"], aside.name)
            return True
        elif previous is None:  # (review EM: said "started with other settings" of a record deleted)
            replace_aside(run_dir, f"holds a training run without a readable {RUN_MARKER} (its record of the "
                          "settings and data it was started with), so it cannot be told to be this run's")
        else:
            replace_aside(run_dir, "holds a training run started with other settings, data or labels")
    found = earlier_run(run_dir, forms, slide_lists) if restore else None
    if found is not None:
        marker.unlink(missing_ok=True)  # a folder holding only a refused run's record
        if run_dir.exists() and any(run_dir.iterdir()):  # a run of these settings killed before its first epoch
            replace_aside(run_dir, "holds no epoch of the run trained earlier with these settings")
        elif run_dir.exists():
            run_dir.rmdir()
        found.rename(run_dir)
        log.warning("%s: the run trained with these settings and data earlier is back from %s", run_dir, found.name)
        if json.dumps(read_record(run_dir), sort_keys=True) != json.dumps(fingerprint, sort_keys=True, default=str):
            atomic_write_json(marker, fingerprint, sort_keys=True)
        return True
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, fingerprint, sort_keys=True)
    return False


def continued_config(run_dir: Path, config):
    """The settings to continue the run of ``run_dir`` with: ``config``, or with the epochs that ``wsi-milssl
    train --resume RUN --epochs N`` continued it to (its ``config.json``), when more: that run is read back as
    finished (the stages after it use its model), instead of refused as holding more epochs than asked for."""
    import dataclasses

    try:
        epochs = int(json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return config
    if epochs <= config.epochs:
        return config
    log.info("%s was continued to %d epochs (train --resume), more than the pipeline's %d: kept as it is", run_dir,
             epochs, config.epochs)
    return dataclasses.replace(config, epochs=epochs)


def keep_grid_parent(model_dir: Path) -> None:
    """Before a grid: a model folder that holds a single run (not a grid's chosen copy) is renamed aside."""

    if not holds_run(model_dir):
        return
    try:
        kind = json.loads((model_dir / RUN_MARKER).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != "grid-choice" and any(p.name != "grid" for p in model_dir.iterdir() if not p.name.startswith(".")):
        replace_aside(model_dir, "holds a single training run, not a grid")
