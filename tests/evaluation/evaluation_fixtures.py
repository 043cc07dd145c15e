"""Helpers that write an annotation and prediction folders in the heatmap stage's format.

The heatmap stage is not used: these fixtures write its files (contract in the lead's notes) so that
the evaluation can be tested alone, with predictions whose right answers are known.

The tumour slide's annotation is written here, not taken from the generator, so that the hand
computations of the tests hold whatever the generator happens to place. It holds two discs (regular
96-gons) in group ``_0``, centred on level-5 pixel centres (level-0 ``32 k + 16``):

- the **lesion**: radius 640 px = 160 µm at 0.25 µm/px, 320 µm across; the evaluation mask grows it
  by 75/2 µm on each side to about 395 µm, far above the 275 µm ITC limit: one lesion.
- the **ITC**: radius 140 px = 35 µm, 70 µm across, about 145 µm once grown: an isolated tumour cell
  region. With the slide's µm/px forced to 1.0 the same disc is 280 µm across (about 355 µm grown)
  and becomes a second lesion.

Their centres are put into the slide's tissue where there is room (the deepest tissue points that
keep each disc and its margin inside the slide and the two regions 640 px apart); the evaluation
never looks at the pixels, so the hand computations do not depend on where the tissue is.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

from wsi_milssl.annotations import PolygonAnnotation, read_annotations, tumor_fraction, write_asap_xml
from wsi_milssl.slide import open_slide
from wsi_milssl.slide.tissue import slide_tissue_mask

SLIDE_PX = 4096
PATCH_LV0 = 256
MPP = 0.25
LESION_RADIUS_PX = 640.0
ITC_RADIUS_PX = 140.0
EDGE_PX = 256  # free level-0 pixels between a grown region and the slide border (margin is 150 px)
GAP_PX = 640  # level-0 pixels between the two discs (both grown by 150 px at 0.25 µm/px)


@dataclass(frozen=True)
class KnownAnnotation:
    """The tumour slide's annotation written by :func:`write_known_annotation` (level-0 px)."""

    stem: str
    path: Path
    lesion_xy: tuple[float, float]
    itc_xy: tuple[float, float]


def _write_csv(path: Path, rows, header=None) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        if header:
            w.writerow(header)
        w.writerows(rows)


def read_slide_labels(synth_dir: Path) -> dict[str, int]:
    with open(synth_dir / "labels.csv") as fh:
        return {r["slide"]: int(r["label"]) for r in csv.DictReader(fh)}


def disc(cx: float, cy: float, radius: float, *, n: int = 96) -> np.ndarray:
    """float64 (n, 2) vertices of a regular n-gon inscribed in the circle (cx, cy, radius)."""
    t = np.arange(n) * (2 * np.pi / n)
    return np.c_[cx + radius * np.cos(t), cy + radius * np.sin(t)]


def _deepest(depth_lv0: np.ndarray, allowed: np.ndarray, centres: np.ndarray) -> tuple[float, float]:
    """The allowed candidate centre with the most tissue around it (first one on ties)."""
    k = int(np.argmax(np.where(allowed, depth_lv0, -1.0)))
    return float(centres[k, 0]), float(centres[k, 1])


