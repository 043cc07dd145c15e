"""A store labelled again (``label`` rewrites the store file with new instance labels and the annotation it was
labelled from) holds the patches it held: ``heatmap`` draws its slide's overlay again where the annotation
file changed, and does not predict it again (review AJ, finding 1: `run` after an edit of a test slide's
annotation file predicted that slide again, hours of GPU on CAMELYON16, although only its outline changed).
A store tiled again (its slide changed) is still predicted again, and a sidecar written before the store's
tiling was recorded is predicted once more rather than reused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.labeling import label_store
from wsi_milssl.store import open_store
from wsi_milssl.tiling import tile_slides

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=0)
# the checkpoints' tiling (conftest.make_checkpoint defaults), for stores the heatmap may read
TILE = dict(target_mpp=1.0, patch_size_px=32, entropy_threshold_bits=3.0, mask_mpp=8.0, pixels="raw")


@pytest.fixture
def slides(tmp_path, slide_writer) -> list[Path]:
    """Two different 2048-px slides (other tissue and tumour layouts), in this test's own folder."""
    folder = tmp_path / "slides"
    folder.mkdir()
    a = slide_writer(folder / "a.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=2048, height=2048, tissue_box=(0, 512, 2048, 1536),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return [a, b]




def _labels(store: Path) -> tuple[np.ndarray, str]:
    """The store's instance labels and the SHA-256 of the annotation it was labelled from."""
    with open_store(store) as s:
        return np.asarray(s.read_array("instance_label")), s.attrs["label_annotation_sha256"]


def test_a_relabelled_store_draws_again_and_a_retiled_one_predicts_again(tmp_path, slides, checkpoint_factory,
                                                                          predicted, outline_writer):
    ckpt, stores, ann, out = checkpoint_factory(), tmp_path / "stores", tmp_path / "ann", tmp_path / "hm"
    config = HeatmapConfig(**FAST)
    tile_slides(slides, stores, TileConfig(**TILE))
    store_a = stores / "a.h5"
    xml = outline_writer(ann, "a", (300, 300, 1500, 1500))
    label_store(store_a, annotation_path=xml)
    labels, sha = _labels(store_a)
    assert labels.any()
    assert make_heatmaps(slides, ckpt, out, config, stores=[stores], annotations_dir=ann).ok
    assert predicted == ["a", "b"]
    probs = (out / "a_probs.npy").read_bytes()

    # an edit that leaves the labels as they were (a comment): the store is rewritten all the same
    with open(xml, "a", encoding="utf-8") as fh:
        fh.write("<!-- checked -->\n")
    before = store_a.stat()
    label_store(store_a, annotation_path=xml)
    again, new_sha = _labels(store_a)
    np.testing.assert_array_equal(again, labels)
    assert new_sha != sha
    assert (store_a.stat().st_size, store_a.stat().st_mtime_ns) != (before.st_size, before.st_mtime_ns)
    predicted.clear()
    run = make_heatmaps(slides, ckpt, out, config, stores=[stores], annotations_dir=ann)
    assert run.ok and predicted == [] and run.redrawn == ("a",) and run.skipped == ("b",)
    assert (out / "a_probs.npy").read_bytes() == probs

    # an edit that changes the labels: drawn again (its outline), not predicted
    xml = outline_writer(ann, "a", (900, 900, 1700, 1700))
    label_store(store_a, annotation_path=xml)
    assert not np.array_equal(_labels(store_a)[0], labels)
    predicted.clear()
    run = make_heatmaps(slides, ckpt, out, config, stores=[stores], annotations_dir=ann)
    assert run.ok and predicted == [] and run.redrawn == ("a",) and run.skipped == ("b",)
    predicted.clear()  # nothing changed since: nothing to do
    run = make_heatmaps(slides, ckpt, out, config, stores=[stores], annotations_dir=ann)
    assert predicted == [] and run.redrawn == () and run.skipped == ("a", "b")

    # the slide changed, its store is tiled again: predicted again
    st = slides[0].stat()
    os.utime(slides[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert [r.status for r in tile_slides(slides, stores, TileConfig(**TILE)).results] == ["ok", "skipped"]
    predicted.clear()
    run = make_heatmaps(slides, ckpt, out, config, stores=[stores], annotations_dir=ann)
    assert run.ok and predicted == ["a"] and run.skipped == ("b",)


def test_a_sidecar_without_the_stores_tiling_is_not_reused_for_a_relabelled_store(tmp_path, slides,
                                                                                 checkpoint_factory, predicted,
                                                                                 outline_writer):
    """A folder written before the store's tiling was recorded (``input_files`` name the store by size and
    modification time only): the store unchanged is skipped, the store relabelled is predicted once more."""
    ckpt, stores, ann, out = checkpoint_factory(), tmp_path / "stores", tmp_path / "ann", tmp_path / "hm"
    config = HeatmapConfig(**FAST)
    tile_slides(slides, stores, TileConfig(**TILE))
    xml = outline_writer(ann, "a", (300, 300, 1500, 1500))
    assert make_heatmaps(slides, ckpt, out, config, stores=[stores]).ok
    for stem in ("a", "b"):  # as an earlier version wrote it
        path = out / f"{stem}_probs.json"
        sidecar = json.loads(path.read_text())
        sidecar["input_files"]["store"].pop("tiling", None)
        path.write_text(json.dumps(sidecar))
    predicted.clear()
    run = make_heatmaps(slides, ckpt, out, config, stores=[stores])
    assert predicted == [] and run.skipped == ("a", "b")

    label_store(stores / "a.h5", annotation_path=xml)
    predicted.clear()
    run = make_heatmaps(slides, ckpt, out, config, stores=[stores])
    assert run.ok and predicted == ["a"] and run.skipped == ("b",)
    assert json.loads((out / "a_probs.json").read_text())["input_files"]["store"]["tiling"]


def test_a_store_tiled_with_other_patch_settings_records_its_own_tiling(tmp_path, slides, checkpoint_factory,
                                                                       predicted):
    """Review CN: a slide read from a store tiled with another min_tissue recorded the model's tiling in its
    sidecar, so evaluate took it for the same run as the slides cut with the model's; it records the store's."""
    ckpt = checkpoint_factory()
    config = HeatmapConfig(**FAST)
    tile_slides(slides[:1], tmp_path / "same", TileConfig(**TILE))
    tile_slides(slides[:1], tmp_path / "other", TileConfig(**TILE, min_tissue=0.9))
    assert make_heatmaps(slides[:1], ckpt, tmp_path / "hm_same", config, stores=[tmp_path / "same"]).ok
    assert make_heatmaps(slides[:1], ckpt, tmp_path / "hm_other", config, stores=[tmp_path / "other"]).ok
    assert make_heatmaps(slides[:1], ckpt, tmp_path / "hm_slide", config).ok

    def plan(folder):
        return json.loads((tmp_path / folder / "a_probs.json").read_text())["tiling_plan"]

    assert plan("hm_same") == plan("hm_slide")  # the same recipe as the model's: one run with slides cut on the fly
    assert plan("hm_other") == {**plan("hm_slide"), "min_tissue": 0.9}


def test_the_checkpoint_is_recorded_by_its_absolute_path(tmp_path, slides, checkpoint_factory, predicted,
                                                         monkeypatch):
    """Review CN: given relative (as typed), the sidecar's checkpoint could not be found by an evaluate run from
    another folder, whose report then said nothing of the model's training."""
    ckpt = checkpoint_factory()
    monkeypatch.chdir(ckpt.parent)
    assert make_heatmaps(slides[:1], Path(ckpt.name), tmp_path / "hm", HeatmapConfig(**FAST)).ok
    assert json.loads((tmp_path / "hm" / "a_probs.json").read_text())["checkpoint"] == str(ckpt.absolute())
    assert json.loads((tmp_path / "hm" / "heatmap_config.json").read_text())["checkpoint"] == str(ckpt.absolute())
