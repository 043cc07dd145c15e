"""ASAP XML annotations in the CAMELYON16 layout: reader (defusedxml) and writer.

Layout::

    <ASAP_Annotations>
      <Annotations>
        <Annotation Name="Annotation 0" Type="Polygon" PartOfGroup="_0" Color="#F4FA58">
          <Coordinates>
            <Coordinate Order="0" X="1024.0" Y="2048.0" />
            ...
      <AnnotationGroups>
        <Group Name="_0" PartOfGroup="None" Color="#FF0000"><Attributes /></Group>

A group's ``PartOfGroup`` (its parent group) and the elements inside its ``<Attributes>`` are read into
``group_details`` (:func:`read_asap_xml`) and written back (:func:`write_asap_xml`), so that a conversion
keeps them; no stage uses them.

Coordinates are level-0 pixels. In CAMELYON16, groups ``_0``/``_1`` (and ``Tumor``) are tumour and
``_2`` (and ``Exclusion``/``None``) are non-tumour regions carved out of tumour.

Reading goes through ``defusedxml`` with DTDs forbidden: a file with a ``<!DOCTYPE>``, an entity
declaration or an external reference (XXE, "billion laughs") is refused with an AnnotationError
before anything is expanded. Polygon-like types (``Polygon``, ``Spline``, ``Rectangle``) are read;
point and line types (``Dot``, ``PointSet``, ``Measurement``) enclose no area and are skipped with a
warning when geometry is built (they are kept by the reader so that conversions lose nothing).
"""

from __future__ import annotations

import logging
import os
import re
from xml.etree.ElementTree import Element, TreeBuilder  # tree types only; parsing is defusedxml's
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import defusedxml
import defusedxml.ElementTree as DET
import numpy as np

from wsi_milssl.atomic import atomic_open
from wsi_milssl.errors import AnnotationError, unreadable_annotation

__all__ = [
    "PolygonAnnotation",
    "write_asap_xml",
    "read_asap_xml",
    "GROUP_COLORS",
    "AREA_TYPES",
    "MAX_ANNOTATION_BYTES",
    "check_group_details",
]

logger = logging.getLogger(__name__)

GROUP_COLORS = {"_0": "#FF0000", "_1": "#FF0000", "_2": "#00FF00", "Tumor": "#FF0000"}

#: ASAP annotation types that enclose an area (read as polygons).
AREA_TYPES = ("Polygon", "Spline", "Rectangle")

_CHUNK_BYTES = 1 << 20

#: Largest annotation file read, ASAP XML or GeoJSON (bytes): far above any slide's annotations
#: (CAMELYON16's largest XML is a few MB), so that reading one file has bounded time and memory.
MAX_ANNOTATION_BYTES = 256 << 20


@dataclass(frozen=True)
class PolygonAnnotation:
    """One polygon: ``coords_lv0`` is a float64 (K, 2) array of level-0 (x, y) vertices, not closed.

    ``holes_lv0`` holds interior rings (each float64 (K, 2), not closed); ASAP XML has no holes (it
    draws them as polygons of a non-tumour group), GeoJSON polygons may carry them.
    """

    name: str
    group: str
    coords_lv0: np.ndarray
    color: str = "#F4FA58"
    type: str = field(default="Polygon")
    holes_lv0: tuple[np.ndarray, ...] = ()


#: An XML element or attribute name as written in ``<Attributes>`` (a letter or ``_``, then letters,
#: digits, ``_``, ``-``, ``.``; no namespace prefix).
_XML_NAME = re.compile(r"[^\W\d][\w.\-]*")


