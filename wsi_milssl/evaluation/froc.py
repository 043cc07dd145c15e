"""CAMELYON16 FROC: evaluation masks, detection matching and the FROC curve and score.

The protocol follows the CAMELYON16 challenge's evaluation script:

1. **Evaluation mask** (:func:`evaluation_mask`): from a boolean tumour mask at level 5 (a 32x
   downsample of level 0), keep every pixel whose Euclidean distance to the nearest tumour pixel is
   under ``75 µm / 2`` (converted to level-5 pixels at ``mpp``: ``75 / (2 * mpp * 32)``; the evaluation
   stage passes each slide's own µm/px, or ``EvaluateConfig.froc_mpp``; the CAMELYON16 script uses 0.243
   µm/px for every slide), fill holes, and label the regions with 8-connectivity.
   The tumour pixels themselves always belong to it (a margin of 0 leaves the tumour undilated).
2. **Isolated tumour cells**: a region whose moment-based major axis is under 275 µm
   (``275 / (mpp * 32)`` level-5 pixels) is an ITC. Detections on an ITC are neither true nor false
   positives, and ITCs are not counted as lesions.
3. **Matching** (:func:`match_detections`): a detection ``(prob, x, y)`` (level-0 pixels) on a
   tumour slide hits the region under level-5 pixel ``(x // 32, y // 32)``. Each lesion counts one
   true positive, at the highest probability among its hits (further hits are neither TP nor FP).
   Detections outside every region, and every detection on a normal slide, are false positives.
4. **Curve** (:func:`froc_curve`): one operating point per distinct probability among the false
   positives and the lesions' best hits. At threshold ``t`` the sensitivity is the fraction of all
   non-ITC lesions whose best hit is ``>= t`` and the false positives per slide are the false
   positives with probability ``>= t`` divided by the number of evaluated slides (all of them,
   tumour and normal, with or without detections). The curve starts at (0, 0) above every threshold.
5. **Score** (:func:`froc_score`): the mean sensitivity at 1/4, 1/2, 1, 2, 4 and 8 false positives per
   slide, interpolated linearly along the curve (as ``numpy.interp`` on the curve ordered by
   decreasing threshold: on a vertical step the higher sensitivity counts; past the last point the
   last sensitivity holds).

One deliberate difference from the original script: it evaluates its thresholds over
``sorted(set(probs))[1:]``, dropping the lowest probability because that is normally the 0 it stores
for missed lesions. The curves agree whenever a lesion is missed or an ITC exists and every
probability is above 0 (the usual case, ties aside: below); when every lesion is detected the original silently loses
its lowest operating point, while here every distinct detection probability is an operating point.
Undetected lesions never count as detected; a hit with probability 0 does (the original ignores it).
A second difference, on ties: the original keeps the lesions' best hits as float32 and the false positives
as float64, so a lesion hit and a false positive with the same probability p fall on two thresholds when
float32(p) > p (p = 0.3 and not 0.7, say): there the hit counts one threshold before the false positive,
here both at one (the sensitivity at some FP rates can differ, as 0.5 against 0.458 in a three-detection case;
probabilities are written with six decimals, so such ties happen).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy import ndimage
from skimage import measure

from wsi_milssl.evaluation.protocol import (  # noqa: F401  (the challenge's constants, defined there)
    CAMELYON16_DOWNSAMPLE,
    CAMELYON16_MPP,
    FP_RATES,
    ITC_MAJOR_AXIS_UM,
    MARGIN_UM,
)

__all__ = [
    "CAMELYON16_DOWNSAMPLE",
    "CAMELYON16_MPP",
    "FP_RATES",
    "ITC_MAJOR_AXIS_UM",
    "MARGIN_UM",
    "OUTCOMES",
    "EvaluationMask",
    "FrocCurve",
    "SlideMatch",
    "evaluation_mask",
    "froc_curve",
    "froc_score",
    "interpolate_sensitivity",
    "match_detections",
]

logger = logging.getLogger(__name__)

OUTCOMES = ("tp", "repeat", "itc", "fp")
"""Per-detection outcome codes of :class:`SlideMatch`: ``tp`` the best hit of a lesion, ``repeat``
another hit of an already hit lesion (neither TP nor FP), ``itc`` a hit on an isolated-tumour-cell
region (neither TP nor FP), ``fp`` a false positive."""


@dataclass(frozen=True)
class EvaluationMask:
    """Labelled evaluation regions of one tumour slide.

    The full mask has ``shape_px`` = (rows, cols) pixels at ``downsample``: pixel (i, j) covers
    level-0 ``[j*ds, (j+1)*ds) x [i*ds, (i+1)*ds)``. Only the window holding every region is
    stored: ``labels`` is int32 (h, w), the full mask's rows ``offset_px[0]:offset_px[0] + h`` and
    columns ``offset_px[1]:offset_px[1] + w``; 0 outside every region and 1..n inside region n
    (everything outside the window is 0). :meth:`full_labels` gives the whole (rows, cols) array.
    ``itc_labels`` are the labels of isolated tumour cells; ``lesion_labels`` the others,
    ascending. ``major_axis_um`` is float64 (n,): the major axis of region ``k`` at index ``k - 1``.
    """

    labels: np.ndarray
    offset_px: tuple[int, int]
    shape_px: tuple[int, int]
    itc_labels: frozenset[int]
    lesion_labels: tuple[int, ...]
    major_axis_um: np.ndarray
    mpp: float
    downsample: int
    margin_px: float

    @property
    def n_regions(self) -> int:
        return int(self.major_axis_um.shape[0])

    @property
    def n_lesions(self) -> int:
        """Regions that count for sensitivity (every region that is not an ITC)."""
        return len(self.lesion_labels)

    @property
    def n_itc(self) -> int:
        return len(self.itc_labels)

    def full_labels(self) -> np.ndarray:
        """int32 (rows, cols): the labels over the whole slide."""
        out = np.zeros(self.shape_px, dtype=np.int32)
        r0, c0 = self.offset_px
        out[r0 : r0 + self.labels.shape[0], c0 : c0 + self.labels.shape[1]] = self.labels
        return out

    def label_at(self, x_lv0: np.ndarray, y_lv0: np.ndarray) -> np.ndarray:
        """int32 (D,) region label under each level-0 point (pixel ``(x // ds, y // ds)``); 0 outside
        every region and for points outside the slide."""
        # compared as floats before any integer cast: a point far off the slide (x = 1e300) is simply outside
        col = np.floor(np.asarray(x_lv0, dtype=np.float64) / self.downsample) - self.offset_px[1]
        row = np.floor(np.asarray(y_lv0, dtype=np.float64) / self.downsample) - self.offset_px[0]
        h, w = self.labels.shape
        inside = (col >= 0) & (row >= 0) & (col < w) & (row < h)
        out = np.zeros(col.shape, dtype=np.int32)
        out[inside] = self.labels[row[inside].astype(np.int64), col[inside].astype(np.int64)]
        return out


def _window(mask: np.ndarray, pad: int) -> tuple[slice, slice]:
    """The bounding box of ``mask``'s True pixels grown by ``pad`` (clipped to the array)."""
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    r0, r1 = max(0, rows[0] - pad), min(mask.shape[0], rows[-1] + 1 + pad)
    c0, c1 = max(0, cols[0] - pad), min(mask.shape[1], cols[-1] + 1 + pad)
    return slice(int(r0), int(r1)), slice(int(c0), int(c1))


def evaluation_mask(
    tumor_mask: np.ndarray,
    *,
    mpp: float,
    downsample: int = CAMELYON16_DOWNSAMPLE,
    margin_um: float = MARGIN_UM,
    itc_major_axis_um: float = ITC_MAJOR_AXIS_UM,
) -> EvaluationMask:
    """Build the CAMELYON16 evaluation regions from a tumour mask.

    Parameters
    ----------
    tumor_mask : bool (rows, cols) tumour pixels at ``downsample`` (level 5 = 32 by default), with
        non-tumour holes already carved out.
    mpp : the µm per level-0 pixel at which the margin and the ITC limit are converted to pixels: the
        slide's own resolution, or 0.243 (:data:`CAMELYON16_MPP`) for the challenge script's numbers.
    margin_um : pixels closer than ``margin_um / 2`` to tumour (Euclidean distance between pixel
        centres, in µm) join the region; 0 keeps the tumour pixels alone (holes still filled).
    itc_major_axis_um : regions whose major axis is under this are isolated tumour cells.
    """
    mask = np.asarray(tumor_mask)
    if mask.ndim != 2:
        raise ValueError(f"tumor_mask must be a 2-D array; got shape {mask.shape}.")
    if not np.isfinite(mpp) or mpp <= 0:
        raise ValueError(f"mpp must be a positive number of µm per pixel; got {mpp!r}.")
    if downsample < 1:
        raise ValueError(f"downsample must be >= 1; got {downsample!r}.")
    mask = mask.astype(bool, copy=False)
    px_um = float(mpp) * downsample
    margin_px = margin_um / (2.0 * px_um)
    if mask.any():
        # Work in the window around the tumour, one pixel wider than the margin: nothing outside it
        # is near tumour, and a hole inside the window is a hole of the whole mask and vice versa.
        rs, cs = _window(mask, int(np.ceil(margin_px)) + 1)
        # distance of every pixel to the nearest tumour pixel (0 on tumour), in mask pixels
        distance = ndimage.distance_transform_edt(~mask[rs, cs])
        # the tumour itself always belongs (distance 0 is not under a margin of 0); for any margin above 0
        # this is the challenge script's ``distance < threshold``, bit for bit
        filled = ndimage.binary_fill_holes((distance < margin_px) | (distance == 0))
        labels = measure.label(filled, connectivity=2).astype(np.int32)
        offset = (rs.start, cs.start)
    else:
        labels, offset = np.zeros((0, 0), dtype=np.int32), (0, 0)
    props = measure.regionprops(labels) if labels.size else []
    major_px = np.array([p.axis_major_length for p in props], dtype=np.float64)
    major_um = major_px * px_um
    itc_px = itc_major_axis_um / px_um
    itc = frozenset(int(p.label) for p, m in zip(props, major_px) if m < itc_px)
    lesions = tuple(int(p.label) for p in props if int(p.label) not in itc)
    return EvaluationMask(
        labels=labels, offset_px=(int(offset[0]), int(offset[1])),
        shape_px=(int(mask.shape[0]), int(mask.shape[1])), itc_labels=itc, lesion_labels=lesions,
        major_axis_um=major_um, mpp=float(mpp), downsample=int(downsample), margin_px=float(margin_px),
    )


@dataclass(frozen=True)
class SlideMatch:
    """Detections of one slide matched against its evaluation regions.

    ``probs``, ``x_lv0``, ``y_lv0``: float64 (D,) the detections; ``outcome``: str (D,) one of
    :data:`OUTCOMES`; ``hit_label``: int32 (D,) region under each detection (0 none; always 0 on a
    normal slide). ``lesion_probs``: float64 (L,) best hit per non-ITC lesion, ascending label order,
    NaN for a missed lesion. ``fp_probs``: float64 (F,) the false positives' probabilities.
    """

    stem: str
    is_tumor: bool
    probs: np.ndarray
    x_lv0: np.ndarray
    y_lv0: np.ndarray
    outcome: np.ndarray
    hit_label: np.ndarray
    lesion_labels: tuple[int, ...]
    lesion_probs: np.ndarray
    fp_probs: np.ndarray
    n_itc: int = 0
    n_outside_mask: int = 0
    mask: EvaluationMask | None = field(default=None, repr=False, compare=False)

    @property
    def n_detections(self) -> int:
        return int(self.probs.shape[0])

    @property
    def n_lesions(self) -> int:
        return int(self.lesion_probs.shape[0])

    @property
    def n_detected(self) -> int:
        """Lesions hit by at least one detection (at the lowest threshold)."""
        return int(np.count_nonzero(~np.isnan(self.lesion_probs)))

    @property
    def n_fp(self) -> int:
        return int(self.fp_probs.shape[0])


def _outside(x: np.ndarray, y: np.ndarray, width: int, height: int, *, stem: str, what: str) -> np.ndarray:
    """bool (D,): the detections outside [0, width) x [0, height) level-0 px (logged when any)."""
    outside = (x < 0) | (y < 0) | (x >= width) | (y >= height)
    if outside.any():
        logger.warning("%s: %d detection(s) lie outside the %s (%d x %d level-0 px); counted as false positives. "
                       "Check that the x, y of the detections are level-0 pixels.", stem or "slide",
                       int(np.count_nonzero(outside)), what, width, height)
    return outside


def match_detections(
    probs: np.ndarray,
    x_lv0: np.ndarray,
    y_lv0: np.ndarray,
    *,
    mask: EvaluationMask | None,
    stem: str = "",
    dimensions_lv0: tuple[int, int] | None = None,
) -> SlideMatch:
    """Match one slide's detections against its evaluation regions.

    ``probs``, ``x_lv0``, ``y_lv0`` are (D,) arrays (probability and level-0 pixel position of each
    detection); ``mask`` is the slide's :class:`EvaluationMask`, or None for a normal slide (every
    detection is then a false positive). Detections outside the slide, ``dimensions_lv0`` = (width,
    height) when given (else, on a tumour slide, the mask's extent), are false positives and logged, on
    tumour and normal slides alike: their coordinates are probably not level-0 pixels.
    """
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    x = np.asarray(x_lv0, dtype=np.float64).reshape(-1)
    y = np.asarray(y_lv0, dtype=np.float64).reshape(-1)
    if not p.shape == x.shape == y.shape:
        raise ValueError(f"probs, x_lv0 and y_lv0 must have one length; got {p.shape}, {x.shape}, {y.shape}.")
    if not (np.isfinite(p).all() and np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError(f"{stem or 'detections'}: probabilities and coordinates must be finite numbers.")
    n = p.shape[0]
    outcome = np.full(n, "fp", dtype="<U6")
    if mask is None:
        n_outside = 0 if dimensions_lv0 is None else int(_outside(x, y, *dimensions_lv0, stem=stem, what="slide").sum())
        return SlideMatch(
            stem=stem, is_tumor=False, probs=p, x_lv0=x, y_lv0=y, outcome=outcome,
            hit_label=np.zeros(n, dtype=np.int32), lesion_labels=(), lesion_probs=np.zeros(0),
            fp_probs=p.copy(), n_outside_mask=n_outside,
        )
    hit = mask.label_at(x, y)
    if dimensions_lv0 is not None:
        outside = _outside(x, y, *dimensions_lv0, stem=stem, what="slide")
    else:
        rows, cols = mask.shape_px
        outside = _outside(x, y, cols * mask.downsample, rows * mask.downsample, stem=stem,
                           what="slide's evaluation mask")
    hit[outside] = 0  # the mask's last row and column reach past the slide's edge
    n_outside = int(outside.sum())
    lesion_index = {label: i for i, label in enumerate(mask.lesion_labels)}
    lesion_probs = np.full(len(mask.lesion_labels), np.nan)
    best_det = np.full(len(mask.lesion_labels), -1, dtype=np.int64)
    for i in range(n):
        label = int(hit[i])
        if label == 0:
            continue
        if label in mask.itc_labels:
            outcome[i] = "itc"
            continue
        k = lesion_index[label]
        outcome[i] = "repeat"
        # the first of equal best probabilities stays the TP
        if best_det[k] < 0 or p[i] > lesion_probs[k]:
            lesion_probs[k] = p[i]
            best_det[k] = i
    outcome[best_det[best_det >= 0]] = "tp"
    return SlideMatch(
        stem=stem, is_tumor=True, probs=p, x_lv0=x, y_lv0=y, outcome=outcome, hit_label=hit,
        lesion_labels=mask.lesion_labels, lesion_probs=lesion_probs, fp_probs=p[outcome == "fp"],
        n_itc=mask.n_itc, n_outside_mask=n_outside, mask=mask,
    )


@dataclass(frozen=True)
class FrocCurve:
    """The FROC curve, ordered by decreasing threshold.

    ``thresholds``: float64 (K+1,), ``inf`` first (the origin, nothing detected), then the distinct
    probabilities descending. ``fp_per_slide`` and ``sensitivity``: float64 (K+1,) at each threshold
    (detections with probability ``>= threshold`` count), both non-decreasing. ``sensitivity`` is NaN
    when there are no lesions.
    """

    thresholds: np.ndarray
    fp_per_slide: np.ndarray
    sensitivity: np.ndarray
    n_slides: int
    n_lesions: int
    n_fp: int
    n_detected: int


def froc_curve(matches: Sequence[SlideMatch]) -> FrocCurve:
    """The FROC curve over all evaluated slides (every slide counts in the FP-per-slide average)."""
    if len(matches) == 0:
        raise ValueError("froc_curve needs at least one evaluated slide.")
    lesion_probs = np.concatenate([m.lesion_probs for m in matches]) if matches else np.zeros(0)
    n_lesions = int(lesion_probs.shape[0])
    tp = np.sort(lesion_probs[~np.isnan(lesion_probs)])
    fp = np.sort(np.concatenate([m.fp_probs for m in matches]))
    thresholds = np.unique(np.concatenate([tp, fp]))[::-1]
    # count of values >= t in a sorted array: len - searchsorted(left)
    n_tp = tp.shape[0] - np.searchsorted(tp, thresholds, side="left")
    n_fp = fp.shape[0] - np.searchsorted(fp, thresholds, side="left")
    n_slides = len(matches)
    fp_rate = np.concatenate([[0.0], n_fp / n_slides])
    if n_lesions:
        sens = np.concatenate([[0.0], n_tp / n_lesions])
    else:
        sens = np.full(fp_rate.shape, np.nan)
    return FrocCurve(
        thresholds=np.concatenate([[np.inf], thresholds]), fp_per_slide=fp_rate, sensitivity=sens,
        n_slides=n_slides, n_lesions=n_lesions, n_fp=int(fp.shape[0]), n_detected=int(tp.shape[0]),
    )


def interpolate_sensitivity(
    fp_per_slide: np.ndarray, sensitivity: np.ndarray, fp_rates: Sequence[float]
) -> np.ndarray:
    """Sensitivity at each of ``fp_rates``, linear along a curve whose ``fp_per_slide`` is
    non-decreasing (float64 (R,)). On a vertical step (several points at one FP rate) the highest
    sensitivity counts; below the first point the first sensitivity, past the last the last one
    holds. This equals ``numpy.interp`` on such a curve, written out so that ties are defined."""
    fp = np.asarray(fp_per_slide, dtype=np.float64)
    sens = np.asarray(sensitivity, dtype=np.float64)
    if fp.ndim != 1 or fp.shape != sens.shape or fp.shape[0] == 0:
        raise ValueError("fp_per_slide and sensitivity must be 1-D arrays of one non-zero length.")
    if np.any(np.diff(fp) < 0):
        raise ValueError("fp_per_slide must be non-decreasing along the curve.")
    out = np.empty(len(fp_rates))
    for r, rate in enumerate(fp_rates):
        j = int(np.searchsorted(fp, rate, side="right")) - 1  # last point with fp <= rate
        if j < 0:
            out[r] = sens[0]
        elif j == fp.shape[0] - 1:
            out[r] = sens[j]
        else:
            w = (rate - fp[j]) / (fp[j + 1] - fp[j])
            out[r] = sens[j] + w * (sens[j + 1] - sens[j])
    return out


def froc_score(curve: FrocCurve, *, fp_rates: Sequence[float] = FP_RATES) -> tuple[float, np.ndarray]:
    """(FROC score, float64 (R,) sensitivities at ``fp_rates``); both NaN when there are no lesions."""
    sens = interpolate_sensitivity(curve.fp_per_slide, curve.sensitivity, fp_rates)
    return float(np.mean(sens)), sens
