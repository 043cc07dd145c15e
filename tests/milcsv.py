"""A small generated MIL problem written as a MIL CSV (``label,bag_id,f1..fn``), for the MIL and
benchmark tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_mil_csv(path: Path, *, n_bags: int = 40, dim: int = 8, seed: int = 0, shift: float = 2.5) -> Path:
    """Write ``label,bag_id,f1..fn`` rows: half the bags positive, 10-40 % positive instances in each;
    positives are shifted by ``shift`` along a fixed random direction. Instance labels are the truth."""
    direction = np.random.default_rng(12345).normal(size=dim)  # the same concept in every draw
    rng = np.random.default_rng(seed)
    direction /= np.linalg.norm(direction)
    rows = []
    for bag in range(n_bags):
        size = int(rng.integers(8, 20))
        positive = bag % 2 == 1
        n_pos = max(1, int(round(size * rng.uniform(0.1, 0.4)))) if positive else 0
        for i in range(size):
            label = 1 if i < n_pos else 0
            x = rng.normal(size=dim) + label * shift * direction
            rows.append(f"{label},b{bag:03d}," + ",".join(f"{v:.5f}" for v in x))
    path.write_text("\n".join(rows) + "\n")
    return path