def check_group_details(details: object, where: str) -> dict[str, dict]:
    """``details`` as the group details this package reads and writes, or AnnotationError naming ``where``.

    ``{group name: {"parent": str, "attributes": [{"tag": str, "attributes": {str: str}, "text": str}]}}``:
    ``parent`` is the group's ``PartOfGroup`` (left out when ``"None"``), ``attributes`` the elements
    directly inside its ``<Attributes>`` (``text`` only when it has some). Either key may be missing.
    """
    fix = ("Fix: correct or remove it (the ASAP group details, partOfGroup and attributes, are kept only for "
           "conversions back to ASAP XML).")
    if not isinstance(details, dict):
        raise AnnotationError(f"{where}: group details must be an object per group; got {type(details).__name__}. {fix}")
    out: dict[str, dict] = {}
    for name, entry in details.items():
        gwhere = f"{where}: group {name!r}"
        if not isinstance(name, str) or not isinstance(entry, dict):
            raise AnnotationError(f"{gwhere}: details must be an object; got {type(entry).__name__}. {fix}")
        clean: dict = {}
        parent = entry.get("parent")
        if parent is not None:
            if not isinstance(parent, str):
                raise AnnotationError(f"{gwhere}: its parent group must be a name; got {parent!r}. {fix}")
            if parent != "None":
                clean["parent"] = parent
        attributes = entry.get("attributes", [])
        if not isinstance(attributes, list):
            raise AnnotationError(f"{gwhere}: its attributes must be a list of elements; got {attributes!r}. {fix}")
        elements = []
        for element in attributes:
            tag = element.get("tag") if isinstance(element, dict) else None
            attrs = element.get("attributes", {}) if isinstance(element, dict) else None
            text = element.get("text", "") if isinstance(element, dict) else None
            if (not isinstance(tag, str) or not _XML_NAME.fullmatch(tag) or not isinstance(attrs, dict)
                    or not all(isinstance(k, str) and _XML_NAME.fullmatch(k) and isinstance(v, str)
                               for k, v in attrs.items()) or not isinstance(text, str)):
                raise AnnotationError(
                    f"{gwhere}: attribute element {element!r} is not {{'tag': XML name, 'attributes': {{XML name: "
                    f"text}}, 'text': text}}. {fix}"
                )
            elements.append({"tag": tag, "attributes": dict(attrs), **({"text": text} if text else {})})
        if elements:
            clean["attributes"] = elements
        if clean:
            out[name] = clean
    return out


# Characters replaced in attribute values (the same output as the standard library's XML writer).
_ATTR_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "\n": "&#10;", "\r": "&#13;",
                               "\t": "&#09;"})


# Characters replaced in element text.
_TEXT_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "\r": "&#13;"})


#: A coordinate as annotation tools write it: ASCII digits, an optional point and exponent ("nan" and "inf" match,
#: to be refused as non-finite rather than as text).
_PLAIN_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:nan|inf|infinity)", re.I)
# Characters XML 1.0 cannot hold, escaped or not: control characters other than tab and newlines,
# lone surrogates, U+FFFE and U+FFFF.
_XML_FORBIDDEN = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _attrs(**values: str) -> str:
    """XML attributes in the given order, their values escaped (no XML library involved in writing)."""
    return "".join(f' {key}="{str(value).translate(_ATTR_ESCAPES)}"' for key, value in values.items())


def _text_attrs(path: Path, where: str, **values: str) -> str:
    """:func:`_attrs` of names, groups and colours: AnnotationError naming ``where`` when a value holds a
    character that XML 1.0 cannot hold (the file written could not be read back)."""
    for key, value in values.items():
        bad = _XML_FORBIDDEN.search(str(value))
        if bad is not None:
            raise AnnotationError(
                f"{path}: {where} cannot be written as ASAP XML: its {key} {str(value)!r} holds the character "
                f"U+{ord(bad.group()):04X}, which XML 1.0 cannot hold. Fix: remove that character in the source file "
                "(or keep GeoJSON, which can hold it)."
            )
    return _attrs(**values)


