"""Fuzzing the annotation readers (ASAP XML via defusedxml, GeoJSON) and the geometry built from them:
any bytes give annotations or an AnnotationError, never another exception, in bounded time and memory."""

from __future__ import annotations

import json
import time
import tracemalloc
from xml.sax.saxutils import quoteattr

import numpy as np
import pytest
from fuzzing import DEFAULT, LONG, NUMBERS, json_values, mutated
from hypothesis import given
from hypothesis import strategies as st

from wsi_milssl.annotations import rasterize_region, read_annotations, tumor_fraction
from wsi_milssl.errors import AnnotationError

SLIDE = (4096, 3072)
GROUPS = st.sampled_from(["_0", "_1", "_2", "Tumor", "Exclusion", "None", "Other", ""])
TYPES = st.sampled_from(["Polygon", "Spline", "Rectangle", "Dot", "PointSet", "Measurement", "Weird", ""])


def _exercise(path) -> None:
    """Read ``path`` and build everything the label and evaluate stages build from it."""
    try:
        aset = read_annotations(path, dimensions_lv0=SLIDE)
        region = aset.region
        aset.has_tumor
        aset.tumor_annotations()
    except AnnotationError:
        return
    coords = np.array([[0, 0], [1000, 1000], [2048, 1536], [4000, 3000]], np.int64)
    frac = tumor_fraction(region, coords, 256)
    assert frac.shape == (4,) and np.all((frac >= 0) & (frac <= 1))
    mask = rasterize_region(region, dimensions_lv0=SLIDE, downsample=64)
    assert mask.shape == (48, 64)


# -- GeoJSON ----------------------------------------------------------------------------------------

POSITION = st.one_of(st.lists(NUMBERS, min_size=2, max_size=3), st.lists(st.integers(-100, 5000), min_size=2, max_size=2),
                     json_values(4))
RING = st.one_of(st.lists(POSITION, max_size=12), json_values(6))


@st.composite
def geometries(draw, depth=0):
    gtype = draw(st.sampled_from(["Polygon", "MultiPolygon", "Point", "MultiPoint", "LineString", "MultiLineString",
                                  "GeometryCollection", "Unknown"]))
    if gtype == "GeometryCollection" and depth < 3:
        return {"type": gtype, "geometries": draw(st.lists(geometries(depth + 1), max_size=3))}
    coords = {
        "Polygon": st.lists(RING, max_size=3), "MultiPolygon": st.lists(st.lists(RING, max_size=2), max_size=3),
        "Point": POSITION, "MultiPoint": st.lists(POSITION, max_size=4), "LineString": st.lists(POSITION, max_size=4),
        "MultiLineString": st.lists(st.lists(POSITION, max_size=4), max_size=2),
    }.get(gtype, json_values(6))
    return {"type": gtype, "coordinates": draw(coords)}


@st.composite
def features(draw):
    props = draw(st.fixed_dictionaries({}, optional={
        "classification": st.one_of(st.fixed_dictionaries({"name": st.one_of(GROUPS, json_values(2))},
                                                          optional={"color": json_values(4),
                                                                    "colorRGB": json_values(1),
                                                                    "names": json_values(4)}),
                                    GROUPS, json_values(3)),
        "objectType": st.one_of(st.just("annotation"), st.just("detection"), json_values(1)),
        "name": st.one_of(st.text(max_size=8), json_values(1)),
        "color": json_values(4),
        "asapType": st.one_of(TYPES, json_values(1)),
    }))
    feature = {"type": draw(st.sampled_from(["Feature", "Feature", None, "Other"])),
               "geometry": draw(st.one_of(geometries(), st.none(), json_values(3))),
               "properties": draw(st.one_of(st.just(props), json_values(2)))}
    return feature


@st.composite
def geojson_bytes(draw) -> bytes:
    shape = draw(st.sampled_from(["collection", "array", "feature", "geometry", "value"]))
    if shape == "collection":
        doc = {"type": "FeatureCollection", "features": draw(st.lists(features(), max_size=5))}
        if draw(st.booleans()):
            doc["asapGroups"] = draw(st.lists(st.fixed_dictionaries({"name": st.one_of(GROUPS, json_values(1)),
                                                                     "color": json_values(1)}), max_size=3))
    elif shape == "array":
        doc = draw(st.lists(features(), max_size=4))
    elif shape == "feature":
        doc = draw(features())
    elif shape == "geometry":
        doc = draw(geometries())
    else:
        doc = draw(json_values())
    text = json.dumps(doc, allow_nan=True)
    data = text.encode("utf-8")
    if draw(st.booleans()):
        data = b"\xef\xbb\xbf" + data
    return draw(st.one_of(st.just(data), mutated(data)))


