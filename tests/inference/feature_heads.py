"""A tiny feature head and the feature files it is drawn over, for the `heatmap --features` tests of
coordinates and grid sizes: 6 x 6 patches of 256 px at 0.5 µm/px (512 level-0 px at 0.25 µm/px)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from wsi_milssl.cli import main
from wsi_milssl.features import write_feature_file

#: The head's training patches: 256 px at 0.5 µm/px = 512 level-0 px of 0.25 µm/px slides.
STEP = 512


def grid(step: int = STEP, n: int = 6) -> np.ndarray:
    """Level-0 top-left corners of an n x n patch grid of ``step`` px, row-major."""
    ys, xs = np.mgrid[0:n, 0:n]
    return np.stack([xs.ravel() * step, ys.ravel() * step], axis=1)


def features(seed: int = 0, n: int = 36) -> np.ndarray:
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n, 8)).astype(np.float32)
    feats[:6] += 3.0 * (seed % 2)
    return feats


def write_ours(path: Path, name: str, seed: int = 0) -> Path:
    """A feature file as `wsi-milssl features` writes it, of a 4096 px slide at 0.25 µm/px."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_feature_file(path, features=features(seed), coords=grid(),
                              attrs={"slide_stem": name, "slide_path": "", "mpp": 0.25,
                                     "dimensions_lv0": [4096, 4096], "encoder": "resnet18", "target_mpp": 0.5,
                                     "patch_size_px": 256},
                              coords_attrs={"patch_size": 256}, features_attrs={"encoder": "resnet18"})


def write_clam(path: Path, coords, coords_attrs: dict | None = None) -> Path:
    """A CLAM-style file: ``features`` and ``coords`` only, CLAM's optional ``coords`` attributes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as fh:
        fh.create_dataset("features", data=features(1, len(coords)))
        ds = fh.create_dataset("coords", data=np.asarray(coords, np.int32))
        for key, value in (coords_attrs or {}).items():
            ds.attrs[key] = value
    return path


def train_head(root: Path) -> Path:
    """Train a one-epoch head on four of our feature files under ``root``; returns its run folder."""
    names = [f"s{i}" for i in range(4)]
    for i, n in enumerate(names):
        write_ours(root / "train" / f"{n}.h5", n, seed=i)
    (root / "labels.csv").write_text("slide,label\n" + "".join(f"{n},{i % 2}\n" for i, n in enumerate(names)))
    assert main(["train", str(root / "train"), "--labels", str(root / "labels.csv"), "--out", str(root / "run"),
                 "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return root / "run"
