"""``wsi-milssl run PIPELINE.toml``: synth -> tile -> label -> (features) -> train -> heatmap -> evaluate, in order.

Every stage writes under the pipeline's output folder::

    OUT/slides/<set>/     generated slides, labels.csv, XML (synth only)
    OUT/stores/<set>/     patch stores, tile_status.csv, qc/
    OUT/labels/<set>/     tumour masks to check the labels by (evaluate does not read them), label_status.csv
    OUT/features/<set>/   feature files, features_status.csv (with a [features] table only)
    OUT/model/            config.json, last.pt, best.pt, metrics.jsonl, metrics.png
    OUT/heatmaps/test/    probability maps, overlays, GeoJSON, detections, scores.csv
    OUT/evaluation/       metrics.json, per_slide.csv, plots, report.html
    OUT/.pipeline/        one stamp per stage (settings + inputs digest)
    OUT/resolved_pipeline.toml   the pipeline as run: --set overrides applied, every setting, absolute paths
                                 (written when a run of every stage finishes; removed when a later run runs a stage,
                                 unless that run started from it)

A stage is skipped when its stamp matches its settings and the stamps of the stages it reads from, and
its outputs still exist, and no earlier stage ran since its stamp was written (a stage that starts marks the
stamps of the later ones: :func:`wsi_milssl.pipeline.stamps.mark_outdated`, so a stage run under ``--until``
makes the later ones run next time), and the generated slides, model and heatmap files it reads are as it
left them (size and modification time: :data:`_CHECKED_FILES`); one that runs says why (:attr:`StageOutcome.reason`). Files changed outside the
pipeline (``train --resume OUT/model``, a heatmap file replaced by hand) are kept by the stage that wrote them,
whose outcome says so ("up to date; kept: model/best.pt changed outside the pipeline (train --resume?)"), and
make the stages that read them run again ("input changed: model/best.pt"). Each stage reads
only the stores (feature files, heatmap files) of the slides now in each set: those of slides a changed split
moved to the other set stay on disk, ignored with a warning (``scores.csv`` lists the test set's slides
only). A stage that runs again after an interruption goes on from what is finished: ``tile`` keeps every
complete store made with the same settings (settings hash) from the same slide file (path, or file name for
slides moved, size and modification time) and re-tiles when the settings or the slide file changed; ``train`` continues each
run folder from its ``last.pt`` when the folder was started with the same settings, data split and training
data (the training set's files and the settings they were tiled, labelled and embedded with, recorded in
``pipeline_run.json``; the test set's files and the mask settings of [label] do not count, and files count by
name, size and time or content, wherever their folder is now: :func:`wsi_milssl.pipeline.stamps.same_files_moved`), skips finished grid points, and never
deletes a run folder: one holding a run with other settings is renamed ``<folder>.replaced-<UTC time>`` and
kept. ``force`` re-runs the named stages and everything downstream and redoes their work: tile, label and
heatmap overwrite their files, train renames ``OUT/model`` (its run or grid) aside the same way and trains
from scratch. A run holds the lock of ``OUT`` (:func:`wsi_milssl.locks.folder_lock`): a second run of the
same pipeline (or another one into the same folder) is refused, naming the folder and the running one's
pid.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import numpy as np

from wsi_milssl.atomic import atomic_open, atomic_write_json
from wsi_milssl.config import config_from_mapping, config_to_dict
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.locks import folder_lock
from wsi_milssl.pipeline.digests import (EARLIER_DEFAULTS, EMBEDDED_UPSTREAM, UPSTREAM, digest_parts,
                                         feature_file_bags, feature_files, run_fingerprints, setting_names,
                                         training_data_forms, with_label_settings)
from wsi_milssl.pipeline.run_folders import (RUN_MARKER, continued_config, holds_run, keep_grid_parent,
                                             prepare_run_dir, replace_aside)
from wsi_milssl.pipeline.spec import (RESOLVED_FILENAME, STAGES, PipelineSpec, load_pipeline, stage_config,
                                      write_resolved_pipeline)
from wsi_milssl.pipeline.stamps import (SETTINGS_FORM, changed_outputs, mark_outdated, mark_running,
                                        read_stamp, recorded_digest, shown_paths, stale_reason, stamp_digest,
                                        write_stamp)

__all__ = ["StageOutcome", "run_pipeline", "split_train_val"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    status: str  # "ran" or "skipped"
    seconds: float
    summary: str = ""
    #: why a stage ran, one line: "first run (no stamp)", "settings changed: train.epochs", "input changed:
    #: FILE", "output missing: FILE", "forced (--force tile)", "the label stage ran before it", ...
    reason: str = ""


def split_train_val(stems: list[str], labels: dict[str, int], *, val_fraction: float, seed: int,
                    groups: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Stratified split of training slides into (train, val); at least one slide of each class in val
    when there are two or more of that class (never the test set): :func:`wsi_milssl.cohorts.stratified_split`.
    With ``groups`` ({stem: patient}: the labels file's patient column, :func:`_label_groups`) whole patients
    are held out, stratified by each patient's highest label, as ``prepare folder`` holds out its test set: a
    patient's slides are all in training or all in validation. Raises ConfigError naming the slides that have
    no label (and the labels file, when ``labels`` is read from one)."""
    from wsi_milssl.cohorts import stratified_split

    unlabelled = sorted(s for s in stems if s not in labels)
    if unlabelled:
        from wsi_milssl.errors import ConfigError

        where = getattr(labels, "path", None) or "the training labels"
        shown = ", ".join(unlabelled[:10]) + (" ..." if len(unlabelled) > 10 else "")
        raise ConfigError(f"{where}: {len(unlabelled)} training slide(s) have no label: {shown}. Fix: add a "
                          "'slide,label' line for each, named as its slide file (or store), or leave them out "
                          "of the training slides.")
    if val_fraction <= 0:
        return sorted(stems), []
    return stratified_split({s: labels[s] for s in stems}, fraction=val_fraction, seed=seed, groups=groups)


def _label_groups(labels_csv, names) -> dict[str, str]:
    """{name: patient} of ``names`` from the labels file's patient column (:data:`wsi_milssl.cohorts.GROUP_COLUMNS`,
    as ``prepare folder`` writes it into train_labels.csv); {} without one: slides are split one by one."""
    from wsi_milssl.cohorts import label_groups_for

    return label_groups_for(labels_csv, names)[1]


class _Context:
    def __init__(self, spec: PipelineSpec, progress: ProgressCallback | None) -> None:
        self.spec = spec
        self.out = spec.out_dir
        self.state = spec.out_dir / ".pipeline"
        self.progress = progress
        #: the stage runs because of ``force`` (named, or downstream of a named stage): its work is
        #: redone from scratch (tile, label and heatmap overwrite; train moves its run folders aside)
        self.redo = False
        #: folders whose files of slides no longer in their set (or, as (folder, "format"), whose stores in
        #: another format) were reported: one warning per folder and run
        self.warned_ignored: set = set()

    def stores(self, set_name: str) -> Path:
        return self.out / "stores" / set_name

    def labels_dir(self, set_name: str) -> Path:
        return self.out / "labels" / set_name

    def features_dir(self, set_name: str) -> Path:
        return self.out / "features" / set_name

    @property
    def model_dir(self) -> Path:
        return self.out / "model"

    @property
    def heatmap_dir(self) -> Path:
        return self.out / "heatmaps" / "test"

    @property
    def evaluation_dir(self) -> Path:
        return self.out / "evaluation"


# ------------------------------------------------------------------------------------------------
# One function per stage: (context) -> (outputs, summary), each calling its stage's API
# (feature mode evaluates its bags here).

def _synth(ctx: _Context) -> tuple[list[str], str]:
    """Generate each set whose slides are not there as its [synth.<set>] settings make them
    (:func:`_generated`): a set whose settings did not change keeps its files (their modification times too,
    so its stores are not tiled again); every set with ``--force``."""
    from wsi_milssl.synth import generate_slides

    outputs, counts = [], []
    for set_name, ds in ctx.spec.sets.items():
        kept = None if ctx.redo else _generated(ds)
        if kept is not None:
            files, n_slides, n_tumour = kept
            counts.append(f"{set_name}: {n_slides} slides ({n_tumour} tumour), up to date")
        else:
            slides = generate_slides(ds.synth, ds.slides, progress=ctx.progress)
            files = [str(ds.labels)] + _existing(p for s in slides for p in (s.slide_path, s.annotation_path))
            counts.append(f"{set_name}: {len(slides)} slides ({sum(s.label for s in slides)} tumour)")
        outputs += files
    return outputs, "; ".join(counts)


