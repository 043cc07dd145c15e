"""The example files in annotations/ read as the README says."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_milssl.annotations import convert_annotations, read_annotations

EXAMPLES = Path(__file__).resolve().parents[2] / "annotations"


def test_examples_describe_the_documented_region(tmp_path):
    xml = read_annotations(EXAMPLES / "example.xml")
    geo = read_annotations(EXAMPLES / "example.geojson")
    triangle = 0.5 * abs((3800 - 3500.5) * (900.75 - 500.25) - (3600 - 3500.5) * (700 - 500.25))
    assert xml.region.area == pytest.approx(2000**2 - 500**2 + triangle)
    assert geo.region.area == pytest.approx(xml.region.area - 100**2)
    assert xml.region.difference(geo.region).area == pytest.approx(100**2)
    assert [p.group for p in geo.polygons] == ["Tumor", "Tumor", "Exclusion"]  # the detection is skipped
    # XML -> GeoJSON -> XML gives the same bytes
    back = convert_annotations(convert_annotations(EXAMPLES / "example.xml", tmp_path / "e.geojson"), tmp_path / "e.xml")
    assert back.read_bytes() == (EXAMPLES / "example.xml").read_bytes()