def _fmt(value: float) -> str:
    # repr-exact for floats so that a round trip keeps every vertex.
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def write_asap_xml(
    annotations: Sequence[PolygonAnnotation],
    path: str | os.PathLike,
    *,
    groups: Sequence[str] | None = None,
    group_colors: Mapping[str, str] | None = None,
    group_details: Mapping[str, dict] | None = None,
    hole_group: str = "_2",
) -> Path:
    """Write ``annotations`` as an ASAP XML file (atomically) and return its path.

    ``groups`` lists the ``<Group>`` elements to declare (default: the groups used, sorted);
    ``group_colors`` overrides their colours; ``group_details`` (:func:`check_group_details`) gives a
    group's ``PartOfGroup`` (default ``None``) and the elements of its ``<Attributes>``. ASAP cannot store holes, so every hole of an
    annotation is written as its own polygon named ``"<name> hole <k>"`` in ``hole_group``.
    Coordinates are written repr-exact, so reading the file back gives the same float64 vertices.
    """
    path = Path(path)
    colors = {**GROUP_COLORS, **(group_colors or {})}
    details = check_group_details(dict(group_details or {}), str(path))
    lines = ["<?xml version='1.0' encoding='utf-8'?>", "<ASAP_Annotations>", "\t<Annotations>"]

    def add(name: str, type_: str, group: str, color: str, coords: np.ndarray) -> None:
        attrs = _text_attrs(path, f"annotation {name!r}", Name=name, Type=type_, PartOfGroup=group, Color=color)
        lines.append(f"\t\t<Annotation{attrs}>")
        points = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
        if len(points) == 0:
            lines.append("\t\t\t<Coordinates />")
        else:
            lines.append("\t\t\t<Coordinates>")
            lines.extend(f"\t\t\t\t<Coordinate{_attrs(Order=str(order), X=_fmt(x), Y=_fmt(y))} />"
                         for order, (x, y) in enumerate(points))
            lines.append("\t\t\t</Coordinates>")
        lines.append("\t\t</Annotation>")

    used = []
    for ann in annotations:
        add(ann.name, ann.type, ann.group, ann.color, ann.coords_lv0)
        used.append(ann.group)
    for ann in annotations:
        for k, hole in enumerate(ann.holes_lv0):
            add(f"{ann.name} hole {k}", "Polygon", hole_group, colors.get(hole_group, "#64FE2E"), hole)
            used.append(hole_group)
    if lines[-1] == "\t<Annotations>":
        lines[-1] = "\t<Annotations />"
    else:
        lines.append("\t</Annotations>")
    names = list(groups) if groups is not None else sorted(set(used))
    names += [g for g in dict.fromkeys(used) if g not in names]
    if names:
        lines.append("\t<AnnotationGroups>")
        for name in names:
            detail = details.get(name, {})
            attrs = _text_attrs(path, f"group {name!r}", Name=name, PartOfGroup=detail.get("parent", "None"),
                                Color=colors.get(name, "#64FE2E"))
            lines.append(f"\t\t<Group{attrs}>")
            elements = detail.get("attributes", [])
            if not elements:
                lines.append("\t\t\t<Attributes />")
            else:
                lines.append("\t\t\t<Attributes>")
                for element in elements:
                    where = f"group {name!r}, attribute element <{element['tag']}>"
                    inner = _text_attrs(path, where, **element["attributes"])
                    text = element.get("text", "")
                    if text:
                        _text_attrs(path, where, text=text)  # refuses characters XML cannot hold
                        body = text.translate(_TEXT_ESCAPES)
                        lines.append(f"\t\t\t\t<{element['tag']}{inner}>{body}</{element['tag']}>")
                    else:
                        lines.append(f"\t\t\t\t<{element['tag']}{inner} />")
                lines.append("\t\t\t</Attributes>")
            lines.append("\t\t</Group>")
        lines.append("\t</AnnotationGroups>")
    else:
        lines.append("\t<AnnotationGroups />")
    lines.append("</ASAP_Annotations>")
    with atomic_open(path, "wb") as fh:
        fh.write(("\n".join(lines) + "\n").encode("utf-8"))
    return path


