"""Non-maximum suppression and the exported files, read back with the evaluation stage's readers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tifffile

from wsi_milssl.errors import ConfigError
from wsi_milssl.evaluation.inputs import (
    find_predictions,
    read_detections,
    read_patch_probs,
    read_probs_sidecar,
    read_scores,
)
from wsi_milssl.inference.exports import (
    MEASUREMENT_NAME,
    nms_detections,
    update_scores_csv,
    write_detections_csv,
    write_patches_csv,
    write_patches_geojson,
    write_probs,
)


def _nms(grid, *, threshold=0.1, radius_um=100.0, stride_lv0=100, patch_size_lv0=100, mpp=0.5, origin=(0, 0)):
    return nms_detections(np.asarray(grid, np.float32), origin_lv0=origin, stride_lv0=stride_lv0,
                          patch_size_lv0=patch_size_lv0, mpp=mpp, threshold=threshold, radius_um=radius_um)


def test_nms_reports_maxima_at_patch_centres_and_suppresses_within_the_radius():
    grid = np.zeros((5, 7), np.float32)
    grid[1, 1], grid[1, 2], grid[2, 2] = 0.9, 0.8, 0.7   # one blob
    grid[4, 6] = 0.6                                      # a second, far away
    grid[0, 5] = np.nan
    # radius 100 µm at 0.5 µm/px = 200 lv0 px = 2 cells: the blob gives one detection
    p, x, y = _nms(grid, origin=(1000, 2000))
    np.testing.assert_allclose(p, [0.9, 0.6], rtol=1e-6)
    assert x.tolist() == [1000 + 1 * 100 + 50, 1000 + 6 * 100 + 50]
    assert y.tolist() == [2000 + 1 * 100 + 50, 2000 + 4 * 100 + 50]
    # a radius under one stride suppresses nothing: every cell above the threshold is reported
    p, _, _ = _nms(grid, radius_um=40.0)
    np.testing.assert_allclose(p, [0.9, 0.8, 0.7, 0.6], rtol=1e-6)
    # the diagonal neighbour at sqrt(2) cells is inside a 1.5-cell radius, (2, 2) -> (1, 1) too
    p, _, _ = _nms(grid, radius_um=75.0)
    np.testing.assert_allclose(p, [0.9, 0.6], rtol=1e-6)
    # the threshold stops the search
    p, _, _ = _nms(grid, threshold=0.65, radius_um=40.0)
    np.testing.assert_allclose(p, [0.9, 0.8, 0.7], rtol=1e-6)
    assert len(_nms(np.full((2, 2), np.nan))[0]) == 0


def test_nms_places_detections_on_the_pixel_holding_an_odd_patch_centre():
    grid = np.zeros((3, 3), np.float32)
    grid[1, 2] = 0.9
    p, x, y = _nms(grid, stride_lv0=2107, patch_size_lv0=2107, mpp=0.243, origin=(5, 7))
    assert x.dtype == np.int64 and y.dtype == np.int64
    # centre point 5 + 2 * 2107 + 1053.5 lies inside pixel 5 + 2 * 2107 + 1053
    assert (x[0], y[0]) == (5 + 2 * 2107 + 1053, 7 + 2107 + 1053)


def test_nms_radius_is_centre_to_centre_distance_in_micrometres():
    grid = np.zeros((1, 6), np.float32)
    grid[0, 0], grid[0, 3] = 0.9, 0.8  # centres 300 lv0 px = 150 µm apart at 0.5 µm/px
    assert len(_nms(grid, radius_um=150.0)[0]) == 1   # distance <= radius: suppressed
    assert len(_nms(grid, radius_um=149.0)[0]) == 2


def test_written_files_read_back_with_the_evaluation_readers(tmp_path):
    coords = np.array([[0, 0], [256, 0], [0, 256]], np.int64)
    probs = np.array([0.25, 0.5, 0.875], np.float32)
    grid = np.array([[0.25, 0.5], [0.875, np.nan]], np.float32)
    side = {"slide": "s1", "slide_path": "/x/s1.tif", "origin_lv0": [0, 0], "stride_lv0": 256,
            "patch_size_lv0": 256, "mpp": 0.25, "shape": [2, 2]}
    paths = write_probs(tmp_path, "s1", grid, side)
    np.testing.assert_array_equal(np.load(paths["probs_npy"]), grid)
    with tifffile.TiffFile(paths["probs_tif"]) as tif:
        np.testing.assert_array_equal(tif.asarray(), grid)
        assert json.loads(tif.pages[0].description)["stride_lv0"] == 256
    assert read_probs_sidecar(paths["probs_json"])["origin_lv0"] == [0, 0]
    write_patches_csv(tmp_path / "s1_patches.csv", coords, probs)
    got_coords, got_probs = read_patch_probs(tmp_path / "s1_patches.csv")
    np.testing.assert_array_equal(got_coords, coords)
    np.testing.assert_allclose(got_probs, probs, atol=1e-6)
    write_patches_geojson(tmp_path / "s1_patches.geojson", coords, probs, patch_size_lv0=256, slide="s1")
    fc = json.loads((tmp_path / "s1_patches.geojson").read_text())
    assert fc["type"] == "FeatureCollection" and len(fc["features"]) == 3
    f = fc["features"][2]
    assert f["properties"] == {"objectType": "detection", "measurements": {MEASUREMENT_NAME: 0.875}}
    assert f["geometry"]["coordinates"][0] == [[0, 256], [256, 256], [256, 512], [0, 512], [0, 256]]
    write_detections_csv(tmp_path / "s1_detections.csv", [0.875, 0.5], [128.0, 384], np.array([384, 128]))
    text = (tmp_path / "s1_detections.csv").read_text()
    assert text == "0.875000,128,384\n0.500000,384,128\n"  # CAMELYON16: prob,x,y, integers, no header
    dets = read_detections(tmp_path / "s1_detections.csv")
    assert dets.x_lv0.tolist() == [128.0, 384.0]
    with pytest.raises(ValueError, match="x_lv0 384.5 is not a whole level-0 pixel"):
        write_detections_csv(tmp_path / "s2_detections.csv", [0.5], [384.5], [128])
    assert not (tmp_path / "s2_detections.csv").exists()
    found = find_predictions(tmp_path)
    assert found["s1"].detections and found["s1"].patches and found["s1"].sidecar and found["s1"].probs_npy
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left


def test_scores_csv_is_updated_slide_by_slide(tmp_path):
    update_scores_csv(tmp_path, {"b": 0.5})
    update_scores_csv(tmp_path, {"a": 0.25, "b": 0.75})
    assert (tmp_path / "scores.csv").read_text() == "slide,score\na,0.250000\nb,0.750000\n"
    assert read_scores(tmp_path / "scores.csv") == {"a": 0.25, "b": 0.75}
    with pytest.raises(ValueError, match="not a finite number"):
        update_scores_csv(tmp_path, {"c": float("nan")})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "scores.csv").write_text("x,y\n1,2\n")
    with pytest.raises(ConfigError, match=r"scores.csv: not a scores file \(header must be 'slide,score'\)"):
        update_scores_csv(tmp_path / "other", {"a": 0.1})
