"""The pipeline's train stage (``wsi-milssl run``): the training/validation split of the training slides, the
[train.grid] points (one at a time or in worker processes), the choice of a point on validation, and the
refusals of a split whose validation slides cannot choose (also made when a pipeline is loaded:
:func:`refuse_unusable_split`). Image mode trains on the stores of tile and label (:func:`train_images`),
feature mode on feature files (:func:`train_features`)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from wsi_milssl.atomic import atomic_open, atomic_write_json
from wsi_milssl.config import config_from_mapping, config_to_dict
from wsi_milssl.errors import ConfigError
from wsi_milssl.events import ProgressEvent, emit
from wsi_milssl.pipeline.context import StageContext, set_stores
from wsi_milssl.pipeline.digests import feature_file_bags, feature_files, run_fingerprints, training_data_forms
from wsi_milssl.pipeline.run_folders import (RUN_MARKER, continued_config, holds_run, keep_grid_parent,
                                             prepare_run_dir, replace_aside)
from wsi_milssl.pipeline.spec import PipelineSpec

__all__ = ["SUGGESTED_VAL_FRACTION", "grid_runs", "grid_worker_count", "label_groups", "model_checkpoint",
           "refuse_grid_without_validation", "refuse_unusable_split", "refuse_unusable_validation",
           "split_train_val", "train_features", "train_images", "validation_score"]

log = logging.getLogger(__name__)


def split_train_val(stems: list[str], labels: dict[str, int], *, val_fraction: float, seed: int,
                    groups: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Stratified split of training slides into (train, val); at least one slide of each class in val
    when there are two or more of that class (never the test set): :func:`wsi_milssl.cohorts.stratified_split`.
    With ``groups`` ({stem: patient}: the labels file's patient column, :func:`label_groups`) whole patients
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


def label_groups(labels_csv, names) -> dict[str, str]:
    """{name: patient} of ``names`` from the labels file's patient column (:data:`wsi_milssl.cohorts.GROUP_COLUMNS`,
    as ``prepare folder`` writes it into train_labels.csv); {} without one: slides are split one by one."""
    from wsi_milssl.cohorts import label_groups_for

    return label_groups_for(labels_csv, names)[1]


def grid_runs(section: dict, source: str) -> list[dict]:
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


def validation_score(result, select_metric: str, run_dir: Path | None = None) -> tuple[float, float] | None:
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


def _train_grid(points: list[_GridPoint], train, val, run_info: dict, *, ctx: StageContext,
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
            out.append((validation_score(result, point.config.select_metric, point.run_dir), result.best_epoch))
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
    return validation_score(result, cfg.select_metric, Path(run_dir)), result.best_epoch


def _train_configs(ctx: StageContext, mode: str) -> tuple[list[dict], list, str]:
    """The [train] table's runs: (grid overrides, TrainConfig per run, source)."""
    from wsi_milssl.config import TrainConfig

    source = f"{ctx.spec.source} [train]"
    section = ctx.spec.section("train")
    section.setdefault("mode", mode)
    runs = grid_runs(section, source)
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
    from types import SimpleNamespace

    from wsi_milssl.mil.scores import selection_problem  # torch-free: checked on every run

    bags = SimpleNamespace(n_bags=len(val), bag_labels=np.array([int(labels[s]) for s in val], dtype=np.int64),
                           instance_labels=None)  # what selection_problem reads of an InstanceSet
    for metric in dict.fromkeys(config.select_metric for config in configs):
        why = selection_problem(bags, metric) if metric != "instance_auc" else None
        if why is not None:
            return metric, why
    return None


def _names(stems: list[str]) -> str:
    """The first 5 of ``stems``, and how many more, for a message."""
    return ", ".join(stems[:5]) + (f" and {len(stems) - 5} more" if len(stems) > 5 else "")


