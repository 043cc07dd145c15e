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

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from wsi_milssl.config import config_from_mapping, config_to_dict
from wsi_milssl.errors import WsiMilsslError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.hashing import file_reads_kept
from wsi_milssl.locks import folder_lock
from wsi_milssl.pipeline.context import StageContext, in_set, listed_stems, set_stores, store_format
from wsi_milssl.pipeline.damaged import set_aside_damaged
from wsi_milssl.pipeline.digests import (EARLIER_DEFAULTS, EMBEDDED_UPSTREAM, UPSTREAM, digest_parts,
                                         feature_files, setting_names, unweighted_stamp_accepted,
                                         with_label_settings)
from wsi_milssl.pipeline.overlap import refuse_test_in_training, refuse_unlabelled_test_bags
from wsi_milssl.pipeline.spec import (RESOLVED_FILENAME, STAGES, PipelineSpec, label_defaults_spelled, load_pipeline,
                                      stage_config,
                                      write_resolved_pipeline)
from wsi_milssl.pipeline.stamps import (OUTPUT_IDS, SETTINGS_FORM, changed_outputs, mark_outdated, mark_running,
                                        read_stamp, recorded_digest, shown_paths, stale_reason, stamp_digest,
                                        write_stamp)
from wsi_milssl.pipeline.training import model_checkpoint, split_train_val, train_features, train_images

