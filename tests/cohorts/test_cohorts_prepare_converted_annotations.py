"""An XML beside the GeoJSON converted from it is one annotation to prepare, as to find_annotation (bc009fb),
by the same rule (review AO, finding 10)."""

from __future__ import annotations

import re

import pytest
from prepare_trees import distinct_copy, gigadb_tree

from wsi_milssl.annotations import convert_annotations
from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.errors import ConfigError


def test_an_xml_and_the_geojson_converted_from_it_are_one_annotation(tmp_path, synth_slides):
    """find_annotation accepts them for one slide (bc009fb); prepare refused two files whose bytes differ."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    xml = root / "testing" / "lesion_annotations" / "Test_001.xml"
    geojson = convert_annotations(xml, root / "testing" / "qupath" / "test_001.geojson")
    result = prepare_camelyon16(root, tmp_path / "out")
    written = result.sets["test"].annotations_dir
    assert [p.name for p in written.iterdir()] == ["Test_001.xml"]  # the XML, as label would read it
    assert (written / "Test_001.xml").read_bytes() == xml.read_bytes()

    # a GeoJSON of other regions is still refused, naming both files
    fewer = tmp_path / "fewer.xml"  # the same file less its first lesion
    fewer.write_text(re.sub(r'<Annotation Name="[^"]*" Type="Polygon" PartOfGroup="_1".*?</Annotation>', "",
                            xml.read_text(), count=1, flags=re.S))
    geojson.write_text(convert_annotations(fewer, tmp_path / "fewer.geojson").read_text())
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, tmp_path / "out2")
    message = str(info.value)
    assert f"Test_001: annotation files that describe different regions: {xml} and {geojson}" in message
    assert "keep one" in message


def test_prepare_folder_takes_the_converted_geojson_too(tmp_path, synth_slides):
    root = tmp_path / "cohort"
    lines = ["slide,label"]
    for k, label in enumerate((0, 0, 1, 1)):
        distinct_copy(synth_slides["tumor" if label else "normal"], root / f"s{k}.tif")
        if label:
            xml = root / f"s{k}.xml"
            xml.write_bytes(synth_slides["tumor"].with_suffix(".xml").read_bytes())
            convert_annotations(xml, root / "geojson" / f"s{k}.geojson")
        lines.append(f"s{k},{label}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    result = prepare_folder(root, root / "labels.csv", tmp_path / "out", test_fraction=0.5)
    assert sum(len(s.annotations) for s in result.sets.values()) == 2
