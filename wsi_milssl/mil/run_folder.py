"""A training run's folder (``--out``): its metrics file and plot, best.pt beside last.pt, the digests of
the data it trained on, and the checks a resume makes against what the run saved. :func:`wsi_milssl.mil.selftrain.fit`
writes and reads these; :mod:`wsi_milssl.mil.checkpoint` saves and loads the checkpoint files themselves."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import numpy as np

from wsi_milssl.atomic import atomic_write_text
from wsi_milssl.config.train import RUNTIME_ONLY_FIELDS, WITHOUT_HIDDEN_LAYERS, TrainConfig
from wsi_milssl.errors import CheckpointError, ConfigError, OutputError
from wsi_milssl.mil.checkpoint import RESUME_FIX, check_resume_parts, read_checkpoint, save_checkpoint
from wsi_milssl.mil.data import InstanceSet

__all__ = ["RUN_FILES", "RESUME_ONLY", "PLOT_INTERVAL_S", "data_digest", "best_checkpoint", "existing_run_error", "missing_checkpoint_error"]

log = logging.getLogger(__name__)


def _data_fingerprint(instances: InstanceSet) -> str:
    """The digest runs of earlier versions recorded (``data_fingerprint``: names, labels, bag ids and the first
    4096 feature rows); still written and compared so that their checkpoints keep this check on resume.
    :func:`data_digest` covers all of the data."""
    h = hashlib.sha256()
    h.update(json.dumps([instances.kind, instances.bag_names, instances.bag_labels.tolist(), len(instances)]).encode())
    h.update(np.ascontiguousarray(instances.bag_ids).tobytes())
    if instances.features is not None:
        h.update(np.ascontiguousarray(instances.features[: min(len(instances), 4096)]).tobytes())
    return h.hexdigest()[:16]


def data_digest(instances: InstanceSet, *, instance_labels: bool = False) -> str:
    """A digest of what training reads from ``instances`` (compared on resume, and between ranks): bag
    names, bag labels and bag of every instance, and every feature row (kind 'features'), or for patch
    stores (kind 'images') each store's patch count, every patch's coordinates and the stored bytes of its
    first and last patch (the pixels come from the slide at those coordinates with the tiling settings, which
    the checkpoint records apart): complete and cheap, a few reads per store whatever its size. With
    ``instance_labels`` the instance labels too (a validation set that selects best.pt by instance AUC)."""
    h = hashlib.sha256()
    h.update(json.dumps([instances.kind, instances.bag_names, instances.bag_labels.tolist(), len(instances)]).encode())
    h.update(np.ascontiguousarray(instances.bag_ids).tobytes())
    if instances.features is not None:
        h.update(np.ascontiguousarray(instances.features))  # the buffer itself: no copy of the set (review CH)
    if instances.kind == "images":
        from wsi_milssl.store import open_store

        for path in instances.store_paths or []:
            with open_store(path) as store:
                n = len(store)
                h.update(f"{n}:{store.pixels}".encode())
                h.update(np.ascontiguousarray(store.coords, dtype=np.int64).tobytes())
                ends = sorted({0, n - 1}) if n else []
                if store.pixels == "jpeg":
                    for data in store.read_jpeg(ends):
                        h.update(bytes(data))
                elif ends:
                    h.update(np.ascontiguousarray(store.read_patches(ends)).tobytes())
    if instance_labels and instances.instance_labels is not None:
        h.update(np.ascontiguousarray(instances.instance_labels).tobytes())
    return h.hexdigest()[:24]


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


#: Redraw metrics.png at most this often (seconds); the last epoch is always drawn.
PLOT_INTERVAL_S = 10.0


def _write_metrics(out_dir: Path, history: list[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(rec, default=_json_default, sort_keys=True) + "\n" for rec in history)
    atomic_write_text(out_dir / "metrics.jsonl", lines)


def _draw_metrics(out_dir: Path, history: list[dict[str, Any]]) -> None:
    """``metrics.png`` of ``history`` (a second or two with matplotlib: drawn after the epoch's checkpoints)."""
    from wsi_milssl.mil.plots import plot_training_metrics

    try:
        plot_training_metrics(history, out_dir / "metrics.png")
    except Exception as exc:  # a plot must never stop training
        log.warning("could not draw %s: %s", out_dir / "metrics.png", exc)


def plot_behind(out_dir: Path) -> bool:
    """Whether ``metrics.png`` is missing or older than ``last.pt``: drawn at an interval, or a kill while it was
    drawn, after the epoch's checkpoints (review CQ: a finished run resumed with nothing to train kept a plot of
    an earlier epoch, naming an earlier best.pt)."""
    try:
        last = (out_dir / "last.pt").stat().st_mtime_ns
    except OSError:
        return False
    try:
        return (out_dir / "metrics.png").stat().st_mtime_ns < last
    except OSError:
        return True


def _check_best(out: Path, last: dict[str, Any], best_epoch: int | None) -> None:
    """On resume: make ``best.pt`` the epoch ``last.pt`` names as best where it can (runs of earlier
    versions wrote last.pt first, so a kill between the two saves left best.pt stale or missing): the
    best epoch is last.pt's own epoch -> best.pt is rewritten from it; otherwise a stale best.pt is
    reported. A best.pt from an epoch after last.pt's (a kill after best.pt's save) is rewritten when
    that epoch runs again."""
    if best_epoch is None:
        return
    path = out / "best.pt"
    held = None
    if path.is_file():
        try:
            held = int(read_checkpoint(path).get("epoch", -1))
        except CheckpointError:
            held = None
    if held == best_epoch or (held is not None and held > int(last["epoch"])):
        return
    if best_epoch == int(last["epoch"]):
        save_checkpoint(best_checkpoint(last), path)
        log.info("%s rewritten from last.pt (epoch %d, the best so far)", path, best_epoch)
        return
    log.warning("%s holds %s, not epoch %d that last.pt names as the best (a run killed between its two "
                "saves by an earlier version); best.pt is replaced when a later epoch scores better, else use "
                "last.pt or train again.", path, "nothing" if held is None else f"epoch {held}", best_epoch)


#: The parts of a checkpoint only a resume reads (from last.pt): best.pt goes without them, half the size of an
#: image model's checkpoint (SGD momentum or Adam's moments are as large as the weights).
RESUME_ONLY = ("optimizer", "scheduler", "grad_scaler", "rng")


def best_checkpoint(ckpt: dict[str, Any]) -> dict[str, Any]:
    """``ckpt`` as best.pt holds it: the model, its settings, metrics and pseudo labels, without
    :data:`RESUME_ONLY` (a run resumes from last.pt)."""
    return {k: v for k, v in ckpt.items() if k not in RESUME_ONLY}


#: What a run writes into its folder besides config.json (a fresh run removes an earlier run's).
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "metrics.png")


