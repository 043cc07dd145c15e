"""GeoJSON annotations as QuPath exports them: reader and writer, level-0 pixel coordinates.

Accepted input: a ``FeatureCollection``, a single ``Feature``, a JSON array of features (QuPath
0.2 "export as array"), or a bare geometry. Geometries: ``Polygon`` and ``MultiPolygon`` (with
holes) are areas; ``Point``/``MultiPoint``/``LineString``/``MultiLineString`` are kept as
non-area annotations (``Dot``/``PointSet``/``Measurement``, as ASAP names them) so that a
conversion loses nothing; ``GeometryCollection`` is walked. The group of a feature is
``properties.classification.name`` (or ``properties.classification`` when it is a string);
features without one get the group ``Unclassified``. Objects whose ``objectType`` is not
``annotation`` (QuPath detections, cells, tiles) are skipped with a warning; QuPath 0.2 exports,
which have no ``objectType``, name the object type in the feature's ``id`` (``PathDetectionObject``,
``PathCellObject``, ``PathTileObject``, ``PathAnnotationObject``: :data:`QUPATH_02_OBJECT_TYPES`),
which is read the same way and is not taken for the annotation's name.

Written files are a ``FeatureCollection`` with one ``Polygon`` feature per annotation:
``properties = {"objectType": "annotation", "name", "classification": {"name": group, "color":
[r, g, b]}, "color": [r, g, b]}`` plus ``"asapType"`` when the ASAP type is not the one implied by
the geometry, and a top-level foreign member ``"asapGroups": [{"name", "color"}]`` that keeps the
declared ASAP groups, with ``"partOfGroup"`` (the parent group, when not ``None``) and ``"attributes"``
(the elements of the group's ``<Attributes>``: ``[{"tag", "attributes": {name: value}, "text"}]``) where
the group has them. Rings are closed (first vertex repeated), as GeoJSON requires; an ASAP polygon
of fewer than 3 vertices is written as a ``Point`` (1) or ``LineString`` (2) with its ``asapType``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from wsi_milssl.atomic import atomic_open
from wsi_milssl.annotations.asap import (
    GROUP_COLORS,
    MAX_ANNOTATION_BYTES,
    PolygonAnnotation,
    check_group_details,
    report_skipped,
)
from wsi_milssl.annotations.groups import UNCLASSIFIED
from wsi_milssl.errors import AnnotationError, unreadable_annotation
from wsi_milssl.paths import read_bounded

__all__ = ["read_geojson", "write_geojson", "hex_to_rgb", "rgb_to_hex", "MAX_JSON_DEPTH", "QUPATH_02_OBJECT_TYPES"]

logger = logging.getLogger(__name__)

# geometry type -> ASAP type it stands for, and back
_GEOMETRY_TYPE = {"Polygon": "Polygon", "Point": "Dot", "MultiPoint": "PointSet", "LineString": "Measurement"}
_BARE_GEOMETRIES = ("Polygon", "MultiPolygon", "Point", "MultiPoint", "LineString", "MultiLineString",
                    "GeometryCollection")
_ASAP_TO_GEOMETRY = {"Polygon": "Polygon", "Spline": "Polygon", "Rectangle": "Polygon",
                     "Dot": "Point", "PointSet": "MultiPoint", "Measurement": "LineString"}

#: Feature ids of QuPath 0.2 exports, which gave the object type there (0.3 moved it to
#: ``properties.objectType``) -> the objectType they stand for. Such an id is not a name.
QUPATH_02_OBJECT_TYPES = {
    "PathAnnotationObject": "annotation",
    "PathDetectionObject": "detection",
    "PathCellObject": "cell",
    "PathTileObject": "tile",
    "PathTMACoreObject": "tma_core",
    "PathRootObject": "root",
}

#: Deepest nesting of JSON arrays and objects accepted. A QuPath MultiPolygon feature inside a
#: FeatureCollection is 8 levels deep; deeper files are refused before any recursive code sees them.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_FIX_EXPORT = "Fix: re-export the annotations from QuPath (File > Export objects as GeoJSON) or another GeoJSON writer."


def hex_to_rgb(color: str) -> list[int] | None:
    """``"#F4FA58"`` -> ``[244, 250, 88]``; None when ``color`` is not ``#RRGGBB``."""
    text = color.strip().lstrip("#") if isinstance(color, str) else ""
    if len(text) != 6:
        return None
    try:
        return [int(text[i:i + 2], 16) for i in (0, 2, 4)]
    except ValueError:
        return None


