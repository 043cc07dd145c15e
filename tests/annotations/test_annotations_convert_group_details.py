"""``annotations convert`` keeps a group's parent group and attributes (review AN, finding 3):
XML -> GeoJSON -> XML dropped ``PartOfGroup`` of a ``<Group>`` (written as None) and the elements of its
``<Attributes>``, while the help says the round trip gives the same file."""

from __future__ import annotations

import json
import re

import pytest

from wsi_milssl.annotations import convert_annotations, read_annotations, read_asap_xml
from wsi_milssl.cli import main
from wsi_milssl.errors import AnnotationError

NESTED = """<?xml version="1.0"?>
<ASAP_Annotations>
	<Annotations>
		<Annotation Name="Annotation 0" Type="Polygon" PartOfGroup="_0" Color="#F4FA58">
			<Coordinates>
				<Coordinate Order="0" X="100" Y="100" />
				<Coordinate Order="1" X="900" Y="100" />
				<Coordinate Order="2" X="900" Y="900" />
			</Coordinates>
		</Annotation>
	</Annotations>
	<AnnotationGroups>
		<Group Name="metastases" PartOfGroup="None" Color="#FF0000">
			<Attributes><Attribute stage="pN1" /><Note>a &amp; b &lt;c&gt;</Note></Attributes>
		</Group>
		<Group Name="_0" PartOfGroup="metastases" Color="#FF0000">
			<Attributes />
		</Group>
	</AnnotationGroups>
</ASAP_Annotations>
"""

EXPECTED = {"metastases": {"attributes": [{"tag": "Attribute", "attributes": {"stage": "pN1"}},
                                          {"tag": "Note", "attributes": {}, "text": "a & b <c>"}]},
            "_0": {"parent": "metastases"}}


def _details(path):
    details: dict = {}
    read_asap_xml(path, group_details=details)
    return details


def test_xml_to_geojson_to_xml_keeps_parent_groups_and_attributes(tmp_path):
    (tmp_path / "nested.xml").write_text(NESTED)
    assert main(["annotations", "convert", str(tmp_path / "nested.xml"), str(tmp_path / "nested.geojson")]) == 0
    assert main(["annotations", "convert", str(tmp_path / "nested.geojson"), str(tmp_path / "back.xml")]) == 0
    assert _details(tmp_path / "nested.xml") == EXPECTED
    assert _details(tmp_path / "back.xml") == EXPECTED
    assert read_annotations(tmp_path / "back.xml").groups == read_annotations(tmp_path / "nested.xml").groups
    groups = json.loads((tmp_path / "nested.geojson").read_text())["asapGroups"]
    assert groups[1] == {"name": "_0", "color": "#FF0000", "partOfGroup": "metastases"}
    # a file this package wrote comes back byte for byte
    convert_annotations(tmp_path / "back.xml", tmp_path / "again.geojson")
    convert_annotations(tmp_path / "again.geojson", tmp_path / "again.xml")
    assert (tmp_path / "again.xml").read_bytes() == (tmp_path / "back.xml").read_bytes()
    assert (tmp_path / "again.geojson").read_bytes() == (tmp_path / "nested.geojson").read_bytes()


@pytest.mark.parametrize("entry, what", [
    ({"name": "g", "partOfGroup": 3}, "its parent group must be a name"),
    ({"name": "g", "attributes": {"stage": "pN1"}}, "its attributes must be a list of elements"),
    ({"name": "g", "attributes": [{"tag": "bad tag"}]}, "attribute element .* is not"),
    ({"name": "g", "attributes": [{"tag": "A", "attributes": {"k": 1}}]}, "attribute element .* is not"),
])
def test_malformed_group_details_in_geojson_are_one_error_naming_the_file(tmp_path, entry, what):
    path = tmp_path / "s.geojson"
    path.write_text(json.dumps({"type": "FeatureCollection", "asapGroups": [entry], "features": []}))
    with pytest.raises(AnnotationError,
                       match=rf"^{re.escape(str(path))}: asapGroups: group 'g': {what}.*Fix: correct or remove it"):
        read_annotations(path)