def existing_run_error(out: Path) -> ConfigError:
    """The error for a fresh run into ``out`` that holds a run's ``last.pt`` (which the run would replace)."""
    return ConfigError(f"{out} already holds a run (last.pt); pass --resume {shlex.quote(str(out))} (resume=True from Python) to "
                       "continue it, or choose a new --out folder.")


def _clear_earlier_run(out: Path) -> None:
    """A fresh (not resumed) run into ``out``: remove the checkpoints, metrics and plot of an earlier run
    there (a run killed in its first epoch, or another run's files copied in), which would otherwise stand
    beside the new run's, and a best.pt of another run be taken for this one's (``heatmap --model RUN``)."""
    found = [name for name in RUN_FILES if (out / name).is_file()]
    if not found:
        return
    for name in found:
        (out / name).unlink()
    log.warning("%s: removed %s of an earlier run (this run starts fresh; `train --resume %s` continues a run).",
                out, ", ".join(found), out)


def _read_history(out_dir: Path, *, before_epoch: int) -> list[dict[str, Any]]:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if int(rec.get("epoch", 0)) <= before_epoch:
                out.append(rec)
    return out


#: The data digests of a run's config (:func:`data_digest`) and what they cover; a checkpoint of an earlier
#: version lacks them, and resumes without that check.
_DIGESTS = {"data_digest": "the training data", "val_data_digest": "the validation data"}


def _other_weights(saved: str | None, current: str | None) -> bool:
    """Whether a resume names other initial weights (``current``) than the run started from (``saved``,
    its ``weights_path``): none against a file, or two files found that differ (SHA-256). The same file
    spelt otherwise is the same; so is a run's file that is not found from here (recorded as typed by an
    earlier version, or moved), as a resume does not read it: last.pt holds the whole model."""
    if saved == current:
        return False
    if not saved or not current:
        return True
    before, now = Path(saved), Path(current)
    if before.resolve() == now.resolve() or not (before.is_file() and now.is_file()):
        return False
    from wsi_milssl.hashing import cached_file_sha256

    return not os.path.samefile(before, now) and cached_file_sha256(before) != cached_file_sha256(now)


