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
    assert f["properties"] == {"objectType": "detection", "measurements": {MEASUREMENT_NAME: 0.875},
                               "classification": {"name": "Tumor", "color": [200, 0, 0]}}
    assert fc["features"][0]["properties"]["classification"] == {"name": "Normal", "color": [90, 160, 90]}
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
    update_scores_csv(tmp_path, {"c": 0.5, "b": 0.25}, keep_others=False)  # a's row is dropped
    assert (tmp_path / "scores.csv").read_text() == "slide,score\nb,0.250000\nc,0.500000\n"
    with pytest.raises(ValueError, match="not a finite number"):
        update_scores_csv(tmp_path, {"c": float("nan")})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "scores.csv").write_text("x,y\n1,2\n")
    with pytest.raises(ConfigError, match=r"scores.csv: not a scores file \(header must be 'slide,score'\)"):
        update_scores_csv(tmp_path / "other", {"a": 0.1})


# ------------------------------------------------------------------------------ viewer files

def test_lesion_polygons_are_contours_of_the_map_with_holes_and_separate_lesions():
    import shapely

    from wsi_milssl.inference.exports import lesion_polygons

    grid = np.full((9, 12), 0.1, np.float32)
    grid[1:6, 1:6] = 0.9      # a ring of positive cells around one negative cell: a lesion with a hole
    grid[3, 3] = 0.2
    grid[7, 10] = 0.8         # a lone positive cell far away
    grid[0, 11] = np.nan      # no patch counts as negative
    polys = lesion_polygons(grid, origin_lv0=(1000, 2000), stride_lv0=100, patch_size_lv0=100, threshold=0.5)
    assert len(polys) == 2
    big, lone = polys
    assert len(big.interiors) == 1 and big.is_valid
    centre = lambda r, c: shapely.Point(1000 + c * 100 + 50, 2000 + r * 100 + 50)  # noqa: E731
    assert all(big.contains(centre(r, c)) for r in range(1, 6) for c in range(1, 6) if (r, c) != (3, 3))
    assert not big.contains(centre(3, 3)) and not big.contains(centre(0, 0))
    assert lone.contains(centre(7, 10)) and not lone.contains(centre(7, 9))
    # 0.8 -> 0.1 crosses 0.5 at 3/7 of a stride: a diamond of that half-diagonal around the cell centre
    assert lone.area == pytest.approx(2 * (100 * 3 / 7) ** 2, rel=1e-6)
    assert lesion_polygons(np.full((3, 3), 0.4), origin_lv0=(0, 0), stride_lv0=10, patch_size_lv0=10,
                           threshold=0.5) == []


def test_a_lesion_at_the_edge_of_the_map_reaches_as_far_as_one_inside_it():
    """Review BO, C1: the map was padded with threshold - 1 (-0.5), so a lesion's outline at the map's edge stopped a
    third of a stride from the last cell centres (a sixth of a stride short); beyond the map counts as 0 now, as a
    cell without a patch does."""
    from wsi_milssl.inference.exports import lesion_polygons

    at_edge = lesion_polygons(np.ones((3, 3)), origin_lv0=(0, 0), stride_lv0=128, patch_size_lv0=128, threshold=0.5)
    inside = np.zeros((5, 5))
    inside[1:4, 1:4] = 1.0
    within = lesion_polygons(inside, origin_lv0=(-128, -128), stride_lv0=128, patch_size_lv0=128, threshold=0.5)
    assert at_edge[0].bounds == pytest.approx((0.0, 0.0, 384.0, 384.0))  # the patches cover [0, 384]²
    assert at_edge[0].bounds == pytest.approx(within[0].bounds)
    assert at_edge[0].area == pytest.approx(within[0].area)


def test_lesions_round_trip_through_the_annotation_readers(tmp_path):
    import shapely

    from wsi_milssl.annotations import read_annotations
    from wsi_milssl.inference.exports import lesion_polygons, write_lesions

    grid = np.zeros((6, 6), np.float32)
    grid[1:5, 1:5] = 0.95
    grid[2:4, 2:4] = 0.0
    polys = lesion_polygons(grid, origin_lv0=(0, 0), stride_lv0=64, patch_size_lv0=64, threshold=0.5)
    written = write_lesions(tmp_path / "s_lesions.geojson", tmp_path / "s_lesions.xml", polys, grid=grid,
                            origin_lv0=(0, 0), stride_lv0=64, patch_size_lv0=64, mpp=0.5)
    for path in written.values():
        region = read_annotations(path).region
        assert region.symmetric_difference(polys[0]).area < 1e-6 * polys[0].area, path
    fc = json.loads(written["lesions_geojson"].read_text())
    props = fc["features"][0]["properties"]
    assert props["classification"] == {"name": "Tumor", "color": [200, 0, 0]}
    assert props["name"] == f"Lesion 1 (max p 0.950, {polys[0].area * 0.25 / 1e6:.3f} mm2)"
    assert 'PartOfGroup="_2"' in written["lesions_xml"].read_text()  # ASAP holds the hole as a _2 polygon
    assert shapely.get_num_interior_rings(polys[0]) == 1


def test_ome_downsample_and_pyramid_levels(tmp_path):
    import tifffile

    from wsi_milssl.inference.exports import ome_downsample, write_probs_ome_tiff

    assert ome_downsample(2107) == 256      # 10x / 512 px on a 0.243 µm/px slide: 8.2 px per stride
    assert ome_downsample(128) == 16 and ome_downsample(12) == 1 and ome_downsample(2107, 3) == 3
    grid = np.full((4, 5), np.nan, np.float32)
    grid[0, 0], grid[3, 4] = 0.2, 0.9
    path = write_probs_ome_tiff(tmp_path / "s_probs.ome.tif", grid, origin_lv0=(0, 0), stride_lv0=200,
                                patch_size_lv0=200, mpp=0.5, dimensions_lv0=(1000, 801), downsample=1)
    with tifffile.TiffFile(path) as tif:
        levels = [lv.asarray() for lv in tif.series[0].levels]
    assert [lv.shape for lv in levels] == [(801, 1000), (401, 500), (201, 250)]
    assert levels[0][700, 900] == pytest.approx(0.9) and levels[0][10, 10] == pytest.approx(0.2)
    assert np.isnan(levels[0][10, 500]) and np.isnan(levels[0][800, 10])  # no patch / below the grid
    # reduced levels keep the maximum of each 2 x 2 block, so small positives stay visible
    assert np.nanmax(levels[2]) == pytest.approx(0.9)
