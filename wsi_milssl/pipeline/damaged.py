"""Output files of a stage that changed outside the pipeline and no longer read (review EM): ``run`` keeps a changed
model or heatmap file as a hand run's (``train --resume``, a heatmap run by hand), but one that is damaged (cut
short, not parseable) or a checkpoint of another run copied in is not one: :func:`set_aside_damaged` sets it
aside so that its stage runs again, or refuses it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from wsi_milssl.errors import WsiMilsslError
from wsi_milssl.pipeline.context import StageContext
from wsi_milssl.pipeline.stamps import changed_outputs

log = logging.getLogger(__name__)

__all__ = ["set_aside_damaged"]


def set_aside_damaged(ctx: StageContext, stage: str) -> str | None:
    """For a stage up to date whose output files changed outside the pipeline (kept by the runner: they may be a
    hand run's), those that no longer read (:func:`_unreadable`: a ``best.pt`` or ``_patches.csv`` cut short,
    review EM: kept as a hand edit, every later run failed with fixes for the hand commands) are renamed to
    ``NAME.damaged`` (replacing an older one), so that the stage runs again and makes them anew (a damaged
    checkpoint: the model folder is set aside, without its record, and trains again); its reason ("output damaged:
    FILE (why)"), or None when every changed file reads."""
    if stage not in ("train", "heatmap"):
        return None
    damaged = []
    for recorded in changed_outputs(ctx.state, stage):
        path = Path(recorded) if Path(recorded).is_absolute() else ctx.out / recorded
        why = _unreadable(path) if path.is_file() else None
        if why is not None:
            damaged.append((path, why))
        elif stage == "train" and path.suffix == ".pt" and path.is_file():
            _refuse_other_run(path)
    if not damaged:
        return None
    path, why = damaged[0]
    more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
    if stage == "train":  # a checkpoint of an epoch validation chose cannot be made again without training it
        from wsi_milssl.pipeline.run_folders import RUN_MARKER, replace_aside

        aside = replace_aside(ctx.model_dir, f"holds a damaged {path.name} ({why}), so the model trains again")
        (aside / RUN_MARKER).unlink(missing_ok=True)  # never brought back as this run's (review EN)
        return f"output damaged: {path}{more} ({why}); the model folder set aside as {aside.name}"
    for path, why in damaged:
        aside = path.with_name(path.name + ".damaged")
        os.replace(path, aside)
        log.warning("%s: %s cannot be read (%s), so it is damaged, not a hand run's: set aside as %s, and the %s "
                    "stage runs again", stage, path, why, aside.name, stage)
    path, why = damaged[0]
    return f"output damaged: {path}{more} ({why}); set aside as {path.name}.damaged"


def _refuse_other_run(checkpoint: Path) -> None:
    """ConfigError when the changed checkpoint ``checkpoint`` of the pipeline's model folder was trained with other
    settings or data than the run of that folder (its ``config.json``), by the rules of a resume
    (:func:`wsi_milssl.mil.run_folder.resume_differences`): a ``train --resume`` keeps them, so it is another run's,
    copied in (review EM: its heatmaps and report went on under this pipeline's settings)."""
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.mil.checkpoint import read_checkpoint
    from wsi_milssl.mil.run_folder import resume_differences

    try:
        run = json.loads((checkpoint.parent / "config.json").read_text(encoding="utf-8"))
        trained = read_checkpoint(checkpoint).get("config")
    except (OSError, ValueError, WsiMilsslError):
        return
    if not isinstance(run, dict) or not isinstance(trained, dict):
        return
    differ = resume_differences(trained, run, checkpoint)
    if differ:
        raise ConfigError(f"{checkpoint}: trained with other settings or data than the pipeline's run in "
                          f"{checkpoint.parent} ({'; '.join(differ[:4])}), so it is another run's, copied in (a "
                          "`train --resume` keeps them). Fix: put the pipeline's own checkpoint back, or train again "
                          "with --force train (the folder is kept as model.replaced-<time>).")


def _unreadable(path: Path) -> str | None:
    """Why the output file ``path`` cannot be read as its kind, or None when it reads: a checkpoint
    (``.pt``) that does not load, a ``.npy`` or ``.json`` that does not parse, a ``.csv`` cut short (every CSV
    the stages write ends with a newline). Images and other files are not read (None)."""
    import csv
    import io

    suffix = path.suffix.lower()
    try:
        if suffix == ".pt":
            from wsi_milssl.mil.checkpoint import read_checkpoint

            read_checkpoint(path)
        elif suffix == ".npy":
            import numpy as np

            np.load(path, mmap_mode="r", allow_pickle=False)
        elif suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif suffix == ".csv":
            text = path.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):
                return "cut short: no newline at its end"
            rows = list(csv.reader(io.StringIO(text)))
            return _patch_rows_differ(path, len(rows) - 1)
    except (OSError, ValueError, EOFError, RuntimeError, csv.Error, WsiMilsslError) as exc:
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        said = said.split(" Fix: ")[0].rstrip(".")  # (the fix of a hand command's error is not this one's)
        return said.removeprefix(f"{path}: ")
    return None


def _patch_rows_differ(path: Path, n_rows: int) -> str | None:
    """For a heatmap's ``<stem>_patches.csv`` of ``n_rows`` rows beside its ``<stem>_probs.json``: why they differ
    (the table cut at a line's end), or None."""
    from wsi_milssl.artifacts import HEATMAP_FILES

    suffix = HEATMAP_FILES["patches_csv"]
    if not path.name.endswith(suffix):
        return None
    sidecar = path.with_name(path.name[: -len(suffix)] + HEATMAP_FILES["probs_json"])
    try:
        recorded = json.loads(sidecar.read_text(encoding="utf-8")).get("n_patches")
    except (OSError, ValueError, AttributeError):
        return None  # the sidecar is checked on its own
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded != n_rows:
        return f"{n_rows} patch rows, where {sidecar.name} records {recorded}"
    return None
