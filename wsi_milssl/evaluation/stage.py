"""The evaluation stage: predictions + annotations + labels -> metrics, curves and an HTML report.

Outputs in ``out_dir`` (names from :data:`wsi_milssl.artifacts.EVALUATION_FILES`; ``docs/artifacts.md``):

    metrics.json            instance_auc, bag_auc, froc, froc_sensitivities (at 1/4, 1/2, 1, 2, 4, 8
                            FP/slide), n_slides, n_lesions, ... ; null with a reason in "reasons"
                            when a metric cannot be computed
    per_slide.csv           one row per evaluated slide (detections, lesions, FPs, score, patches)
    detection_outcomes.csv  slide,prob,x_lv0,y_lv0,outcome,region for every detection
    froc_curve.csv          threshold,fp_per_slide,sensitivity (decreasing threshold)
    froc.png, roc_instance.png, roc_bag.png (ROC plots only when the AUC exists)
    config.json             the EvaluateConfig used
    report.html             self-contained report (images embedded)

An earlier run's files are removed first and metrics.json is written last (:func:`_remove_earlier_run`): a
folder without metrics.json is a run's that did not finish, and holds no file of an earlier run.

The evaluated slides are those with a detections file in the predictions folder; each needs a label.
Each slide is evaluated at the level-0 µm/px and with the score its ``<stem>_probs.json`` records (the
heatmap's own, written after every other file of the slide; :func:`_slide_mpp`, :func:`_slide_scores`).
Tumour slides need their annotation file and their slide (for the level-0 size, and the MPP where no
sidecar records one and no ``froc_mpp`` is given); their
polygons are read with ``config.tumor_groups`` / ``non_tumor_groups`` (as the label stage reads them),
and one whose polygons are all in other groups is refused. Refused too: a slide whose latest heatmap
run failed (``heatmap_status.csv``), whatever files an earlier run left, a slide without its
``<stem>_probs.json`` in a heatmap folder (an interrupted run's: :func:`_refuse_unfinished`), and a folder
whose slides' ``<stem>_probs.json`` record different heatmap runs (:func:`_one_run`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

import numpy as np
from PIL import Image

from wsi_milssl.annotations import (annotation_version, find_annotation, rasterize_region, read_annotations,
                                    same_annotation_version)
from wsi_milssl.annotations.groups import groups_hiding_the_tumour
from wsi_milssl.artifacts import (
    DETECTION_OUTCOME_COLUMNS,
    Detections,
    EVALUATION_FILES,
    FROC_CURVE_COLUMNS,
    HEATMAP_CONFIG_FILENAME,
    HEATMAP_STATUS_FILENAME,
    PER_SLIDE_COLUMNS,
    SCORES_FILENAME,
    read_heatmap_config,
)
from wsi_milssl.atomic import atomic_write_bytes, atomic_write_csv, atomic_write_json
from wsi_milssl.cohorts import labels_for, stem_key
from wsi_milssl.config.base import config_hash, config_to_dict, write_resolved_config
from wsi_milssl.config.evaluate import EvaluateConfig
from wsi_milssl.errors import EvaluationError, FolderLockedError, MissingResolutionError, WsiMilsslError
from wsi_milssl.evaluation.froc import (
    FrocCurve,
    SlideMatch,
    evaluation_mask,
    froc_curve,
    froc_score,
    match_detections,
)
from wsi_milssl.evaluation.protocol import (
    CAMELYON16_DOWNSAMPLE,
    FP_RATES,
    froc_protocol,
    froc_protocol_summary,
    outdated_metrics,
)
from wsi_milssl.evaluation.inputs import (
    PredictionFiles,
    find_predictions,
    read_detections,
    read_labels,
    read_patch_probs,
    read_probs_sidecar,
    read_scores,
    resolve_slides,
)
from wsi_milssl.evaluation.metrics import Metric, RocCurve, auc_metric, roc
from wsi_milssl.evaluation.plots import (
    MATCH_VIEW_LEGEND,
    froc_png,
    match_view_png,
    probability_map_png,
    roc_png,
    thumbnail_png,
)
from wsi_milssl.evaluation.report import ReportData, model_line, write_report
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.labeling.stage import patch_labels
from wsi_milssl.locks import folder_lock, folder_writer
from wsi_milssl.slide import open_slide
from wsi_milssl.tiling.inputs import file_fingerprint

__all__ = ["PER_SLIDE_COLUMNS", "EvaluationResult", "SlideResult", "evaluate_predictions", "froc_protocol_summary",
           "outdated_metrics"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class SlideResult:
    """One evaluated slide: its detection match, patch probabilities and instance labels.

    ``patch_probs``: float64 (N,), ``instance_labels``: uint8 (N,) (None when the slide has no patch
    table or sidecar); ``mpp``: level-0 µm/px used (None for a normal slide without one).
    """

    stem: str
    label: int
    match: SlideMatch
    files: PredictionFiles
    patch_probs: np.ndarray | None = None
    instance_labels: np.ndarray | None = None
    mpp: float | None = None


@dataclass(frozen=True)
class EvaluationResult:
    """What :func:`evaluate_predictions` computed and wrote (``paths``: output name -> path)."""

    metrics: dict[str, Any]
    slides: list[SlideResult]
    curve: FrocCurve
    instance_roc: RocCurve | None
    bag_roc: RocCurve | None
    paths: dict[str, Path] = field(default_factory=dict)


def _slide_geometry(stem: str, slide_path: Path | None, mpp: float | None, *, need_mpp: bool = True
                    ) -> tuple[tuple[int, int], float | None]:
    """Level-0 (width, height) of a tumour slide, from its slide file, and its µm/px: ``mpp`` (the one its
    heatmap was made with, :func:`_slide_mpp`), else the slide's own. ``need_mpp`` False (the FROC's margin
    and ITC limit are measured at ``--froc-mpp``): a slide that records no µm/px is accepted, with None."""
    if slide_path is None:
        raise EvaluationError(
            f"slide {stem!r} is a tumour slide but its slide file was not found (needed for its level-0 "
            "size and MPP). Fix: pass --slides with the folder (or a CSV 'slide,path') that holds it."
        )
    with open_slide(slide_path, mpp_override=mpp) as slide:
        dims = tuple(int(v) for v in slide.dimensions)
        try:
            return dims, float(slide.mpp)
        except MissingResolutionError:  # none recorded, or none usable (review EU: an objective power that gives
            if need_mpp:  # no microscope's resolution was refused where none at all was accepted)
                raise
            return dims, None


def _slide_mpp(sidecar: dict | None, config: EvaluateConfig) -> float | None:
    """The level-0 µm/px a slide is evaluated at: ``config.mpp`` when given (:func:`_check_mpp` refused one
    that contradicts the sidecars), else the one its heatmap was made with (the ``mpp`` of its
    ``<stem>_probs.json``: ``heatmap --slide-mpp`` or the store's), else None (the slide's own)."""
    if config.mpp is not None:
        return config.mpp
    recorded = (sidecar or {}).get("mpp")  # read_probs_sidecar checked it is a positive number when given
    return None if recorded is None else float(recorded)


def _check_mpp(predictions_dir: Path, sidecars: dict[str, dict], config: EvaluateConfig) -> None:
    """EvaluationError when ``config.mpp`` (``--slide-mpp``) differs (by more than 0.1 %) from the µm/px that
    slides' heatmaps were made with, as their sidecars record it: their lesions would be measured at another
    scale than the one their detections and patches were placed at."""
    if config.mpp is None:
        return
    other = {stem: float(s["mpp"]) for stem, s in sidecars.items()
             if s.get("mpp") is not None and abs(float(s["mpp"]) - config.mpp) > 1e-3 * float(s["mpp"])}
    if not other:
        return
    stems = sorted(other)
    shown = ", ".join(f"{stem} ({other[stem]:g})" for stem in stems[:10]) + (" and more" if len(stems) > 10 else "")
    raise EvaluationError(
        f"{predictions_dir}: --slide-mpp {config.mpp:g} (in a pipeline, [evaluate] mpp) is not the µm/px the heatmaps "
        f"of slides {shown} were made with, as their <stem>_probs.json record it ('mpp'), so their lesions would be "
        "measured at another scale than their detections. Fix: drop --slide-mpp (evaluate uses the µm/px each "
        f"heatmap was made with), or run the heatmap stage again with --slide-mpp {config.mpp:g} --overwrite. In a "
        f"pipeline, whose heatmaps take the stores' µm/px: drop [evaluate] mpp, or set [tile] slide_mpp = "
        f"{config.mpp:g} (which tiles and predicts again).")


def _check_slide_files(predictions_dir: Path, sidecars: dict[str, dict], slide_paths: dict[str, Path]) -> None:
    """EvaluationError when a slide file evaluate reads (for its size and µm/px) is not the one its heatmap was
    predicted from, as the sidecar records it (``input_files``: its size; a copy with a new modification time
    is the same file): a slide replaced since, or ``--slides`` of another set whose slides have the same names
    (review CN: evaluated without a word, with that set's annotations and labels). Slides read from stores are
    checked too (their sidecars record the slide file); sidecars that record none (earlier versions, feature
    heads) are not."""
    changed = []
    for stem, sidecar in sidecars.items():
        files = sidecar.get("input_files")
        recorded = files.get("slide") if isinstance(files, dict) else None
        size = recorded.get("size_bytes") if isinstance(recorded, dict) else None
        path = _find_slide_path(stem, slide_paths, sidecar) if isinstance(size, int) else None
        now = file_fingerprint(path) if path is not None else None
        if now is not None and now["size_bytes"] != size:
            changed.append(f"{stem} (predicted from a {size:,}-byte {Path(str(recorded.get('path'))).name}, "
                           f"evaluated with {path}, {now['size_bytes']:,} bytes)")
    if changed:
        raise EvaluationError(
            f"{predictions_dir}: {len(changed)} slide file(s) are not the ones their heatmaps were predicted from: "
            f"{_first(changed, 5)}. A slide replaced since its heatmap, or --slides of another set whose slides "
            "have the same names (whose annotations and labels would then be scored against these predictions). "
            "Fix: pass the slides, annotations and labels of the predicted set, or predict these slides again "
            "(`wsi-milssl heatmap ... --overwrite`; in a pipeline `run` does it).")


def _normal_slide_size(stem: str, slide_paths: dict[str, Path], sidecar: dict | None, config: EvaluateConfig
                       ) -> tuple[int, int] | None:
    """A normal slide's level-0 (width, height) when its slide file is at hand (to report detections off the
    slide), else None: a normal slide needs neither its file nor its MPP to be evaluated."""
    path = _find_slide_path(stem, slide_paths, sidecar)
    if path is None:
        return None
    try:
        with open_slide(path, mpp_override=config.mpp) as slide:
            return tuple(int(v) for v in slide.dimensions)
    except WsiMilsslError:
        return None


def _find_slide_path(stem: str, slide_paths: dict[str, Path], sidecar: dict | None) -> Path | None:
    if stem in slide_paths:
        return slide_paths[stem]
    key = stem_key(stem)  # names match without case (the challenge's Test_001.csv, the download's test_001.tif)
    for name, path in slide_paths.items():
        if stem_key(name) == key:
            return path
    candidate = (sidecar or {}).get("slide_path")
    if isinstance(candidate, str) and candidate and Path(candidate).exists():
        return Path(candidate)
    return None


def _refuse_hidden_tumour(aset, annotation: Path, stem: str, config: EvaluateConfig) -> None:
    """EvaluationError when a tumour slide has no tumour polygon because its polygons are in groups that may be the
    tumour (:func:`~wsi_milssl.annotations.groups.groups_hiding_the_tumour`), as ``label`` refuses it: evaluated
    so, its lesions would vanish and every detection on them count as a false positive."""
    why = groups_hiding_the_tumour((a.group for a in aset.polygons), aset.group_map)
    if why is None:
        return
    raise EvaluationError(
        f"{annotation}: slide {stem!r} is labelled tumour but none of its polygons is in a tumour group "
        f"({', '.join(config.tumor_groups)}); {why}, so the slide would have no lesion and its true positives would "
        "count as false positives. Fix: name the tumour group(s) with --tumor-groups (and the others with "
        "--non-tumor-groups; in a pipeline, [label] tumor_groups / non_tumor_groups), or correct the annotation "
        "file.")


def _refuse_changed_predictions(predictions_dir: Path, before: Mapping[Path, dict | None]) -> None:
    """EvaluationError, before any output is written, when prediction files changed while they were read (``before``:
    their :func:`~wsi_milssl.tiling.inputs.file_fingerprint` when reading started) or a heatmap run now writes
    the folder: the figures would mix two runs' predictions while the report named one."""
    changed = [p.name for p, state in before.items() if file_fingerprint(p) != state]
    writer = folder_writer(predictions_dir)
    if changed or writer is not None:
        what = f"{len(changed)} of its files changed while evaluate read them ({_first(changed)})" if changed else \
            f"{writer} started writing it while evaluate read it"
        raise EvaluationError(f"{predictions_dir}: {what}, so the evaluation would mix the predictions of two heatmap "
                              "runs. Nothing was written. Fix: wait until that heatmap run finishes, then evaluate "
                              "again.")


