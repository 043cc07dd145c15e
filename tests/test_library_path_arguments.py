"""Review AX, B2 and C1: the stage functions called from Python with one path instead of a list. A str walked
through its characters (``tile_slides("s.tif")`` returned one failed "slide" per character and wrote their
status rows), a Path was "not iterable", and ``run_pipeline("pipeline.toml")`` raised AttributeError. One path
is now a list of one (:func:`wsi_milssl.paths.path_list`), and run_pipeline loads a TOML path itself."""

from __future__ import annotations

import pytest

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.config import TileConfig
from wsi_milssl.errors import SlideReadError
from wsi_milssl.mil import read_patch_stores
from wsi_milssl.paths import path_list
from wsi_milssl.pipeline import run_pipeline
from wsi_milssl.slide import SlideReader
from wsi_milssl.tiling import tile_slides

TILE = TileConfig(magnification=10.0, patch_size_px=64, min_tissue=0.5, workers=1)


def test_path_list_takes_one_path_or_many(tmp_path):
    assert path_list("a.tif") == ["a.tif"]
    assert path_list(tmp_path) == [tmp_path]
    assert path_list(p for p in ("a", "b")) == ["a", "b"]


def test_tile_slides_and_read_patch_stores_take_one_path(tmp_path, synth_slides):
    slide = synth_slides["tumor"]
    run = tile_slides(str(slide), tmp_path / "stores", TILE)
    assert [(r.slide, r.status) for r in run.results] == [(slide.stem, "ok")]
    bags = read_patch_stores(tmp_path / "stores", {slide.stem: 1})
    assert bags.bag_names == [slide.stem] and len(bags) == run.results[0].n_patches


def test_a_folder_given_as_a_slide_says_how_to_list_its_slides(tmp_path):
    (tmp_path / "slides").mkdir()
    with pytest.raises(SlideReadError, match=r"this is a folder, not a slide file\. Fix: give the slide files in it "
                                             r"\(the command line, and `wsi_milssl.tiling.find_slides`"):
        SlideReader(tmp_path / "slides")


def test_run_pipeline_takes_the_path_of_its_toml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative out_dir is taken from the folder the run starts in
    toml = tmp_path / "p.toml"
    toml.write_text('[pipeline]\nname = "lib"\nout_dir = "out"\n' + GENERATED_SLIDES)
    outcomes = run_pipeline(toml, until="synth")
    assert [(o.stage, o.status) for o in outcomes] == [("synth", "ran")]
    assert (tmp_path / "out" / "slides").is_dir()


def test_find_slides_and_the_feature_readers_take_one_path(tmp_path, synth_dir):
    """Review BA, B2: the single-path fix missed find_slides (which the README's Python recipe calls) and the
    feature-file readers."""
    import h5py
    import numpy as np

    from wsi_milssl.mil import read_feature_files
    from wsi_milssl.tiling import find_slides

    assert find_slides(str(synth_dir)) == find_slides([synth_dir]) and len(find_slides(synth_dir)) == 2
    with h5py.File(tmp_path / "bag_a.h5", "w") as fh:
        fh["features"] = np.ones((3, 4), np.float32)
    bags = read_feature_files(str(tmp_path / "bag_a.h5"), {"bag_a": 1})
    assert bags.bag_names == ["bag_a"] and len(bags) == 3


def test_run_pipeline_given_a_path_checks_the_data_paths_first(tmp_path):
    """Review BA, B3: run_pipeline(path) loaded the file without the command line's path check, so a missing
    [data] folder failed only after the stages before it had run."""
    from tinypipeline import FEATURE_BAGS, feature_bags

    from wsi_milssl.errors import ConfigError

    feature_bags(tmp_path / "bags" / "train", 8, seed=0)  # the test set's folder is missing
    toml = tmp_path / "f.toml"
    toml.write_text('[pipeline]\nname = "f"\n' + FEATURE_BAGS)
    with pytest.raises(ConfigError, match="test_features"):
        run_pipeline(toml)
    assert not (tmp_path / "f_out" / "model").exists()