def _generated(ds) -> tuple[list[str], int, int] | None:
    """(files, slides, tumour slides) of a generated set whose folder holds a finished run of
    ``generate_slides`` with the set's settings (its ``manifest.json``, written last, records them) and every
    file it wrote (labels.csv, each slide, each tumour slide's XML); None when it must be generated."""
    folder = Path(ds.slides)
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        wanted = json.loads(json.dumps(config_to_dict(ds.synth)))
        if manifest.get("config") != wanted:
            return None
        slides = [(str(s["slide"]), int(s["label"])) for s in manifest["slides"]]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    files = [Path(ds.labels)] + [folder / f"{stem}{suffix}" for stem, label in slides
                                 for suffix in ((".tif", ".xml") if label else (".tif",))]
    if not all(f.is_file() for f in files):
        return None
    return [str(f) for f in files], len(slides), sum(label for _, label in slides)


def _tile(ctx: _Context) -> tuple[list[str], str]:
    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import find_slides, tile_slides

    config = config_from_mapping(TileConfig, ctx.spec.section("tile"), source=f"{ctx.spec.source} [tile]")
    outputs, parts = [], []
    for set_name, ds in ctx.spec.sets.items():
        slides = find_slides([ds.slides])
        # Complete stores with these settings, cut from the slide files as they are now (same path,
        # size and modification time), are kept: tile skips them and re-tiles a slide generated or
        # exported again since. Stores made with other settings (or unreadable ones) mean the
        # settings changed: the set is tiled again.
        stale = [] if ctx.redo else _stale_stores(slides, ctx.stores(set_name), config)
        if ctx.redo:
            log.info("tile: forced; re-tiling every slide of the %s set", set_name)
        elif stale:
            log.info("tile: %d store(s) of the %s set were made with other settings (%s); re-tiling the set",
                     len(stale), set_name, ", ".join(stale[:5]))
        run = tile_slides(slides, ctx.stores(set_name), config, overwrite=ctx.redo or bool(stale),
                           progress=ctx.progress, keep_other_stores=True)  # of slides that left the set
        failed = [r for r in run.results if r.status == "failed"]
        if failed:
            from wsi_milssl.errors import WsiMilsslError

            raise WsiMilsslError(
                f"tile: {len(failed)} slide(s) of the {set_name} set failed (see {run.status_csv}): "
                + "; ".join(f"{r.slide}: {r.error}" for r in failed[:3])
            )
        outputs += [str(run.status_csv)] + _existing(r.store_path for r in run.results)
        parts.append(f"{set_name}: {sum(r.n_patches for r in run.results)} patches from {len(run.results)} slides")
    return outputs, "; ".join(parts)


def _existing(paths) -> list[str]:
    """The paths among ``paths`` that exist: a stage's per-slide files, recorded in its stamp so that one
    deleted later makes the stage run again (it redoes only what is missing) instead of a later stage
    silently working without that slide."""
    return [str(p) for p in paths if p and Path(p).exists()]


def _label(ctx: _Context) -> tuple[list[str], str]:
    from wsi_milssl.config import LabelConfig
    from wsi_milssl.labeling import label_stores

    config = config_from_mapping(LabelConfig, ctx.spec.section("label"), source=f"{ctx.spec.source} [label]")
    outputs, parts = [], []
    folder = lambda ds: None if ds.annotations is None else Path(ds.annotations).resolve()  # noqa: E731
    for set_name, ds in ctx.spec.sets.items():
        # one annotations folder for both sets: the other set's annotation files are not unmatched
        others = [stem for other, ods in ctx.spec.sets.items() if other != set_name and folder(ds) is not None
                  and folder(ods) == folder(ds)
                  for stem in _set_stores(ctx, other)]
        report = label_stores(list(_set_stores(ctx, set_name).values()), annotations_dir=ds.annotations,
                              labels_csv=ds.labels, config=config, out_dir=ctx.labels_dir(set_name),
                              progress=ctx.progress, overwrite=ctx.redo, other_stems=others)
        failed = [r for r in report.results if r.status == "failed"]
        if failed:
            from wsi_milssl.errors import WsiMilsslError

            raise WsiMilsslError(f"label: {len(failed)} store(s) of the {set_name} set failed: "
                                 + "; ".join(f"{r.stem}: {r.error}" for r in failed[:3]))
        outputs.append(str(ctx.labels_dir(set_name) / "label_status.csv"))
        parts.append(f"{set_name}: {len(report.results)} stores")
    return outputs, "; ".join(parts)


def _features(ctx: _Context) -> tuple[list[str], str]:
    """Embed the stores of both sets with the [features] encoder: a feature file made with these settings
    from the same store is kept (its instance labels brought up to date), one made with other settings or
    from a changed store is made again; every file with ``--force``."""
    from wsi_milssl.config import FeaturesConfig
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.features import extract_features

    config = config_from_mapping(FeaturesConfig, ctx.spec.section("features"), source=f"{ctx.spec.source} [features]")
    outputs, parts = [], []
    for set_name in ctx.spec.sets:
        run = extract_features(list(_set_stores(ctx, set_name).values()), ctx.features_dir(set_name), config,
                               overwrite=ctx.redo, replace_other=True, progress=ctx.progress)
        failed = [r for r in run.results if r.status == "failed"]
        if failed:
            raise WsiMilsslError(f"features: {len(failed)} slide(s) of the {set_name} set failed (see {run.status_csv}): "
                                 + "; ".join(f"{r.slide}: {r.error}" for r in failed[:3]))
        outputs += [str(run.status_csv)] + _existing(r.path for r in run.results)
        dim = run.results[0].feature_dim if run.results else 0
        kept = sum(r.status == "skipped" for r in run.results)
        parts.append(f"{set_name}: {run.n_patches} patches x {dim} from {len(run.results) - kept} slides"
                     + (f" ({kept} up to date)" if kept else ""))
    return outputs, f"{config.encoder}: " + "; ".join(parts)