def _check_geojson(tmp_dir, data: bytes) -> None:
    path = tmp_dir / "fuzz.geojson"
    path.write_bytes(data)
    _exercise(path)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("annotation_fuzz")


@DEFAULT
@given(data=geojson_bytes())
def test_geojson_fuzz(fuzz_dir, data):
    _check_geojson(fuzz_dir, data)


@DEFAULT
@given(data=st.binary(max_size=2048))
def test_geojson_random_bytes(fuzz_dir, data):
    _check_geojson(fuzz_dir, data)


@pytest.mark.slow
@LONG
@given(data=st.one_of(geojson_bytes(), st.binary(max_size=4096)))
def test_geojson_fuzz_long(fuzz_dir, data):
    _check_geojson(fuzz_dir, data)


# -- ASAP XML ---------------------------------------------------------------------------------------

NUMBER_TEXT = st.one_of(NUMBERS.map(repr), st.floats(-1e4, 1e4).map(str), st.integers(-100, 5000).map(str),
                        st.sampled_from(["nan", "inf", "-Infinity", "1,5", "1,2,3", "", " 12 ", "0x10", "1e999"]),
                        st.text(max_size=6))


def _attr(name: str, value: str | None) -> str:
    return "" if value is None else f" {name}={quoteattr(value)}"


@st.composite
def asap_bytes(draw) -> bytes:
    annotations = []
    for k in range(draw(st.integers(0, 4))):
        coords = []
        for i in range(draw(st.integers(0, 8))):
            order = draw(st.one_of(st.just(str(i)), st.integers(-3, 20).map(str), st.text(max_size=3), st.none()))
            coords.append(f"<Coordinate{_attr('Order', order)}{_attr('X', draw(st.one_of(NUMBER_TEXT, st.none())))}"
                          f"{_attr('Y', draw(st.one_of(NUMBER_TEXT, st.none())))} />")
        attrs = (_attr("Name", draw(st.one_of(st.text(max_size=8), st.none())))
                 + _attr("Type", draw(st.one_of(TYPES, st.none())))
                 + _attr("PartOfGroup", draw(st.one_of(GROUPS, st.none())))
                 + _attr("Color", draw(st.one_of(st.just("#FF0000"), st.text(max_size=8), st.none()))))
        annotations.append(f"<Annotation{attrs}><Coordinates>{''.join(coords)}</Coordinates></Annotation>")
    groups = "".join(f"<Group{_attr('Name', draw(GROUPS))}{_attr('Color', draw(st.text(max_size=8)))} />"
                     for _ in range(draw(st.integers(0, 2))))
    root = draw(st.sampled_from(["ASAP_Annotations", "ASAP_Annotations", "Other"]))
    head = draw(st.sampled_from(["<?xml version='1.0' encoding='utf-8'?>", "", "<?xml version='1.0' encoding='latin-1'?>",
                                 "<!DOCTYPE x [<!ENTITY a 'b'>]>", "<?xml version='1.0' encoding='nonsense'?>"]))
    text = (f"{head}<{root}><Annotations>{''.join(annotations)}</Annotations>"
            f"<AnnotationGroups>{groups}</AnnotationGroups></{root}>")
    data = text.encode("utf-8")
    return draw(st.one_of(st.just(data), mutated(data)))


def _check_xml(tmp_dir, data: bytes) -> None:
    path = tmp_dir / "fuzz.xml"
    path.write_bytes(data)
    _exercise(path)


@DEFAULT
@given(data=asap_bytes())
def test_asap_xml_fuzz(fuzz_dir, data):
    _check_xml(fuzz_dir, data)


@DEFAULT
@given(data=st.binary(max_size=2048))
def test_asap_xml_random_bytes(fuzz_dir, data):
    _check_xml(fuzz_dir, data)


@pytest.mark.slow
@LONG
@given(data=st.one_of(asap_bytes(), st.binary(max_size=4096)))
def test_asap_xml_fuzz_long(fuzz_dir, data):
    _check_xml(fuzz_dir, data)


# -- bounded time and memory for hostile sizes -----------------------------------------------------

