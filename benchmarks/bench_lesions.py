"""Benchmark the heatmap's lesion outlines (``inference.exports.lesion_polygons``) on noisy maps: an early
checkpoint's map of a large slide holds thousands of contours. Prints cells, contours kept as lesions and seconds.
Run: ``python benchmarks/bench_lesions.py [--sides 71 100 142 200] [--positive-fraction 0.2]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from wsi_milssl.inference.exports import lesion_polygons


def noisy_map(side: int, positive_fraction: float, seed: int = 0) -> np.ndarray:
    """A ``side`` x ``side`` probability map: noise below 0.3, scattered cells at 0.9, one square lesion."""
    rng = np.random.default_rng(seed)
    grid = rng.random((side, side)) * 0.3
    grid[rng.random((side, side)) < positive_fraction] = 0.9
    grid[side // 5:side // 2, side // 5:side // 2] = 0.95
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[71, 100, 142, 200])
    parser.add_argument("--positive-fraction", type=float, default=0.2)
    args = parser.parse_args()
    print(f"{'cells':>8} {'lesions':>8} {'seconds':>8}")
    for side in args.sides:
        grid = noisy_map(side, args.positive_fraction)
        start = time.perf_counter()
        polys = lesion_polygons(grid, origin_lv0=(0, 0), stride_lv0=512, patch_size_lv0=512, threshold=0.5)
        print(f"{side * side:>8} {len(polys):>8} {time.perf_counter() - start:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
