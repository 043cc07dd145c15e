"""Fixtures of the feature-stage tests: the session's two generated slides tiled and labelled into
small stores (2 µm/px, 32 px patches: about 40-100 patches a slide)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from feature_fixtures import TILE
from wsi_milssl.config import LabelConfig


@pytest.fixture(scope="session")
def labelled_stores(tmp_path_factory, synth_dir) -> Path:
    """Stores of the session's synth slides (synth_000 tumour, synth_001 normal) with instance labels."""
    from wsi_milssl.labeling import label_stores
    from wsi_milssl.tiling import find_slides, tile_slides

    out = tmp_path_factory.mktemp("feature_stores")
    run = tile_slides(find_slides([synth_dir]), out, TILE)
    assert run.ok
    label_stores(out, annotations_dir=synth_dir, labels_csv=synth_dir / "labels.csv", config=LabelConfig(),
                 out_dir=out / "labels")
    return out


@pytest.fixture
def stores_copy(tmp_path, labelled_stores) -> Path:
    """A private copy of the labelled stores (tests that change them)."""
    dest = tmp_path / "stores"
    dest.mkdir()
    for p in labelled_stores.glob("*.h5"):
        shutil.copy2(p, dest / p.name)
    return dest
