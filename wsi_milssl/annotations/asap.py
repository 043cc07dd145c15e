"""ASAP XML annotations in the CAMELYON16 layout.

Layout::

    <ASAP_Annotations>
      <Annotations>
        <Annotation Name="Annotation 0" Type="Polygon" PartOfGroup="_0" Color="#F4FA58">
          <Coordinates>
            <Coordinate Order="0" X="1024.0" Y="2048.0" />
            ...
      <AnnotationGroups>
        <Group Name="_0" PartOfGroup="None" Color="#FF0000"><Attributes /></Group>

Coordinates are level-0 pixels. In CAMELYON16, groups ``_0``/``_1`` (and ``Tumor``) are tumour and
``_2`` (and ``Exclusion``/``None``) are non-tumour regions carved out of tumour.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["PolygonAnnotation", "write_asap_xml", "GROUP_COLORS"]

GROUP_COLORS = {"_0": "#FF0000", "_1": "#FF0000", "_2": "#00FF00", "Tumor": "#FF0000"}


@dataclass(frozen=True)
class PolygonAnnotation:
    """One polygon: ``coords_lv0`` is a float64 (K, 2) array of level-0 (x, y) vertices, not closed."""

    name: str
    group: str
    coords_lv0: np.ndarray
    color: str = "#F4FA58"
    type: str = field(default="Polygon")


def _fmt(value: float) -> str:
    # repr-exact for floats so that a round trip keeps every vertex.
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def write_asap_xml(
    annotations: Sequence[PolygonAnnotation], path: str | os.PathLike, *, groups: Sequence[str] | None = None
) -> Path:
    """Write ``annotations`` as an ASAP XML file (atomically) and return its path."""
    path = Path(path)
    root = ET.Element("ASAP_Annotations")
    anns = ET.SubElement(root, "Annotations")
    for ann in annotations:
        el = ET.SubElement(
            anns, "Annotation",
            {"Name": ann.name, "Type": ann.type, "PartOfGroup": ann.group, "Color": ann.color},
        )
        coords = ET.SubElement(el, "Coordinates")
        for order, (x, y) in enumerate(np.asarray(ann.coords_lv0, dtype=np.float64)):
            ET.SubElement(coords, "Coordinate", {"Order": str(order), "X": _fmt(x), "Y": _fmt(y)})
    group_el = ET.SubElement(root, "AnnotationGroups")
    names = list(groups) if groups is not None else sorted({a.group for a in annotations})
    for name in names:
        g = ET.SubElement(
            group_el, "Group", {"Name": name, "PartOfGroup": "None", "Color": GROUP_COLORS.get(name, "#64FE2E")}
        )
        ET.SubElement(g, "Attributes")
    ET.indent(root, space="\t")
    tmp = path.with_name(path.name + ".tmp")
    ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
    os.replace(tmp, path)
    return path