def _grid_runs(section: dict, source: str) -> list[dict]:
    """Expand ``[train.grid]`` (TrainConfig field -> list of values) into one override dict per run."""
    import itertools

    from wsi_milssl.errors import ConfigError

    grid = section.pop("grid", None)
    if not grid:
        return [{}]
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{source} [train.grid].{key} must be a non-empty list; got {values!r}.")
    keys = sorted(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def _validation_score(result, select_metric: str, run_dir: Path | None = None) -> tuple[float, float] | None:
    """The validation score of ``result``'s best epoch (None without one): from its metrics record, or,
    when ``metrics.jsonl`` lacks that record (a run killed between its writes), from the score the
    run folder's checkpoints recorded; else one WsiMilsslError naming the folder and the fix."""
    from wsi_milssl.mil.scores import selection_score

    if result.best_epoch is None:
        return None
    record = next((r for r in result.history if r.get("epoch") == result.best_epoch), None)
    if record is None and run_dir is not None:
        record = _checkpoint_score(Path(run_dir), result.best_epoch, select_metric)
        if isinstance(record, tuple):
            return record
    if record is None:
        from wsi_milssl.errors import WsiMilsslError

        where = run_dir if run_dir is not None else result.out_dir
        raise WsiMilsslError(
            f"{where}: no record of the best epoch ({result.best_epoch}) in metrics.jsonl nor in the folder's "
            "checkpoints, so its validation score is unknown (the run was interrupted or its files edited). Fix: "
            f"move {where} aside (or re-run the pipeline with --force train, which does) and train it again.")
    metrics = {k[len("val_"):]: v for k, v in record.items() if k.startswith("val_")}
    return selection_score(metrics, select_metric)


def _checkpoint_score(run_dir: Path, epoch: int, select_metric: str) -> tuple[float, float] | dict | None:
    """What ``last.pt`` / ``best.pt`` of ``run_dir`` recorded about ``epoch``: the selection score their
    "best" entry holds (a tuple), else their "metrics" record of that epoch (a dict); None when neither."""
    from wsi_milssl.errors import CheckpointError
    from wsi_milssl.mil.checkpoint import read_checkpoint

    for name in ("last.pt", "best.pt"):
        try:
            ckpt = read_checkpoint(run_dir / name)
        except (CheckpointError, OSError):
            continue
        best = ckpt.get("best") or {}
        score = best.get("score")
        if (best.get("epoch") == epoch and best.get("metric", select_metric) == select_metric
                and isinstance(score, (list, tuple)) and len(score) == 2):
            return (float(score[0]), float(score[1]))
        metrics = ckpt.get("metrics") or {}
        if metrics.get("epoch") == epoch:
            return metrics
    return None


@dataclass(frozen=True)
class _GridPoint:
    """One [train.grid] point: its name, overrides, config, run folder and whether it resumes."""

    name: str
    overrides: dict
    config: object
    run_dir: Path
    resume: bool


def grid_worker_count(setting: int | str, n_points: int) -> int:
    """Grid points trained at once: ``"auto"`` = one per visible GPU (1 without GPUs, or with one), or
    the given count; never more than there are points."""
    if setting == "auto":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 1
    else:
        n = int(setting)
    return max(1, min(n, n_points))


def _train_grid(points: list[_GridPoint], train, val, run_info: dict, *, ctx: _Context,
                data: dict) -> list[tuple[tuple[float, float] | None, int | None]]:
    """Train every grid point; returns (validation score, best epoch) per point, in order.

    One point at a time in this process, or with ``[pipeline].grid_workers`` > 1 (or one per GPU),
    that many at once, each in its own process (spawned; point k on GPU k mod the GPU count, or on
    a share of the CPU threads), which reads the data again from ``data`` (:func:`_load_grid_data`).
    Each point is chosen on the same validation slides either way.
    """
    from wsi_milssl.mil.selftrain import fit

    workers = grid_worker_count(ctx.spec.grid_workers, len(points))
    if workers == 1:
        out = []
        for point in points:
            result = fit(train, config=point.config, out_dir=point.run_dir, val=val, run_info=run_info,
                         resume=point.resume, progress=ctx.progress)
            out.append((_validation_score(result, point.config.select_metric, point.run_dir), result.best_epoch))
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    threads = 0 if n_gpus else max(1, (multiprocessing.cpu_count() or 1) // workers)
    log.info("training %d grid points, %d at a time (%s)", len(points), workers,
             f"{n_gpus} GPU(s)" if n_gpus else f"CPU, {threads} thread(s) each")
    emit(ctx.progress, ProgressEvent("train-grid", 0, len(points), unit="run"))
    results: list = [None] * len(points)
    from wsi_milssl.parent_watch import watch_parent

    # the grid's trainers end when this process is killed: run on under pid 1 they would keep writing
    # checkpoints into the run folders that the next `run` resumes
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=watch_parent, initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(_fit_grid_point, data, config_to_dict(point.config), str(point.run_dir), point.resume,
                               run_info, None if not n_gpus else k % n_gpus, threads): k
                   for k, point in enumerate(points)}
        from concurrent.futures import as_completed

        for done, fut in enumerate(as_completed(futures), start=1):
            k = futures[fut]
            results[k] = fut.result()
            emit(ctx.progress, ProgressEvent("train-grid", done, len(points), unit="run", item=points[k].name))
    return results


def _load_grid_data(data: dict):
    """(train, val) instance sets from a picklable description: ``{"mode": "images", "train": [stores],
    "val": [stores], "labels": csv}`` or ``{"mode": "features", "files": [h5], "labels": csv, "train":
    [bag names], "val": [bag names]}``."""
    from wsi_milssl.mil.data import read_feature_files, read_labels_csv, read_patch_stores

    label_map = read_labels_csv(data["labels"])
    if data["mode"] == "features":
        everything = read_feature_files([Path(p) for p in data["files"]], label_map)
        index = {n: i for i, n in enumerate(everything.bag_names)}
        train = everything.subset_bags([index[n] for n in data["train"]])
        val = everything.subset_bags([index[n] for n in data["val"]]) if data["val"] else None
        return train, val
    train = read_patch_stores([Path(p) for p in data["train"]], label_map)
    val = read_patch_stores([Path(p) for p in data["val"]], label_map) if data["val"] else None
    return train, val


def _fit_grid_point(data: dict, config: dict, run_dir: str, resume: bool, run_info: dict, gpu: int | None,
                    threads: int):
    """One grid point in its own process (see :func:`_train_grid`): (validation score, best epoch)."""
    import torch

    from wsi_milssl.config import TrainConfig
    from wsi_milssl.mil.selftrain import fit

    if gpu is not None:
        torch.cuda.set_device(gpu)
    cfg = config_from_mapping(TrainConfig, config, source=f"{run_dir} (grid point)")
    if threads and cfg.threads == 0:
        torch.set_num_threads(threads)
    train, val = _load_grid_data(data)
    result = fit(train, config=cfg, out_dir=Path(run_dir), val=val, run_info=run_info, resume=resume)
    return _validation_score(result, cfg.select_metric, Path(run_dir)), result.best_epoch


def _train_configs(ctx: _Context, mode: str) -> tuple[list[dict], list, str]:
    """The [train] table's runs: (grid overrides, TrainConfig per run, source)."""
    from wsi_milssl.config import TrainConfig

    source = f"{ctx.spec.source} [train]"
    section = ctx.spec.section("train")
    section.setdefault("mode", mode)
    runs = _grid_runs(section, source)
    configs = [config_from_mapping(TrainConfig, {**section, **o}, source=source) for o in runs]
    return runs, configs, source


def _no_validation_cause(stems: list[str], labels, what: str, groups: dict[str, str] | None = None) -> str:
    """Why :func:`split_train_val` held out no ``what`` (slide or bag) with ``val_fraction`` > 0: each class
    has fewer than 2 training ``what``s (with ``groups``: patients, by their highest label)."""
    if groups:
        from wsi_milssl.cohorts.names import name_key

        highest: dict[str, int] = {}
        for s in stems:
            unit = f"patient:{name_key(groups[s])}" if groups.get(s) else f"{what}:{s}"
            highest[unit] = max(highest.get(unit, 0), int(labels[s]))
        tumour = sum(highest.values())
        return (f"split_train_val holds out whole patients (the labels file's patient column), a patient of a class "
                f"only when the class has at least 2 training patients (by each patient's highest label); here: "
                f"{tumour} tumour, {len(highest) - tumour} normal patients")
    tumour = sum(1 for s in stems if labels[s] == 1)
    return (f"split_train_val puts a {what} of a class into validation only when the class has at least 2 training "
            f"{what}s; here: {tumour} tumour, {len(stems) - tumour} normal")


#: The val_fraction the refusals of a [train.grid] with val_fraction = 0 suggest, and split with to tell whether
#: it would be enough (which classes a split holds out does not depend on the fraction, see split_train_val)
SUGGESTED_VAL_FRACTION = 0.25


def _selection_problem(configs: list, val: list[str], labels) -> tuple[str, str] | None:
    """(select_metric, why) for the first of ``configs``' select metrics that the validation slides or bags
    ``val`` can never give, as far as their labels tell: :func:`wsi_milssl.mil.scores.selection_problem` (bag
    AUC needs both classes). instance_auc is left to train: instance labels are known only once label has run."""
    from wsi_milssl.mil.data import InstanceSet
    from wsi_milssl.mil.scores import selection_problem

    bags = InstanceSet(kind="images", bag_ids=np.zeros(0, dtype=np.int64), bag_names=list(val),
                       bag_labels=np.array([int(labels[s]) for s in val], dtype=np.int64))
    for metric in dict.fromkeys(config.select_metric for config in configs):
        why = selection_problem(bags, metric) if metric != "instance_auc" else None
        if why is not None:
            return metric, why
    return None


def _names(stems: list[str]) -> str:
    """The first 5 of ``stems``, and how many more, for a message."""
    return ", ".join(stems[:5]) + (f" and {len(stems) - 5} more" if len(stems) > 5 else "")


def _refuse_grid_without_validation(configs: list, stems: list[str], labels, val: list, *, val_fraction: float,
                                    source: str, what: str, would_val: list | None = None,
                                    groups: dict[str, str] | None = None) -> None:
    """ConfigError for a [train.grid] of two or more points (``configs``, TrainConfigs) whose split of ``stems``
    (training slides or bags) holds out no validation ``what`` to choose a point on. With ``val_fraction`` = 0,
    ``would_val`` (what :data:`SUGGESTED_VAL_FRACTION` would hold out; None when unknown) lets the refusal name
    every fix needed at once: more training ``what``s too, where that split would hold out none, or only ones
    its select_metric cannot use. A single run trains on; when ``val_fraction`` > 0 gave no validation
    ``what``, one warning says that it keeps last.pt, as no epoch can be chosen. ``groups``: the patients the
    split holds out whole (:func:`split_train_val`), counted in the cause."""
    from wsi_milssl.errors import ConfigError

    grid = f"a [train.grid] of {len(configs)} points"
    if val_fraction <= 0:
        if len(configs) < 2:
            return
        needs = f"{source}: {grid} needs validation {what}s to choose one on, but [data].val_fraction is 0"
        fix = (f"set [data].val_fraction > 0 (e.g. {SUGGESTED_VAL_FRACTION:g}: training {what}s held out, never "
               "the test set)")
        if would_val is not None and not would_val:
            raise ConfigError(f"{needs}, and any val_fraction > 0 would hold out none: "
                              f"{_no_validation_cause(stems, labels, what, groups)}. Fix: {fix} and add training {what}s "
                              f"so that a class has at least 2 (both classes, for select_metric = \"bag_auc\"), or "
                              "drop [train.grid].")
        problem = _selection_problem(configs, would_val, labels) if would_val else None
        if problem is not None:
            metric, why = problem
            raise ConfigError(f"{needs}, and val_fraction = {SUGGESTED_VAL_FRACTION:g} would hold out "
                              f"{_names(would_val)}: {why} (select_metric \"{metric}\"), as with any val_fraction "
                              f"> 0: {_no_validation_cause(stems, labels, what, groups)}. Fix: {fix} and either "
                              f"{_USE_BAG_NLL} or add training {what}s so that each class has at least 2; or drop "
                              "[train.grid].")
        raise ConfigError(f"{needs}. Fix: {fix}, or drop [train.grid].")
    if val:
        return
    cause = _no_validation_cause(stems, labels, what, groups)
    if len(configs) > 1:
        raise ConfigError(f"{source}: {grid} needs validation {what}s to choose one on, but [data].val_fraction "
                          f"= {val_fraction:g} gave none, as any would: {cause}. Fix: add training {what}s so "
                          "that a class has at least 2 (both classes, for select_metric = \"bag_auc\"), or drop "
                          "[train.grid] (or give each of its keys one value): a single run keeps last.pt.")
    log.warning("%s: [data].val_fraction = %g gave no validation %ss (%s): training keeps last.pt, the last "
                "epoch, not one chosen on validation", source, val_fraction, what, cause)


#: The fix of a select_metric that validation of one class cannot give
_USE_BAG_NLL = 'set select_metric = "bag_nll" in [train] (the validation bag loss, defined with one class)'


def _refuse_unusable_validation(configs: list, stems: list[str], labels, val: list, *, val_fraction: float,
                                source: str, what: str, groups: dict[str, str] | None = None) -> None:
    """ConfigError for a run (single, or a [train.grid]'s points: ``configs``, TrainConfigs) whose select_metric
    the validation ``what``s ``val`` split off ``stems`` can never give, as far as their labels tell
    (:func:`_selection_problem`: bag AUC on one class): train would certainly fail on them. ``groups`` as
    :func:`_refuse_grid_without_validation` takes them."""
    from wsi_milssl.errors import ConfigError

    problem = _selection_problem(configs, val, labels) if val else None
    if problem is None:
        return
    metric, why = problem
    more = f"add training {what}s so that each class has at least 2"
    held = (f"[data].val_fraction = {val_fraction:g} holds out {_names(val)}: {why}, as any val_fraction > 0 "
            f"would: {_no_validation_cause(stems, labels, what, groups)}")
    if len(configs) > 1:
        raise ConfigError(f"{source}: a [train.grid] of {len(configs)} points is chosen on the validation {what}s "
                          f"by select_metric \"{metric}\", but {held}. Fix: {_USE_BAG_NLL}, or {more}.")
    raise ConfigError(f"{source}: select_metric \"{metric}\" chooses best.pt on the validation {what}s, so train "
                      f"would fail: {held}. Fix: {_USE_BAG_NLL}, or {more}, or set [data].val_fraction = 0 (no "
                      "validation: training keeps last.pt, the last epoch).")


def _fit_runs(ctx: _Context, runs: list[dict], configs: list, *, train, val, split: dict,
              run_info: dict, data: dict) -> tuple[int | None, str]:
    """Train the single run into OUT/model, or every [train.grid] point into OUT/model/grid/<point> and
    copy the best on validation into OUT/model; returns (best epoch, summary addition). With ``force`` the
    model folder (its single run or grid) is renamed aside first; the callers have made every check that
    can refuse the run (:func:`_refuse_grid_without_validation`), so a refused run leaves the model where
    it was."""
    import shutil

    from wsi_milssl.mil.selftrain import fit

    if ctx.redo and holds_run(ctx.model_dir):
        replace_aside(ctx.model_dir, "is trained again (--force)")
    data_forms = training_data_forms(ctx.spec)
    slides = ctx.spec.sets["train"].slides
    slide_lists = (Path(slides).name,) if slides is not None and Path(slides).is_file() else ()
    if len(configs) == 1:
        fingerprints = run_fingerprints(ctx.spec, ctx.state, configs[0], split, kind="single", data=data_forms)
        resume = prepare_run_dir(ctx.model_dir, *fingerprints, slide_lists=slide_lists, restore=not ctx.redo)
        config = continued_config(ctx.model_dir, configs[0]) if resume else configs[0]
        result = fit(train, config=config, out_dir=ctx.model_dir, val=val, run_info=run_info, resume=resume,
                     progress=ctx.progress)
        return result.best_epoch, ""
    keep_grid_parent(ctx.model_dir)
    points = []
    for overrides, config in zip(runs, configs):
        name = "_".join(f"{k}-{v}" for k, v in overrides.items())
        run_dir = ctx.model_dir / "grid" / name
        # a finished grid point resumes at its last epoch: nothing to train, its result is read back
        fingerprints = run_fingerprints(ctx.spec, ctx.state, config, split, kind="grid", data=data_forms)
        resume = prepare_run_dir(run_dir, *fingerprints, slide_lists=slide_lists, restore=not ctx.redo)
        points.append(_GridPoint(name, overrides, continued_config(run_dir, config) if resume else config, run_dir, resume))
    t_grid = time.perf_counter()
    outcomes = _train_grid(points, train, val, run_info, ctx=ctx, data=data)
    grid_s = time.perf_counter() - t_grid
    scored = []
    for point, (score, best_epoch) in zip(points, outcomes):
        scored.append((score if score is not None else (-float("inf"), -float("inf")), point.name, point.run_dir,
                       point.overrides, best_epoch))
    scored.sort(key=lambda item: item[0], reverse=True)
    _, name, chosen, overrides, best_epoch = scored[0]
    for item in chosen.iterdir():
        if item.is_file() and not item.name.startswith(".") and item.name != RUN_MARKER:
            with open(item, "rb") as src, atomic_open(ctx.model_dir / item.name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    atomic_write_json(ctx.model_dir / "grid.json",
                      [{"run": n, "overrides": o, "validation_score": list(s)} for s, n, _, o, _ in scored])
    atomic_write_json(ctx.model_dir / RUN_MARKER, {"kind": "grid-choice", "chosen": name})
    log.info("grid of %d points trained in %.1f s", len(points), grid_s)
    return best_epoch, f", grid of {len(runs)} in {grid_s:.0f} s: chose {name} on validation"


def _model_checkpoint(model_dir: Path) -> Path:
    """The checkpoint the later stages use: ``best.pt`` (chosen on the validation slides), or ``last.pt``
    of a run without validation. A run with validation whose ``best.pt`` is gone is an error: its last
    epoch is not the one validation chose."""

    if (model_dir / "best.pt").is_file():
        return model_dir / "best.pt"
    try:
        data = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("data") or {}
    except (OSError, ValueError, AttributeError):
        data = {}
    if data.get("val_inputs"):
        from wsi_milssl.errors import CheckpointError

        raise CheckpointError(f"{model_dir}: best.pt (the epoch the validation slides chose) is missing, and "
                              "last.pt may be another epoch. Fix: restore best.pt, or train again with --force train.")
    return model_dir / "last.pt"


def _model_outputs(model_dir: Path) -> list[str]:
    """What the train stage's stamp records: the checkpoint the later stages use (:func:`_model_checkpoint`)
    and ``last.pt``, the one a run continues from (either deleted makes the stage run again)."""
    return list(dict.fromkeys([str(_model_checkpoint(model_dir)), str(model_dir / "last.pt")]))


def _train(ctx: _Context) -> tuple[list[str], str]:
    """Train on the training set; with ``[train.grid]``, train every combination and keep the one
    that scores best on the validation slides (held out from the training set, never the test set)."""
    from wsi_milssl.mil.data import read_labels_csv, read_patch_stores

    runs, configs, source = _train_configs(ctx, "images")
    ds = ctx.spec.sets["train"]
    labels = read_labels_csv(ds.labels)
    stores = _set_stores(ctx, "train")
    groups = _label_groups(ds.labels, sorted(stores))
    train_stems, val_stems = split_train_val(sorted(stores), labels, val_fraction=ctx.spec.val_fraction,
                                             seed=ctx.spec.split_seed, groups=groups)
    _refuse_grid_without_validation(configs, sorted(stores), labels, val_stems, val_fraction=ctx.spec.val_fraction,
                                    source=source, what="slide", groups=groups)
    train = read_patch_stores([stores[s] for s in train_stems], labels)
    val = read_patch_stores([stores[s] for s in val_stems], labels) if val_stems else None
    # absolute, as `train` records them: `train --resume OUT/model` may run from another folder
    run_info = {"data": {"inputs": [str(stores[s].resolve()) for s in train_stems],
                         "labels": str(Path(ds.labels).resolve()),
                         "val_inputs": [str(stores[s].resolve()) for s in val_stems] or None,
                         "val_labels": str(Path(ds.labels).resolve()) if val_stems else None,
                         "input_mode": "images"}}
    data = {"mode": "images", "train": [str(stores[s]) for s in train_stems],
            "val": [str(stores[s]) for s in val_stems], "labels": str(ds.labels)}
    best_epoch, summary_extra = _fit_runs(ctx, runs, configs, train=train, val=val,
                                          split={"train": train_stems, "val": val_stems}, run_info=run_info, data=data)
    return _model_outputs(ctx.model_dir), (f"{len(train_stems)} training / {len(val_stems)} validation slides, "
                                           f"best epoch {best_epoch}{summary_extra}")


# ------------------------------------------------------------------------------------------------
# Resuming: tile keeps finished stores, train continues its run folders

#: Written into each training run folder the pipeline starts: what the run was started with.
def _stale_stores(slides: list[Path], out_dir: Path, config) -> list[str]:
    """Stems whose store in ``out_dir`` exists but was made with other settings or cannot be read.
    (A store of an older version of its slide file is not stale here: ``tile_slides`` replaces it.)"""
    from wsi_milssl.errors import StoreError
    from wsi_milssl.store.schema import store_path
    from wsi_milssl.tiling import check_existing_store, slide_stem

    stale = []
    for slide in slides:
        stem = slide_stem(slide)
        try:
            check_existing_store(store_path(out_dir, stem, config.format), config)
        except StoreError:
            stale.append(stem)
    return stale


def _set_stores(ctx: _Context, set_name: str, paths: list[Path] | None = None, *, what: str = "store"
                ) -> dict[str, Path]:
    """{stem: path} of the set's current slides among ``paths`` (default: the stores in ``OUT/stores/<set>``
    in the tile stage's format; or the feature files made from them). Those of slides no longer in the set
    (its slide list changed, as when a cohort's split moves slides between train and test, or a slide was
    renamed) and stores in another format (an earlier run's) are left out, and kept on disk; one warning
    per folder and run says which."""
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.store import find_stores
    from wsi_milssl.store.schema import store_path

    if paths is None:
        folder = ctx.stores(set_name)
        paths = find_stores([folder])
        fmt = _store_format(ctx)
        suffix = store_path(folder, "x", fmt).suffix
        other = sorted(Path(p).name for p in paths if Path(p).suffix != suffix)
        if other and (folder, "format") not in ctx.warned_ignored:
            ctx.warned_ignored.add((folder, "format"))
            log.warning("%s: ignored %d store(s) in another format than [tile] format = %r (%s%s), from an earlier "
                        "run; they are kept, remove them if they are not needed", folder, len(other), fmt,
                        ", ".join(other[:5]), " ..." if len(other) > 5 else "")
        paths = [p for p in paths if Path(p).suffix == suffix]
    stores = {slide_stem(p): p for p in paths}
    return _in_set(ctx, set_name, stores, Path(paths[0]).parent if paths else None, what=what)


def _missing_unrecorded(ctx: _Context, stage: str) -> list[Path]:
    """The outputs of ``stage`` that stamps of earlier versions did not record and that are missing: a store of a
    listed slide (:func:`_missing_stores`), the model's ``last.pt``, the evaluation's ``metrics.json``."""
    if stage == "tile":
        return _missing_stores(ctx)
    expected = {"train": [ctx.model_dir / "last.pt"], "evaluate": [ctx.evaluation_dir / "metrics.json"]}
    return [p for p in expected.get(stage, []) if not p.exists()]


def _earlier_evaluation(ctx: _Context) -> str | None:
    """Why the evaluation (of image data: feature mode's has no FROC) is an earlier version's though its stamp
    matches, else None: its metrics.json does not record the FROC's protocol as this version does for its
    settings (:func:`wsi_milssl.evaluation.outdated_metrics`). The stamp cannot tell: a setting added at its default
    leaves a stamp of the earlier version as it was (:func:`stage_settings`)."""
    if ctx.spec.mode == "features":
        return None
    from wsi_milssl.evaluation import outdated_metrics

    return outdated_metrics(ctx.evaluation_dir, with_label_settings(ctx.spec, "evaluate"))


def _missing_stores(ctx: _Context) -> list[Path]:
    """The stores (in the tile stage's format) of listed slides that are not in ``OUT/stores/<set>``: a store
    deleted after its stage ran must be made again, not left out of training without a word."""
    from wsi_milssl.store.schema import store_path

    fmt = _store_format(ctx)
    expected = [store_path(ctx.stores(name), stem, fmt) for name in ctx.spec.sets
                for stem in (_listed_stems(ctx, name) or [])]
    return [p for p in expected if not p.exists()]


def _store_format(ctx: _Context) -> str:
    """The store format the tile stage writes (``[tile] format``)."""
    from wsi_milssl.config import TileConfig

    return config_from_mapping(TileConfig, ctx.spec.section("tile"), source=f"{ctx.spec.source} [tile]").format


def _listed_stems(ctx: _Context, set_name: str) -> list[str] | None:
    """The exact stems of the set's slides (its slide list or folder); None without one (every file counts)."""
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.tiling import find_slides

    ds = ctx.spec.sets[set_name]
    if ds.slides is None or not Path(ds.slides).exists():
        return None
    return [slide_stem(p) for p in find_slides([ds.slides], keep_missing=True)]


def _in_set(ctx: _Context, set_name: str, found: dict[str, T], folder: Path | None, *, what: str) -> dict[str, T]:
    """The items of ``found`` ({stem: item} of the files in ``folder``) whose slides are now in the set, by
    the exact stem of a listed slide (in Unicode NFC: the store of a slide since renamed, if only in letter
    case, is not the renamed slide's); the others are left out, with one warning per folder and run naming
    them."""
    import unicodedata

    from wsi_milssl.cohorts import stem_key

    listed = _listed_stems(ctx, set_name)
    if listed is None:
        return found
    nfc = lambda name: unicodedata.normalize("NFC", name)  # noqa: E731
    wanted = {stem_key(stem): nfc(stem) for stem in listed}
    current = {stem: item for stem, item in found.items() if wanted.get(stem_key(stem)) == nfc(stem)}
    ignored = sorted(stem for stem in found if stem not in current)
    if ignored and folder not in ctx.warned_ignored:
        ctx.warned_ignored.add(folder)
        log.warning("%s: ignored %d %s(s) of slides no longer in the %s set (%s%s); they are kept, remove them "
                    "if they are not needed", folder, len(ignored), what, set_name, ", ".join(ignored[:5]),
                    " ..." if len(ignored) > 5 else "")
    return current


def _train_features(ctx: _Context) -> tuple[list[str], str]:
    """Feature mode: MIL-SSL on instance features (pre-extracted, or the features stage's); validation bags
    split off the training set. A ``[train.grid]`` is trained and chosen on them as in image mode."""
    from wsi_milssl.mil.data import read_feature_files, read_labels_csv

    runs, configs, source = _train_configs(ctx, "features")
    ds = ctx.spec.sets["train"]
    if ctx.spec.feature_stage:  # the features stage's files of the set's current slides
        files = [p.resolve() for p in _set_stores(ctx, "train", feature_files(ctx.features_dir("train")),
                                                  what="feature file").values()]
    else:
        files = [p.resolve() for p in feature_files(ds.features)]
    labels_csv = Path(ds.labels).resolve()
    data = read_feature_files(files, read_labels_csv(labels_csv))
    labels = {name: int(lab) for name, lab in zip(data.bag_names, data.bag_labels)}
    groups = _label_groups(labels_csv, list(data.bag_names))
    train_names, val_names = split_train_val(list(data.bag_names), labels, val_fraction=ctx.spec.val_fraction,
                                             seed=ctx.spec.split_seed, groups=groups)
    _refuse_grid_without_validation(configs, list(data.bag_names), labels, val_names,
                                    val_fraction=ctx.spec.val_fraction, source=source, what="bag", groups=groups)
    index = {n: i for i, n in enumerate(data.bag_names)}
    train = data.subset_bags([index[n] for n in train_names])
    val = data.subset_bags([index[n] for n in val_names]) if val_names else None
    run_info = {"data": _feature_run_data(files, labels_csv, train_names, val_names)}
    grid_data = {"mode": "features", "files": [str(p) for p in files], "labels": str(labels_csv),
                 "train": list(train_names), "val": list(val_names)}
    best_epoch, summary_extra = _fit_runs(ctx, runs, configs, train=train, val=val,
                                          split={"train": train_names, "val": val_names}, run_info=run_info,
                                          data=grid_data)
    return _model_outputs(ctx.model_dir), (f"{len(train_names)} training / {len(val_names)} validation bags, "
                                           f"best epoch {best_epoch}{summary_extra}")


def _feature_run_data(files: list[Path], labels_csv: Path, train_names: list[str], val_names: list[str]) -> dict:
    """The "data" entry of a feature run's config.json, as ``wsi-milssl train`` records it (so ``train
    --resume RUN`` reads the same bags again): the training files as ``inputs``, the validation files as
    ``val_inputs``, absolute paths. The split is by bag; a file whose bags fall on both sides cannot be
    listed, so then no inputs are recorded (a warning says so) and ``bags`` keeps the split."""
    train_set, val_set = set(train_names), set(val_names)
    train_files, val_files, mixed = [], [], []
    for path in files:
        bags = feature_file_bags(path)
        if bags is None:
            mixed.append(path)
        elif not bags or set(bags) <= train_set:
            train_files.append(path)
        elif set(bags) <= val_set:
            val_files.append(path)
        else:
            mixed.append(path)
    record: dict = {"labels": str(labels_csv), "input_mode": "features",
                    "bags": {"train": list(train_names), "val": list(val_names)}}
    if mixed:
        log.warning("%s holds bags of both the training and the validation split; the run's config.json lists "
                    "no inputs, so `wsi-milssl train --resume` cannot read them (the pipeline itself resumes).",
                    mixed[0])
        record.update(inputs=[], val_inputs=None, val_labels=None)
        return record
    record.update(inputs=[str(p) for p in train_files], val_inputs=[str(p) for p in val_files] or None,
                  val_labels=str(labels_csv) if val_files else None)
    return record


def _evaluate_features(ctx: _Context) -> tuple[list[str], str]:
    """Feature mode: bag AUC / accuracy (and instance AUC when the files carry instance labels) on the test set
    (:func:`wsi_milssl.evaluation.bags.evaluate_feature_bags`)."""
    from wsi_milssl.evaluation.bags import evaluate_feature_bags

    ds = ctx.spec.sets["test"]
    out = ctx.evaluation_dir
    summary = evaluate_feature_bags(_model_checkpoint(ctx.model_dir), feature_files(ds.features), ds.labels, out)
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    return [str(out / "metrics.json"), str(out / "scores.csv")], (
        f"bag AUC {fmt(summary['bag_auc'])}, bag accuracy {fmt(summary['bag_accuracy'])} on {summary['n_bags']} "
        "test bags")


def _refuse_other_test_features(spec: PipelineSpec) -> None:
    """Feature mode: test features made otherwise than the training features (another encoder, weights,
    width, resolution or encoder options; a file of each set compared) refused before training, not after it.
    Files that cannot be read are left to the stages, which name them."""
    from wsi_milssl.errors import ConfigError, WsiMilsslError
    from wsi_milssl.features.schema import encoder_label, encoders_differ, read_feature_file, settings_differences

    def first(name: str):  # the first file with patches (training leaves empty ones out)
        for path in feature_files(spec.sets[name].features):
            ff = read_feature_file(path)
            if len(ff):
                return ff
        raise IndexError(name)

    try:
        train, test = first("train"), first("test")
    except (IndexError, OSError, WsiMilsslError):
        return
    diffs = settings_differences(test.feature_settings, train.feature_settings)
    made, trained = (test.encoder, test.encoder_weights_sha256), (train.encoder, train.encoder_weights_sha256)
    if encoders_differ(made, trained):
        diffs.insert(0, f"{encoder_label(*made)} vs {encoder_label(*trained)}")
    widths = [int(f.features.shape[1]) for f in (test, train) if f.features.ndim == 2 and len(f)]
    if len(widths) == 2 and widths[0] != widths[1]:
        diffs.insert(0, f"{widths[0]} vs {widths[1]} values per patch")
    if diffs:
        raise ConfigError(f"{spec.source}: the test features ({test.path}) were made otherwise than the training "
                          f"features ({train.path}): {'; '.join(diffs)}. Fix: point [data].test_features at "
                          "features made with the training encoder, weights, options, resolution and patch size.")


def _heatmap(ctx: _Context) -> tuple[list[str], str]:
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.inference import make_heatmaps
    from wsi_milssl.tiling import find_slides

    config = with_label_settings(ctx.spec, "heatmap")
    checkpoint = _model_checkpoint(ctx.model_dir)
    ds = ctx.spec.sets["test"]
    stores = _set_stores(ctx, "test")
    # the slides as they are listed now, not as their stores record them (where they were tiled: another folder
    # once OUT has been moved or copied)
    slides = [p for p in find_slides([ds.slides]) if slide_stem(p) in stores]
    run = make_heatmaps(slides, checkpoint, ctx.heatmap_dir, config, stores=list(stores.values()),
                        annotations_dir=ds.annotations, progress=ctx.progress, overwrite=ctx.redo)
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        raise WsiMilsslError(f"heatmap: {len(failed)} slide(s) failed (see {ctx.heatmap_dir}): "
                             + "; ".join(f"{r.slide}: {r.error}" for r in failed[:3]))
    _write_set_scores(run)
    n = sum(r.n_patches for r in run.results)
    slide_files = _existing(p for r in run.results for p in r.outputs.values())  # (a deleted overlay: drawn again)
    reused = [f"{len(v)} {what}" for v, what in ((run.skipped, "kept"), (run.redrawn, "drawn again")) if v]
    return [str(ctx.heatmap_dir / "scores.csv")] + slide_files, (
        f"{len(run.results)} slides{' (' + ', '.join(reused) + ')' if reused else ''}, {n} patches")


def _write_set_scores(run) -> None:
    """``scores.csv`` of the heatmap folder with the scores of the run's slides (the test set's now): rows
    of slides no longer in the set are dropped (their other files are kept, and ignored by evaluate)."""
    from wsi_milssl.inference.exports import update_scores_csv

    update_scores_csv(run.out_dir, {r.slide: r.score for r in run.results if r.score is not None},
                      keep_others=False)


def _heatmap_features(ctx: _Context) -> tuple[list[str], str]:
    """With a [features] table: the head's probabilities on the test set's feature files (the stores' grid)."""
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.inference.feature_maps import make_feature_heatmaps
    from wsi_milssl.inference.stage import COMPLETE_SLIDE_FILES
    from wsi_milssl.tiling import find_slides

    config = with_label_settings(ctx.spec, "heatmap")
    checkpoint = _model_checkpoint(ctx.model_dir)
    ds = ctx.spec.sets["test"]
    files = _set_stores(ctx, "test", feature_files(ctx.features_dir("test")), what="feature file")
    run = make_feature_heatmaps(list(files.values()), checkpoint, ctx.heatmap_dir, config,
                                slides=find_slides([ds.slides]) if ds.slides is not None else (),
                                annotations_dir=ds.annotations, progress=ctx.progress)
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        raise WsiMilsslError(f"heatmap: {len(failed)} slide(s) failed (see {ctx.heatmap_dir}): "
                             + "; ".join(f"{r.slide}: {r.error}" for r in failed[:3]))
    _write_set_scores(run)
    n = sum(r.n_patches for r in run.results)
    slide_files = _existing(r.outputs.get(k) for r in run.results for k in COMPLETE_SLIDE_FILES)
    return [str(ctx.heatmap_dir / "scores.csv")] + slide_files, f"{len(run.results)} slides, {n} patches (feature head)"


def _evaluate(ctx: _Context) -> tuple[list[str], str]:
    from wsi_milssl.artifacts import EVALUATION_FILES, parse_heatmap_name
    from wsi_milssl.evaluation import evaluate_predictions, froc_protocol_summary

    config = with_label_settings(ctx.spec, "evaluate")
    ds = ctx.spec.sets["test"]
    # the heatmap files of slides no longer in the test set (a changed split, a renamed slide) stay in the
    # folder, ignored
    names = sorted(p.name for p in ctx.heatmap_dir.iterdir() if not p.name.startswith(".")) \
        if ctx.heatmap_dir.is_dir() else []  # hidden files (a Mac's ._X copies) are no slide's, as for evaluate
    stems = {parsed[0]: parsed[0] for parsed in map(parse_heatmap_name, names) if parsed}
    _in_set(ctx, "test", stems, ctx.heatmap_dir, what="heatmap output")  # warns about the others
    result = evaluate_predictions(ctx.heatmap_dir, labels_csv=ds.labels, out_dir=ctx.evaluation_dir,
                                  annotations_dir=ds.annotations, slides=ds.slides, config=config,
                                  progress=ctx.progress, only=_listed_stems(ctx, "test"))
    m = result.metrics
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    # every file of the folder the evaluation wrote (the plots only where their metric exists): one deleted
    # makes the stage run again, which writes them all
    return _existing(ctx.evaluation_dir / name for name in EVALUATION_FILES.values()), (
        f"instance AUC {fmt(m.get('instance_auc'))}, bag AUC {fmt(m.get('bag_auc'))}, FROC {fmt(m.get('froc'))}"
        + (f" ({protocol})" if (protocol := froc_protocol_summary(m)) else "")
    )


_RUNNERS: dict[str, Callable[[_Context], tuple[list[str], str]]] = {
    "synth": _synth, "tile": _tile, "label": _label, "train": _train, "heatmap": _heatmap, "evaluate": _evaluate,
}
_FEATURE_RUNNERS = {"train": _train_features, "evaluate": _evaluate_features}
# Image data with a [features] table: the stores are embedded, the head trains and draws on the features.
_EMBEDDED_RUNNERS = {**_RUNNERS, "features": _features, "train": _train_features, "heatmap": _heatmap_features}


def run_pipeline(
    spec: PipelineSpec | str | os.PathLike,
    *,
    force: Iterable[str] = (),
    until: str | None = None,
    progress: ProgressCallback | None = None,
    on_stage: Callable[[StageOutcome], None] | None = None,
    out_named_by: str = "--out",
) -> list[StageOutcome]:
    """Run the pipeline's stages in order, skipping those that are up to date; returns one StageOutcome per
    stage (its status: ran, skipped, failed; seconds; summary; the reason it ran).

    ``spec``: a loaded pipeline (:func:`wsi_milssl.pipeline.load_pipeline`, which also takes ``out_dir`` and
    ``--set`` overrides; ``check_paths=True`` as the command line) or the path of its TOML file (loaded so). ``force``: stages to run although up to date (and the
    ones after them); ``until``: the last stage to run; ``progress``: callback receiving ProgressEvents;
    ``on_stage``: called with each stage's outcome as it ends.

    Holds the lock of the pipeline's output folder for the whole run (FolderLockedError while
    another run holds it; its fix names the folder as ``out_named_by``: ``demo`` takes it as OUT_DIR).
    """
    if isinstance(spec, (str, os.PathLike)):
        spec = load_pipeline(spec, check_paths=True)  # as `wsi-milssl run`: [data] paths exist
    forced = set(force)
    unknown = forced - set(STAGES)
    if unknown or (until is not None and until not in STAGES):
        from wsi_milssl.errors import ConfigError

        bad = sorted(unknown) or [until]
        raise ConfigError(f"unknown stage(s) {', '.join(map(str, bad))}; stages are {', '.join(STAGES)}.")
    if spec.mode == "features":
        stages = ["train", "evaluate"]
    else:
        stages = [s for s in STAGES if (s != "synth" or spec.sets["train"].synth is not None)
                  and (s != "features" or spec.feature_stage)]
    every_stage = list(stages)
    absent = sorted(forced - set(stages))
    if absent:
        from wsi_milssl.errors import ConfigError

        raise ConfigError(f"{spec.source}: --force {', '.join(absent)}: not a stage of this pipeline (its stages: "
                          f"{', '.join(stages)}).")
    if until is not None:
        if until not in stages:
            from wsi_milssl.errors import ConfigError

            raise ConfigError(f"{spec.source}: stage {until!r} is not part of this pipeline (its stages: "
                              f"{', '.join(stages)}).")
        stages = stages[: stages.index(until) + 1]
        later = sorted(forced - set(stages), key=STAGES.index)
        if later:
            from wsi_milssl.errors import ConfigError

            raise ConfigError(f"--force {', '.join(later)}: after --until {until}, so it would not run. Fix: drop "
                              f"--until, or force a stage up to {until}.")
    _refuse_shared_slides(spec)
    if spec.mode == "images":  # [label]'s settings in [heatmap] / [evaluate]: a clash found before any stage runs
        for stage in ("heatmap", "evaluate"):
            if stage in stages:
                with_label_settings(spec, stage)
    elif "evaluate" in stages:
        _refuse_other_test_features(spec)
    with folder_lock(spec.out_dir, named_by=out_named_by):
        outcomes = _run_stages(spec, stages, forced, progress=progress, on_stage=on_stage)
        if stages == every_stage:
            # the pipeline as it ran (overrides applied, every setting, absolute paths), beside its outputs: only
            # once every stage is done with these settings (_run_stages removed the file of an earlier run)
            write_resolved_pipeline(spec, spec.out_dir / RESOLVED_FILENAME)
        return outcomes


def refuse_unusable_split(spec: PipelineSpec, *, read_lists: bool,
                          train_lists: tuple[dict[str, int], dict[str, str]] | None = None) -> None:
    """When a pipeline is loaded (:func:`~wsi_milssl.pipeline.spec.load_pipeline`: before ``run``'s first stage,
    and ``prepare``'s check of the pipeline it writes): the refusals of a [train.grid] whose split holds out no
    validation slides, or with val_fraction = 0 (:func:`_refuse_grid_without_validation`, as the train stage's),
    and of any run whose validation slides cannot give its select_metric (:func:`_refuse_unusable_validation`),
    made from the training slide list and labels (``read_lists``: a run's, whose [data] paths were checked; not
    read for a pipeline written before its lists, as prepare writes it) or the names and labels synth will
    generate, whose stores tile makes and train splits. Feature files are split by the train stage, the first of
    a feature pipeline; a slide list or labels file that cannot be read is the stages' error to report. A grid
    with val_fraction = 0 is refused all the same. ``train_lists``: the training slides' ({stem: label},
    {stem: patient}) as ``prepare`` holds them before it writes the lists (read instead of the files)."""
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.config import TrainConfig
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.mil.data import read_labels_csv
    from wsi_milssl.pipeline.spec import _set_by
    from wsi_milssl.synth.generate import tumour_flags
    from wsi_milssl.tiling import find_slides

    ds = spec.sets["train"]
    source = f"{spec.source} [train]{_set_by(spec.overrides, 'train', 'data', 'synth.train')}"
    section = spec.section("train")
    section.setdefault("mode", spec.train_mode)
    configs = [config_from_mapping(TrainConfig, {**section, **o}, source=source)
               for o in _grid_runs(section, source)]
    if (spec.mode == "features" or (len(configs) < 2 and spec.val_fraction <= 0)
            or (ds.synth is None and ds.slides is None)):
        return
    stems: list[str] = []
    groups: dict[str, str] = {}
    try:
        if ds.synth is not None:  # synth_NNN, labelled as generate_slides labels them
            labels = {f"synth_{i:03d}": int(flag) for i, flag in enumerate(tumour_flags(ds.synth))}
            stems = sorted(labels)
        elif train_lists is not None:
            labels, groups = dict(train_lists[0]), dict(train_lists[1])
            stems = sorted(labels)
        elif read_lists:
            stems = sorted(slide_stem(p) for p in find_slides([ds.slides], keep_missing=True))
            labels = read_labels_csv(ds.labels)
            groups = _label_groups(ds.labels, stems)
        if stems:
            _, val = split_train_val(stems, labels, val_fraction=spec.val_fraction, seed=spec.split_seed,
                                     groups=groups)
            would_val = (split_train_val(stems, labels, val_fraction=SUGGESTED_VAL_FRACTION,
                                         seed=spec.split_seed, groups=groups)[1] if spec.val_fraction <= 0 else None)
    except WsiMilsslError:
        stems = []
    if stems:
        if len(configs) > 1:  # (a single run without validation: train warns, once)
            _refuse_grid_without_validation(configs, stems, labels, val, val_fraction=spec.val_fraction,
                                            source=source, what="slide", would_val=would_val, groups=groups)
        _refuse_unusable_validation(configs, stems, labels, val, val_fraction=spec.val_fraction, source=source,
                                    what="slide", groups=groups)
    elif spec.val_fraction <= 0:  # a grid: no split holds out anything with val_fraction = 0
        _refuse_grid_without_validation(configs, [], {}, [], val_fraction=0.0, source=source, what="slide")


def _refuse_unavailable_encoder(spec: PipelineSpec) -> None:
    """Before the first stage of a run whose features stage will run: the [features] encoder built with its
    weights, as the features stage builds it, so that weights that are not there ("cached" ones not in the
    library's cache, no such file) or do not fit the encoder stop the run before tile and label (hours on
    CAMELYON16). Missing weights are one ConfigError naming the pipeline and its setting, [features] weights
    (the features command's message names its --weights option)."""
    from wsi_milssl.config import FeaturesConfig
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.features.encoders import EncoderWeightsError, create_encoder
    from wsi_milssl.pipeline.spec import _set_by

    where = f"{spec.source} [features]{_set_by(spec.overrides, 'features')}"
    config = config_from_mapping(FeaturesConfig, spec.section("features"), source=where)
    try:
        create_encoder(config.encoder, weights=config.weights, kwargs=config.encoder_kwargs)
    except EncoderWeightsError as exc:
        raise ConfigError(f"{where}: {exc.problem} Fix: {exc.fix(setting=True)}") from None


def _refuse_shared_slides(spec: PipelineSpec) -> None:
    """ConfigError when a slide file is in both the training and the test set (a test slide the model
    trained or validated on would be scored as unseen); files are compared by device and inode, so one
    file under two names counts, and two slides that only share a name (two folders) do not."""
    from wsi_milssl.cohorts.names import file_identity
    from wsi_milssl.errors import ConfigError, WsiMilsslError
    from wsi_milssl.tiling import find_slides

    if spec.mode == "features" or any(ds.synth is not None or ds.slides is None for ds in spec.sets.values()):
        return
    try:
        # a listed file that does not exist is the tile stage's error to report
        train = {file_identity(p): p for p in find_slides([spec.sets["train"].slides], keep_missing=True)
                 if Path(p).exists()}
        test = [p for p in find_slides([spec.sets["test"].slides], keep_missing=True) if Path(p).exists()]
    except WsiMilsslError:  # the tile stage says what is wrong with the lists
        return
    shared = [(train[file_identity(p)], p) for p in test if file_identity(p) in train]
    if shared:
        raise ConfigError(f"{spec.source}: {len(shared)} slide(s) are in both the training and the test set ("
                          + ", ".join(f"{a}" if Path(a) == Path(b) else f"{a} = {b}" for a, b in shared[:3])
                          + (", ..." if len(shared) > 3 else "") + "): the model would be scored on slides it "
                          "trained or validated on. Fix: take them off one of the two slide lists.")


def _run_stages(spec: PipelineSpec, stages: list[str], forced: set[str], *,
                progress: ProgressCallback | None, on_stage: Callable[[StageOutcome], None] | None
                ) -> list[StageOutcome]:
    ctx = _Context(spec, progress)
    # two chains of digests: this version's, and the one stamps of earlier versions hold (accepted for skipping)
    digests: dict[str, str] = {}
    legacy_digests: dict[str, str] = {}
    outcomes: list[StageOutcome] = []
    forced_first: str | None = None  # the first stage run for `force`: every later one is redone too
    # the [features] encoder is checked before the first stage that runs, when that stage is features or one before
    # it (every stage after one that ran runs too): not found missing after tile and label
    check_encoder = spec.feature_stage and "features" in stages
    for i, stage in enumerate(stages):
        legacy_digests[stage] = stamp_digest(*digest_parts(spec, stage, legacy_digests, ctx.state, form="legacy"))
        # a stamp that records every setting is compared in that form; one of the earlier "changed" form (or a
        # digest alone) in its own, then replaced by one of every setting if the stage runs
        stamp = read_stamp(ctx.state, stage)
        forms = ("all",) if stamp is None or stamp.get(SETTINGS_FORM) == "all" else ("changed", "all")
        checked = {}
        for form in forms:
            settings, inputs = digest_parts(spec, stage, digests, ctx.state, form=form)
            settings = setting_names(stage, settings)
            checked[form] = (recorded_digest(ctx.state, stage, stamp_digest(settings, inputs), settings, inputs),
                             settings, inputs)
        candidates = [checked[form][0] for form in forms]
        digest, settings, inputs = checked[forms[0]]
        if stamp is not None and stamp.get("digest") in candidates:
            digest = stamp["digest"]  # the chain goes on with the digest of the form the stamp holds
        digests[stage] = digest
        emit(progress, ProgressEvent("pipeline", i, len(stages), unit="stage", item=stage))
        if stage in forced and forced_first is None:
            forced_first = stage
            ctx.redo = True
        ran_before = [o.stage for o in outcomes if o.status == "ran"]
        stale = stale_reason(ctx.state, stage, (*candidates, legacy_digests[stage]), settings=settings, inputs=inputs,
                             ran=ran_before)
        if stale is not None and stale.startswith("settings changed: "):
            stale += _default_change_note(spec, stage, stamp, settings)
        if stale is None:  # outputs that stamps of earlier versions do not record
            missing = _missing_unrecorded(ctx, stage)
            stale = f"output missing: {missing[0]}" if missing else None
        if stale is None and stage == "evaluate":
            stale = _earlier_evaluation(ctx)
        if stale is None and not ran_before and forced_first is None:
            outcome = StageOutcome(stage, "skipped", 0.0, "up to date" + _kept_note(ctx, stage))
        else:
            if forced_first is not None:
                reason = f"forced (--force {forced_first})"
            else:
                reason = stale or f"the {ran_before[-1]} stage ran before it"
            if check_encoder and STAGES.index(stage) <= STAGES.index("features"):
                _refuse_unavailable_encoder(spec)
            check_encoder = False
            log.info("%s runs: %s", stage, reason)
            start = time.perf_counter()
            if spec.mode == "features":
                runner = _FEATURE_RUNNERS[stage]
            else:
                runner = (_EMBEDDED_RUNNERS if spec.feature_stage else _RUNNERS)[stage]
            _remove_resolved_pipeline(spec)
            # every later stage, also one this run does not reach (--until, an error, a kill), was made from
            # this stage's earlier outputs: out of date until it runs again
            mark_outdated(ctx.state, STAGES[STAGES.index(stage) + 1:], by=stage)
            mark_running(ctx.state, stage)
            outputs, summary = runner(ctx)
            digest, settings, inputs = checked["all"]
            digests[stage] = digest
            write_stamp(ctx.state, stage, digest=digest, outputs=outputs, settings=settings, inputs=inputs,
                        reads=_file_reads(spec, stage), settings_form="all")
            outcome = StageOutcome(stage, "ran", time.perf_counter() - start, summary, reason)
        outcomes.append(outcome)
        if on_stage is not None:
            on_stage(outcome)
    emit(progress, ProgressEvent("pipeline", len(stages), len(stages), unit="stage"))
    return outcomes


def _default_change_note(spec: PipelineSpec, stage: str, stamp: dict | None, settings: dict) -> str:
    """For a stamp of the earlier form (settings that differed from their defaults; ``settings``: {name: value} in
    that form): the changed settings that the pipeline leaves at their defaults and that it left out because they
    were at a default that changed since (:data:`~wsi_milssl.pipeline.digests.EARLIER_DEFAULTS`), with the value
    that keeps the earlier result; "" when there are none. (A stamp of this version's form does not say which
    settings the pipeline set, so a value it recorded may be one the pipeline set then.)"""
    if stage == "synth" or not stamp or not isinstance(stamp.get("settings"), dict) or stamp.get(SETTINGS_FORM):
        return ""
    defaults = config_to_dict(stage_config(spec, stage, defaults_only=True))
    notes = []
    for name, value in settings.items():
        table, _, key = name.partition(".")
        if (table != stage or key in spec.section(stage) or name in stamp["settings"]
                or defaults.get(key, object()) != value):
            continue
        before = EARLIER_DEFAULTS.get(stage, {}).get(key)
        if before is not None and before != value:
            notes.append(f"the default of {name} is {value} since this version, {before} before: set {name} = "
                         f"{json.dumps(before)} to keep the earlier result")
    return f" ({'; '.join(notes)})" if notes else ""


#: the stages whose output files a hand command or edit may replace in place (``train --resume OUT/model``,
#: ``heatmap`` into ``OUT/heatmaps``, an annotation or labels file of generated slides corrected) and whose readers
#: are cheap to run again (heatmap keeps every slide predicted with the same checkpoint; tile every store cut from
#: the same slide file). The files of tile, label and features are not checked: a folder copied without its
#: modification times (``cp -r``) would otherwise label and train again.
_CHECKED_FILES = ("synth", "train", "heatmap")


def _file_reads(spec: PipelineSpec, stage: str) -> tuple[str, ...]:
    """The stages whose output files ``stage`` reads and whose identities its stamp records (:func:`write_stamp`'s
    ``reads``): among :data:`_CHECKED_FILES`, those its digest covers, and in a feature pipeline (``[data] mode =
    "features"``) the model that evaluate reads."""
    if spec.mode == "features":
        return ("train",) if stage == "evaluate" else ()
    upstream = (EMBEDDED_UPSTREAM if spec.feature_stage else UPSTREAM)[stage]
    return tuple(s for s in upstream if s in _CHECKED_FILES)


#: what may have changed the output files of a stage of :data:`_CHECKED_FILES` outside the pipeline: said
#: when it keeps them
_CHANGED_BY = {"synth": "edited by hand?", "train": "train --resume?", "heatmap": "heatmap run by hand?"}


def _kept_note(ctx: _Context, stage: str) -> str:
    """"; kept: FILES changed outside the pipeline (HOW?)" for a stage that is up to date though output files of
    it changed since it wrote them (:func:`wsi_milssl.pipeline.stamps.changed_outputs`: ``train --resume
    OUT/model`` continued the model); "" when none did. The stage keeps them (nothing is trained or drawn again,
    nothing renamed); the stages that read them run again, saying "input changed: FILES"."""
    changed = changed_outputs(ctx.state, stage) if stage in _CHECKED_FILES else []
    if not changed:
        return ""
    shown = shown_paths(changed)
    how = f" ({_CHANGED_BY[stage]})"
    log.warning("%s: %s changed since the pipeline wrote %s%s; kept, and the stages that read %s run again",
                stage, shown, "it" if len(changed) == 1 else "them", how, "it" if len(changed) == 1 else "them")
    return f"; kept: {shown} changed outside the pipeline{how}"


def _remove_resolved_pipeline(spec: PipelineSpec) -> None:
    """Before a stage changes the outputs: remove ``OUT/resolved_pipeline.toml`` of an earlier run, which would
    no longer describe them (the settings of a run stopped by ``--until``, an interruption or an error never
    reached the later stages); :func:`run_pipeline` writes it again when a run of every stage finishes. A run
    started from that very file keeps it: it holds the user's settings (those of the last run of every stage)."""
    path = spec.out_dir / RESOLVED_FILENAME
    if path.is_file() and Path(spec.source).is_file() and path.samefile(spec.source):
        return
    if path.is_file():
        path.unlink()
        log.info("%s removed: a stage runs; it is written again when a run of every stage finishes", path)