__all__ = ["StageOutcome", "run_pipeline", "split_train_val"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    status: str  # "ran" or "skipped"
    seconds: float
    summary: str = ""
    #: why a stage ran, one line: "first run (no stamp)", "settings changed: train.epochs", "input changed:
    #: FILE", "output missing: FILE", "forced (--force tile)", "the label stage ran before it", ...
    reason: str = ""


# ------------------------------------------------------------------------------------------------
# One function per stage: (context) -> (outputs, summary), each calling its stage's API
# (feature mode evaluates its bags here; train's are in pipeline/training.py).


def _synth(ctx: StageContext) -> tuple[list[str], str]:
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


def _tile(ctx: StageContext) -> tuple[list[str], str]:
    from wsi_milssl.config import TileConfig
    from wsi_milssl.store.base import remove_path
    from wsi_milssl.store.schema import store_path
    from wsi_milssl.tiling import feature_file_error, find_slides, tile_slides

    config = config_from_mapping(TileConfig, ctx.spec.section("tile"), source=f"{ctx.spec.source} [tile]")
    outputs, parts, failures = [], [], []
    for set_name, ds in ctx.spec.sets.items():
        slides = find_slides([ds.slides])
        # Complete stores with these settings, cut from the slide files as they are now (same path,
        # size and modification time), are kept: tile skips them and re-tiles a slide generated or
        # exported again since. Stores made with other settings (the settings changed, or a store tiled
        # again by hand) or unreadable ones are removed and tiled again, they alone (review EY: one store
        # tiled by hand re-tiled the whole set).
        stale = [] if ctx.redo else _stale_stores(slides, ctx.stores(set_name), config)
        if ctx.redo:
            log.info("tile: forced; re-tiling every slide of the %s set", set_name)
        elif stale:
            log.info("tile: %d store(s) of the %s set were made with other settings or are unreadable (%s); "
                     "tiling them again", len(stale), set_name, ", ".join(stale[:5]))
            paths = [store_path(ctx.stores(set_name), stem, config.format) for stem in stale]
            feature_files = feature_file_error(paths)  # tile never replaces one (review FA: it was removed)
            if feature_files is not None:
                raise feature_files
            for path in paths:
                remove_path(path)
        run = tile_slides(slides, ctx.stores(set_name), config, overwrite=ctx.redo,
                          progress=ctx.progress, keep_other_stores=True)  # of slides that left the set
        failed = [r for r in run.results if r.status == "failed"]
        if failed:  # the other sets are tiled first: every bad slide is named at once (review BS)
            failures.append(_failed(failed, run.status_csv, set_name=set_name))
            continue
        outputs += [str(run.status_csv)] + _existing(r.store_path for r in run.results)
        empty = sum(r.n_patches == 0 for r in run.results)  # no tissue passed the filters (review BK)
        kept = sum(r.status == "skipped" for r in run.results)
        more = [f"{n} {what}" for n, what in ((kept, "kept"), (empty, "without a patch")) if n]
        parts.append(f"{set_name}: {sum(r.n_patches for r in run.results)} patches from {len(run.results)} slides"
                     + (f" ({', '.join(more)})" if more else ""))
    if failures:
        raise WsiMilsslError(f"tile: {' | '.join(failures)}. To go on, mend or replace those slide files, or leave them "
                             "out of their set (its slide list or folder, and the labels); then run again: the slides "
                             "tiled are kept.")
    return outputs, "; ".join(parts)


def _failed(failed: list, status_csv, *, set_name: str, what: str = "slide(s)", name=lambda r: r.slide) -> str:
    """"N slide(s) of the SET set failed (see STATUS_CSV): a: error; ..." (the first three): the one wording of a
    slide stage that failed on some of a set's slides, pointing at its status file (review BQ: five copies, some
    without the file)."""
    return (f"{len(failed)} {what} of the {set_name} set failed (see {status_csv}): "
            + "; ".join(f"{name(r)}: {str(r.error).rstrip('. ')}" for r in failed[:3]))


def _existing(paths) -> list[str]:
    """The paths among ``paths`` that exist: a stage's per-slide files, recorded in its stamp so that one
    deleted later makes the stage run again (it redoes only what is missing) instead of a later stage
    silently working without that slide."""
    return [str(p) for p in paths if p and Path(p).exists()]


def _label(ctx: StageContext) -> tuple[list[str], str]:
    from wsi_milssl.config import LabelConfig
    from wsi_milssl.labeling import STATUS_CSV as LABEL_STATUS_CSV, label_stores

    config = config_from_mapping(LabelConfig, ctx.spec.section("label"), source=f"{ctx.spec.source} [label]")
    outputs, parts = [], []
    folder = lambda ds: None if ds.annotations is None else Path(ds.annotations).resolve()  # noqa: E731
    for set_name, ds in ctx.spec.sets.items():
        # one annotations folder for both sets: the other set's annotation files are not unmatched
        others = [stem for other, ods in ctx.spec.sets.items() if other != set_name and folder(ds) is not None
                  and folder(ods) == folder(ds)
                  for stem in set_stores(ctx, other)]
        report = label_stores(list(set_stores(ctx, set_name).values()), annotations_dir=ds.annotations,
                              labels_csv=ds.labels, config=config, out_dir=ctx.labels_dir(set_name),
                              progress=ctx.progress, overwrite=ctx.redo, other_stems=others)
        failed = [r for r in report.results if r.status == "failed"]
        if failed:
            raise WsiMilsslError("label: " + _failed(failed, ctx.labels_dir(set_name) / LABEL_STATUS_CSV,
                                                     set_name=set_name, what="store(s)", name=lambda r: r.stem))
        outputs.append(str(ctx.labels_dir(set_name) / LABEL_STATUS_CSV))
        parts.append(f"{set_name}: {len(report.results)} stores")
    return outputs, "; ".join(parts)


def _features(ctx: StageContext) -> tuple[list[str], str]:
    """Embed the stores of both sets with the [features] encoder: a feature file made with these settings
    from the same store is kept (its instance labels brought up to date), one made with other settings or
    from a changed store is made again; every file with ``--force``."""
    from wsi_milssl.config import FeaturesConfig
    from wsi_milssl.features import extract_features

    config = config_from_mapping(FeaturesConfig, ctx.spec.section("features"), source=f"{ctx.spec.source} [features]")
    outputs, parts = [], []
    for set_name in ctx.spec.sets:
        run = extract_features(list(set_stores(ctx, set_name).values()), ctx.features_dir(set_name), config,
                               overwrite=ctx.redo, replace_other=True, progress=ctx.progress)
        failed = [r for r in run.results if r.status == "failed"]
        if failed:
            raise WsiMilsslError("features: " + _failed(failed, run.status_csv, set_name=set_name))
        outputs += [str(run.status_csv)] + _existing(r.path for r in run.results)
        dim = run.results[0].feature_dim if run.results else 0
        kept = sum(r.status == "skipped" for r in run.results)
        parts.append(f"{set_name}: {run.n_patches} patches x {dim} from {len(run.results) - kept} slides"
                     + (f" ({kept} up to date)" if kept else ""))
    return outputs, f"{config.encoder}: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------------
# Resuming: tile keeps finished stores (train continues its run folders: pipeline/training.py)


def _stale_stores(slides: list[Path], out_dir: Path, config) -> list[str]:
    """Stems whose store in ``out_dir`` exists but was made with other settings or cannot be read.
    (A store of an older version of its slide file is not stale here: ``tile_slides`` replaces it.)"""
    from wsi_milssl.store.schema import store_path
    from wsi_milssl.tiling import slide_stem

    return [slide_stem(s) for s in slides if not _tiled_so(store_path(out_dir, slide_stem(s), config.format), config)]


def _tiled_so(path: Path, config) -> bool:
    """Whether the store at ``path`` is missing, or readable and made with ``config``'s settings."""
    from wsi_milssl.errors import StoreError
    from wsi_milssl.tiling import check_existing_store

    try:
        check_existing_store(path, config)
    except StoreError:
        return False
    return True


#: ``OUT/.pipeline/`` file (JSON; not a stage stamp) of the stores :func:`_stores_changed` found as their stage made
#: them: {stage: {"settings": the settings digest they were checked against, "stores": {path: [inode, size,
#: mtime_ns]}}}
CHECKED_STORES_FILENAME = "stores_checked.cache"


def _stores_changed(ctx: StageContext, stage: str) -> str | None:
    """For tile or label up to date by their stamps: why the stores in ``OUT/stores`` are not the ones they made,
    else None: stores cut with other settings than [tile]'s, or labelled with other settings than [label]'s or not
    at all (review EV: a hand `tile --overwrite` or `label` into ``OUT/stores`` went unnoticed, every stage was up
    to date and the report came from stores of other settings than the resolved pipeline's). The settings a store
    records are compared, not its size and time (:data:`_CHECKED_FILES`: a copied run does not tile again); a store
    found so is not opened again while its identity (:func:`_identity`) stays (:data:`CHECKED_STORES_FILENAME`;
    review EZ: opening 400 stores twice was two thirds of a run with nothing to do). tile and label replace a store
    whole (a new inode), as their hand commands do."""
    check = _store_check(ctx, stage)
    if check is None:
        return None
    expected, stores, usable, what, who = check
    record = _read_checked_stores(ctx)
    known = record.get(stage, {}).get("stores") if record.get(stage, {}).get("settings") == expected else None
    known = known if isinstance(known, dict) else {}
    found: dict[str, list[int]] = {}
    for set_name, by_stem in stores.items():
        other = []
        for stem, path in by_stem.items():
            if not os.path.lexists(path):
                continue  # a missing store is the stage's "output missing"
            identity = _identity(path)
            if identity is not None and known.get(str(path)) == identity:
                found[str(path)] = identity
            elif usable(Path(path)):
                if identity is not None:
                    found[str(path)] = identity
            else:
                other.append(stem)
        if other:
            return (f"output changed outside the pipeline: {len(other)} store(s) of the {set_name} set {what} "
                    f"({', '.join(other[:3])}; {who})")
    _write_checked_stores(ctx, record, {stage: {"settings": expected, "stores": found}})
    return None


def _record_checked_stores(ctx: StageContext, stages: tuple[str, ...]) -> None:
    """After tile or label ran: its stores are as ``stages``' settings make them; recorded, so that the next run
    does not open them to find that out (review FA)."""
    record, entries = _read_checked_stores(ctx), {}
    for stage in stages:
        check = _store_check(ctx, stage)
        if check is None:
            return
        expected, stores = check[0], check[1]
        found = {str(path): _identity(path) for by_stem in stores.values() for path in by_stem.values()}
        entries[stage] = {"settings": expected, "stores": {p: i for p, i in found.items() if i is not None}}
    _write_checked_stores(ctx, record, entries)


def _write_checked_stores(ctx: StageContext, record: dict, entries: dict) -> None:
    from wsi_milssl.atomic import atomic_write_json

    if all(record.get(stage) == entry for stage, entry in entries.items()):
        return
    try:
        atomic_write_json(ctx.state / CHECKED_STORES_FILENAME, {**record, **entries}, sort_keys=True)
    except (OSError, WsiMilsslError):
        pass  # a read-only OUT: checked again next time


def _store_check(ctx: StageContext, stage: str):
    """(settings digest, {set: {stem: store path}}, usable(path) -> bool, what a failing store is, who changed it)
    of tile's or label's stores in an image pipeline; None for other stages, feature pipelines, or a slide list
    that cannot be read (the stage reports it)."""
    from wsi_milssl.config import LabelConfig, TileConfig
    from wsi_milssl.store import open_store, schema
    from wsi_milssl.store.schema import store_path
    from wsi_milssl.tiling import find_slides, slide_stem

    if ctx.spec.mode == "features" or stage not in ("tile", "label"):
        return None
    if stage == "tile":
        config = config_from_mapping(TileConfig, ctx.spec.section("tile"), source=f"{ctx.spec.source} [tile]")

        stores = {}
        for set_name, ds in ctx.spec.sets.items():
            try:
                slides = find_slides([ds.slides])
            except WsiMilsslError:
                return None
            folder = ctx.stores(set_name)
            stores[set_name] = {slide_stem(s): store_path(folder, slide_stem(s), config.format) for s in slides}
        return (config.settings_hash(), stores, lambda path: _tiled_so(path, config),
                "made with other settings than [tile]'s or unreadable",
                "tile run by hand?")
    from wsi_milssl.labeling.stage import label_config_hash

    expected = label_config_hash(config_from_mapping(LabelConfig, ctx.spec.section("label"),
                                                     source=f"{ctx.spec.source} [label]"))

    def labelled(path: Path) -> bool:
        try:
            with open_store(path) as store:
                attrs, has_labels = store.attrs, store.has(schema.INSTANCE_LABEL)
        except (WsiMilsslError, OSError):
            return False
        return attrs.get("label_config_hash") == expected and (attrs.get("label_status") == "unannotated"
                                                                or has_labels)

    stores = {set_name: set_stores(ctx, set_name) for set_name in ctx.spec.sets}
    return expected, stores, labelled, "not labelled with [label]'s settings", "tile or label run by hand?"


def _identity(path) -> list[int] | None:
    """[inode, size, mtime_ns] of a store file, and for a folder (Zarr) also of its root ``zarr.json``, which holds
    its attributes (review FA: `cp -r` of another store into the folder rewrote its files and left the folder's own
    inode, size and time); None when it cannot be read."""
    try:
        st = os.stat(path)
        ids = [st.st_ino, st.st_size, st.st_mtime_ns]
        if os.path.isdir(path):
            meta = os.stat(os.path.join(path, "zarr.json"))
            ids += [meta.st_ino, meta.st_size, meta.st_mtime_ns]
    except OSError:
        return None
    return ids


def _read_checked_stores(ctx: StageContext) -> dict:
    try:
        record = json.loads((ctx.state / CHECKED_STORES_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and all(isinstance(v, dict) for v in record.values()) else {}


def _missing_unrecorded(ctx: StageContext, stage: str) -> list[Path]:
    """The outputs of ``stage`` that stamps of earlier versions did not record and that are missing: a store of a
    listed slide (:func:`_missing_stores`), the model's ``last.pt``, the evaluation's ``metrics.json``."""
    if stage == "tile":
        return _missing_stores(ctx)
    expected = {"train": [ctx.model_dir / "last.pt"], "evaluate": [ctx.evaluation_dir / "metrics.json"]}
    return [p for p in expected.get(stage, []) if not p.exists()]


def _earlier_evaluation(ctx: StageContext) -> str | None:
    """Why the evaluation (of image data: feature mode's has no FROC) is an earlier version's though its stamp
    matches, else None: its metrics.json does not record the FROC's protocol as this version does for its
    settings (:func:`wsi_milssl.evaluation.outdated_metrics`). The stamp cannot tell: a setting added at its default
    leaves a stamp of the earlier version as it was (:func:`stage_settings`)."""
    if ctx.spec.mode == "features":
        return None
    from wsi_milssl.evaluation import outdated_metrics

    return outdated_metrics(ctx.evaluation_dir, with_label_settings(ctx.spec, "evaluate"))


def _evaluation_changed(ctx: StageContext) -> str | None:
    """Why the evaluation runs again though its stamp matches: files of it changed since the stage wrote them (an
    ``evaluate --out OUT/evaluation`` by hand, of other predictions or settings), else None. They are the run's
    report, which no later stage reads: rewritten, not kept as train's and heatmap's changed files are."""
    changed = changed_outputs(ctx.state, "evaluate")
    if not changed:
        return None
    ids = (read_stamp(ctx.state, "evaluate") or {}).get(OUTPUT_IDS) or {}
    if not any(isinstance(v, list) and len(v) > 2 for v in ids.values()):  # an earlier version's stamp (review BI)
        return (f"output changed, or copied without its modification times: {shown_paths(changed)} (its stamp, "
                "of an earlier version, holds no checksums to tell which)")
    return f"output changed outside the pipeline: {shown_paths(changed)} (evaluate run by hand?)"


def _missing_stores(ctx: StageContext) -> list[Path]:
    """The stores (in the tile stage's format) of listed slides that are not in ``OUT/stores/<set>``: a store
    deleted after its stage ran must be made again, not left out of training without a word."""
    from wsi_milssl.store.schema import store_path

    fmt = store_format(ctx)
    expected = [store_path(ctx.stores(name), stem, fmt) for name in ctx.spec.sets
                for stem in (listed_stems(ctx, name) or [])]
    return [p for p in expected if not p.exists()]


def _refuse_stores_without_pixels(spec: PipelineSpec, stages: list[str]) -> None:
    """ConfigError, before any stage runs, when [tile] pixels = "none" (coordinates only) and this run reaches the
    stage that reads the pixels (train, or the [features] stage): it was found there, after tile had cut every
    store again without them (review BR). A run ``--until tile`` or ``label`` may keep coordinates only."""
    reader = "features" if spec.feature_stage else "train"
    if spec.mode == "features" or reader not in stages or spec.section("tile").get("pixels") != "none":
        return
    from wsi_milssl.errors import ConfigError

    raise ConfigError(f"{spec.source}{' with --set ' + ' --set '.join(spec.overrides) if spec.overrides else ''}: "
                      f"[tile] pixels = \"none\" keeps the patches' coordinates only, but the {reader} stage "
                      f"{'embeds' if reader == 'features' else 'trains on'} their pixels. Fix: remove the setting "
                      "(pixels = \"jpeg\", the default) or set \"raw\"; or stop the run before it (--until label).")


def _warn_unused_tables(spec: PipelineSpec) -> None:
    """A pipeline of feature files ([data] mode = "features") trains on the files and scores bags: warn that the
    settings of [tile], [label], [heatmap] and [evaluate] it holds change nothing (review BR: they were ignored
    without a word; [evaluate] lesion_exclude has its own warning)."""
    def changed(table: str) -> list[str]:  # the settings it sets to other values than the defaults (a
        # resolved_pipeline.toml spells every default: review BT)
        config, default = stage_config(spec, table), stage_config(spec, table, defaults_only=True)
        return sorted(k for k in spec.section(table) if getattr(config, k, None) != getattr(default, k, None))

    unused = [f"[{table}]" for table in ("tile", "label", "heatmap") if changed(table)]
    keys = [k for k in changed("evaluate") if k != "lesion_exclude"]
    if keys:
        unused.append(f"[evaluate] {', '.join(keys)}")
    if unused:
        log.warning("%s: not used by a pipeline of feature files ([data] mode = \"features\" trains on the files and "
                    "scores bags, with no slide to tile, label, draw or measure lesions on), so %s change nothing. "
                    "Fix: remove them, or run an image pipeline for the slide-level outputs.", " and ".join(unused),
                    "its settings" if len(unused) == 1 else "their settings")


def _evaluate_features(ctx: StageContext) -> tuple[list[str], str]:
    """Feature mode: bag AUC / accuracy (and instance AUC when the files carry instance labels) on the test set
    (:func:`wsi_milssl.evaluation.bags.evaluate_feature_bags`)."""
    from wsi_milssl.evaluation.bags import evaluate_feature_bags

    excluded = stage_config(ctx.spec, "evaluate").lesion_exclude
    if excluded:  # (review BL: it was ignored without a word)
        log.warning("[evaluate] lesion_exclude (%s) is not used in feature mode: its evaluation has no FROC, and its "
                    "instance AUC counts every test bag's instances. Fix: evaluate an image pipeline's heatmaps for "
                    "the lesion-level metrics, or remove the setting.", ", ".join(excluded))
    ds = ctx.spec.sets["test"]
    out = ctx.evaluation_dir
    summary = evaluate_feature_bags(model_checkpoint(ctx.model_dir), feature_files(ds.features), ds.labels, out)
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    return [str(out / "metrics.json"), str(out / "scores.csv")], (
        f"bag AUC {fmt(summary['bag_auc'])}, bag accuracy {fmt(summary['bag_accuracy'])} on {summary['n_bags']} "
        "test bags" + (f" ({n} labelled slide(s) without a test feature file not evaluated: metrics.json "
                       "not_evaluated)" if (n := len(summary["not_evaluated"])) else ""))


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


def _heatmap(ctx: StageContext) -> tuple[list[str], str]:
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.inference import make_heatmaps
    from wsi_milssl.tiling import find_slides

    config = with_label_settings(ctx.spec, "heatmap")
    checkpoint = model_checkpoint(ctx.model_dir)
    ds = ctx.spec.sets["test"]
    stores = set_stores(ctx, "test")
    # the slides as they are listed now, not as their stores record them (where they were tiled: another folder
    # once OUT has been moved or copied)
    slides = [p for p in find_slides([ds.slides]) if slide_stem(p) in stores]
    run = make_heatmaps(slides, checkpoint, ctx.heatmap_dir, config, stores=list(stores.values()),
                        annotations_dir=ds.annotations, progress=ctx.progress, overwrite=ctx.redo)
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        raise WsiMilsslError("heatmap: " + _failed(failed, run.status_csv, set_name="test"))
    _write_set_scores(run)
    n = sum(r.n_patches for r in run.results)
    slide_files = _existing(p for r in run.results for p in r.outputs.values())  # (a deleted overlay: drawn again)
    reused = [f"{len(v)} {what}" for v, what in ((run.skipped, "kept"), (run.redrawn, "drawn again")) if v]
    empty = sum(r.n_patches == 0 for r in run.results)
    if empty:
        reused.append(f"{empty} without a patch")
    return [str(ctx.heatmap_dir / "scores.csv")] + slide_files, (
        f"{len(run.results)} slides{' (' + ', '.join(reused) + ')' if reused else ''}, {n} patches")


def _write_set_scores(run) -> None:
    """``scores.csv`` of the heatmap folder with the scores of the run's slides (the test set's now): rows
    of slides no longer in the set are dropped (their other files are kept, and ignored by evaluate)."""
    from wsi_milssl.inference.exports import update_scores_csv

    update_scores_csv(run.out_dir, {r.slide: r.score for r in run.results if r.score is not None},
                      keep_others=False)


def _heatmap_features(ctx: StageContext) -> tuple[list[str], str]:
    """With a [features] table: the head's probabilities on the test set's feature files (the stores' grid)."""
    from wsi_milssl.inference.feature_maps import make_feature_heatmaps
    from wsi_milssl.inference.stage import COMPLETE_SLIDE_FILES
    from wsi_milssl.tiling import find_slides

    config = with_label_settings(ctx.spec, "heatmap")
    checkpoint = model_checkpoint(ctx.model_dir)
    ds = ctx.spec.sets["test"]
    files = set_stores(ctx, "test", feature_files(ctx.features_dir("test")), what="feature file")
    run = make_feature_heatmaps(list(files.values()), checkpoint, ctx.heatmap_dir, config,
                                slides=find_slides([ds.slides]) if ds.slides is not None else (),
                                annotations_dir=ds.annotations, progress=ctx.progress)
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        raise WsiMilsslError("heatmap: " + _failed(failed, run.status_csv, set_name="test"))
    _write_set_scores(run)
    n = sum(r.n_patches for r in run.results)
    slide_files = _existing(r.outputs.get(k) for r in run.results for k in COMPLETE_SLIDE_FILES)
    return [str(ctx.heatmap_dir / "scores.csv")] + slide_files, f"{len(run.results)} slides, {n} patches (feature head)"


def _evaluate(ctx: StageContext) -> tuple[list[str], str]:
    from wsi_milssl.artifacts import EVALUATION_FILES, parse_heatmap_name
    from wsi_milssl.evaluation import evaluate_predictions, froc_protocol_summary

    config = with_label_settings(ctx.spec, "evaluate")
    if config.title == stage_config(ctx.spec, "evaluate", defaults_only=True).title:  # absent, or spelled out as in
        config = dataclasses.replace(config, title=f"{ctx.spec.name}: evaluation")  # resolved_pipeline.toml (review BS)
    ds = ctx.spec.sets["test"]
    # the heatmap files of slides no longer in the test set (a changed split, a renamed slide) stay in the
    # folder, ignored
    names = sorted(p.name for p in ctx.heatmap_dir.iterdir() if not p.name.startswith(".")) \
        if ctx.heatmap_dir.is_dir() else []  # hidden files (a Mac's ._X copies) are no slide's, as for evaluate
    stems = {parsed[0]: parsed[0] for parsed in map(parse_heatmap_name, names) if parsed}
    in_set(ctx, "test", stems, ctx.heatmap_dir, what="heatmap output")  # warns about the others
    result = evaluate_predictions(ctx.heatmap_dir, labels_csv=ds.labels, out_dir=ctx.evaluation_dir,
                                  annotations_dir=ds.annotations, slides=ds.slides, config=config,
                                  progress=ctx.progress, only=listed_stems(ctx, "test"))
    m = result.metrics
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    # every file of the folder the evaluation wrote (the plots only where their metric exists): one deleted
    # makes the stage run again, which writes them all
    return _existing(ctx.evaluation_dir / name for name in EVALUATION_FILES.values()), (
        f"instance AUC {fmt(m.get('instance_auc'))}, bag AUC {fmt(m.get('bag_auc'))}, FROC {fmt(m.get('froc'))}"
        + (f" ({protocol})" if (protocol := froc_protocol_summary(m)) else "")
    )


_RUNNERS: dict[str, Callable[[StageContext], tuple[list[str], str]]] = {
    "synth": _synth, "tile": _tile, "label": _label, "train": train_images, "heatmap": _heatmap, "evaluate": _evaluate,
}
_FEATURE_RUNNERS = {"train": train_features, "evaluate": _evaluate_features}
# Image data with a [features] table: the stores are embedded, the head trains and draws on the features.
_EMBEDDED_RUNNERS = {**_RUNNERS, "features": _features, "train": train_features, "heatmap": _heatmap_features}


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
        _warn_unused_tables(spec)
    else:
        stages = [s for s in STAGES if (s != "synth" or spec.sets["train"].synth is not None)
                  and (s != "features" or spec.feature_stage)]
    every_stage = list(stages)
    _refuse_stores_without_pixels(spec, stages[:stages.index(until) + 1] if until in stages else stages)
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
    # each file's content hashed (and a feature file's bags read) once in this run, not by every check (review
    # CH: up to five times, 2.7 GB hashed for 545 MB of feature files)
    with file_reads_kept():
        refuse_test_in_training(spec)
        if "evaluate" in stages:
            refuse_unlabelled_test_bags(spec)
        if spec.mode == "images":  # [label]'s settings in [heatmap] / [evaluate]: a clash found before any stage runs
            for stage in ("heatmap", "evaluate"):
                if stage in stages:
                    with_label_settings(spec, stage)
            spelled = label_defaults_spelled(spec)
            if spelled:  # review BR: a line that reads as the value used, while [label]'s is
                log.warning("%s: %s, as a setting left at its default does (the packaged templates spell these "
                            "defaults out). To evaluate with another value than [label]'s, set one other than the "
                            "default, or run `wsi-milssl evaluate` with it.", spec.source, "; ".join(spelled))
        elif "evaluate" in stages:
            _refuse_other_test_features(spec)
        with folder_lock(spec.out_dir, named_by=out_named_by):
            outcomes = _run_stages(spec, stages, forced, progress=progress, on_stage=on_stage)
            if stages == every_stage:
                # the pipeline as it ran (overrides applied, every setting, absolute paths), beside its outputs: only
                # once every stage is done with these settings (_run_stages removed the file of an earlier run)
                write_resolved_pipeline(spec, spec.out_dir / RESOLVED_FILENAME)
                _write_index(spec)  # once there is a report to point at (review BU)
            return outcomes


#: ``OUT/README.txt``: where a reader of the output folder finds what (review BS: it had no entry point)
INDEX_FILENAME = "README.txt"

_INDEX = """This folder is the output of `wsi-milssl run` of the pipeline {name!r} (its resolved_pipeline.toml below).

Start with:
  evaluation/report.html     the results: metrics, ROC/FROC plots, every test slide with its heatmap
                             (a pipeline of feature files: evaluation/metrics.json and scores.csv)
  evaluation/metrics.json    the same numbers, for scripts

The model and its outputs:
  model/best.pt              the model chosen on the validation slides (metrics.jsonl, metrics.png: training)
  heatmaps/test/             per test slide: probability map (OME-TIFF), overlay PNG, QuPath GeoJSON,
                             CAMELYON16 detections CSV; scores.csv (slide scores)

Intermediate files (made again when needed; not results):
  slides/                    generated slides (a generated pipeline only)
  stores/<set>/              patch stores cut from the slides, qc/ images of the tiling
  labels/<set>/              the annotations as masks (*_tumor_mask.png: ground truth, not predictions)
  features/<set>/            patch features (a pipeline with a [features] table)
  .pipeline/                 what each stage ran with (`run` skips stages that are up to date)

resolved_pipeline.toml is the pipeline as it ran (written once every stage has run); `wsi-milssl run` on it
finds every stage up to date. evaluation.outdated/, when present, is an earlier report set aside because an
earlier stage ran again. Files and their columns: `wsi-milssl docs artifacts` (docs/artifacts.md).
"""


def _write_index(spec: PipelineSpec) -> None:
    """Write :data:`INDEX_FILENAME` into OUT where it is missing or another pipeline's (never fails a run)."""
    from wsi_milssl.atomic import atomic_write_text

    path = spec.out_dir / INDEX_FILENAME
    text = _INDEX.format(name=spec.name)  # not the pipeline file's path: a run from another file rewrites nothing
    try:
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            atomic_write_text(path, text)
    except (OSError, UnicodeDecodeError, WsiMilsslError) as exc:
        log.warning("%s: cannot write the output folder's index (%s)", path, exc)


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


def _run_stages(spec: PipelineSpec, stages: list[str], forced: set[str], *,
                progress: ProgressCallback | None, on_stage: Callable[[StageOutcome], None] | None
                ) -> list[StageOutcome]:
    ctx = StageContext(spec, progress)
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
        if stage == "train" and unweighted_stamp_accepted(spec, stamp, ctx.state):
            # a stamp written before the weights files counted, after they were last modified: up to date as it was
            for form in forms:
                earlier, earlier_inputs = digest_parts(spec, stage, digests, ctx.state, form=form, weights=False)
                earlier = setting_names(stage, earlier)
                candidates.append(recorded_digest(ctx.state, stage, stamp_digest(earlier, earlier_inputs), earlier,
                                                  earlier_inputs))
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
            stale = _evaluation_changed(ctx) or _earlier_evaluation(ctx)  # a hand run first (review DD)
        if stale is None and not ran_before and forced_first is None:
            stale = _stores_changed(ctx, stage)
        if stale is None and not ran_before and forced_first is None:
            stale = set_aside_damaged(ctx, stage)  # changed outputs are kept only when they still read
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
            if stage != "evaluate":
                _set_evaluation_aside(ctx, by=stage)
            mark_running(ctx.state, stage)
            outputs, summary = runner(ctx)
            if stage == "evaluate":
                shutil.rmtree(_outdated(ctx.evaluation_dir), ignore_errors=True)
            if stage in ("tile", "label"):  # made with these settings: not opened next time to find that out
                _record_checked_stores(ctx, ("tile", "label") if stage == "label" else ("tile",))
            digest, settings, inputs = checked["all"]
            digests[stage] = digest
            write_stamp(ctx.state, stage, digest=digest, outputs=outputs, settings=settings, inputs=inputs,
                        reads=_file_reads(spec, stage), settings_form="all", output_sha256=stage == "evaluate")
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


def _kept_note(ctx: StageContext, stage: str) -> str:
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


def _outdated(folder: Path) -> Path:
    return folder.with_name(f"{folder.name}.outdated")


def _set_evaluation_aside(ctx: StageContext, *, by: str) -> None:
    """Before a stage before evaluate changes its outputs: rename ``OUT/evaluation`` to ``OUT/evaluation.outdated``
    (replacing an older one), as its report and metrics describe the earlier outputs; a run stopped before
    evaluate runs again (``--until``, an error, a kill) leaves no report in ``OUT/evaluation`` that looks current
    (review BS). Removed when evaluate finishes."""
    folder = ctx.evaluation_dir
    if not folder.is_dir():
        return
    aside = _outdated(folder)
    shutil.rmtree(aside, ignore_errors=True)
    folder.rename(aside)
    heatmaps = ctx.out / "heatmaps"
    also = (f" (and {heatmaps} holds the earlier heatmaps until the heatmap stage runs again)"
            if by != "heatmap" and heatmaps.is_dir() else "")
    log.warning("%s moved to %s: its report describes the %s stage's earlier outputs%s; evaluate writes a new one",
                folder, aside.name, by, also)


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
