"""Review ES, A1 and A6: output files are named after a store's or feature file's own ``slide_stem`` attribute,
which was used unchecked: ``../../X`` or an absolute path wrote label masks, feature files and heatmaps outside
``--out`` (replacing files there), and two stores swapped by name were labelled with each other's annotations
(label matches annotations by the file name, train by the attribute). Now a stem that is a path is refused, and a
store's must be its file's name."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import StoreError
from wsi_milssl.features import read_feature_file, write_feature_file
from wsi_milssl.store import open_store


@pytest.mark.parametrize("stem", ["../../escaped", "/tmp/absolute", ".."])
def test_a_store_whose_slide_stem_is_a_path_is_refused_and_nothing_is_written_outside(stores_copy, tmp_path, stem,
                                                                                      synth_dir, capsys):
    store = stores_copy / "synth_000.h5"
    with h5py.File(store, "a") as fh:
        fh.attrs["slide_stem"] = stem
    with pytest.raises(StoreError, match=r"its slide_stem attribute .* cannot name output files: it is a path"):
        with open_store(store) as s:
            s.stem
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    out = tmp_path / "deep" / "labels"
    assert main(["label", str(stores_copy), "--annotations", str(synth_dir), "--labels",
                 str(synth_dir / "labels.csv"), "--out", str(out)]) != 0
    assert "cannot name output files" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before
    assert not list(tmp_path.glob("*escaped*")) and not list((tmp_path / "deep").glob("*escaped*"))


def test_stores_swapped_by_name_are_refused(stores_copy):
    a, b = stores_copy / "synth_000.h5", stores_copy / "synth_001.h5"
    a.rename(stores_copy / "tmp.h5")
    b.rename(a)
    (stores_copy / "tmp.h5").rename(b)
    with pytest.raises(StoreError) as err:
        with open_store(a) as s:
            s.stem
    assert "its slide_stem attribute says slide 'synth_001', but the store file is named for 'synth_000'" in \
        str(err.value) and "rename the store to synth_001.h5" in str(err.value)


def test_a_feature_file_whose_slide_stem_is_a_path_is_refused(tmp_path):
    coords = np.array([[0, 0], [256, 0]])
    path = write_feature_file(tmp_path / "f.h5", features=np.zeros((2, 4), np.float32), coords=coords,
                              attrs={"slide_stem": "../../escaped"}, coords_attrs={}, features_attrs={})
    with pytest.raises(StoreError, match=r"f\.h5: its slide_stem attribute '\.\./\.\./escaped' cannot name output "
                                         r"files: it is a path"):
        read_feature_file(path)


@pytest.mark.parametrize("kind", ["dangling link", "folder"])
def test_an_annotation_name_that_is_not_a_file_fails_the_slide_instead_of_labelling_it_normal(stores_copy, tmp_path,
                                                                                              synth_dir, kind):
    """Review ES, B1: a `<stem>.xml` that is a broken link or a folder was taken as no annotation, and the tumour
    slide's store was labelled again in place as normal, every patch negative."""
    import shutil

    from wsi_milssl.config import LabelConfig
    from wsi_milssl.labeling import label_stores

    ann = tmp_path / "ann"
    ann.mkdir()
    for p in synth_dir.glob("*.xml"):
        shutil.copy(p, ann / p.name)
    (ann / "synth_000.xml").unlink()
    if kind == "dangling link":
        (ann / "synth_000.xml").symlink_to(tmp_path / "moved" / "synth_000.xml")
    else:
        (ann / "synth_000.xml").mkdir()
    before = (stores_copy / "synth_000.h5").read_bytes()
    run = label_stores(stores_copy, annotations_dir=ann, labels_csv=synth_dir / "labels.csv", config=LabelConfig(),
                       out_dir=tmp_path / "labels")
    status = {r.stem: r for r in run.results}
    assert status["synth_000"].status == "failed" and status["synth_001"].status in ("ok", "mask")
    assert f"{ann / 'synth_000.xml'}: the annotation of slide 'synth_000' is " in status["synth_000"].error
    assert (stores_copy / "synth_000.h5").read_bytes() == before  # not labelled again as a normal slide


@pytest.mark.parametrize("name", ["case.svs", "B ", "Tumor 01 "])
def test_a_slide_whose_name_holds_a_suffix_or_ends_in_a_blank_tiles_and_labels(synth_slides, tmp_path, name):
    """Review EU, B1: a converted slide named ``case.svs.tif`` (stem ``case.svs``) or ``B .tif`` (stem ``B ``) was
    tiled, and its store then refused by label and heatmap: the name rule took the stem's own suffix or blank off."""
    import os
    import shutil

    from wsi_milssl.config import LabelConfig, TileConfig
    from wsi_milssl.labeling import label_stores
    from wsi_milssl.tiling import tile_slides

    slides, ann = tmp_path / "slides", tmp_path / "ann"
    slides.mkdir()
    ann.mkdir()
    slide = slides / f"{name}.tif"
    os.symlink(synth_slides["tumor"], slide)
    shutil.copy(synth_slides["tumor"].with_suffix(".xml"), ann / f"{name}.xml")
    (tmp_path / "labels.csv").write_text(f"slide,label\n{name},1\n")
    tiled = tile_slides([slide], tmp_path / "stores", TileConfig(magnification=5, patch_size_px=64))
    assert tiled.ok, tiled.results
    store = Path(tiled.results[0].store_path)
    assert store.name == f"{name}.h5"
    with open_store(store) as s:
        assert s.stem == name
    run = label_stores(tmp_path / "stores", annotations_dir=ann, labels_csv=tmp_path / "labels.csv",
                       config=LabelConfig(), out_dir=tmp_path / "labels")
    assert [r.status for r in run.results] == ["ok"], [r.error for r in run.results]