def _evaluate_slide(
    files: PredictionFiles, label: int, *, annotations_dir: Path | None, slide_paths: dict[str, Path],
    config: EvaluateConfig,
) -> SlideResult:
    stem = files.stem
    if files.detections is None:  # the heatmap stage found no tissue patch: no detection, no patch
        dets = Detections(np.zeros(0), np.zeros(0), np.zeros(0))
    else:
        dets = read_detections(files.detections)
    sidecar = read_probs_sidecar(files.sidecar) if files.sidecar is not None else None
    coords = probs = None
    if files.patches is not None:
        coords, probs = read_patch_probs(files.patches)
        recorded = (sidecar or {}).get("n_patches")
        if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded != len(probs):
            raise EvaluationError(  # (review BW: a table cut short was evaluated as it was)
                f"{files.patches}: holds {len(probs)} patch rows, but {files.sidecar} records {recorded} patches: "
                "the table was cut short or changed after the heatmap stage wrote it. Fix: run the heatmap stage "
                "again for this slide (delete its files first, or pass --overwrite).")
    mpp = _slide_mpp(sidecar, config)

    if label == 1:
        ann_path = find_annotation(stem, annotations_dir) if annotations_dir is not None else None
        if ann_path is None:
            where = f"in {annotations_dir}" if annotations_dir is not None else "(no annotations folder was given)"
            raise EvaluationError(
                f"slide {stem!r} is labelled tumour but has no annotation file "
                f"({stem}.xml or {stem}.geojson) {where}. Fix: pass --annotations (annotations_dir from Python; in a "
                "pipeline, [data] test_annotations) with the folder that holds it, or correct its label in the labels "
                "CSV."
            )
        # the slide's µm/px measures the margin and ITC limit unless config.froc_mpp does (nothing else needs it:
        # the patches' tumour fractions are in level-0 pixels)
        dims, mpp = _slide_geometry(stem, _find_slide_path(stem, slide_paths, sidecar), mpp,
                                    need_mpp=config.froc_mpp is None)
        aset = read_annotations(ann_path, group_map=config.group_map(), dimensions_lv0=dims)
        region = aset.region
        if not aset.has_tumor:
            _refuse_hidden_tumour(aset, ann_path, stem, config)
        tumor = rasterize_region(region, dimensions_lv0=dims, downsample=CAMELYON16_DOWNSAMPLE)
        if not aset.has_tumor:  # as label: an empty file, or carved-out regions alone, is allowed with a word
            logger.warning("%s: labelled tumour, but %s has no tumour polygon (groups %s); the slide has no "
                           "evaluation region (every detection on it is a false positive).", stem, ann_path,
                           ", ".join(config.tumor_groups))
        elif not np.any(tumor):
            logger.warning("%s: the tumour annotations cover no level-5 pixel centre; the slide has no "
                           "evaluation region (every detection on it is a false positive).", stem)
        # the margin and ITC limit in µm become pixels at config.froc_mpp when given (the challenge's 0.243 for
        # every slide), else at the slide's own µm/px; the mask's pixels are the slide's level 5 either way
        froc_mpp = mpp if config.froc_mpp is None else config.froc_mpp
        mask = evaluation_mask(tumor, mpp=froc_mpp, margin_um=config.margin_um,
                               itc_major_axis_um=config.itc_major_axis_um)
        match = match_detections(dets.probs, dets.x_lv0, dets.y_lv0, mask=mask, stem=stem, dimensions_lv0=dims)
    else:
        region = None
        if annotations_dir is not None and find_annotation(stem, annotations_dir) is not None:
            logger.warning("%s: labelled normal but has an annotation file; following the label, every "
                           "detection on it is a false positive and every patch negative.", stem)
        match = match_detections(dets.probs, dets.x_lv0, dets.y_lv0, mask=None, stem=stem,
                                 dimensions_lv0=_normal_slide_size(stem, slide_paths, sidecar, config))

    inst = None
    if files.detections is None:
        probs, inst = np.zeros(0), np.zeros(0, dtype=np.uint8)
    elif coords is not None and sidecar is not None:
        if region is None:
            inst = np.zeros(coords.shape[0], dtype=np.uint8)
        else:
            # label's rule (patch_labels), not a copy of it: the same instance labels as the label stage's
            inst = patch_labels(region, coords, float(sidecar["patch_size_lv0"]),
                                positive_fraction=config.positive_fraction)[1]
    return SlideResult(stem=stem, label=label, match=match, files=files, patch_probs=probs,
                       instance_labels=inst, mpp=mpp)


