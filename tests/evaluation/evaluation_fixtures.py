"""Helpers that write prediction folders in the heatmap stage's format from the generated slides.

The heatmap stage is not used: these fixtures write its files (contract in the lead's notes) so that
the evaluation can be tested alone, with predictions whose right answers are known.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import shapely
from PIL import Image

from wsi_milssl.annotations import read_annotations, tumor_fraction

SLIDE_PX = 4096
PATCH_LV0 = 256


def _write_csv(path: Path, rows, header=None) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        if header:
            w.writerow(header)
        w.writerows(rows)


def tumour_points(region) -> tuple[tuple[float, float], tuple[float, float]]:
    """A level-0 point inside the largest tumour part (the macro lesion) and one inside the smallest."""
    parts = sorted(shapely.get_parts(region), key=lambda g: g.area)
    big = parts[-1].representative_point()
    small = parts[0].representative_point()
    return (big.x, big.y), (small.x, small.y)


def write_predictions(synth_dir: Path, out: Path, *, with_patches: bool = True, with_scores: bool = True) -> dict:
    """Write a heatmap-style folder for the two generated slides; return what the test needs to know.

    Tumour slide: patch probability = the patch's exact tumour fraction (so instance AUC is 1 when the
    0.25 rule is applied with the right patch size); detections: 0.7 inside the macro lesion (TP),
    0.95 on the smallest tumour part (an ITC at this size), 0.7 again on the macro lesion (repeat).
    Normal slide: probabilities 0.1-0.2; one detection at 0.8 (FP). Scores: tumour 0.9, normal 0.2.
    """
    out.mkdir(parents=True, exist_ok=True)
    with open(synth_dir / "labels.csv") as fh:
        labels = {r["slide"]: int(r["label"]) for r in csv.DictReader(fh)}
    info: dict = {"labels": labels}
    grid = np.arange(0, SLIDE_PX, PATCH_LV0)
    xs, ys = np.meshgrid(grid, grid)
    coords = np.stack([xs.ravel(), ys.ravel()], axis=1).astype(np.int64)
    rng = np.random.default_rng(0)
    for stem, label in labels.items():
        if label == 1:
            region = read_annotations(synth_dir / f"{stem}.xml").region
            probs = tumor_fraction(region, coords, PATCH_LV0).astype(np.float64)
            big, small = tumour_points(region)
            dets = [(0.7, *big), (0.95, *small), (0.7, big[0] + 1, big[1])]
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
                    "stride_lv0": PATCH_LV0, "patch_size_lv0": PATCH_LV0, "mpp": 0.25,
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