def write_known_annotation(synth_dir: Path, out_dir: Path) -> KnownAnnotation:
    """Write ``<tumour stem>.xml`` into ``out_dir`` with the lesion and ITC discs described above."""
    labels = read_slide_labels(synth_dir)
    tumour = [s for s, lab in labels.items() if lab == 1]
    if len(tumour) != 1:
        raise RuntimeError(f"test setup: expected one tumour slide in {synth_dir}, found {tumour}")
    stem = tumour[0]
    with open_slide(synth_dir / f"{stem}.tif") as slide:
        if tuple(slide.dimensions) != (SLIDE_PX, SLIDE_PX) or abs(slide.mpp - MPP) > 1e-9:
            raise RuntimeError(f"test setup: {stem} is {slide.dimensions} px at {slide.mpp} µm/px, "
                               f"the hand computations assume {SLIDE_PX} px at {MPP} µm/px")
        tissue = slide_tissue_mask(slide)
    # depth: level-0 distance from each tissue-mask pixel to the nearest non-tissue pixel
    depth = ndimage.distance_transform_edt(tissue.mask) * float(np.mean(tissue.downsample_xy))
    lattice = np.arange(16, SLIDE_PX, 32, dtype=np.float64)  # level-5 pixel centres
    gx, gy = np.meshgrid(lattice, lattice)
    centres = np.c_[gx.ravel(), gy.ravel()]
    rows = np.minimum((centres[:, 1] / tissue.downsample_xy[1]).astype(int), tissue.mask.shape[0] - 1)
    cols = np.minimum((centres[:, 0] / tissue.downsample_xy[0]).astype(int), tissue.mask.shape[1] - 1)
    depth_at = depth[rows, cols]

    def inside(radius: float) -> np.ndarray:
        lo, hi = radius + 150 + EDGE_PX, SLIDE_PX - radius - 150 - EDGE_PX
        return np.all((centres >= lo) & (centres <= hi), axis=1)

    lesion = _deepest(depth_at, inside(LESION_RADIUS_PX), centres)
    far = np.hypot(centres[:, 0] - lesion[0], centres[:, 1] - lesion[1]) >= LESION_RADIUS_PX + ITC_RADIUS_PX + GAP_PX
    itc = _deepest(depth_at, inside(ITC_RADIUS_PX) & far, centres)
    anns = [PolygonAnnotation("lesion", "_0", disc(*lesion, LESION_RADIUS_PX)),
            PolygonAnnotation("itc", "_0", disc(*itc, ITC_RADIUS_PX))]
    path = write_asap_xml(anns, Path(out_dir) / f"{stem}.xml")
    return KnownAnnotation(stem=stem, path=path, lesion_xy=lesion, itc_xy=itc)


def write_predictions(synth_dir: Path, known: KnownAnnotation, out: Path, *, with_patches: bool = True,
                      with_scores: bool = True) -> dict:
    """Write a heatmap-style folder for the two generated slides; return what the test needs to know.

    Tumour slide: patch probability = the patch's exact tumour fraction (so instance AUC is 1 when the
    0.25 rule is applied with the right patch size); detections: 0.7 at the lesion's centre (TP),
    0.95 at the ITC's centre, 0.7 one pixel right of the lesion's centre (repeat).
    Normal slide: probabilities 0.1-0.2; one detection at 0.8 (FP). Scores: tumour 0.9, normal 0.2.
    """
    out.mkdir(parents=True, exist_ok=True)
    labels = read_slide_labels(synth_dir)
    info: dict = {"labels": labels}
    grid = np.arange(0, SLIDE_PX, PATCH_LV0)
    xs, ys = np.meshgrid(grid, grid)
    coords = np.stack([xs.ravel(), ys.ravel()], axis=1).astype(np.int64)
    rng = np.random.default_rng(0)
    for stem, label in labels.items():
        if label == 1:
            if stem != known.stem:
                raise RuntimeError(f"test setup: the annotation was written for {known.stem}, not {stem}")
            region = read_annotations(known.path).region
            probs = tumor_fraction(region, coords, PATCH_LV0).astype(np.float64)
            (lx, ly), (ix, iy) = known.lesion_xy, known.itc_xy
            dets = [(0.7, lx, ly), (0.95, ix, iy), (0.7, lx + 1, ly)]
            info["tumor"] = stem
            info["n_positive_patches"] = int((probs >= 0.25).sum())
        else:
            probs = 0.1 + 0.1 * rng.random(len(coords))
            dets = [(0.8, 1000.0, 1000.0)]
            info["normal"] = stem
        if with_patches:
            _write_csv(out / f"{stem}_patches.csv", [(x, y, f"{p:.6f}") for (x, y), p in zip(coords, probs)],
                       header=("x_lv0", "y_lv0", "prob"))
            side = {"slide": stem, "slide_path": str(synth_dir / f"{stem}.tif"), "origin_lv0": [0, 0],
                    "stride_lv0": PATCH_LV0, "patch_size_lv0": PATCH_LV0, "mpp": MPP,
                    "shape": [len(grid), len(grid)]}
            (out / f"{stem}_probs.json").write_text(json.dumps(side))
            grid_probs = probs.reshape(len(grid), len(grid)).astype(np.float32)
            np.save(out / f"{stem}_probs.npy", grid_probs)
            rgb = (np.stack([grid_probs, np.zeros_like(grid_probs), 1 - grid_probs], -1) * 255).astype(np.uint8)
            Image.fromarray(rgb).resize((256, 256), Image.Resampling.NEAREST).save(out / f"{stem}_heatmap.png")
        _write_csv(out / f"{stem}_detections.csv", [(p, round(x), round(y)) for p, x, y in dets])
    if with_scores:
        _write_csv(out / "scores.csv", [(s, 0.9 if l else 0.2) for s, l in labels.items()], header=("slide", "score"))
    return info
