"""Exact tumour fractions, masks, repair and clipping, checked against independent computations.

The independent reference never touches shapely or our readers: vertices come from the XML through
the standard library, inside/outside from matplotlib's point-in-polygon on a sample grid that is
dense (128 x 128 per patch) wherever an outline crosses the patch.
"""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import shapely
from matplotlib.path import Path as MplPath
from matplotlib.transforms import Bbox

from wsi_milssl.annotations import (
    AnnotationSet,
    PolygonAnnotation,
    rasterize_region,
    read_annotations,
    subdivide,
    tumor_fraction,
    write_asap_xml,
)

SLIDE_PX = 4096


def _xml_polygons(path):
    """{group: [float (K, 2) vertices]} read with the standard library only."""
    out: dict[str, list[np.ndarray]] = {}
    for el in ET.parse(path).getroot().iter("Annotation"):
        xy = np.array([[float(c.get("X")), float(c.get("Y"))] for c in el.iter("Coordinate")])
        out.setdefault(el.get("PartOfGroup"), []).append(xy)
    return out


def _closed_path(vertices) -> MplPath:
    """A matplotlib path of the polygon's outline, closing segment included."""
    v = np.asarray(vertices, dtype=np.float64)
    return MplPath(np.vstack([v, v[:1]]), closed=True)