def rgb_to_hex(value: Any) -> str | None:
    """``[r, g, b]`` or a QuPath packed ``colorRGB`` int -> ``"#RRGGBB"``; None when not a colour."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        value = [(value >> 16) & 255, (value >> 8) & 255, value & 255]
    if isinstance(value, (list, tuple)) and len(value) >= 3 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value[:3]
    ):
        r, g, b = (int(np.clip(round(v), 0, 255)) for v in value[:3])
        return f"#{r:02X}{g:02X}{b:02X}"
    return None


# ----------------------------------------------------------------------------- reading


class _Ctx:
    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, where: str, what: str) -> AnnotationError:
        return AnnotationError(f"{self.path}: {where}: {what}")


def _positions(ctx: _Ctx, where: str, value: Any, *, min_len: int = 1) -> np.ndarray:
    """A list of [x, y(, z)] positions -> float64 (K, 2)."""
    if not isinstance(value, list) or len(value) < min_len:
        raise ctx.error(where, f"expected a list of at least {min_len} [x, y] positions; got {_short(value)}.")
    out = np.empty((len(value), 2), dtype=np.float64)
    for k, pos in enumerate(value):
        if (
            not isinstance(pos, list)
            or len(pos) < 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pos[:2])
        ):
            raise ctx.error(where, f"position {k} must be [x, y] numbers; got {_short(pos)}.")
        try:
            out[k] = pos[0], pos[1]
        except OverflowError:  # an integer too large for a float
            out[k] = np.inf, np.inf
    if not np.isfinite(out).all():
        raise ctx.error(where, "has a non-finite coordinate (NaN, Infinity, or a number too large for float64); "
                               "coordinates must be level-0 pixels.")
    return out


def _ring(ctx: _Ctx, where: str, value: Any) -> np.ndarray:
    coords = _positions(ctx, where, value, min_len=1)
    if len(coords) > 1 and np.array_equal(coords[0], coords[-1]):
        coords = coords[:-1]  # GeoJSON rings repeat the first vertex; ASAP polygons do not
    return coords


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, np.ndarray) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _classification(props: Mapping[str, Any]) -> tuple[str, str | None]:
    cls = props.get("classification")
    if isinstance(cls, str) and cls.strip():
        return cls, None
    if isinstance(cls, Mapping):
        name = cls.get("name")
        color = rgb_to_hex(cls.get("color", cls.get("colorRGB")))
        if isinstance(name, str) and name.strip():
            return name, color
        names = cls.get("names")  # QuPath derived classes: {"names": ["Tumor", "Positive"]}
        if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
            return ": ".join(names), color
    return UNCLASSIFIED, None


def _geometry_annotations(
    ctx: _Ctx, where: str, geometry: Any, *, name: str, group: str, color: str, asap_type: str | None
) -> list[PolygonAnnotation]:
    if not isinstance(geometry, Mapping):
        raise ctx.error(where, f"'geometry' must be an object with 'type' and 'coordinates'; got {_short(geometry)}.")
    gtype = geometry.get("type")
    coords = geometry.get("coordinates")
    out: list[PolygonAnnotation] = []

    def ann(points: np.ndarray, type_: str, holes: tuple[np.ndarray, ...] = ()) -> PolygonAnnotation:
        return PolygonAnnotation(name=name, group=group, coords_lv0=points, color=color,
                                 type=asap_type or type_, holes_lv0=holes)

    if gtype == "Polygon" or gtype == "MultiPolygon":
        polys = [coords] if gtype == "Polygon" else coords
        if not isinstance(polys, list):
            raise ctx.error(where, f"MultiPolygon 'coordinates' must be a list of polygons; got {_short(polys)}.")
        for p, rings in enumerate(polys):
            pwhere = where if gtype == "Polygon" else f"{where}, polygon {p}"
            if not isinstance(rings, list) or not rings:
                raise ctx.error(pwhere, f"Polygon 'coordinates' must be a list of rings; got {_short(rings)}.")
            parsed = [_ring(ctx, f"{pwhere}, ring {r}", ring) for r, ring in enumerate(rings)]
            out.append(ann(parsed[0], "Polygon", tuple(parsed[1:])))
    elif gtype == "Point":
        out.append(ann(_positions(ctx, where, [coords]), "Dot"))
    elif gtype == "MultiPoint":
        out.append(ann(_positions(ctx, where, coords), "PointSet"))
    elif gtype == "LineString":
        out.append(ann(_positions(ctx, where, coords), "Measurement"))
    elif gtype == "MultiLineString":
        if not isinstance(coords, list):
            raise ctx.error(where, f"MultiLineString 'coordinates' must be a list of lines; got {_short(coords)}.")
        for k, line in enumerate(coords):
            out.append(ann(_positions(ctx, f"{where}, line {k}", line), "Measurement"))
    elif gtype == "GeometryCollection":
        geoms = geometry.get("geometries")
        if not isinstance(geoms, list):
            raise ctx.error(where, "GeometryCollection needs a 'geometries' list.")
        for k, g in enumerate(geoms):
            out += _geometry_annotations(ctx, f"{where}, geometry {k}", g, name=name, group=group,
                                         color=color, asap_type=asap_type)
    else:
        raise ctx.error(
            where,
            f"unsupported geometry type {gtype!r}; expected Polygon, MultiPolygon, Point, MultiPoint, "
            "LineString, MultiLineString or GeometryCollection.",
        )
    return out


def _json_depth(text: str) -> int:
    """Deepest nesting of arrays and objects in valid JSON ``text`` (strings left out), without recursion."""
    codes = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    opens = (codes == ord("[")) | (codes == ord("{"))
    where = np.flatnonzero(opens | (codes == ord("]")) | (codes == ord("}")))
    if not where.size:
        return 0
    return int(np.cumsum(np.where(opens[where], 1, -1).astype(np.int32)).max())


def _load_json(path: Path) -> Any:
    """Parse the file with bounded size and depth; AnnotationError (file, cause, fix) for anything else."""
    try:
        size = path.stat().st_size
        if size > MAX_ANNOTATION_BYTES:
            raise AnnotationError(
                f"{path}: {size} bytes is larger than any slide's annotations ({MAX_ANNOTATION_BYTES} bytes at "
                f"most are read). Fix: export annotations only (no detections or cells) as GeoJSON."
            )
        raw = read_bounded(path, MAX_ANNOTATION_BYTES)  # a device or pipe reports size 0
    except FileNotFoundError:
        raise AnnotationError(f"{path}: annotation file not found; check the path.") from None
    except OSError as exc:
        raise AnnotationError(unreadable_annotation(path, exc)) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise AnnotationError(f"{path}: not UTF-8 text at byte {exc.start}; GeoJSON must be UTF-8. {_FIX_EXPORT}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AnnotationError(
            f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg}); "
            "fix the syntax there or re-export the file."
        ) from None
    except RecursionError:
        raise AnnotationError(
            f"{path}: JSON nested too deeply to parse (hundreds of levels of [ or {{); GeoJSON annotations are "
            f"fewer than {MAX_JSON_DEPTH} levels deep. {_FIX_EXPORT}"
        ) from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise AnnotationError(f"{path}: invalid JSON ({exc}). {_FIX_EXPORT}") from None
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise AnnotationError(
            f"{path}: JSON nested {depth} levels deep; GeoJSON annotations are at most {MAX_JSON_DEPTH} levels "
            f"deep (a MultiPolygon feature is 8). {_FIX_EXPORT}"
        )
    return data


def read_geojson(
    path: str | os.PathLike, *, skipped: list[str] | None = None, group_details: dict | None = None
) -> tuple[list[PolygonAnnotation], dict[str, str]]:
    """Read a GeoJSON file: (annotations in file order, groups ``{name: colour}`` in first-use order).

    ``group_details``, when a dict, receives the ``partOfGroup`` and ``attributes`` of the ``asapGroups``
    entries (:func:`wsi_milssl.annotations.asap.check_group_details`; AnnotationError for malformed ones).

    Objects that are not annotations and features without geometry are left out with a warning, or
    described in ``skipped`` when it is a list. Raises AnnotationError naming the file and the line (invalid JSON) or the feature (invalid
    structure or coordinates), and for files over :data:`MAX_ANNOTATION_BYTES` or nested deeper
    than :data:`MAX_JSON_DEPTH`.
    """
    path = Path(path)
    ctx = _Ctx(path)
    data = _load_json(path)

    groups: dict[str, str] = {}
    if isinstance(data, Mapping) and isinstance(data.get("asapGroups"), list):
        for g in data["asapGroups"]:
            if isinstance(g, Mapping) and isinstance(g.get("name"), str):
                groups[g["name"]] = g.get("color") if isinstance(g.get("color"), str) else GROUP_COLORS.get(g["name"], "#64FE2E")
                if group_details is not None and ("partOfGroup" in g or "attributes" in g):
                    entry = {"parent": g.get("partOfGroup"), "attributes": g.get("attributes", [])}
                    group_details.update(check_group_details({g["name"]: entry}, f"{path}: asapGroups"))

    if isinstance(data, list):
        features = data
    elif isinstance(data, Mapping) and data.get("type") == "FeatureCollection":
        features = data.get("features")
        if not isinstance(features, list):
            raise ctx.error("FeatureCollection", "'features' must be a list.")
    elif isinstance(data, Mapping) and data.get("type") == "Feature":
        features = [data]
    elif isinstance(data, Mapping) and data.get("type") in _BARE_GEOMETRIES:
        features = [{"type": "Feature", "geometry": data, "properties": {}}]
    else:
        kind = data.get("type") if isinstance(data, Mapping) else type(data).__name__
        raise AnnotationError(
            f"{path}: top level is {kind!r}; expected a GeoJSON FeatureCollection, Feature, geometry or a "
            "list of features (as QuPath exports them)."
        )

    out: list[PolygonAnnotation] = []
    skipped_objects: Counter[str] = Counter()
    no_geometry = 0
    for index, feature in enumerate(features):
        where = f"feature {index}"
        if not isinstance(feature, Mapping):
            raise ctx.error(where, f"expected a GeoJSON Feature object; got {_short(feature)}.")
        if feature.get("type") not in ("Feature", None):
            raise ctx.error(where, f"'type' is {feature.get('type')!r}; expected 'Feature'.")
        props = feature.get("properties") or {}
        if not isinstance(props, Mapping):
            raise ctx.error(where, f"'properties' must be an object; got {_short(props)}.")
        fid = feature.get("id")
        object_type = props.get("objectType", props.get("object_type"))
        if object_type is None and isinstance(fid, str):
            object_type = QUPATH_02_OBJECT_TYPES.get(fid)  # QuPath 0.2 gave the object type as the feature id
        if object_type is not None and object_type != "annotation":
            skipped_objects[str(object_type)] += 1
            continue
        name = props.get("name")
        if not isinstance(name, str) or not name:
            qupath_02_type = isinstance(fid, str) and fid in QUPATH_02_OBJECT_TYPES
            name = str(fid) if fid is not None and not qupath_02_type else f"Annotation {index}"
        where = f"feature {index} ({name!r})"
        group, class_color = _classification(props)
        if class_color and group not in groups:
            groups[group] = class_color
        color = rgb_to_hex(props.get("color")) or class_color or GROUP_COLORS.get(group, "#F4FA58")
        asap_type = props.get("asapType") if isinstance(props.get("asapType"), str) else None
        geometry = feature.get("geometry")
        if geometry is None:
            no_geometry += 1
            continue
        out += _geometry_annotations(ctx, where, geometry, name=name, group=group, color=color, asap_type=asap_type)
        groups.setdefault(group, class_color or GROUP_COLORS.get(group, "#64FE2E"))
    left_out = []
    if skipped_objects:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(skipped_objects.items()))
        left_out.append(f"{sum(skipped_objects.values())} object(s) that are not annotations ({kinds}); only QuPath "
                        "annotations are read")
    if no_geometry:
        left_out.append(f"{no_geometry} feature(s) with a null geometry")
    report_skipped(path, left_out, skipped)
    return out, groups


# ----------------------------------------------------------------------------- writing


def _closed(coords: np.ndarray) -> list[list[float]]:
    pts = np.asarray(coords, dtype=np.float64).reshape(-1, 2).tolist()
    return pts + [pts[0]]


def _feature(path: Path, ann: PolygonAnnotation, group_colors: Mapping[str, str]) -> dict[str, Any]:
    gtype = _ASAP_TO_GEOMETRY.get(ann.type, "MultiPoint")
    pts = np.asarray(ann.coords_lv0, dtype=np.float64).reshape(-1, 2)
    if gtype == "Polygon" and len(pts) < 3:
        # A GeoJSON ring needs 3 distinct vertices; fewer are written as the Point or LineString they
        # are (QuPath reads both), and asapType keeps the ASAP type for the way back.
        gtype = "Point" if len(pts) == 1 else "LineString"
    if gtype == "Polygon":
        holes = [h for h in ann.holes_lv0 if len(h) >= 3]
        if len(holes) < len(ann.holes_lv0):
            logger.warning("%s: dropped %d hole(s) of fewer than 3 vertices of %r: they enclose no area and are "
                           "not valid GeoJSON rings.", path, len(ann.holes_lv0) - len(holes), ann.name)
        geometry = {"type": "Polygon", "coordinates": [_closed(pts)] + [_closed(h) for h in holes]}
    elif gtype == "Point" and len(pts) == 1:
        geometry = {"type": "Point", "coordinates": pts[0].tolist()}
    elif gtype == "LineString" and len(pts) >= 2:
        geometry = {"type": "LineString", "coordinates": pts.tolist()}
    else:
        gtype = "MultiPoint"
        geometry = {"type": "MultiPoint", "coordinates": pts.tolist()}
    props: dict[str, Any] = {"objectType": "annotation", "name": ann.name}
    if ann.group != UNCLASSIFIED:
        cls: dict[str, Any] = {"name": ann.group}
        rgb = hex_to_rgb(group_colors.get(ann.group, GROUP_COLORS.get(ann.group, "")))
        if rgb is not None:
            cls["color"] = rgb
        props["classification"] = cls
    rgb = hex_to_rgb(ann.color)
    if rgb is not None:
        props["color"] = rgb
    if _GEOMETRY_TYPE.get(gtype) != ann.type:
        props["asapType"] = ann.type
    return {"type": "Feature", "geometry": geometry, "properties": props}


def write_geojson(
    annotations: Sequence[PolygonAnnotation],
    path: str | os.PathLike,
    *,
    groups: Mapping[str, str] | Sequence[str] | None = None,
    group_details: Mapping[str, dict] | None = None,
) -> Path:
    """Write ``annotations`` as a GeoJSON FeatureCollection (atomically) and return its path.

    ``groups`` (names, or ``{name: "#RRGGBB"}``) are recorded in the ``asapGroups`` member so that a
    conversion back to ASAP XML declares the same groups, with their ``group_details`` (parent group
    and attributes, :func:`wsi_milssl.annotations.asap.check_group_details`). Coordinates are written
    repr-exact.
    """
    path = Path(path)
    if groups is None:
        group_colors = {g: GROUP_COLORS.get(g, "#64FE2E") for g in dict.fromkeys(a.group for a in annotations)}
    elif isinstance(groups, Mapping):
        group_colors = dict(groups)
    else:
        group_colors = {g: GROUP_COLORS.get(g, "#64FE2E") for g in groups}
    details = check_group_details(dict(group_details or {}), str(path))

    def asap_group(name: str, color: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": name, "color": color}
        if "parent" in details.get(name, {}):
            entry["partOfGroup"] = details[name]["parent"]
        if "attributes" in details.get(name, {}):
            entry["attributes"] = details[name]["attributes"]
        return entry

    doc = {
        "type": "FeatureCollection",
        "asapGroups": [asap_group(n, c) for n, c in group_colors.items()],
        "features": [_feature(path, a, group_colors) for a in annotations],
    }
    with atomic_open(path, "w") as fh:
        json.dump(doc, fh, allow_nan=False)
        fh.write("\n")
    return path
