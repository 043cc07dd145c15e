"""Benchmark the label stage's geometry: 150,000 patches against 500 polygons (200,000 vertices).

Prints a table of seconds per step: building the tumour region (union, minus holes, make_valid),
exact per-patch tumour fractions (STRtree + vectorised shapely), and the level-5 (32x) evaluation
mask. Run: ``python benchmarks/bench_label.py [--patches 150000] [--polygons 500] [--vertices 200000]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from wsi_milssl.annotations import AnnotationSet, PolygonAnnotation, rasterize_region, tumor_fraction


def star_polygon(rng: np.random.Generator, cx: float, cy: float, radius: float, n_vertices: int) -> np.ndarray:
    """An irregular star-shaped polygon (n_vertices, 2) around (cx, cy)."""
    angles = np.sort(rng.uniform(0, 2 * np.pi, n_vertices))
    k = np.arange(1, 6)[:, None]
    wobble = (rng.normal(0, 0.12, (5, 1)) * np.cos(k * angles + rng.uniform(0, 6.3, (5, 1)))).sum(0)
    r = radius * np.clip(1 + wobble + rng.normal(0, 0.01, n_vertices), 0.3, None)
    return np.c_[cx + r * np.cos(angles), cy + r * np.sin(angles)]


def make_annotations(rng, *, n_polygons: int, n_vertices: int, side_lv0: float) -> list[PolygonAnnotation]:
    """``n_polygons`` polygons, 90 % tumour (``_0``/``_1``) and 10 % holes (``_2``) inside tumour ones."""
    n_holes = n_polygons // 10
    n_tumor = n_polygons - n_holes
    per = n_vertices // n_polygons
    anns = []
    centres = rng.uniform(0.03 * side_lv0, 0.97 * side_lv0, (n_tumor, 2))
    radii = np.exp(rng.uniform(np.log(150), np.log(3000), n_tumor))
    for k in range(n_tumor):
        anns.append(PolygonAnnotation(f"Annotation {k}", "_0" if k % 3 else "_1",
                                      star_polygon(rng, *centres[k], radii[k], per)))
    for k in range(n_holes):
        cx, cy = centres[k]
        anns.append(PolygonAnnotation(f"Annotation {n_tumor + k}", "_2",
                                      star_polygon(rng, cx, cy, 0.3 * radii[k], per)))
    return anns


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=150_000)
    parser.add_argument("--polygons", type=int, default=500)
    parser.add_argument("--vertices", type=int, default=200_000)
    parser.add_argument("--patch-size-lv0", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    side = int(np.ceil(np.sqrt(args.patches))) * args.patch_size_lv0
    anns = make_annotations(rng, n_polygons=args.polygons, n_vertices=args.vertices, side_lv0=side)
    n_cols = int(np.ceil(np.sqrt(args.patches)))
    idx = np.arange(args.patches)
    coords = np.c_[idx % n_cols, idx // n_cols].astype(np.int64) * args.patch_size_lv0

    rows = []
    t0 = time.perf_counter()
    aset = AnnotationSet(anns).with_dimensions((side, side))
    region = aset.region
    t1 = time.perf_counter()
    rows.append(("region (union - holes, make_valid, clip)", t1 - t0))
    fraction = tumor_fraction(region, coords, args.patch_size_lv0)
    labels = (fraction >= np.float32(0.25)).astype(np.uint8)
    t2 = time.perf_counter()
    rows.append(("tumour fractions + instance labels", t2 - t1))
    mask = rasterize_region(region, dimensions_lv0=(side, side), downsample=32)
    t3 = time.perf_counter()
    rows.append((f"evaluation mask {mask.shape[1]}x{mask.shape[0]} (32x)", t3 - t2))
    rows.append(("total", t3 - t0))

    n_vertices = sum(len(a.coords_lv0) for a in anns)
    print(f"{args.patches:,} patches of {args.patch_size_lv0} px (level 0) on a {side:,} x {side:,} px slide; "
          f"{len(anns)} polygons, {n_vertices:,} vertices")
    print(f"positives: {int(labels.sum()):,}  patches touching tumour: {int((fraction > 0).sum()):,}  "
          f"tumour area: {region.area / side**2:.2%} of the slide")
    print(f"{'step':<48} {'seconds':>8}")
    for name, sec in rows:
        print(f"{name:<48} {sec:>8.3f}")


if __name__ == "__main__":
    main()