def _passed_over_csvs(passed_over: list[Path], found: dict[str, PredictionFiles]) -> tuple[list[str], list[str]]:
    """The plain CSVs that :func:`find_predictions` passed over, in words: (those of no labelled slide, those
    beside their slide's ``<stem>_detections.csv``, each with the file evaluated instead)."""
    evaluated = {stem_key(f.stem): f.detections for f in found.values() if f.detections is not None}
    unlabelled, beside = [], []
    for p in passed_over:
        used = evaluated.get(stem_key(p.stem))
        if used is None:
            unlabelled.append(p.name)
        else:
            beside.append(f"{p.name} ({used.name} is evaluated instead)")
    return unlabelled, beside


def _first(items: list[str], n: int = 20) -> str:
    """The first ``n`` of ``items``, comma-separated, with " ..." where there are more."""
    return ", ".join(items[:n]) + (" ..." if len(items) > n else "")


def _metric_value(metric: Metric) -> float | None:
    return None if metric.value is None else float(metric.value)


def _some_of(n: int, n_slides: int) -> str:
    """"2 of 5 slides", or "the one slide" when only one is evaluated."""
    return "the one slide" if n_slides == 1 else f"{n} of {n_slides} slides"


def _lesion_excluded(results: list[SlideResult], config: EvaluateConfig) -> tuple[list[str], list[SlideResult]]:
    """(the evaluated slides that ``config.lesion_exclude`` names, the results of the others); a name of no evaluated
    slide is a warning (a list written for the whole cohort, such as CAMELYON16's Test_114)."""
    wanted = {stem_key(name.strip()): name for name in config.lesion_exclude}
    excluded = [r.stem for r in results if stem_key(r.stem) in wanted]
    unknown = sorted(set(wanted) - {stem_key(s) for s in excluded})
    if unknown:  # (review EW: "A,B" for two slides was one unknown name, and both slides were scored)
        commas = any("," in wanted[k] for k in unknown)
        logger.warning("lesion_exclude names %d slide(s) that are not evaluated here: %s%s", len(unknown),
                       ", ".join(repr(wanted[k]) if commas else wanted[k] for k in unknown),
                       " (names are separate values: --lesion-exclude A B, or a list in TOML, not one 'A,B')"
                       if commas else "")
    if excluded:
        logger.info("%d slide(s) left out of the FROC and the instance AUC (lesion_exclude), kept in the bag AUC: %s",
                    len(excluded), ", ".join(excluded))
    return excluded, [r for r in results if stem_key(r.stem) not in wanted]


def _instance_metric(results: list[SlideResult]) -> tuple[Metric, RocCurve | None]:
    missing = [r.stem for r in results if r.instance_labels is None]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        return Metric(None, f"no patch probabilities (<stem>_patches.csv with <stem>_probs.json) for "
                            f"{_some_of(len(missing), len(results))} ({shown})"), None
    labels = np.concatenate([r.instance_labels for r in results])
    probs = np.concatenate([r.patch_probs for r in results])
    return auc_metric(labels, probs, what="patches"), roc(labels, probs, what="patches")


def _slide_scores(results: list[SlideResult], sidecars: dict[str, dict], scores_path: Path
                  ) -> tuple[dict[str, float | None], list[str]]:
    """({slide: score}, [slides whose ``scores.csv`` row is not their sidecar's score]).

    A slide's score is the one its ``<stem>_probs.json`` records: the heatmap stage writes it after every other
    file of the slide, so it is the score of the very files evaluated, where ``scores.csv`` (updated after it) may
    still hold an earlier run's row (a run killed in between). Slides whose sidecar records none (detection
    folders of other tools, earlier versions) take their ``scores.csv`` row; a slide without a tissue patch
    scores 0 (as a max over no patch, it ranks below every other); None: no score."""
    scores: dict[str, float | None] = {}
    for r in results:
        value = sidecars.get(r.stem, {}).get("score")
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise EvaluationError(f"{r.files.sidecar}: 'score' is {value!r}; it must be the slide's score (a finite "
                                  "number). Fix: run the heatmap stage again for this slide, or move the file away.")
        scores[r.stem] = float(value)
    keyed = {stem_key(k): v for k, v in read_scores(scores_path).items()} if scores_path.is_file() else {}
    stale = sorted(stem for stem, v in scores.items()
                   if stem_key(stem) in keyed and abs(keyed[stem_key(stem)] - v) > 1e-6)
    for r in results:
        if r.stem not in scores:
            scores[r.stem] = keyed.get(stem_key(r.stem), 0.0 if r.files.detections is None else None)
    return scores, stale


def _bag_metric(results: list[SlideResult], scores: dict[str, float | None], scores_path: Path,
                empty: Iterable[str] = ()) -> tuple[Metric, RocCurve | None]:
    """The slide-level AUC; none when scores are missing or every slide was empty (``empty``: their stems; each
    scored 0, review CX: an AUC of 0.5 was reported for a test set without one patch)."""
    if results and {r.stem for r in results} <= set(empty):
        return Metric(None, "every slide was empty (no tissue patch), so no slide has a score"), None
    missing = [r.stem for r in results if scores[r.stem] is None]
    if missing and not scores_path.is_file():
        return Metric(None, f"no slide scores ({scores_path.name} is missing from the predictions folder)"), None
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        return Metric(None, f"{scores_path.name} has no score for {_some_of(len(missing), len(results))} "
                            f"({shown})"), None
    if results and all(r.files.detections is None for r in results) and not scores_path.is_file():
        return Metric(None, "every slide was empty (no tissue patch), so no slide has a score"), None
    labels = np.array([r.label for r in results])
    values = np.array([scores[r.stem] for r in results])
    return auc_metric(labels, values, what="slides"), roc(labels, values, what="slides")


def _slide_row(r: SlideResult, score: float | None, lesion_excluded: bool = False) -> dict[str, Any]:
    """The slide's row of per_slide.csv (its own counts; ``lesion_excluded``: 1 when the FROC and the instance
    AUC leave it out)."""
    m = r.match
    inst_auc = None
    if r.instance_labels is not None and r.patch_probs is not None:
        inst_auc = auc_metric(r.instance_labels, r.patch_probs, what="patches").value
    return {
        "slide": r.stem, "label": r.label, "n_detections": m.n_detections, "n_fp": m.n_fp,
        "n_lesions": m.n_lesions, "n_lesions_detected": m.n_detected, "n_itc": m.n_itc,
        "n_repeat_hits": int(np.count_nonzero(m.outcome == "repeat")),
        "n_itc_hits": int(np.count_nonzero(m.outcome == "itc")),
        "max_prob": float(m.probs.max()) if m.n_detections else None,
        "score": score,
        "n_patches": None if r.patch_probs is None else int(r.patch_probs.shape[0]),
        "n_positive_patches": None if r.instance_labels is None else int(r.instance_labels.sum()),
        "instance_auc": inst_auc,
        "mpp": r.mpp,
        "lesion_excluded": int(lesion_excluded),
    }


#: the longer side (px) at which the report embeds a heatmap overlay when --thumbnail-px is smaller: the
#: overlay (2048 px by default) is shown at --thumbnail-px and opens at this size on a click, where its colour
#: bar, title and scale bar are legible (text about 9 px tall); as a 256-colour palette PNG it costs about what
#: the 320-px RGB thumbnail did (the demo's four: 426 KB against 385 KB)
REPORT_HEATMAP_PX = 800
#: the metrics' names in the report's notes
_METRIC_NAMES = {"instance_auc": "instance AUC", "bag_auc": "bag AUC", "froc": "FROC score"}
#: the report's caption of a FROC match view; the legend of its symbols stands once above the gallery
MATCH_VIEW_CAPTION = "FROC view"


def _thumbnails(r: SlideResult, *, max_px: int) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    try:
        if r.files.heatmap_png is not None:
            with Image.open(r.files.heatmap_png) as img:
                img.load()
                out.append(("heatmap", thumbnail_png(img, max_size_px=max(max_px, REPORT_HEATMAP_PX), colours=256)))
        elif r.files.probs_npy is not None:
            probs = np.load(r.files.probs_npy, allow_pickle=False)
            if probs.ndim == 2 and probs.size:
                out.append(("probability map", probability_map_png(probs, max_size_px=max_px)))
    except (OSError, ValueError) as exc:
        logger.warning("%s: cannot read its heatmap for the report (%s)", r.stem, exc)
    if r.match.mask is not None:
        out.append((MATCH_VIEW_CAPTION, match_view_png(r.match, max_size_px=max_px)))
    return out