def refuse_grid_without_validation(configs: list, stems: list[str], labels, val: list, *, val_fraction: float,
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


def refuse_unusable_validation(configs: list, stems: list[str], labels, val: list, *, val_fraction: float,
                                source: str, what: str, groups: dict[str, str] | None = None) -> None:
    """ConfigError for a run (single, or a [train.grid]'s points: ``configs``, TrainConfigs) whose select_metric
    the validation ``what``s ``val`` split off ``stems`` can never give, as far as their labels tell
    (:func:`_selection_problem`: bag AUC on one class): train would certainly fail on them. ``groups`` as
    :func:`refuse_grid_without_validation` takes them."""
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


def _fit_runs(ctx: StageContext, runs: list[dict], configs: list, *, train, val, split: dict,
              run_info: dict, data: dict) -> tuple[int | None, str]:
    """Train the single run into OUT/model, or every [train.grid] point into OUT/model/grid/<point> and
    copy the best on validation into OUT/model; returns (best epoch, summary addition). With ``force`` the
    model folder (its single run or grid) is renamed aside first; the callers have made every check that
    can refuse the run (:func:`refuse_grid_without_validation`), so a refused run leaves the model where
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
        last = ctx.model_dir / "last.pt"
        before = last.stat().st_mtime_ns if resume and last.is_file() else None
        result = fit(train, config=config, out_dir=ctx.model_dir, val=val, run_info=run_info, resume=resume,
                     progress=ctx.progress)
        kept = before is not None and last.is_file() and last.stat().st_mtime_ns == before
        # review BS: the line read as if it had trained; review CQ: and as if a continued run had started over
        continued = ", continued from the last.pt of a run of these settings (stopped, or of fewer epochs)"
        return result.best_epoch, (", the finished run of these settings kept (no epoch trained)" if kept else
                                   continued if before is not None else "")
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


def model_checkpoint(model_dir: Path) -> Path:
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
    """What the train stage's stamp records: the checkpoint the later stages use (:func:`model_checkpoint`)
    and ``last.pt``, the one a run continues from (either deleted makes the stage run again)."""
    return list(dict.fromkeys([str(model_checkpoint(model_dir)), str(model_dir / "last.pt")]))


def train_images(ctx: StageContext) -> tuple[list[str], str]:
    """Train on the training set; with ``[train.grid]``, train every combination and keep the one
    that scores best on the validation slides (held out from the training set, never the test set)."""
    from wsi_milssl.mil.data import read_labels_csv, read_patch_stores

    runs, configs, source = _train_configs(ctx, "images")
    ds = ctx.spec.sets["train"]
    labels = read_labels_csv(ds.labels)
    stores = set_stores(ctx, "train")
    groups = label_groups(ds.labels, sorted(stores))
    train_stems, val_stems = split_train_val(sorted(stores), labels, val_fraction=ctx.spec.val_fraction,
                                             seed=ctx.spec.split_seed, groups=groups)
    refuse_grid_without_validation(configs, sorted(stores), labels, val_stems, val_fraction=ctx.spec.val_fraction,
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
    # stores without a patch are left out of the sets read (review BK: the line counted them as trained on)
    n_val = 0 if val is None else val.n_bags
    empty = len(train_stems) + len(val_stems) - train.n_bags - n_val
    return _model_outputs(ctx.model_dir), (f"{train.n_bags} training / {n_val} validation slides"
                                           + (f" ({empty} without a patch left out)" if empty else "")
                                           + f", {_best(best_epoch)}{summary_extra}")


def train_features(ctx: StageContext) -> tuple[list[str], str]:
    """Feature mode: MIL-SSL on instance features (pre-extracted, or the features stage's); validation bags
    split off the training set. A ``[train.grid]`` is trained and chosen on them as in image mode."""
    from wsi_milssl.mil.data import read_feature_files, read_labels_csv

    runs, configs, source = _train_configs(ctx, "features")
    ds = ctx.spec.sets["train"]
    if ctx.spec.feature_stage:  # the features stage's files of the set's current slides
        files = [p.resolve() for p in set_stores(ctx, "train", feature_files(ctx.features_dir("train")),
                                                  what="feature file").values()]
    else:
        files = [p.resolve() for p in feature_files(ds.features)]
    labels_csv = Path(ds.labels).resolve()
    data = read_feature_files(files, read_labels_csv(labels_csv))
    labels = {name: int(lab) for name, lab in zip(data.bag_names, data.bag_labels)}
    groups = label_groups(labels_csv, list(data.bag_names))
    train_names, val_names = split_train_val(list(data.bag_names), labels, val_fraction=ctx.spec.val_fraction,
                                             seed=ctx.spec.split_seed, groups=groups)
    refuse_grid_without_validation(configs, list(data.bag_names), labels, val_names,
                                    val_fraction=ctx.spec.val_fraction, source=source, what="bag", groups=groups)
    index = {n: i for i, n in enumerate(data.bag_names)}
    train = data.subset_bags([index[n] for n in train_names])
    val = data.subset_bags([index[n] for n in val_names]) if val_names else None
    del data  # the whole set, copied into train and val: not held through training (review CH)
    run_info = {"data": _feature_run_data(files, labels_csv, train_names, val_names)}
    grid_data = {"mode": "features", "files": [str(p) for p in files], "labels": str(labels_csv),
                 "train": list(train_names), "val": list(val_names)}
    best_epoch, summary_extra = _fit_runs(ctx, runs, configs, train=train, val=val,
                                          split={"train": train_names, "val": val_names}, run_info=run_info,
                                          data=grid_data)
    return _model_outputs(ctx.model_dir), (f"{len(train_names)} training / {len(val_names)} validation bags, "
                                           f"{_best(best_epoch)}{summary_extra}")


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


def refuse_unusable_split(spec: PipelineSpec, *, read_lists: bool,
                          train_lists: tuple[dict[str, int], dict[str, str]] | None = None) -> None:
    """When a pipeline is loaded (:func:`~wsi_milssl.pipeline.spec.load_pipeline`: before ``run``'s first stage,
    and ``prepare``'s check of the pipeline it writes): the refusals of a [train.grid] whose split holds out no
    validation slides, or with val_fraction = 0 (:func:`refuse_grid_without_validation`, as the train stage's),
    and of any run whose validation slides cannot give its select_metric (:func:`refuse_unusable_validation`),
    made from the training slide list and labels (``read_lists``: a run's, whose [data] paths were checked; not
    read for a pipeline written before its lists, as prepare writes it) or the names and labels synth will
    generate, whose stores tile makes and train splits. Feature files are split by the train stage, the first of
    a feature pipeline; a slide list or labels file that cannot be read is the stages' error to report. A grid
    with val_fraction = 0 is refused all the same. ``train_lists``: the training slides' ({stem: label},
    {stem: patient}) as ``prepare`` holds them before it writes the lists (read instead of the files)."""
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.config import TrainConfig
    from wsi_milssl.cohorts import read_labels as read_labels_csv  # torch-free: checked on every run
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.pipeline.spec import _set_by

    ds = spec.sets["train"]
    source = f"{spec.source} [train]{_set_by(spec.overrides, 'train', 'data', 'synth.train')}"
    section = spec.section("train")
    section.setdefault("mode", spec.train_mode)
    configs = [config_from_mapping(TrainConfig, {**section, **o}, source=source)
               for o in grid_runs(section, source)]
    if spec.mode == "features" or (ds.synth is None and ds.slides is None):
        return
    checks_validation = not (len(configs) < 2 and spec.val_fraction <= 0)
    from wsi_milssl.synth.generate import tumour_flags  # not before: a feature pipeline does not need them
    from wsi_milssl.tiling import find_slides
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
            groups = label_groups(ds.labels, stems)
        if stems and checks_validation:
            _, val = split_train_val(stems, labels, val_fraction=spec.val_fraction, seed=spec.split_seed,
                                     groups=groups)
            would_val = (split_train_val(stems, labels, val_fraction=SUGGESTED_VAL_FRACTION,
                                         seed=spec.split_seed, groups=groups)[1] if spec.val_fraction <= 0 else None)
    except WsiMilsslError:
        stems = []
    _refuse_one_class(stems, labels if stems else {}, source=source, synth=ds.synth is not None)
    if not checks_validation:
        return
    if stems:
        if len(configs) > 1:  # (a single run without validation: train warns, once)
            refuse_grid_without_validation(configs, stems, labels, val, val_fraction=spec.val_fraction,
                                            source=source, what="slide", would_val=would_val, groups=groups)
        refuse_unusable_validation(configs, stems, labels, val, val_fraction=spec.val_fraction, source=source,
                                    what="slide", groups=groups)
    elif spec.val_fraction <= 0:  # a grid: no split holds out anything with val_fraction = 0
        refuse_grid_without_validation(configs, [], {}, [], val_fraction=0.0, source=source, what="slide")


def _refuse_one_class(stems: list[str], labels: Mapping[str, int], *, source: str, synth: bool = False) -> None:
    """ConfigError when every training slide has one label (review EC: the train stage refused it only after every
    slide was tiled and labelled, hours on CAMELYON16): MIL-SSL learns negatives from normal slides and positives
    inside tumour slides. Slides without a label are the stages' error to name: with any, nothing is said here
    (review EI). ``synth``: the slides are generated, so the fix is in [synth.train]."""
    if not stems or any(s not in labels for s in stems):
        return
    classes = {int(labels[s]) for s in stems}
    if len(classes) != 1:
        return
    only, other = ("tumour (label 1)", "normal (label 0): MIL-SSL learns negatives from them") if 1 in classes else \
        ("normal (label 0)", "tumour (label 1): MIL-SSL finds positives inside them")
    fix = ("set [synth.train] n_slides and tumor_slide_fraction so that round(n_slides x tumor_slide_fraction) is "
           "neither 0 nor n_slides" if synth else f"add training slides labelled {other}")
    raise ConfigError(f"{source}: the {len(stems)} training slide(s) are all {only}, so the train stage would stop "
                      f"after every slide is tiled and labelled. Fix: {fix}.")


def _best(best_epoch: int | None) -> str:
    """The train line's part on best.pt: its epoch, or that none was chosen (no validation slides; review CY: it
    said "best epoch None")."""
    return f"best epoch {best_epoch}" if best_epoch is not None else "no validation slides to choose a best epoch"
