"""Fixtures of the MIL tests: small generated patch stores (the MIL CSV fixtures are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def make_image_stores(out_dir: Path, *, fmt: str = "h5", n_bags: int = 4, n_patches: int = 48,
                      size_px: int = 32, seed: int = 0, pixels: str = "jpeg") -> tuple[list[Path], Path]:
    """Write one real patch store per bag through the store API, plus ``labels.csv``.

    Odd bags are positive with about a quarter tumour patches. Every patch is pink noise; a tumour
    patch also holds a few dark-purple 'nuclei' (small squares), a structural, not a global-colour cue.
    ``instance_label`` is written as the label stage would. Returns (store paths, labels.csv path).
    """
    from wsi_milssl.store import create_writer, encode_jpeg, write_arrays

    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, rows = [], ["slide,label"]
    side = int(np.ceil(np.sqrt(n_patches)))
    for bag in range(n_bags):
        stem = f"slide_{seed}_{bag:02d}"
        positive = bag % 2 == 1
        labels = np.zeros(n_patches, dtype=np.uint8)
        if positive:
            labels[rng.choice(n_patches, size=max(1, n_patches // 4), replace=False)] = 1
        imgs = np.empty((n_patches, size_px, size_px, 3), dtype=np.uint8)
        for i in range(n_patches):
            img = np.clip(rng.normal((225, 180, 200), 12, size=(size_px, size_px, 3)), 0, 255)
            for _ in range(4 if labels[i] else 0):
                y, x = rng.integers(0, size_px - 5, size=2)
                img[y:y + 5, x:x + 5] = (90, 40, 120)
            imgs[i] = img.astype(np.uint8)
        coords = np.stack([np.arange(n_patches) % side, np.arange(n_patches) // side], 1) * size_px * 4
        path = out_dir / f"{stem}.{fmt}"
        with create_writer(path, pixels=pixels, patch_size_px=size_px) as writer:
            payload = {"jpeg": [encode_jpeg(im, quality=95) for im in imgs], "raw": imgs, "none": None}[pixels]
            writer.append(coords=coords, entropy_bits=np.full(n_patches, 6.0), tissue_fraction=np.ones(n_patches),
                          patches=payload)
            writer.finalize({"slide_path": str(out_dir / f"{stem}.tif"), "slide_stem": stem, "mpp": 0.25,
                             "target_mpp": 1.0, "target_magnification": 10.0, "patch_size_px": size_px,
                             "patch_size_lv0": size_px * 4, "stride_px": size_px, "stride_lv0": size_px * 4,
                             "entropy_threshold_bits": 5.0, "pixels": pixels})
        write_arrays(path, {"instance_label": labels}, attrs={"slide_label": int(positive)})
        paths.append(path)
        rows.append(f"{stem},{int(positive)}")
    labels_csv = out_dir / "labels.csv"
    labels_csv.write_text("\n".join(rows) + "\n")
    return paths, labels_csv


@pytest.fixture(scope="session")
def image_store_factory():
    """The :func:`make_image_stores` helper, as a fixture (test modules cannot import conftest reliably)."""
    return make_image_stores
