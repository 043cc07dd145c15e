"""No half-patch or one-patch shift between the map, the overlay and the level-0 coordinates.

A slide whose only tumour is one grid cell's exact square; the oracle model is positive only for a
patch mostly covered by tumour, so a read half a patch off would find no positive patch and a read
one patch off would find it in the wrong cell. Every output must put the positive patch at that
square: the map cell, the sidecar's cell rule, the patch CSV, the GeoJSON square, the detection at
its centre and the coloured overlay pixels.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from wsi_milssl.config import HeatmapConfig, TileConfig
from wsi_milssl.evaluation.inputs import read_detections, read_patch_probs, read_probs_sidecar
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.inference.exports import MEASUREMENT_NAME
from wsi_milssl.inference.heatmap import PNG_TEXT_KEY
from wsi_milssl.slide import open_slide

MPP = 0.25  # the marker slides' level-0 µm/px

# (target_mpp, patch_size_px, stride_px, marked cell (row, col)); the slide is 0.25 µm/px.
GEOMETRIES = {
    "exact-level": (1.0, 32, None, (8, 10)),      # 128 lv0 px patches read at level 2 as they are
    "resized": (1.5, 32, None, (5, 7)),           # 192 lv0 px, read as 48 px at level 2, resized to 32
    "overlapping": (1.0, 32, 16, (16, 20)),       # 128 lv0 px patches every 64 lv0 px
    # 97 lv0 px: an odd side, as 10x / 512 px on a 0.243 µm/px CAMELYON16 slide (2107 px); the
    # patch centre is a half pixel, the detection must still be an integer pixel inside the square
    "odd-side": (0.7578125, 32, None, (8, 10)),
}


def challenge_read_csv(csvDIR):
    """``readCSVContent`` of the CAMELYON16 evaluation script (Evaluation_FROC.py), line for line."""
    Xcorr, Ycorr, Probs = ([] for i in range(3))
    csv_lines = open(csvDIR, "r").readlines()
    for i in range(len(csv_lines)):
        line = csv_lines[i]
        elems = line.rstrip().split(',')
        Probs.append(float(elems[0]))
        Xcorr.append(int(elems[1]))
        Ycorr.append(int(elems[2]))
    return Probs, Xcorr, Ycorr


def _expected(geometry):
    target_mpp, patch_px, stride_px, (r0, c0) = geometry
    ds = target_mpp / 0.25
    patch_lv0 = int(round(patch_px * ds))
    stride_lv0 = int(round((stride_px or patch_px) * ds))
    return patch_lv0, stride_lv0, c0 * stride_lv0, r0 * stride_lv0


def _run(tmp_path, marker_slide_factory, checkpoint_factory, geometry, *, source="slide", workers=1):
    target_mpp, patch_px, stride_px, _ = geometry
    patch_lv0, stride_lv0, x, y = _expected(geometry)
    slide = marker_slide_factory(x, y, patch_lv0)
    ckpt = checkpoint_factory(target_mpp=target_mpp, patch_size_px=patch_px, stride_px=stride_px)
    stores = None
    if source == "store":
        from wsi_milssl.tiling import tile_slide

        tile_slide(slide, tmp_path / "stores", TileConfig(target_mpp=target_mpp, patch_size_px=patch_px,
                                                          stride_px=stride_px, entropy_threshold_bits=3.0,
                                                          pixels="raw"))
        stores = [tmp_path / "stores"]
    config = HeatmapConfig(num_workers=workers, batch_size=48, thumbnail_px=512, alpha=1.0, overlay_threshold=0.5,
                           ome_downsample=4)
    run = make_heatmaps([slide], ckpt, tmp_path / "hm", config, stores=stores)
    assert run.ok, run.results
    return slide, tmp_path / "hm", (patch_lv0, stride_lv0, x, y)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_one_positive_patch_lands_on_its_square_in_every_output(tmp_path, marker_slide_factory, checkpoint_factory,
                                                                name):
    geometry = GEOMETRIES[name]
    r0, c0 = geometry[3]
    slide, out, (patch_lv0, stride_lv0, x, y) = _run(tmp_path, marker_slide_factory, checkpoint_factory, geometry)
    stem = slide.stem

    # 1. the map: exactly one cell is positive, the marked one; its neighbours were read and are negative
    grid = np.load(out / f"{stem}_probs.npy")
    assert grid.dtype == np.float32
    positive = np.argwhere(np.nan_to_num(grid, nan=0.0) >= 0.5)
    assert positive.tolist() == [[r0, c0]]
    assert grid[r0, c0] > 0.99
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        assert np.isfinite(grid[r0 + dr, c0 + dc]) and grid[r0 + dr, c0 + dc] < 0.1

    # 2. the sidecar's cell rule maps that cell back to the marked square
    side = read_probs_sidecar(out / f"{stem}_probs.json")
    assert side["shape"] == list(grid.shape)
    assert (side["stride_lv0"], side["patch_size_lv0"]) == (stride_lv0, patch_lv0)
    ox, oy = side["origin_lv0"]
    assert (ox + c0 * side["stride_lv0"], oy + r0 * side["stride_lv0"]) == (x, y)

    # 3. patch table: one positive row, at the square's top-left
    coords, probs = read_patch_probs(out / f"{stem}_patches.csv")
    assert coords[probs >= 0.5].tolist() == [[x, y]]
    assert len(coords) == int(np.isfinite(grid).sum())

    # 4. GeoJSON: one detection with a high measurement, whose polygon is the square
    features = json.loads((out / f"{stem}_patches.geojson").read_text())["features"]
    assert len(features) == len(coords)
    hot = [f for f in features if f["properties"]["measurements"][MEASUREMENT_NAME] >= 0.5]
    assert len(hot) == 1 and hot[0]["properties"]["objectType"] == "detection"
    assert hot[0]["properties"]["classification"] == {"name": "Tumor", "color": [200, 0, 0]}
    assert {f["properties"]["classification"]["name"] for f in features if f is not hot[0]} == {"Normal"}
    ring = hot[0]["geometry"]["coordinates"][0]
    assert ring == [[x, y], [x + patch_lv0, y], [x + patch_lv0, y + patch_lv0], [x, y + patch_lv0], [x, y]]

    # 5. detections: the strongest is at the pixel holding the square's centre, and the challenge's own
    #    reader (int(x), int(y)) parses every line
    dets = read_detections(out / f"{stem}_detections.csv")
    assert dets.probs[0] > 0.99
    assert (dets.x_lv0[0], dets.y_lv0[0]) == (x + patch_lv0 // 2, y + patch_lv0 // 2)
    assert (dets.probs[1:] < 0.5).all()
    probs_c, xs_c, ys_c = challenge_read_csv(out / f"{stem}_detections.csv")
    assert len(probs_c) == len(dets) >= 1
    assert (xs_c[0], ys_c[0]) == (x + patch_lv0 // 2, y + patch_lv0 // 2)
    assert x <= xs_c[0] < x + patch_lv0 and y <= ys_c[0] < y + patch_lv0
    assert (xs_c, ys_c) == (dets.x_lv0.astype(int).tolist(), dets.y_lv0.astype(int).tolist())

    # 6. overlay: exactly the thumbnail pixels whose centres lie in the cell's part of the slide changed
    png = Image.open(out / f"{stem}_heatmap.png")
    meta = json.loads(png.text[PNG_TEXT_KEY])
    th, tw = meta["thumbnail_hw"]
    with open_slide(slide) as s:
        thumb, _ = s.thumbnail(max_size_px=512)
        w0, h0 = s.dimensions
    assert thumb.shape[:2] == (th, tw)
    dx, dy = w0 / tw, h0 / th
    assert meta["downsample_xy"] == pytest.approx([dx, dy])
    image = np.asarray(png.convert("RGB"))
    assert image.shape[1] > tw  # the colour bar is appended on the right
    assert image.shape[0] > th  # the title and scale bar sit in a band below the thumbnail
    changed = (image[:th, :tw] != thumb).any(axis=2)
    # With overlapping patches each pixel shows the patch whose centre is nearest: the central
    # stride x stride part of the marked patch.
    lo = (patch_lv0 - stride_lv0) / 2
    cx = (np.arange(tw) + 0.5) * dx
    cy = (np.arange(th) + 0.5) * dy
    in_x = (cx >= x + lo) & (cx < x + lo + stride_lv0)
    in_y = (cy >= y + lo) & (cy < y + lo + stride_lv0)
    expected = in_y[:, None] & in_x[None, :]
    assert expected.sum() >= 4
    np.testing.assert_array_equal(changed, expected)

    # 7. OME-TIFF: a pyramid with physical pixel sizes and schema-valid OME-XML, whose level 0 lies on
    #    the slide: mapped through the physical pixel size, exactly the marked part is positive
    import ome_types
    import tifffile

    with tifffile.TiffFile(out / f"{stem}_probs.ome.tif") as tif:
        assert tif.is_ome
        levels = tif.series[0].levels
        level0 = levels[0].asarray()
        shapes = [lv.shape for lv in levels]
        xml = tif.ome_metadata
        tags = tif.pages[0].tags
        assert tif.pages[0].is_tiled
        x_res = tags["XResolution"].value
    ome_types.validate_xml(xml)
    pixels = ome_types.from_xml(xml).images[0].pixels
    d = side["ome_downsample"]
    assert d == 4 and pixels.physical_size_x == pytest.approx(MPP * d) == pixels.physical_size_y
    assert pixels.physical_size_x_unit.value == "µm"
    assert x_res[0] / x_res[1] == pytest.approx(1e4 / (MPP * d))  # pixels per cm in the TIFF tags too
    assert shapes[0] == (-(-h0 // d), -(-w0 // d)) == (pixels.size_y, pixels.size_x)
    assert len(shapes) >= 2 and all(b == (-(-a[0] // 2), -(-a[1] // 2)) for a, b in zip(shapes, shapes[1:]))
    assert level0.dtype == np.float32
    lv0_per_px = pixels.physical_size_x / MPP
    ocx = (np.arange(level0.shape[1]) + 0.5) * lv0_per_px
    ocy = (np.arange(level0.shape[0]) + 0.5) * lv0_per_px
    expected_ome = ((ocy >= y + lo) & (ocy < y + lo + stride_lv0))[:, None] & \
        ((ocx >= x + lo) & (ocx < x + lo + stride_lv0))[None, :]
    np.testing.assert_array_equal(np.nan_to_num(level0) >= 0.5, expected_ome)
    centre = (int((y + patch_lv0 / 2) // lv0_per_px), int((x + patch_lv0 / 2) // lv0_per_px))
    assert level0[centre] == pytest.approx(grid[r0, c0])

    # 8. predicted lesions: one polygon around the marked cell, in QuPath GeoJSON and ASAP XML alike
    import shapely

    from wsi_milssl.annotations import read_annotations

    for suffix in ("_lesions.xml", "_lesions.geojson"):
        region = read_annotations(out / f"{stem}{suffix}").region
        assert len(shapely.get_parts(region)) == 1
        assert region.contains(shapely.Point(x + patch_lv0 / 2, y + patch_lv0 / 2))
        x0, y0, x1, y1 = region.bounds
        assert x - stride_lv0 < x0 and x1 < x + patch_lv0 + stride_lv0 and y - stride_lv0 < y0
    lesion = json.loads((out / f"{stem}_lesions.geojson").read_text())["features"][0]["properties"]
    assert lesion["classification"] == {"name": "Tumor", "color": [200, 0, 0]}
    assert lesion["objectType"] == "annotation" and lesion["name"].startswith("Lesion 1 (max p ")
    assert float(lesion["name"].split("max p ")[1].split(",")[0]) == pytest.approx(grid[r0, c0], abs=5e-4)


def test_store_input_gives_the_same_cell(tmp_path, marker_slide_factory, checkpoint_factory):
    geometry = GEOMETRIES["exact-level"]
    r0, c0 = geometry[3]
    slide, out, (patch_lv0, _, x, y) = _run(tmp_path, marker_slide_factory, checkpoint_factory, geometry,
                                            source="store")
    grid = np.load(out / f"{slide.stem}_probs.npy")
    assert np.argwhere(np.nan_to_num(grid) >= 0.5).tolist() == [[r0, c0]]
    coords, probs = read_patch_probs(out / f"{slide.stem}_patches.csv")
    assert coords[probs >= 0.5].tolist() == [[x, y]]
    side = json.loads((out / f"{slide.stem}_probs.json").read_text())
    assert side["source"] == "store"