def _near(path: MplPath, coords, size) -> np.ndarray:
    """int64 indices of the patches whose square meets the bounding box of ``path``."""
    (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
    return np.flatnonzero((coords[:, 0] <= x1) & (coords[:, 0] + size >= x0)
                          & (coords[:, 1] <= y1) & (coords[:, 1] + size >= y0))


def _sampled_fraction(polys_by_group, coords, size, samples):
    """Fraction of sample points (samples x samples per patch, at sub-cell centres) inside
    (any tumour polygon) and outside (every _2 polygon). Points are tested only against the
    polygons whose bounding box meets their patch (outside it they are outside the polygon)."""
    offs = (np.arange(samples) + 0.5) * size / samples
    ox, oy = np.meshgrid(offs, offs)
    sub = np.c_[ox.ravel(), oy.ravel()]
    inside = np.zeros((len(coords), len(sub)), bool)
    layers = [(g == "_2", p) for g in ("_0", "_1", "_2") for p in polys_by_group.get(g, [])]
    for is_hole, vertices in layers:  # every tumour polygon first, then the holes
        path = _closed_path(vertices)
        sel = _near(path, coords, size)
        if len(sel) == 0:
            continue
        hit = path.contains_points((coords[sel][:, None, :] + sub[None]).reshape(-1, 2)).reshape(len(sel), -1)
        if is_hole:
            inside[sel] &= ~hit
        else:
            inside[sel] |= hit
    return inside.mean(axis=1)


def _boundary_patches(polys_by_group, coords, size) -> np.ndarray:
    """bool (N,): some polygon's outline passes through the patch square (matplotlib, exact). Inside
    every other patch the inside/outside state is constant, so any sample of it is exact."""
    out = np.zeros(len(coords), bool)
    for vertices in (p for ps in polys_by_group.values() for p in ps):
        path = _closed_path(vertices)
        for i in _near(path, coords, size):
            if not out[i]:
                box = Bbox.from_extents(coords[i, 0], coords[i, 1], coords[i, 0] + size, coords[i, 1] + size)
                out[i] = path.intersects_bbox(box, filled=False)
    return out


def _reference_fraction(polys_by_group, coords, size, *, computed, coarse=32, fine=128):
    """An independent rasterised tumour fraction per patch: ``coarse`` x ``coarse`` samples per patch
    everywhere, then ``fine`` x ``fine`` samples where the patch is a boundary patch: an outline
    crosses it, or the coarse reference or the ``computed`` fraction is strictly between 0 and 1.
    (A 128 x 128 midpoint sampling errs by well under 0.01 on these smooth outlines; 256 x 256 agrees
    with it to about 1e-3.)"""
    coords = np.asarray(coords)
    ref = _sampled_fraction(polys_by_group, coords, size, coarse)
    refine = np.flatnonzero(_boundary_patches(polys_by_group, coords, size)
                            | ((ref > 0) & (ref < 1)) | ((computed > 0) & (computed < 1)))
    ref[refine] = _sampled_fraction(polys_by_group, coords[refine], size, fine)
    return ref


@pytest.fixture(scope="module")
def holed_xml(synth_slides, tmp_path_factory):
    """The fixture's tumour annotation plus a `_2` hole: the macro lesion shrunk to 35 % about its centre."""
    src = synth_slides["tumor"].with_suffix(".xml")
    groups = _xml_polygons(src)
    macro = groups["_0"][0]
    centre = macro.mean(axis=0)
    hole = centre + 0.35 * (macro - centre)
    if not shapely.Polygon(macro).contains(shapely.Polygon(hole)):
        pytest.fail("test setup: the shrunk hole is not inside the macro lesion")
    anns = [PolygonAnnotation(f"Annotation {k}", g, p) for k, (g, ps) in enumerate(groups.items()) for p in ps]
    anns.append(PolygonAnnotation("hole", "_2", hole))
    return write_asap_xml(anns, tmp_path_factory.mktemp("holed") / src.name)


def _grid(size, stride):
    xs, ys = np.meshgrid(np.arange(0, SLIDE_PX - size + 1, stride), np.arange(0, SLIDE_PX - size + 1, stride))
    return np.c_[xs.ravel(), ys.ravel()].astype(np.int64)


@pytest.mark.parametrize("size,stride", [(128, 128), (200, 96)])
def test_fractions_match_independent_raster(holed_xml, size, stride):
    coords = _grid(size, stride)
    aset = read_annotations(holed_xml, dimensions_lv0=(SLIDE_PX, SLIDE_PX))
    got = tumor_fraction(aset.region, coords, size)
    ref = _reference_fraction(_xml_polygons(holed_xml), coords, size, computed=got)
    assert got.dtype == np.float32 and got.shape == (len(coords),)
    assert (ref > 0).sum() > 20 and (ref == 1).sum() > 5  # the slide really has tumour on this grid
    assert np.abs(got - ref).max() < 0.01


def test_patches_inside_hole_have_zero_fraction(holed_xml):
    coords = _grid(64, 32)
    hole = shapely.Polygon(_xml_polygons(holed_xml)["_2"][-1])
    boxes = shapely.box(coords[:, 0], coords[:, 1], coords[:, 0] + 64, coords[:, 1] + 64)
    in_hole = shapely.within(boxes, hole)
    assert in_hole.sum() >= 4
    got = tumor_fraction(read_annotations(holed_xml).region, coords, 64)
    assert np.all(got[in_hole] == 0)
    # and the ring of tumour around the hole is there: patches touching the hole's outside are positive
    assert got[~in_hole].max() == 1.0


def test_random_overlapping_polygons_exact_area():
    rng = np.random.default_rng(1)
    anns = []
    for k in range(30):
        c = rng.uniform(200, 1800, 2)
        ang = np.sort(rng.uniform(0, 2 * np.pi, 40))
        r = rng.uniform(50, 300) * rng.uniform(0.6, 1.0, 40)
        anns.append(PolygonAnnotation(f"a{k}", "_0" if k % 5 else "_2", c + np.c_[r * np.cos(ang), r * np.sin(ang)]))
    aset = AnnotationSet(anns)
    coords = rng.uniform(0, 1900, (3000, 2)).round().astype(np.int64)
    got = tumor_fraction(aset.region, coords, 100)
    # exact: per-box shapely intersection with the whole region (no subdivision, no tree)
    boxes = shapely.box(coords[:, 0], coords[:, 1], coords[:, 0] + 100, coords[:, 1] + 100)
    exact = shapely.area(shapely.intersection(aset.region, boxes)) / 100**2
    np.testing.assert_allclose(got, exact, atol=1e-6)
    assert (got > 0).sum() > 100


def test_subdivide_keeps_area_and_bounds_vertices():
    ang = np.linspace(0, 2 * np.pi, 5000, endpoint=False)
    r = 1000 * (1 + 0.2 * np.sin(7 * ang))
    poly = shapely.Polygon(np.c_[r * np.cos(ang), r * np.sin(ang)]).difference(shapely.box(-100, -100, 100, 100))
    pieces = subdivide(poly, max_vertices=64)
    assert len(pieces) > 50
    assert shapely.get_num_coordinates(pieces).max() <= 64
    assert shapely.area(pieces).sum() == pytest.approx(poly.area, rel=1e-9)


def test_tumor_fraction_edge_cases():
    square = shapely.box(0, 0, 100, 100)
    assert tumor_fraction(None, np.zeros((3, 2)), 10).tolist() == [0, 0, 0]
    assert tumor_fraction(square, np.zeros((0, 2)), 10).shape == (0,)
    np.testing.assert_allclose(tumor_fraction(square, [[0, 0], [95, 95], [50, -5], [200, 200]], 10),
                               [1.0, 0.25, 0.5, 0.0])
    with pytest.raises(ValueError, match=r"coords_lv0 must have shape \(N, 2\)"):
        tumor_fraction(square, np.zeros(4), 10)
    with pytest.raises(ValueError, match="patch_size_lv0 must be a positive number"):
        tumor_fraction(square, np.zeros((1, 2)), 0)


def test_rasterize_region_matches_pixel_centres():
    rng = np.random.default_rng(2)
    polys = []
    for _ in range(12):
        c = rng.uniform(300, 3700, 2)
        ang = np.sort(rng.uniform(0, 2 * np.pi, 30))
        r = rng.uniform(60, 500) * rng.uniform(0.5, 1.0, 30)
        polys.append(shapely.Polygon(c + np.c_[r * np.cos(ang), r * np.sin(ang)]).buffer(0))
    region = shapely.union_all(polys).difference(shapely.Point(2000, 2000).buffer(400))
    dims = (4000, 3000)  # region leaves the slide at the bottom: rows beyond H are cut
    mask = rasterize_region(region, dimensions_lv0=dims, downsample=32)
    assert mask.shape == (94, 125)  # ceil(3000/32), ceil(4000/32)
    jj, ii = np.meshgrid(np.arange(mask.shape[1]), np.arange(mask.shape[0]))
    ref = shapely.contains_xy(region, (jj + 0.5) * 32, (ii + 0.5) * 32)
    assert mask.sum() > 500
    assert (mask != ref).sum() <= 2  # only centres lying exactly on an edge may differ
    assert not rasterize_region(None, dimensions_lv0=dims).any()


def test_invalid_polygons_are_repaired(caplog):
    bowtie = np.array([[0, 0], [100, 100], [100, 0], [0, 100]], float)  # self-intersecting
    dup = np.array([[200, 0], [300, 0], [300, 0], [300, 100], [200, 100]], float)
    aset = AnnotationSet([PolygonAnnotation("bow", "_0", bowtie), PolygonAnnotation("dup", "_1", dup)])
    with caplog.at_level(logging.WARNING):
        region = aset.region
    assert region.is_valid
    assert region.area == pytest.approx(2 * 2500 + 10_000)
    assert "repaired 1 invalid polygon(s)" in caplog.text and "bow" in caplog.text


def test_parts_outside_the_slide_are_clipped_with_warning(caplog):
    anns = [
        PolygonAnnotation("edge", "_0", np.array([[-50, -50], [50, -50], [50, 50], [-50, 50]], float)),
        PolygonAnnotation("far", "_0", np.array([[5000, 5000], [5100, 5000], [5100, 5100]], float)),
    ]
    with caplog.at_level(logging.WARNING):
        aset = AnnotationSet(anns).with_dimensions((1000, 1000))
        assert aset.region.area == pytest.approx(2500)
    assert "1 polygon(s) extend beyond the slide (1000 x 1000 px at level 0) and were clipped" in caplog.text
    assert "lying entirely outside the slide" in caplog.text and "far" in caplog.text
    assert AnnotationSet(anns).region.area == pytest.approx(10_000 + 5000)  # no clipping without a size