def _check_resume_config(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    diffs = resume_differences(saved, current, path)
    if diffs:
        raise CheckpointError(
            f"{path}: cannot resume with different settings or data ({'; '.join(diffs[:4])}); resume with the "
            "original settings and data (see config.json in the run folder) or start a new --out folder."
        )


def resume_differences(saved: dict[str, Any], current: dict[str, Any], path: Path) -> list[str]:
    """What a run saved with the checkpoint config ``saved`` cannot be continued with under ``current`` (another
    such config), as ``setting: before -> now`` lines: [] when it can (``epochs`` of a constant-rate run, the
    speed-only settings and the settings a model ignores aside)."""
    # a setting added after the run was saved ran at its default (which is the old behaviour)
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    diffs = []
    unchecked = [what for key, what in _DIGESTS.items() if key not in saved]
    if unchecked:
        log.info("%s was saved by an earlier version without a digest of all of %s: resuming without checking that "
                 "those are unchanged.", path, " and ".join(unchecked))
    for key, value in current.items():
        if key in RUNTIME_ONLY_FIELDS or key in ("runtime", "package_version", "data", "distributed"):
            continue
        if key in _DIGESTS:
            if key in saved and saved[key] != value:
                diffs.append(f"{_DIGESTS[key]} changed since the run was saved (digest {saved[key]} -> {value})")
            continue
        if key == "epochs" and saved.get("scheduler", "none") == "none":
            continue  # extending a constant-rate run keeps the first epochs identical
        if key in ("hidden_dims", "dropout") and current.get("model") in WITHOUT_HIDDEN_LAYERS and \
                json.dumps(value) == json.dumps(defaults.get(key)):
            continue  # no effect on this model; an earlier version recorded them as given (review CZ)
        before = saved.get(key, defaults.get(key))
        if key == "weights_path":
            if _other_weights(before, value):
                diffs.append(f"{key}: {before!r} -> {value!r}")
            continue
        if key == "store_settings" and isinstance(before, dict) and isinstance(value, dict):
            # what the data record that a run saved by an earlier version did not (the feature files' settings):
            # only what both record is compared; so within the feature files' settings (an earlier version
            # recorded random encoder weights as '', not recorded, where they now read 'random')
            value = {k: v for k, v in value.items() if k in before}
            old_fs, new_fs = before.get("feature_settings"), value.get("feature_settings")
            if isinstance(old_fs, dict) and isinstance(new_fs, dict):
                recorded = {k for k, v in old_fs.items() if v not in ("", None)}
                before = {**before, "feature_settings": {k: v for k, v in old_fs.items() if k in recorded}}
                value = {**value, "feature_settings": {k: v for k, v in new_fs.items() if k in recorded}}
        if json.dumps(before, sort_keys=True) != json.dumps(value, sort_keys=True):
            diffs.append(f"{key}: {before!r} -> {value!r}")
    return diffs


def missing_checkpoint_error(run_dir: Path) -> CheckpointError:
    """The error for a resume from ``run_dir`` without ``last.pt``: a run stopped before it saved its first
    epoch leaves ``config.json`` (and maybe ``metrics.jsonl``) without it, and is started again instead."""
    if (run_dir / "config.json").is_file():
        return CheckpointError(f"{run_dir}: last.pt is missing: the run there never finished an epoch (last.pt is "
                               "saved at the end of each), so there is nothing to resume. Fix: start the run again "
                               "with its command into the same --out (without --resume); it starts from epoch 1.")
    return CheckpointError(f"{run_dir}: no last.pt to resume from; start the run without resume (--resume) or pass "
                           "the folder of an earlier run.")


def _save_failed(out: Path, exc: OutputError, *, saved_epoch: int) -> OutputError:
    """The error for a checkpoint or metrics write that failed (full disk, read-only): what happened,
    and how to go on from the last complete checkpoint."""
    if saved_epoch > 0 and (out / "last.pt").is_file():
        then = (f"The run folder {out} keeps the checkpoint of epoch {saved_epoch} (last.pt): once there is "
                f"space, continue with `wsi-milssl train --resume {shlex.quote(str(out))}` (in a pipeline: run it "
                "again).")
    else:
        then = f"No epoch of this run was saved yet: start it again once {out} can be written."
    return OutputError(f"{exc} {then}", errno=exc.errno)


def _resume_checkpoint(out: Path, ckpt_config: dict[str, Any], config: TrainConfig) -> dict[str, Any]:
    """The run's ``last.pt``, checked for a resume: complete, saved with the data and settings of
    ``ckpt_config`` (the run now), and not beyond ``config.epochs``. ``ckpt_config`` then records the
    run's own ``weights_path`` (a resume does not read the initial weights, whatever their spelling now)."""
    path = out / "last.pt"
    if not path.is_file():
        raise missing_checkpoint_error(out)
    ckpt = read_checkpoint(path, fix=RESUME_FIX)
    check_resume_parts(ckpt, path)
    _check_resume_config(ckpt["config"], ckpt_config, path)
    ckpt_config["weights_path"] = ckpt["config"].get("weights_path")
    start_epoch = int(ckpt["epoch"])
    if config.epochs < start_epoch:
        raise ConfigError(f"{path} holds {start_epoch} trained epochs, more than the {config.epochs} asked for "
                          "(--epochs); a resume cannot go back, and the run is left as it is. Fix: resume with "
                          f"--epochs {start_epoch} or more, or train again into a new --out with --epochs "
                          f"{config.epochs}.")
    return ckpt