class _LineTreeBuilder(TreeBuilder):
    """A TreeBuilder that remembers the source line of every element (for error messages)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Element, int] = {}
        self.parser: DET.DefusedXMLParser | None = None

    def start(self, tag, attrs):  # noqa: D401 - TreeBuilder API
        elem = super().start(tag, attrs)
        if self.parser is not None:
            self.lines[elem] = self.parser.parser.CurrentLineNumber
        return elem


def _parse_xml(path: Path) -> tuple[Element, dict[Element, int]]:
    builder = _LineTreeBuilder()
    parser = DET.DefusedXMLParser(target=builder, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    builder.parser = parser
    try:
        size = path.stat().st_size
        if size > MAX_ANNOTATION_BYTES:
            raise AnnotationError(
                f"{path}: {size} bytes is larger than any slide's annotations ({MAX_ANNOTATION_BYTES} bytes at "
                "most are read). Fix: check this is an ASAP annotation file; re-export it from ASAP."
            )
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK_BYTES):
                parser.feed(chunk)
        root = parser.close()
    except FileNotFoundError:
        raise AnnotationError(f"{path}: annotation file not found; check the path.") from None
    except OSError as exc:
        raise AnnotationError(unreadable_annotation(path, exc)) from None
    except defusedxml.DTDForbidden as exc:
        line = parser.parser.CurrentLineNumber
        raise AnnotationError(
            f"{path}: refused XML with a DOCTYPE declaration <!DOCTYPE {exc.name}> at line {line}: DTDs and "
            "entity declarations allow XXE and 'billion laughs' attacks, and ASAP XML never needs them. "
            "Remove the <!DOCTYPE ...> block or re-export the file from ASAP."
        ) from None
    except defusedxml.EntitiesForbidden as exc:
        line = parser.parser.CurrentLineNumber
        raise AnnotationError(
            f"{path}: refused XML with an entity declaration ({exc.name!r}) at line {line}: entities allow "
            "XXE and 'billion laughs' attacks, and ASAP XML never needs them. Remove the declaration or "
            "re-export the file from ASAP."
        ) from None
    except defusedxml.DefusedXmlException as exc:
        line = parser.parser.CurrentLineNumber
        raise AnnotationError(
            f"{path}: refused XML with an external reference or other unsafe construct at line {line} "
            f"({type(exc).__name__}: {exc}). Remove it or re-export the file from ASAP."
        ) from None
    except (LookupError, ValueError) as exc:  # an unknown or unsupported encoding in the XML declaration
        raise AnnotationError(
            f"{path}: cannot decode the XML ({type(exc).__name__}: {exc}). Fix: save the file as UTF-8 with "
            "<?xml version='1.0' encoding='utf-8'?>, or re-export it from ASAP."
        ) from None
    except DET.ParseError as exc:
        line, col = getattr(exc, "position", (None, None))
        raise AnnotationError(
            f"{path}: not well-formed XML at line {line}, column {col} ({exc.msg if hasattr(exc, 'msg') else exc}); "
            "fix the file there or re-export it from ASAP."
        ) from None
    return root, builder.lines


def _number(path: Path, line: int | None, where: str, attr: str, text: str | None) -> float:
    if text is None:
        raise AnnotationError(f"{path}: line {line}: {where} has no {attr} attribute; every <Coordinate> needs X and Y.")
    value: float | None = None
    plain = text.strip()
    if plain.count(",") == 1:  # some ASAP exports use a decimal comma ("1234,5")
        plain = plain.replace(",", ".")
    if _PLAIN_NUMBER.fullmatch(plain):  # float() alone also took Python's "1_000" and other scripts' digits ("١٢");
        value = float(plain)  # no annotation tool writes them, and a C reader (strtod) stops at the "_"
    if value is None:
        raise AnnotationError(
            f"{path}: line {line}: {where} has {attr}={text!r}, which is not a number; "
            "coordinates must be level-0 pixel numbers."
        )
    if not np.isfinite(value):
        raise AnnotationError(f"{path}: line {line}: {where} has a non-finite {attr}={text!r}.")
    return value


def report_skipped(path: Path, what: Sequence[str], skipped: list[str] | None) -> None:
    """What a reader left out of ``path``: appended to ``skipped`` when it is a list (the caller decides),
    else logged as one warning each."""
    if skipped is not None:
        skipped.extend(what)
        return
    for item in what:
        logger.warning("%s: skipped %s.", path, item)


def read_asap_xml(
    path: str | os.PathLike, *, skipped: list[str] | None = None, group_details: dict | None = None
) -> tuple[list[PolygonAnnotation], dict[str, str]]:
    """Read an ASAP XML file: (polygons in file order, declared groups ``{name: colour}`` in file order).

    ``group_details``, when a dict, receives each group's ``PartOfGroup`` other than ``None`` and the
    elements directly inside its ``<Attributes>`` (tag, attributes, text; :func:`check_group_details`).

    Every annotation with coordinates is returned, whatever its ``Type`` (points and lines too, so
    that a conversion keeps them; AnnotationSet leaves out those that enclose no area). Annotations
    without coordinates are left out with a warning, or described in ``skipped`` when it is a list.
    Raises AnnotationError naming the file and the line for malformed or hostile XML and for
    coordinates that are not numbers.
    """
    path = Path(path)
    root, lines = _parse_xml(path)
    if root.tag != "ASAP_Annotations":
        raise AnnotationError(
            f"{path}: line {lines.get(root)}: root element is <{root.tag}>, expected <ASAP_Annotations>; "
            "this is not an ASAP annotation file."
        )
    polygons: list[PolygonAnnotation] = []
    empty: list[str] = []
    for index, ann in enumerate(root.iter("Annotation")):
        name = ann.get("Name") or f"Annotation {index}"
        type_ = ann.get("Type") or "Polygon"
        group = ann.get("PartOfGroup") or "None"
        color = ann.get("Color") or "#F4FA58"
        where = f"<Annotation Name={name!r}>"
        points = []
        orders = []
        for coord in ann.iter("Coordinate"):
            line = lines.get(coord)
            order = coord.get("Order")
            cwhere = f"<Coordinate Order={order!r}> of {where}"
            points.append((
                _number(path, line, cwhere, "X", coord.get("X")),
                _number(path, line, cwhere, "Y", coord.get("Y")),
            ))
            orders.append(order)
        if not points:
            empty.append(name)
            continue
        coords = np.asarray(points, dtype=np.float64).reshape(-1, 2)
        try:
            order_keys = [int(o) for o in orders]
        except (TypeError, ValueError):
            order_keys = None
        if order_keys is not None and order_keys != sorted(order_keys):
            coords = coords[np.argsort(order_keys, kind="stable")]
        polygons.append(PolygonAnnotation(name=name, group=group, coords_lv0=coords, color=color, type=type_))
    if empty:
        names = ", ".join(empty[:10]) + (" ..." if len(empty) > 10 else "")
        report_skipped(path, [f"{len(empty)} annotation(s) without coordinates: {names}"], skipped)
    groups: dict[str, str] = {}
    for group in root.iter("Group"):
        name = group.get("Name")
        if name:
            groups[name] = group.get("Color") or GROUP_COLORS.get(name, "#64FE2E")
            if group_details is not None:
                group_details.update(_group_details(path, lines, name, group))
    return polygons, groups


def _group_details(path: Path, lines: dict[Element, int], name: str, group: Element) -> dict[str, dict]:
    """{name: details} of one ``<Group>`` element, or {} when it has neither a parent nor attributes."""
    entry: dict = {"parent": group.get("PartOfGroup") or "None", "attributes": []}
    for attributes in group.findall("Attributes"):
        for element in attributes:
            if not isinstance(element.tag, str) or not _XML_NAME.fullmatch(element.tag):
                raise AnnotationError(f"{path}: line {lines.get(element)}: element <{element.tag}> in the "
                                      f"<Attributes> of group {name!r} has a name with a namespace. Fix: remove it.")
            text = element.text if element.text and element.text.strip() else ""
            entry["attributes"].append({"tag": element.tag, "attributes": dict(element.attrib), "text": text})
    return check_group_details({name: entry}, f"{path}: <Group Name={name!r}>")