def _bounded(path, *, seconds: float, peak_bytes: int) -> None:
    """Read ``path`` (result or AnnotationError) within ``seconds`` of the process's CPU time and ``peak_bytes``
    of Python allocations. Two passes: tracemalloc slows the run by about 75 %, and the wall clock counts
    whatever else the machine runs (a loaded test machine failed 30 s limits at 44 and 51 s)."""
    t0 = time.process_time()
    _exercise(path)
    elapsed = time.process_time() - t0
    assert elapsed < seconds, f"{path.name}: {elapsed:.1f} s of CPU"
    tracemalloc.start()
    try:
        _exercise(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < peak_bytes, f"{path.name}: peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("kind", ["geojson-arrays", "geojson-objects", "xml-elements"])
def test_deep_nesting_is_refused_quickly(tmp_path, kind):
    depth = 200_000
    if kind == "geojson-arrays":
        path, text = tmp_path / "deep.geojson", "[" * depth + "]" * depth
    elif kind == "geojson-objects":
        path, text = tmp_path / "deep.geojson", '{"a":' * depth + "1" + "}" * depth
    else:
        path, text = tmp_path / "deep.xml", "<ASAP_Annotations>" + "<a>" * depth + "</a>" * depth + "</ASAP_Annotations>"
    path.write_text(text)
    _bounded(path, seconds=10, peak_bytes=400 << 20)


@pytest.mark.parametrize("fmt, n", [
    ("geojson", 20_000), ("xml", 20_000),
    pytest.param("geojson", 100_000, marks=pytest.mark.slow), pytest.param("xml", 100_000, marks=pytest.mark.slow),
    pytest.param("geojson", 1_000_000, marks=pytest.mark.slow), pytest.param("xml", 1_000_000, marks=pytest.mark.slow),
])
def test_huge_coordinate_lists_take_bounded_time_and_memory(tmp_path, fmt, n):
    """``n`` vertices of one self-intersecting tumour polygon (100,000: about 3 MB of text), read,
    repaired, clipped and used for patch fractions and a mask: 30 s of CPU and 1 GiB per 100,000."""
    t = np.linspace(0, 40 * np.pi, n, endpoint=False)
    xy = np.c_[2048 + 1500 * np.cos(t) * np.sin(3 * t), 1536 + 1200 * np.sin(t)]
    if fmt == "geojson":
        path = tmp_path / "huge.geojson"
        ring = np.vstack([xy, xy[:1]]).round(2).tolist()
        path.write_text(json.dumps({"type": "Feature", "properties": {"classification": {"name": "Tumor"}},
                                    "geometry": {"type": "Polygon", "coordinates": [ring]}}))
    else:
        path = tmp_path / "huge.xml"
        coords = "".join(f'<Coordinate Order="{i}" X="{x:.2f}" Y="{y:.2f}" />' for i, (x, y) in enumerate(xy))
        path.write_text(f'<ASAP_Annotations><Annotations><Annotation Name="a" Type="Polygon" PartOfGroup="_0">'
                        f"<Coordinates>{coords}</Coordinates></Annotation></Annotations></ASAP_Annotations>")
    _bounded(path, seconds=30 * n / 100_000, peak_bytes=(1 << 30) * n // 100_000)


# -- what the fuzzer found (regressions) ------------------------------------------------------------

@pytest.mark.parametrize("name, text, match", [
    ("enc.xml", "<?xml version='1.0' encoding='nonsense'?><ASAP_Annotations/>",
     r"enc\.xml: cannot decode the XML \(LookupError: unknown encoding: nonsense\)\. Fix: save the file as UTF-8"),
    ("bigint.geojson", '{"type": "MultiPoint", "coordinates": [[0, 0], [0, 1' + "0" * 400 + "]]}",
     r"bigint\.geojson: feature 0 \('Annotation 0'\): has a non-finite coordinate .*too large for float64"),
    ("digits.geojson", '{"type": "Point", "coordinates": [1' + "0" * 5000 + ", 2]}",
     r"digits\.geojson: invalid JSON \(Exceeds the limit .*Fix: re-export"),
    ("far.xml", '<ASAP_Annotations><Annotations><Annotation Name="t" Type="Polygon" PartOfGroup="_0"><Coordinates>'
                '<Coordinate Order="0" X="0" Y="0"/><Coordinate Order="1" X="1e300" Y="0"/>'
                '<Coordinate Order="2" X="0" Y="1e300"/></Coordinates></Annotation></Annotations></ASAP_Annotations>',
     r"far\.xml: polygon 't' has a vertex at 1e\+300 px, outside any slide .*Fix: check that its coordinates"),
])
def test_fuzz_findings_are_annotation_errors(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(AnnotationError, match=match):
        read_annotations(path, dimensions_lv0=SLIDE).region


def test_huge_coordinates_still_convert_losslessly(tmp_path):
    """The range check is the geometry's: readers keep every finite coordinate, so conversions stay exact."""
    path = tmp_path / "far.xml"
    path.write_text('<ASAP_Annotations><Annotations><Annotation Name="t" Type="Polygon" PartOfGroup="_0"><Coordinates>'
                    '<Coordinate Order="0" X="0" Y="0"/><Coordinate Order="1" X="1e300" Y="0"/>'
                    '<Coordinate Order="2" X="0" Y="1e15"/></Coordinates></Annotation></Annotations></ASAP_Annotations>')
    aset = read_annotations(path)
    assert aset.polygons[0].coords_lv0.max() == 1e300