def _none_if_nan(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _heatmap_outcomes(predictions_dir: Path, stems: list[str]) -> tuple[dict[str, str], list[str]]:
    """({slide: error} of the slides among ``stems`` that the heatmap stage's status file (when the folder
    has one) records as failed, [slides it records as empty: no tissue patch])."""
    path = predictions_dir / HEATMAP_STATUS_FILENAME
    if not stems or not path.is_file():
        return {}, []
    wanted = {stem_key(s): s for s in stems}
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise EvaluationError(f"{path}: cannot read the heatmap status file ({exc}). Fix: re-run the heatmap "
                              "stage, or delete the file to evaluate without it.") from None
    ours = [(wanted[stem_key(r.get("slide") or "")], r) for r in rows if stem_key(r.get("slide") or "") in wanted]
    failed = {s: (r.get("error") or "no message").strip() for s, r in ours if r.get("status") == "failed"}
    return failed, sorted({s for s, r in ours if r.get("status") == "empty"})


#: What a slide's ``<stem>_probs.json`` records of the run that made it, compared across the evaluated
#: slides when a sidecar has neither a ``fingerprint`` nor a ``checkpoint_sha256`` (feature heads and
#: earlier versions, half-written slides): the checkpoint and the settings that shape the detections and
#: the score.
_RUN_FIELDS = ("checkpoint", "model_name", "bag_pooling", "detection_threshold", "nms_radius_um", "tumor_threshold")

#: The settings that shape a slide's evaluated files, compared with ``checkpoint_sha256`` (the checkpoint's
#: bytes): the model, the pooling, the detection and classification settings and the tiling. Per-slide
#: facts (``mpp``, ``stride_lv0``) and the overlay's drawing settings are not among them; the µm/px given
#: in place of the slides' own is checked apart (:func:`_one_slide_mpp`).
_CONTENT_FIELDS = ("model_name", "bag_pooling", "detection_threshold", "nms_radius_um", "tumor_threshold",
                   "target_mpp", "patch_size_px", "tiling_plan")


def _canonical(value: Any) -> str:
    """One spelling of a recorded value (1000 and 1000.0 are the same setting)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return json.dumps(value, sort_keys=True, default=str)


def _recorded(sidecar: dict, key: str) -> str | None:
    value = sidecar.get(key)
    return value if isinstance(value, str) and value else None


def _run_identities(sidecar: dict) -> list[tuple]:
    """What identifies the heatmap run that made a slide; two slides share a run when they share any of them:
    the same ``fingerprint`` (the checkpoint's bytes and every output setting: a resumed or sharded run, or one
    with other runtime settings) and ``tiling_plan`` (a slide read from a store tiled otherwise), or the same
    ``checkpoint_sha256`` with the same :data:`_CONTENT_FIELDS` (the same weights, by whatever path, with the
    same detection settings and tiling: runs that differ only in drawing settings or a per-slide µm/px). A sidecar with neither is identified by the recorded checkpoint
    path and settings (:data:`_RUN_FIELDS`)."""
    ids: list[tuple] = []
    fingerprint = _recorded(sidecar, "fingerprint")
    if fingerprint is not None:  # with the tiling its patches were chosen with (a store's own: review CN)
        ids.append(("fingerprint", fingerprint, _canonical(sidecar.get("tiling_plan"))))
    sha = _recorded(sidecar, "checkpoint_sha256")
    if sha is not None:
        ids.append(("contents", sha) + tuple(_canonical(sidecar.get(k)) for k in _CONTENT_FIELDS))
    if not ids:
        ids.append(("settings",) + tuple(repr(sidecar.get(k)) for k in _RUN_FIELDS))
    return ids


def _group_runs(sidecars: dict[str, dict]) -> list[list[str]]:
    """The slides of ``sidecars`` grouped by run: the union of the slides that share an identity
    (:func:`_run_identities`); largest group first."""
    parent = {stem: stem for stem in sidecars}

    def root(stem: str) -> str:
        while parent[stem] != stem:
            parent[stem] = parent[parent[stem]]
            stem = parent[stem]
        return stem

    owner: dict[tuple, str] = {}
    for stem, sidecar in sidecars.items():
        for identity in _run_identities(sidecar):
            if identity in owner:
                parent[root(stem)] = root(owner[identity])
            else:
                owner[identity] = stem
    groups: dict[str, list[str]] = {}
    for stem in sidecars:
        groups.setdefault(root(stem), []).append(stem)
    return sorted(groups.values(), key=lambda stems: (-len(stems), stems[0]))


def _values(sidecars: list[dict], key: str) -> list[Any]:
    """The distinct recorded (not null) values of ``key`` among ``sidecars``, in order."""
    seen: dict[str, Any] = {}
    for sidecar in sidecars:
        value = sidecar.get(key)
        if value is not None and value != "":
            seen.setdefault(_canonical(value), value)
    return list(seen.values())


def _show(values: list[Any]) -> str:
    return " or ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _describe_run(sidecars: list[dict], others_have_fingerprints: bool) -> str:
    checkpoints = _values(sidecars, "checkpoint")
    parts = [f"checkpoint {' or '.join(str(c) for c in checkpoints) or 'not recorded'}"]
    fingerprints = _values(sidecars, "fingerprint")
    if fingerprints:
        parts.append(f"fingerprint {' or '.join(str(f) for f in fingerprints)}")
    elif others_have_fingerprints:
        parts.append("no fingerprint: made by a feature head or an earlier version that recorded none, or its "
                     "files were left half-written by an interrupted run")
    for key in _RUN_FIELDS[1:]:
        values = _values(sidecars, key)
        if values:
            parts.append(f"{key} {' or '.join(str(v) for v in values)}")
    return ", ".join(parts)


def _differences(first: list[dict], other: list[dict], first_label: str, other_label: str) -> list[str]:
    """What the slides of run ``other`` record differently from those of run ``first`` (other's value first)."""
    out: list[str] = []

    def disjoint(a: list[Any], b: list[Any]) -> bool:
        return bool(a) and bool(b) and not {_canonical(v) for v in a} & {_canonical(v) for v in b}

    sha_a, sha_b = _values(first, "checkpoint_sha256"), _values(other, "checkpoint_sha256")
    path_a, path_b = _values(first, "checkpoint"), _values(other, "checkpoint")
    if sha_a and sha_b:
        if disjoint(sha_a, sha_b):
            out.append(f"checkpoint file contents differ (SHA-256 {_show([v[:12] for v in sha_b])} vs "
                       f"{_show([v[:12] for v in sha_a])})")
    else:
        if disjoint(path_a, path_b):
            out.append(f"checkpoint {_show(path_b)} vs {_show(path_a)}")
        if sha_a or sha_b:
            out.append(f"slides {other_label if sha_a else first_label} record no checkpoint_sha256 (made by an "
                       "earlier version, or left half-written by an interrupted run), so their checkpoint file "
                       "contents cannot be compared")
    for key in _CONTENT_FIELDS:
        a, b = _values(first, key), _values(other, key)
        if not disjoint(a, b):
            continue
        if key == "tiling_plan" and len(a) == 1 and len(b) == 1 and isinstance(a[0], dict) and isinstance(b[0], dict):
            out += [f"tiling {k} {_show([b[0].get(k)])} vs {_show([a[0].get(k)])}"
                    for k in sorted(set(a[0]) | set(b[0])) if _canonical(a[0].get(k)) != _canonical(b[0].get(k))]
        else:
            out.append(f"{key} {_show(b)} vs {_show(a)}")
    if not sha_a and not sha_b and not out:
        fp_a, fp_b = _values(first, "fingerprint"), _values(other, "fingerprint")
        if fp_a and fp_b:
            out.append(f"fingerprint {_show(fp_b)} vs {_show(fp_a)} (the checkpoint's bytes or another heatmap "
                       "setting, drawing settings included; files of earlier versions do not record which)")
        elif fp_a or fp_b:
            out.append(f"slides {other_label if fp_a else first_label} record no fingerprint (made by an earlier "
                       "version or a feature head of one, or left half-written by an interrupted run)")
    return out


def _one_run(predictions_dir: Path, sidecars: dict[str, dict]) -> dict | None:
    """The sidecar of one evaluated slide when every slide with a ``<stem>_probs.json`` was made by the same
    heatmap run (slides linked by a shared identity: :func:`_run_identities`), None without sidecars (detection
    CSVs of other tools); EvaluationError naming the slides of each run and what differs between them
    otherwise. A run resumed, sharded or re-run with other runtime or drawing settings (workers, device, batch
    size; colour map, thumbnail size, outlines) counts as one, as does one checkpoint named by two paths."""
    groups = _group_runs(sidecars)
    if len(groups) <= 1:
        _one_slide_mpp(predictions_dir, sidecars)
        return next(iter(sidecars.values()), None)
    runs = [[sidecars[s] for s in stems] for stems in groups]
    fingerprinted = any(_recorded(s, "fingerprint") for s in sidecars.values())

    def slides(stems: list[str]) -> str:
        return ", ".join(stems[:10]) + (f" and {len(stems) - 10} more" if len(stems) > 10 else "")

    described = "; ".join(f"slides {slides(stems)} by {_describe_run(run, fingerprinted)}"
                          for stems, run in zip(groups, runs))
    differs = "; ".join(
        f"slides {slides(stems)} against slides {slides(groups[0])}: "
        + (", ".join(_differences(runs[0], run, slides(groups[0]), slides(stems))) or "no recorded setting")
        for stems, run in zip(groups[1:], runs[1:]))
    raise EvaluationError(
        f"{predictions_dir}: its slides were predicted by {len(groups)} different heatmap runs (another checkpoint "
        f"or other settings), so evaluating them together would mix models and report only the last run's "
        f"settings: {described}. What differs: {differs}. Fix: run the heatmap stage again with --overwrite on the "
        "whole set of slides into this folder (or into a new one), then evaluate: `wsi-milssl heatmap ... "
        "--overwrite` (in a pipeline: `wsi-milssl run PIPELINE --force heatmap`).")


def _one_slide_mpp(predictions_dir: Path, sidecars: dict[str, dict]) -> None:
    """EvaluationError when the slides cut on the fly were cut with different ``--slide-mpp`` values (a
    partial re-run with a wrong one cut its slides at another magnification). Sidecars record ``slide_mpp``
    only for slides cut on the fly (a store brings its own µm/px), null for the slide's own; sidecars of
    earlier versions do not record it and match any value."""
    values: dict[str, list[str]] = {}
    for stem, sidecar in sidecars.items():
        if "slide_mpp" in sidecar:
            value = sidecar["slide_mpp"]
            values.setdefault("none (the slide's own)" if value is None else _canonical(value), []).append(stem)
    if len(values) > 1:
        shown = "; ".join(f"slides {', '.join(stems[:10])}{' and more' if len(stems) > 10 else ''} with "
                          f"--slide-mpp {value}" for value, stems in values.items())
        raise EvaluationError(
            f"{predictions_dir}: its slides were cut at µm/px given in different ways ({shown}), so some were cut "
            "at another magnification than the others. Fix: run the heatmap stage again with --overwrite on the "
            "whole set with one --slide-mpp (or none), then evaluate: `wsi-milssl heatmap ... --overwrite` (in a "
            "pipeline: `wsi-milssl run PIPELINE --force heatmap`).")


def _training_summary(checkpoint: Any, sha256: Any) -> dict[str, Any]:
    """What the report says of the model's training (review BS: it said nothing): from the run folder beside
    ``checkpoint`` (its ``config.json`` and ``metrics.jsonl``, when they are there), the model, epochs, μ, T, λ,
    the selection metric and the epoch best.pt holds with its validation score; {} when the folder has none, or
    when its checkpoint is no longer the one the heatmaps recorded (``sha256``: a run resumed or replaced since,
    whose records describe another model: review BU)."""
    from wsi_milssl.hashing import cached_file_sha256

    if not isinstance(checkpoint, str) or not checkpoint:
        return {}
    try:
        if not isinstance(sha256, str) or cached_file_sha256(checkpoint) != sha256:
            return {}
    except OSError:
        return {}
    folder = Path(checkpoint).parent
    try:
        saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    summary = {k: saved.get(k) for k in ("model", "epochs", "mu", "mu_ramp_epochs", "fixed_mu", "lam", "select_metric")
               if k in saved}
    summary["run_folder"] = str(folder)
    try:
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
                   if line.strip()]
    except (OSError, ValueError):
        records = []
    best = next((r.get("best_epoch") for r in reversed(records) if isinstance(r, dict) and r.get("best_epoch")), None)
    if best is not None:
        chosen = next((r for r in records if isinstance(r, dict) and r.get("epoch") == best), {})
        summary["best_epoch"] = best
        summary["best_epoch_validation"] = {k: chosen.get(k) for k in ("val_bag_auc", "val_instance_auc", "val_bag_nll")
                                            if chosen.get(k) is not None}
    return summary


def _few_cases(metrics: Mapping[str, Any]) -> list[str]:
    """Report notes on metrics that rest on few cases (review BS: a bag AUC of 2 against 2 slides read as any
    other): the bag AUC with fewer than 10 slides of a class, the FROC with fewer than 10 lesions."""
    notes = []
    tumour, normal = int(metrics.get("n_tumor_slides") or 0), int(metrics.get("n_normal_slides") or 0)
    if metrics.get("bag_auc") is not None and min(tumour, normal) < 10:
        notes.append(f"the bag AUC rests on {tumour} tumour and {normal} normal slide(s): one slide ranked otherwise "
                     f"moves it by up to {max(1 / tumour, 1 / normal):.2f}.")
    lesions = int(metrics.get("n_lesions") or 0)
    if metrics.get("froc") is not None and 0 < lesions < 10:
        notes.append(f"the FROC rests on {lesions} lesion(s): each one found or missed moves a sensitivity by "
                     f"{1 / lesions:.2f}.")
    return notes


def _refuse_stopped_heatmap_run(predictions_dir: Path, without_files: list[str]) -> None:
    """EvaluationError when a heatmap run into ``predictions_dir`` stopped (Ctrl-C, a kill, a crash: its mark of an
    unfinished run is left, :func:`~wsi_milssl.tiling.status.marking_unfinished`) before it made labelled slides
    that have no files (``without_files``): the metrics would count only the slides done so far (review BN). A
    labelled slide no heatmap run was asked for is only "not evaluated", as before."""
    from wsi_milssl.tiling.status import unfinished_runs

    runs = unfinished_runs(predictions_dir, "heatmap")
    wanted = {stem_key(s) for r in runs for s in (r.get("slides") if isinstance(r.get("slides"), list) else ())}
    missing = [s for s in without_files if stem_key(s) in wanted]
    if not missing:
        return
    last = runs[-1]
    started = last.get("started")
    when = time.strftime(" started %Y-%m-%d %H:%M", time.localtime(started)) if isinstance(started, (int, float)) else ""
    raise EvaluationError(
        f"{predictions_dir}: a heatmap run into it stopped before it finished (`{last.get('command', 'heatmap')}`"
        f"{when}): {len(missing)} labelled slide(s) it was to predict have no files yet ({_first(missing)}), so the "
        "metrics would count only the slides done so far. Fix: run that heatmap command again (it keeps the slides "
        "it finished and predicts the rest), then evaluate.")


def _refuse_unfinished(predictions_dir: Path, found: dict[str, PredictionFiles],
                       evaluated: dict[str, PredictionFiles]) -> None:
    """EvaluationError naming the slides of ``evaluated`` without a ``<stem>_probs.json`` in a folder of the heatmap
    stage (it has ``heatmap_config.json``, or other slides have sidecars). The stage removes a slide's sidecar
    before it rewrites the slide's files and writes it after all of them, so such a slide's files are those of an
    interrupted run, partly an earlier run's. Folders of other tools (detection CSVs, no sidecar) pass."""
    if not (predictions_dir / HEATMAP_CONFIG_FILENAME).is_file() and not any(f.sidecar for f in found.values()):
        return
    unfinished = sorted(s for s, f in evaluated.items() if f.sidecar is None)
    if not unfinished:
        return
    shown = ", ".join(unfinished[:20]) + (f" and {len(unfinished) - 20} more" if len(unfinished) > 20 else "")
    raise EvaluationError(
        f"{predictions_dir}: slides {shown} have prediction files but no <stem>_probs.json, which the heatmap stage "
        "writes after every other file of a slide, so their files are those of an interrupted heatmap run (partly "
        "an earlier run's) and would be evaluated as finished ones. Fix: run the heatmap stage again into this "
        "folder (it predicts again every slide without its <stem>_probs.json), then evaluate.")


def _later_run(pred_config: dict | None, sidecars: list[dict]) -> bool:
    """Whether ``heatmap_config.json`` (rewritten by every heatmap run) describes another run than the one that
    made the evaluated slides: its fingerprint is none of theirs (where both record fingerprints), else its
    checkpoint path is none of theirs."""
    if pred_config is None or not sidecars:
        return False
    fingerprint = _recorded(pred_config, "fingerprint")
    fingerprints = _values(sidecars, "fingerprint")
    if fingerprint is not None and fingerprints:
        return fingerprint not in fingerprints
    checkpoint = pred_config.get("checkpoint")
    checkpoints = _values(sidecars, "checkpoint")
    return checkpoint is not None and bool(checkpoints) and checkpoint not in checkpoints


def _remove_earlier_run(out_dir: Path) -> None:
    """Remove the evaluation files (:data:`EVALUATION_FILES`) an earlier run left in ``out_dir``, metrics.json
    first, before this run writes its own, metrics.json last: a run stopped part-way (Ctrl-C, a full disk) then
    leaves no earlier run's file beside its own, and no metrics.json, so the folder is visibly unfinished. Other
    files in the folder are kept."""
    names = EVALUATION_FILES
    for name in (names["metrics"], *(name for kind, name in names.items() if kind != "metrics")):
        (out_dir / name).unlink(missing_ok=True)


@dataclass(frozen=True)
class _Selection:
    """The slides one evaluation reads, and what it passed over (for the warnings, metrics and notes)."""

    evaluated: dict[str, PredictionFiles]  # stem -> its files (none for a slide in ``empty``)
    slide_labels: dict[str, int]  # stem -> 1 tumour, 0 normal, for every evaluated slide
    skipped: list[str]  # labelled slides with no predictions: not evaluated
    empty: list[str]  # slides the heatmap stage found without a tissue patch: no detection, score 0
    not_evaluated_files: list[str]  # file names find_predictions passed over
    unlabelled_csvs: list[str]  # <stem>.csv files of no labelled slide
    beside: list[str]  # <stem>.csv files beside their slide's <stem>_detections.csv


def _select_slides(predictions_dir: Path, labels: Mapping[str, int], only: Collection[str] | None) -> _Selection:
    """The slides of ``predictions_dir`` to evaluate (``only``: see :func:`evaluate_predictions`). Raises
    EvaluationError naming the fix for slides with probabilities but no detections, slides the heatmap stage
    failed on, an earlier run's files of an empty slide, unfinished slides and a stopped heatmap run."""
    passed_over: list[Path] = []
    found = find_predictions(predictions_dir, known_stems=set(labels), only=only, passed_over=passed_over)
    not_evaluated_files = [p.name for p in passed_over]
    unlabelled_csvs, beside = _passed_over_csvs(passed_over, found)
    if unlabelled_csvs:  # plain <stem>.csv count only for labelled slides: any CSV could be named so
        logger.warning("%s: %d CSV file(s) are not evaluated: named <stem>.csv (the challenge's detection files), they "
                       "match no slide of the labels CSV: %s. If they are detections, add their slides to the labels "
                       "CSV (else the FROC leaves out their false positives and slides); otherwise move them out of "
                       "the folder.", predictions_dir, len(unlabelled_csvs), _first(unlabelled_csvs))
    if beside:
        logger.warning("%s: %d CSV file(s) are not evaluated: named <stem>.csv (the challenge's detection files), they "
                       "are beside their slide's <stem>_detections.csv: %s. Fix: move the file that is not "
                       "the slide's detections out of the folder.", predictions_dir, len(beside), _first(beside))
    evaluated = {s: f for s, f in found.items() if f.detections is not None}
    orphans = sorted(s for s, f in found.items() if f.detections is None and (f.patches or f.sidecar))
    if orphans:
        raise EvaluationError(
            f"{predictions_dir}: slides {', '.join(orphans)} have patch probabilities but no "
            "<stem>_detections.csv, so the FROC would miss them. Fix: re-run the heatmap stage for them "
            "or remove their files from the folder."
        )
    slide_labels = labels_for(labels, evaluated, what="predicted slide")  # one error lists every unlabelled slide
    evaluated_keys = {stem_key(s) for s in evaluated}
    listed = None if only is None else {stem_key(s) for s in only}
    skipped = sorted(s for s in labels
                     if stem_key(s) not in evaluated_keys and (listed is None or stem_key(s) in listed))
    _refuse_stopped_heatmap_run(predictions_dir, skipped)
    # every slide to evaluate, with files or without: the status file records the heatmap stage's latest run
    failed, empty = _heatmap_outcomes(predictions_dir, sorted(set(evaluated) | set(skipped)))
    if failed:
        old = [s for s in failed if s in evaluated]
        raise EvaluationError(
            f"{predictions_dir / HEATMAP_STATUS_FILENAME}: the heatmap stage failed on labelled slides "
            f"{', '.join(f'{s} ({e})' for s, e in failed.items())}, so the FROC would count only the others"
            + (f" (the files of {', '.join(old)} in the folder are an earlier run's, not the latest)" if old else "")
            + ". Fix: mend and re-run the heatmap stage for them, or remove them from the labels CSV to evaluate "
            "the rest.")
    # the latest run leaves an empty slide one file, an empty <stem>_detections.csv (for the CAMELYON16 script's
    # count of slides); any other file of it (or detections in that file) is an earlier run's
    stale = [s for s in empty if s in evaluated and (evaluated[s].patches or evaluated[s].sidecar
                                                     or os.path.getsize(evaluated[s].detections) > 0)]
    for s in empty:
        if s not in stale:
            evaluated.pop(s, None)  # evaluated below as empty (no detection), not as an unfinished slide
    if stale:  # the heatmap stage removes a slide's files when it finds it empty: these are older
        raise EvaluationError(
            f"{predictions_dir / HEATMAP_STATUS_FILENAME}: the heatmap stage's latest run found no tissue patch on "
            f"slides {', '.join(stale)}, but prediction files of an earlier run of them are in {predictions_dir}. "
            "Fix: re-run the heatmap stage for them (it removes those files), or delete their files.")
    _refuse_unfinished(predictions_dir, found, evaluated)
    if empty:  # no tissue patch: evaluated with no detection (a tumour slide's lesions are missed)
        evaluated.update({s: PredictionFiles(stem=s) for s in empty})
        slide_labels.update(labels_for(labels, {s: None for s in empty}, what="predicted slide"))
        skipped = [s for s in skipped if s not in empty]
        logger.warning("%d slide(s) had no tissue patch in the heatmap stage (%s); they count with no detection "
                       "(their lesions missed) and score 0.", len(empty), ", ".join(empty))
    if not evaluated:  # neither a detection file nor a slide the heatmap stage found empty
        raise EvaluationError(
            f"{predictions_dir}: no detection files (<stem>_detections.csv, CAMELYON16 'prob,x,y') found. "
            "Fix: pass the heatmap stage's output folder as --predictions."
        )
    if skipped:
        logger.info("%d labelled slides have no predictions and are not evaluated (listed in %s under "
                    "not_evaluated)", len(skipped), EVALUATION_FILES["metrics"])
    return _Selection(evaluated=evaluated, slide_labels=slide_labels, skipped=skipped, empty=list(empty),
                      not_evaluated_files=not_evaluated_files, unlabelled_csvs=unlabelled_csvs, beside=beside)


def _report_notes(sel: _Selection, *, reasons: Mapping[str, str], lesion_excluded: list[str],
                  lesion_results: list[SlideResult], stale_scores: list[str]) -> list[str]:
    """The report's notes on what is unavailable, left out or passed over (one sentence each)."""
    notes = [f"{_METRIC_NAMES.get(k, k.replace('_', ' '))} unavailable: {v}." for k, v in reasons.items()]
    if lesion_excluded:
        notes.append(f"{len(lesion_excluded)} slide(s) are left out of the FROC and the instance AUC "
                     f"(lesion_exclude) and kept in the bag AUC: {', '.join(lesion_excluded)}.")
    n_outside = sum(r.match.n_outside_mask for r in lesion_results)
    if sel.empty:
        notes.append(f"{len(sel.empty)} slide(s) had no tissue patch in the heatmap stage and count with a score of 0 "
                     f"in the bag AUC and no detection (a tumour slide's lesions missed): {_first(sorted(sel.empty))}.")
    if sel.skipped:
        notes.append(f"{len(sel.skipped)} labelled slide(s) have no predictions here and are not evaluated: "
                     f"{', '.join(sel.skipped[:20])}{' ...' if len(sel.skipped) > 20 else ''}.")
    if sel.unlabelled_csvs:
        notes.append(f"{len(sel.unlabelled_csvs)} CSV file(s) in the predictions folder match no labelled slide and "
                     f"are not evaluated (if they are detections, their slides are missing from the labels CSV): "
                     f"{_first(sel.unlabelled_csvs)}.")
    if sel.beside:
        notes.append(f"{len(sel.beside)} CSV file(s) in the predictions folder are not evaluated: named <stem>.csv, "
                     f"they are beside their slide's <stem>_detections.csv: {_first(sel.beside)}.")
    if stale_scores:
        notes.append(f"{SCORES_FILENAME} holds other scores than the sidecars of slides "
                     f"{', '.join(stale_scores[:20])}{' ...' if len(stale_scores) > 20 else ''} (an interrupted "
                     "heatmap run); the sidecars' scores, those of the evaluated files, are used.")
    if n_outside:
        notes.append(f"{n_outside} detection(s) lie outside their slide and count as false positives.")
    return notes


def _stale_outlines(sidecars: dict[str, dict], annotations_dir: Path | None) -> list[str]:
    """A note naming the slides whose heatmap overlay outlines another version of their annotation than the one
    evaluated (its ``outline_file``: name and bytes, :func:`~wsi_milssl.annotations.same_annotation_version`;
    review CN: an annotation edited after the
    heatmap was scored as edited, while the report's picture still outlined the lesion deleted), else []."""
    if annotations_dir is None:
        return []
    stale = []
    for stem, sidecar in sidecars.items():
        recorded = sidecar.get("outline_file")
        if not isinstance(recorded, dict):  # no overlay outline recorded (no slide file, or an earlier version)
            continue
        try:
            path = find_annotation(stem, annotations_dir)
        except WsiMilsslError:
            continue
        now = annotation_version(path) if path is not None else None
        if now is None or not same_annotation_version(recorded, now):
            stale.append(stem)
    if not stale:
        return []
    return [f"the heatmap overlays of {len(stale)} slide(s) outline another version of their annotation than the one "
            f"evaluated (edited since, or another annotations folder): {_first(sorted(stale))}; the metrics use the "
            "evaluated annotations. `wsi-milssl heatmap` with the same settings and --annotations draws the overlays "
            "again without predicting."]


def _write_tables(out_dir: Path, results: list[SlideResult], rows: list[dict[str, Any]], curve: FrocCurve
                  ) -> dict[str, Path]:
    """Write the per-slide table (``rows``), the detection outcomes and the FROC curve's points as CSVs;
    returns output name -> path."""
    paths: dict[str, Path] = {}
    names = EVALUATION_FILES
    paths["per_slide"] = atomic_write_csv(out_dir / names["per_slide"], rows, columns=PER_SLIDE_COLUMNS)
    det_rows = [
        {"slide": r.stem, "prob": float(p), "x_lv0": float(x), "y_lv0": float(y), "outcome": o, "region": int(h)}
        for r in results
        for p, x, y, o, h in zip(r.match.probs, r.match.x_lv0, r.match.y_lv0, r.match.outcome, r.match.hit_label)
    ]
    paths["detection_outcomes"] = atomic_write_csv(
        out_dir / names["detection_outcomes"], det_rows, columns=DETECTION_OUTCOME_COLUMNS)
    curve_rows = [{"threshold": t, "fp_per_slide": f, "sensitivity": None if math.isnan(s) else s}
                  for t, f, s in zip(curve.thresholds, curve.fp_per_slide, curve.sensitivity)]
    paths["froc_curve"] = atomic_write_csv(out_dir / names["froc_curve"], curve_rows, columns=FROC_CURVE_COLUMNS)
    return paths


def _report_configuration(config: EvaluateConfig, predictions_dir: Path, sidecars: Mapping[str, dict[str, Any]],
                          run_sidecar: dict[str, Any] | None, *, protocol: str,
                          inputs: Mapping[str, str | os.PathLike | None]) -> tuple[dict[str, Any], list[str]]:
    """The report's configuration section (the evaluation's settings and inputs, the run that made the evaluated
    slides as their sidecars record it, the training behind its checkpoint, the heatmap run's settings) and
    the notes on heatmap runs it cannot show as one."""
    configuration = {
        "evaluate": config_to_dict(config),
        "inputs": {k: None if v is None else str(v) for k, v in inputs.items()},
        "protocol": {
            "mask_downsample": CAMELYON16_DOWNSAMPLE, "margin_um": config.margin_um, "froc_mpp": config.froc_mpp,
            "froc_protocol": protocol,
            "itc_major_axis_um": config.itc_major_axis_um, "fp_rates": list(FP_RATES),
            "positive_fraction": config.positive_fraction,
        },
    }
    pred_config = read_heatmap_config(predictions_dir)
    if run_sidecar is not None:  # what made the evaluated slides, as their sidecars record it
        configuration["predictions_run"] = {k: run_sidecar.get(k)
                                            for k in ("fingerprint", "checkpoint_sha256") + _RUN_FIELDS}
        training = _training_summary(run_sidecar.get("checkpoint"), run_sidecar.get("checkpoint_sha256"))
        if training:
            configuration["training"] = training
    notes: list[str] = []
    later_run = _later_run(pred_config, list(sidecars.values()))
    if later_run:
        notes.append(f"{HEATMAP_CONFIG_FILENAME} describes a later heatmap run (checkpoint "
                     f"{pred_config.get('checkpoint')}) than the one that made the evaluated slides (checkpoint "
                     f"{run_sidecar.get('checkpoint')}); the configuration shows what the slides' sidecars record.")
    elif pred_config is not None and len(_values(list(sidecars.values()), "fingerprint")) > 1:
        notes.append(f"the evaluated slides were made by heatmap runs with other drawing settings (one run by "
                     f"their checkpoint and detection settings); {HEATMAP_CONFIG_FILENAME}, which the last of "
                     "them wrote, is not shown as the configuration of all of them.")
    elif pred_config is not None:
        configuration["predictions_config"] = pred_config
    return configuration, notes


def _write_plots(out_dir: Path, paths: dict[str, Path], curve: FrocCurve, *, froc_value: float | None,
                 sensitivities: list[float | None], protocol: str, inst_roc: RocCurve | None,
                 bag_roc: RocCurve | None) -> list[tuple[str, bytes]]:
    """Write the FROC and ROC plots that have data as PNGs (adding their paths to ``paths``); returns
    (caption, PNG bytes) for the report."""
    plots: list[tuple[str, bytes]] = []
    if curve.n_lesions:
        png = froc_png(curve, score=froc_value, sensitivities=sensitivities, protocol=protocol)
        paths["froc_png"] = atomic_write_bytes(out_dir / EVALUATION_FILES["froc_png"], png)
        plots.append((f"FROC curve ({'CAMELYON16 protocol' if protocol == 'CAMELYON16' else protocol})", png))
    for key, curve_roc, caption in (
        ("roc_instance_png", inst_roc, "Instance ROC (patches)"),
        ("roc_bag_png", bag_roc, "Bag ROC (slides)"),
    ):
        name = EVALUATION_FILES[key]
        if curve_roc is not None:
            png = roc_png(curve_roc, title=caption)
            paths[key] = atomic_write_bytes(out_dir / name, png)
            plots.append((caption, png))
    return plots


def evaluate_predictions(
    predictions_dir: str | os.PathLike,
    *,
    labels_csv: str | os.PathLike,
    out_dir: str | os.PathLike,
    annotations_dir: str | os.PathLike | None = None,
    slides: str | os.PathLike | None = None,
    config: EvaluateConfig | None = None,
    progress: ProgressCallback | None = None,
    only: Collection[str] | None = None,
) -> EvaluationResult:
    """Evaluate heatmap predictions and write metrics, curves, tables and ``report.html``.

    Parameters
    ----------
    predictions_dir : the heatmap stage's output folder, or a folder of CAMELYON16 detection CSVs.
    labels_csv : ``slide,label`` (1 tumour, 0 normal) for at least every evaluated slide.
    out_dir : folder for the outputs (created); its lock is held while they are written
        (:func:`wsi_milssl.locks.folder_lock`: FolderLockedError while another run writes it). An earlier
        run's evaluation files in it are removed first and ``metrics.json`` is written last.
    annotations_dir : ASAP XML / GeoJSON per tumour slide (``<stem>.xml`` / ``<stem>.geojson``).
    slides : a folder of slides or a CSV ``slide,path``; a tumour slide's file gives its level-0
        size and MPP (the sidecar's ``slide_path`` is used when the slide is not listed here).
    only : the slides (exact stems) to evaluate; the files, labels and heatmap status rows of other slides
        are ignored (as the pipeline ignores those of slides no longer in its test set, or renamed), and a
        slide of ``only`` without files counts as the heatmap stage recorded it (empty, failed). Default:
        every predicted slide, and every labelled one.
    Returns an :class:`EvaluationResult` (``metrics`` as written to ``metrics.json``, ``paths`` of the files).
    """
    config = config or EvaluateConfig()
    predictions_dir = Path(predictions_dir)
    out_dir = Path(out_dir)
    writer = folder_writer(predictions_dir)
    if writer is not None:
        raise FolderLockedError(f"{predictions_dir}: {writer} is still writing this folder, so its predictions "
                                "are not complete. Fix: wait until that heatmap run (every shard of it) finishes, "
                                "then evaluate.")
    annotations_dir = None if annotations_dir is None else Path(annotations_dir)
    if annotations_dir is not None and not annotations_dir.is_dir():
        what = "is a file, not the annotations folder" if annotations_dir.is_file() else \
            "the annotations folder does not exist"
        raise EvaluationError(f"{annotations_dir}: {what}. Fix: check --annotations (the folder of the "
                              "<slide name>.xml or .geojson files).")
    labels = read_labels(labels_csv)
    selection = _select_slides(predictions_dir, labels, only)
    evaluated, slide_labels, empty = selection.evaluated, selection.slide_labels, selection.empty
    slide_paths = resolve_slides(slides)
    # what is read, as it is now: a heatmap run started after the check above (its lock is not held here) and
    # rewriting slides while they are read would mix two runs' predictions in one report
    read_files = [p for f in evaluated.values() for p in (f.detections, f.patches, f.sidecar, f.probs_npy,
                                                          f.heatmap_png) if p is not None]
    read_files.append(predictions_dir / SCORES_FILENAME)
    before = {p: file_fingerprint(p) for p in read_files}
    sidecars = {s: read_probs_sidecar(f.sidecar) for s, f in evaluated.items() if f.sidecar is not None}
    run_sidecar = _one_run(predictions_dir, sidecars)
    _check_mpp(predictions_dir, sidecars, config)
    _check_slide_files(predictions_dir, sidecars, slide_paths)

    results: list[SlideResult] = []
    total = len(evaluated)
    emit(progress, ProgressEvent("evaluate", 0, total, unit="slide"))
    for i, (stem, files) in enumerate(evaluated.items(), start=1):
        results.append(_evaluate_slide(files, slide_labels[stem], annotations_dir=annotations_dir,
                                       slide_paths=slide_paths, config=config))
        emit(progress, ProgressEvent("evaluate", i, total, unit="slide", item=stem))

    # the lesion-level metrics (FROC, instance AUC: they read the annotations) leave out config.lesion_exclude
    lesion_excluded, lesion_results = _lesion_excluded(results, config)
    curve = (froc_curve([r.match for r in lesion_results]) if lesion_results else  # every slide excluded
             FrocCurve(thresholds=np.array([np.inf]), fp_per_slide=np.zeros(1), sensitivity=np.full(1, np.nan),
                       n_slides=0, n_lesions=0, n_fp=0, n_detected=0))
    reasons: dict[str, str] = {}
    if curve.n_lesions:
        score, sens = froc_score(curve, fp_rates=FP_RATES)
        froc_value: float | None = score
        sens_list: list[float | None] = [float(v) for v in sens]
    else:
        froc_value, sens_list = None, [None] * len(FP_RATES)
        held = [r for r in results if r.stem in lesion_excluded and r.match.n_lesions]  # (review BM)
        reasons["froc"] = (f"no lesions: lesion_exclude left out the {sum(r.match.n_lesions for r in held)} "
                           f"lesion(s) of {', '.join(r.stem for r in held)}; sensitivity is undefined" if held else
                           "no lesions (no tumour slide with a non-ITC region): sensitivity is undefined")
    if lesion_results:
        inst_metric, inst_roc = _instance_metric(lesion_results)
    else:
        inst_metric, inst_roc = Metric(None, "every evaluated slide is in lesion_exclude"), None
    scores, stale_scores = _slide_scores(results, sidecars, predictions_dir / SCORES_FILENAME)
    if stale_scores:
        logger.warning("%s: its rows of slides %s are not the scores their <stem>_probs.json record (an interrupted "
                       "heatmap run left an earlier run's rows); the sidecars' scores are evaluated. Fix: run the "
                       "heatmap stage again on the folder (it resumes) to mend %s.", predictions_dir / SCORES_FILENAME,
                       ", ".join(stale_scores), SCORES_FILENAME)
    bag_metric, bag_roc = _bag_metric(results, scores, predictions_dir / SCORES_FILENAME, empty)
    if inst_metric.value is None:
        reasons["instance_auc"] = inst_metric.reason
    if bag_metric.value is None:
        reasons["bag_auc"] = bag_metric.reason

    n_patches = sum(int(r.patch_probs.shape[0]) for r in lesion_results if r.patch_probs is not None)
    protocol = froc_protocol(config)
    metrics: dict[str, Any] = {
        "instance_auc": _metric_value(inst_metric),
        "bag_auc": _metric_value(bag_metric),
        "froc": _none_if_nan(froc_value) if froc_value is not None else None,
        "froc_sensitivities": sens_list,
        "n_slides": len(results),  # the FROC's are those less lesion_excluded
        "n_lesions": curve.n_lesions,
        "fp_rates": list(FP_RATES),
        # the FROC's settings: the µm/px its margin and ITC limit were measured at (null: each slide's own)
        "margin_um": config.margin_um,
        "itc_major_axis_um": config.itc_major_axis_um,
        "froc_mpp": config.froc_mpp,
        "froc_protocol": protocol,
        "lesion_excluded": lesion_excluded,
        "no_tissue": sorted(empty),  # scored 0, no detection (review BS: said on stderr only)
        "n_tumor_slides": sum(r.label for r in results),
        "n_normal_slides": sum(1 - r.label for r in results),
        "n_itc": sum(r.match.n_itc for r in lesion_results),
        "n_lesions_detected": curve.n_detected,
        "n_detections": sum(r.match.n_detections for r in lesion_results),
        "n_false_positives": curve.n_fp,
        "n_patches": n_patches if inst_metric.n else None,
        "n_positive_patches": inst_metric.n_positive if inst_metric.n else None,
        "reasons": reasons,
        "not_evaluated": selection.skipped,
        "not_evaluated_files": selection.not_evaluated_files,
        "config_hash": config_hash(config, exclude=("title", "thumbnail_px")),
    }

    # the report's heatmaps are read here, before the check: read after it, a heatmap run in between would put
    # another model's maps beside these metrics
    thumbs = {r.stem: _thumbnails(r, max_px=config.thumbnail_px) for r in results}
    _refuse_changed_predictions(predictions_dir, before)
    with folder_lock(out_dir):  # one evaluate writes the folder at a time: its files are of one run
        _remove_earlier_run(out_dir)
        paths: dict[str, Path] = {}
        names = EVALUATION_FILES
        rows = [_slide_row(r, scores.get(r.stem), r.stem in lesion_excluded) for r in results]
        paths.update(_write_tables(out_dir, results, rows, curve))
        plots = _write_plots(out_dir, paths, curve, froc_value=froc_value, sensitivities=sens_list,
                             protocol=protocol, inst_roc=inst_roc, bag_roc=bag_roc)
        paths["config"] = write_resolved_config(config, out_dir, name=names["config"])

        notes = _report_notes(selection, reasons=reasons, lesion_excluded=lesion_excluded,
                              lesion_results=lesion_results, stale_scores=stale_scores)
        notes += _few_cases(metrics)
        notes += _stale_outlines(sidecars, annotations_dir)
        inputs = {"predictions": predictions_dir, "labels": labels_csv, "annotations": annotations_dir,
                  "slides": slides}
        configuration, run_notes = _report_configuration(config, predictions_dir, sidecars, run_sidecar,
                                                         protocol=protocol, inputs=inputs)
        notes += run_notes
        legend = (f"{MATCH_VIEW_CAPTION}: the evaluation regions and detections, axes in level-0 pixels; "
                  f"{MATCH_VIEW_LEGEND}." if any(cap == MATCH_VIEW_CAPTION for t in thumbs.values() for cap, _ in t)
                  else "")
        data = ReportData(title=config.title, metrics=metrics, plots=plots, slide_rows=rows, thumbnails=thumbs,
                          configuration=configuration, notes=notes, thumbnail_px=config.thumbnail_px,
                          gallery_legend=legend, model=model_line(configuration.get("training") or {}))
        paths["report"] = write_report(data, out_dir / names["report"])
        # last: a folder with metrics.json is a finished run's (:func:`_remove_earlier_run`)
        paths["metrics"] = atomic_write_json(out_dir / names["metrics"], metrics)
    logger.info("evaluated %d slides: FROC %s, instance AUC %s, bag AUC %s", len(results),
                metrics["froc"], metrics["instance_auc"], metrics["bag_auc"])
    return EvaluationResult(metrics=metrics, slides=results, curve=curve, instance_roc=inst_roc,
                            bag_roc=bag_roc, paths=paths)
