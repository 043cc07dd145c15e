"""Read, write, convert and find annotation files (ASAP XML or GeoJSON, chosen by suffix or content)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Literal, Mapping, Sequence

import numpy as np
import shapely

from wsi_milssl.annotations.asap import AREA_TYPES, PolygonAnnotation, read_asap_xml, report_skipped, write_asap_xml
from wsi_milssl.annotations.geojson import read_geojson, write_geojson
from wsi_milssl.annotations.geometry import AnnotationSet, annotation_geometry, polygonal, without_holes
from wsi_milssl.cohorts.names import ANNOTATION_SUFFIXES
from wsi_milssl.annotations.groups import GroupMap, as_group_map
from wsi_milssl.errors import AnnotationError, unreadable_annotation

__all__ = [
    "ANNOTATION_SUFFIXES",
    "AnnotationFormat",
    "annotation_format",
    "read_annotations",
    "write_annotations",
    "convert_annotations",
    "find_annotation",
    "annotation_difference",
    "list_annotation_files",
]

logger = logging.getLogger(__name__)

AnnotationFormat = Literal["asap", "geojson"]



def annotation_format(path: str | os.PathLike) -> AnnotationFormat:
    """``"asap"`` for ``.xml``, ``"geojson"`` for ``.geojson``/``.json``; otherwise sniffed from content."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".xml":
        return "asap"
    if suffix in (".geojson", ".json"):
        return "geojson"
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except FileNotFoundError:
        raise AnnotationError(f"{path}: annotation file not found; check the path.") from None
    except OSError as exc:
        raise AnnotationError(unreadable_annotation(path, exc)) from None
    if head.startswith(b"<"):
        return "asap"
    if head[:1] in (b"{", b"["):
        return "geojson"
    raise AnnotationError(
        f"{path}: cannot tell the annotation format (suffix {suffix or 'none'!r}, content is neither XML nor "
        "JSON); name the file .xml (ASAP) or .geojson (QuPath GeoJSON)."
    )


def _read_raw(path: Path, skipped: list[str] | None,
              group_details: dict | None = None) -> tuple[list[PolygonAnnotation], dict[str, str]]:
    reader = read_asap_xml if annotation_format(path) == "asap" else read_geojson
    return reader(path, skipped=skipped, group_details=group_details)


def read_annotations(
    path: str | os.PathLike,
    *,
    group_map: GroupMap | Mapping[str, str] | None = None,
    dimensions_lv0: tuple[int, int] | None = None,
    skipped: list[str] | None = None,
) -> AnnotationSet:
    """Read ASAP XML or GeoJSON into an AnnotationSet (level-0 px).

    ``group_map``: which groups are tumour / non-tumour (default CAMELYON16: ``_0``, ``_1``,
    ``Tumor`` tumour; ``_2``, ``Exclusion``, ``None`` non-tumour), a GroupMap or a mapping
    ``{group: "tumor" | "non_tumor"}``. ``dimensions_lv0`` = (width, height) of the slide clips
    the geometry to it (with a warning). What the reader leaves out (objects that are not annotations,
    annotations without coordinates) is warned about, or described in ``skipped`` when it is a list.
    Raises AnnotationError for missing, malformed or hostile
    files, naming the file and the element or line.
    """
    path = Path(path)
    gmap = as_group_map(group_map)
    details: dict[str, dict] = {}
    polygons, groups = _read_raw(path, skipped, details)
    aset = AnnotationSet(polygons=polygons, group_map=gmap, groups=groups, source=path, group_details=details)
    return aset.with_dimensions(dimensions_lv0) if dimensions_lv0 is not None else aset


def write_annotations(
    annotations: AnnotationSet | Sequence[PolygonAnnotation],
    path: str | os.PathLike,
    *,
    format: AnnotationFormat | None = None,
    groups: Mapping[str, str] | None = None,
    group_map: GroupMap | Mapping[str, str] | None = None,
    group_details: Mapping[str, dict] | None = None,
) -> Path:
    """Write annotations as ASAP XML or GeoJSON (by ``format`` or the suffix of ``path``), atomically.

    ``groups`` (``{name: "#RRGGBB"}``) and ``group_details`` (parent groups and attributes) default to
    those of an AnnotationSet; both formats keep them, so that conversions lose no group.

    ASAP XML has no holes: holes of tumour polygons become polygons of the first non-tumour group
    (``_2``), which the ASAP reader subtracts from the union of all tumour polygons. A hole that holds
    tumour (an island drawn as another polygon, or another part of a MultiPolygon) is written as the
    hole minus that tumour, split into polygons without holes (:func:`without_holes`), so that the
    file read back covers the same tumour region; a non-tumour polygon whose hole holds tumour is
    written as such pieces itself. A polygon of a group that is neither tumour nor non-tumour (a
    QuPath class such as ``Metastasis``, ``Tumor: Positive``, an unclassified polygon) may be read as
    either later (``--tumor-groups``), so one with holes is written as such pieces too, in its own
    group: the pieces cover the polygon minus its holes whatever its group is read as. Other holes of
    non-tumour polygons cannot be expressed and are dropped with a warning (they carve nothing out of
    the tumour), as are holes of polygons that enclose no area.
    """
    path = Path(path)
    if isinstance(annotations, AnnotationSet):
        polygons = list(annotations.polygons)
        groups = dict(annotations.groups) if groups is None else dict(groups)
        gmap = annotations.group_map if group_map is None else as_group_map(group_map)
        details = dict(annotations.group_details) if group_details is None else dict(group_details)
    else:
        polygons = list(annotations)
        gmap = as_group_map(group_map)
        details = dict(group_details or {})
    if format is None:
        suffix = path.suffix.lower()
        if suffix == ".xml":
            format = "asap"
        elif suffix in (".geojson", ".json"):
            format = "geojson"
        else:
            raise AnnotationError(
                f"{path}: cannot tell the output format from suffix {suffix or 'none'!r}; "
                "use .xml (ASAP) or .geojson (GeoJSON)."
            )
    if format == "geojson":
        return write_geojson(polygons, path, groups=groups, group_details=details)
    if format != "asap":
        raise AnnotationError(f"{path}: unknown annotation format {format!r}; use 'asap' or 'geojson'.")
    hole_group = gmap.first_non_tumor()
    polygons = _asap_polygons(polygons, gmap, path=path)
    declared = dict(groups or {})
    if any(a.holes_lv0 for a in polygons):
        declared.setdefault(hole_group, "#00FF00")
    names = list(declared) + [g for g in dict.fromkeys(a.group for a in polygons) if g not in declared]
    return write_asap_xml(polygons, path, groups=names, group_colors=declared, group_details=details,
                          hole_group=hole_group)


def _asap_polygons(polygons: list[PolygonAnnotation], gmap: GroupMap, *, path: Path | None) -> list[PolygonAnnotation]:
    """``polygons`` as :func:`write_annotations` writes them to ASAP XML: only tumour polygons keep holes
    (written as polygons of ``gmap.first_non_tumor()``), see :func:`_holes_around_tumour`. The holes that
    cannot be written are dropped, with a warning naming ``path`` (none when ``path`` is None)."""
    polygons = _holes_around_tumour(polygons, gmap)
    non_tumour = [a.name for a in polygons if a.holes_lv0 and gmap.role(a.group) == "non_tumor"]
    if non_tumour and path is not None:
        logger.warning(
            "%s: ASAP XML cannot hold holes of non-tumour polygons; dropped the holes of %d polygon(s): %s.",
            path, len(non_tumour), ", ".join(non_tumour[:8]),
        )
    no_area = [a.name for a in polygons if a.holes_lv0 and gmap.role(a.group) is None]
    if no_area and path is not None:  # an unknown group's polygon with area was split into pieces without holes
        logger.warning(
            "%s: ASAP XML cannot hold holes; dropped the holes of %d polygon(s) that enclose no area: %s.",
            path, len(no_area), ", ".join(no_area[:8]),
        )
    return [a if gmap.role(a.group) == "tumor" else _without_holes(a) for a in polygons]


def _without_holes(annotation: PolygonAnnotation) -> PolygonAnnotation:
    return replace(annotation, holes_lv0=())


def _hole_geometry(ring: np.ndarray):
    """A hole ring as a valid (Multi)Polygon, or None when it encloses no area."""
    ring = np.asarray(ring, dtype=np.float64).reshape(-1, 2)
    if len(np.unique(ring, axis=0)) < 3:
        return None
    hole = shapely.Polygon(ring)
    if not hole.is_valid:
        hole = polygonal(shapely.make_valid(hole, method="structure", keep_collapsed=False))
    return None if hole.is_empty or hole.area <= 0 else hole


def _holes_around_tumour(polygons: list[PolygonAnnotation], gmap: GroupMap) -> list[PolygonAnnotation]:
    """``polygons`` made fit for ASAP XML without losing tumour that lies inside a hole.

    The ASAP reader computes (union of tumour polygons) minus (union of non-tumour polygons), and a
    hole written as a non-tumour polygon would carve away a tumour island inside it. So a hole of a
    tumour polygon that overlaps tumour becomes the hole minus all tumour, split into polygons without
    holes (written as ``"<name> hole <k>"``, one per piece); a non-tumour polygon with a hole that
    overlaps tumour becomes its own pieces without holes (same name and group). Holes that hold no
    tumour are left as they are (one ``_2`` polygon each, or dropped for non-tumour polygons).
    A polygon of an unknown group (neither tumour nor non-tumour) with holes always becomes its own
    pieces: whether it is tumour is decided only when the file is read (``--tumor-groups``), and its
    pieces cover the same area either way, where a ``_2`` hole could carve other tumour and a dropped
    hole would add its area.
    """
    if not any(a.holes_lv0 for a in polygons):
        return polygons
    tumour = [g for g in (annotation_geometry(a) for a in polygons if gmap.role(a.group) == "tumor") if g is not None]
    tree = shapely.STRtree(tumour) if tumour else None

    def tumour_in(hole):
        near = tree.query(hole, predicate="intersects") if tree is not None else ()
        if not len(near):
            return None
        inside = shapely.intersection(hole, shapely.union_all([tumour[i] for i in near]))
        return inside if shapely.area(inside) > 0 else None

    def rings(geometry) -> list[np.ndarray]:
        return [np.asarray(p.exterior.coords, dtype=np.float64)[:-1] for p in without_holes(geometry)]

    def pieces(ann: PolygonAnnotation) -> list[PolygonAnnotation]:
        """``ann`` as polygons without holes (same name and group); ``ann`` itself when it encloses no area."""
        geometry = annotation_geometry(ann)
        return [ann] if geometry is None else [replace(ann, coords_lv0=r, holes_lv0=()) for r in rings(geometry)]

    out: list[PolygonAnnotation] = []
    for ann in polygons:
        role = gmap.role(ann.group)
        if not ann.holes_lv0 or ann.type not in AREA_TYPES:
            out.append(ann)
            continue
        if role is None:
            out += pieces(ann)
            continue
        holes = [(ring, _hole_geometry(ring)) for ring in ann.holes_lv0]
        inside = [None if hole is None else tumour_in(hole) for _, hole in holes]
        if not any(i is not None for i in inside):
            out.append(ann)
        elif role == "tumor":
            new_holes: list[np.ndarray] = []
            for (ring, hole), tumour_part in zip(holes, inside):
                new_holes += [ring] if tumour_part is None else rings(shapely.difference(hole, tumour_part))
            out.append(replace(ann, holes_lv0=tuple(new_holes)))
        else:
            out += pieces(ann)
    return out


def convert_annotations(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    group_map: GroupMap | Mapping[str, str] | None = None,
) -> Path:
    """Convert ASAP XML <-> GeoJSON (formats from the suffixes). Every vertex and group is kept, with
    the groups' colours, parent groups (``PartOfGroup``) and ``<Attributes>`` (in GeoJSON's ``asapGroups``).

    An input whose every object is left out (QuPath detections, annotations without coordinates) is
    refused with an AnnotationError saying what was left out; nothing is written.
    """
    source, destination = Path(source), Path(destination)
    if source.resolve() == destination.resolve():
        raise AnnotationError(f"{source}: input and output are the same file; choose another output path.")
    skipped: list[str] = []
    aset = read_annotations(source, group_map=group_map, skipped=skipped)
    if skipped and not aset.polygons:
        raise AnnotationError(
            f"{source}: no annotation to convert: skipped {'; '.join(skipped)}. Nothing was written to "
            f"{destination}. Fix: convert a file of annotations (QuPath: export the annotations as GeoJSON; a "
            "heatmap's <stem>_lesions.geojson or .xml, not its <stem>_patches.geojson of patch detections)."
        )
    report_skipped(source, skipped, None)
    return write_annotations(aset, destination)


def find_annotation(slide_stem: str, annotations_dir: str | os.PathLike) -> Path | None:
    """``<stem>.xml``, ``<stem>.geojson`` or ``<stem>.json`` in ``annotations_dir`` (that order), or None.

    An exact name wins; otherwise the name is matched case-insensitively (and in Unicode NFC). A ``.json``
    that does not look like GeoJSON is not an annotation file (see :func:`list_annotation_files`). When
    more than one annotation file matches the stem (``s.xml`` beside ``s.geojson``, or ``S.XML``), they
    must describe the same regions and groups (identical files, or one converted from the other): for
    every group, its polygons cover the same area, with each file read as ASAP XML holds it (GeoJSON
    holes as polygons of the hole group ``_2``, as :func:`convert_annotations` writes them with the default
    groups). Then the first (the XML) is returned; else AnnotationError naming both files and the fix.
    A folder with one file per slide is not parsed here.
    """
    directory = Path(annotations_dir)
    if not directory.is_dir():
        raise AnnotationError(_not_a_folder(directory))
    from wsi_milssl.cohorts.names import file_identity, name_key

    exact = [directory / f"{slide_stem}{suffix}" for suffix in ANNOTATION_SUFFIXES]
    stat = directory.stat()
    try:
        index = _folder_index(str(directory), (stat.st_dev, stat.st_ino), stat.st_mtime_ns)
    except PermissionError:  # a folder that may be read but not listed (mode 711): exact names only (review CB)
        index = {}
    folded = [p for suffix in ANNOTATION_SUFFIXES for p in index.get(name_key(f"{slide_stem}{suffix}"), ())]
    found: dict[object, Path] = {}
    for p in [*exact, *folded]:
        if os.path.isfile(p):  # False for a name too long for the file system (Path.is_file raises)
            found.setdefault(file_identity(p), p)  # one file under two spellings (case-insensitive folders)
        elif os.path.lexists(p):  # (review ES: taken as no annotation, the tumour slide was labelled normal)
            what = "a link to nothing" if os.path.islink(p) and not os.path.exists(p) else "not a file"
            raise AnnotationError(f"{p}: the annotation of slide {slide_stem!r} is {what}, so it cannot be read. Fix: "
                                  "put the annotation file itself there (or a link to it), or remove the name if the "
                                  "slide has none.")
    if not found:
        return None
    candidates = list(found.values())
    if len(candidates) > 1:  # a .json beside the others counts only when it looks like GeoJSON
        candidates = [p for p in candidates if p.suffix.lower() != ".json" or looks_like_geojson(p)] or candidates[:1]
    chosen, *others = candidates
    for other in others:  # a stage asks once or twice per slide: each pair of file versions is compared once
        _check_same_annotations(slide_stem, chosen, other, _file_version(chosen), _file_version(other))
    return chosen


def annotation_version(path: str | os.PathLike) -> dict | None:
    """What identifies the version of an annotation file an overlay outlines (a heatmap sidecar's
    ``outline_file``): its :func:`wsi_milssl.tiling.file_fingerprint` (path, size, modification time) and the
    SHA-256 of its bytes; None when it cannot be read."""
    from wsi_milssl.hashing import file_sha256
    from wsi_milssl.tiling.inputs import file_fingerprint

    fingerprint = file_fingerprint(path)
    if fingerprint is None:
        return None
    try:
        return {**fingerprint, "sha256": file_sha256(path)}
    except OSError:
        return None


def same_annotation_version(recorded: object, now: dict | None) -> bool:
    """Whether two :func:`annotation_version` records (or None) are one version of one annotation file: the same
    file name and bytes (review EM: an outline edited in place with its size and time kept was taken as the one
    drawn); records of earlier versions, without a digest, by name, size and modification time. Not the folder: a
    folder moved with its files keeps them."""
    if not isinstance(recorded, dict) or not isinstance(now, dict):
        return recorded == now
    if Path(str(recorded.get("path"))).name != Path(str(now.get("path"))).name:
        return False
    if recorded.get("sha256") and now.get("sha256"):
        return recorded["sha256"] == now["sha256"]
    return (recorded.get("size_bytes"), recorded.get("mtime_ns")) == (now.get("size_bytes"), now.get("mtime_ns"))


def _file_version(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def looks_like_geojson(path: Path) -> bool:
    """Whether the ``.json`` file ``path`` looks like GeoJSON (a feature or polygon in its first 64 KiB)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(65536)
    except OSError:
        return False
    return b'"Feature' in head or b'"Polygon"' in head or b'"MultiPolygon"' in head


@functools.lru_cache(maxsize=64)
def _check_same_annotations(stem: str, first: Path, second: Path, *versions: tuple[int, int, int]) -> None:
    """AnnotationError unless the annotation files ``first`` and ``second`` of slide ``stem`` describe the
    same regions and groups (:func:`annotation_difference`). ``versions``: the files' inode, size and
    modification time, so that a result is reused only for the same files."""
    fix = ("Fix: remove or rename the one that is out of date (label, evaluate and heatmap read one annotation "
           "file per slide).")
    try:
        why = annotation_difference(first, second)
    except AnnotationError as exc:
        raise AnnotationError(f"{stem}: two annotation files, {first} and {second}, and one cannot be read: {exc} "
                              f"{fix}") from None
    except OSError as exc:
        raise AnnotationError(f"{stem}: two annotation files, {first} and {second}, and one cannot be read "
                              f"({exc}). {fix}") from None
    if why is not None:
        raise AnnotationError(f"{stem}: two annotation files describe different regions: {first} and {second} "
                              f"({why}). {fix}")


def annotation_difference(first: str | os.PathLike, second: str | os.PathLike) -> str | None:
    """None when the annotation files ``first`` and ``second`` describe the same regions and groups: identical
    bytes, or for every group the same area (up to sub-pixel slivers: :func:`_same_area`), each file read as ASAP XML holds it (GeoJSON
    holes as polygons of the hole group ``_2``, as :func:`convert_annotations` writes them); else why they
    differ, in words naming the files by their names. This is the rule :func:`find_annotation` (and
    ``wsi-milssl prepare``) accept two files of one slide by. Raises AnnotationError or OSError for a file
    that cannot be read or parsed."""
    first, second = Path(first), Path(second)
    if first.stat().st_size == second.stat().st_size and first.read_bytes() == second.read_bytes():
        return None
    areas = [_group_areas(p) for p in (first, second)]
    names = [{key: name for key, (name, _) in a.items()} for a in areas]
    if set(names[0]) != set(names[1]):
        only = [", ".join(sorted(names[k][g] for g in set(names[k]) - set(names[1 - k]))) or "none" for k in (0, 1)]
        return f"groups with polygons only in {first.name}: {only[0]}; only in {second.name}: {only[1]}"
    differ = [names[0][g] for g in sorted(names[0]) if not _same_area(areas[0][g][1], areas[1][g][1])]
    if not differ:
        return None
    return f"the polygons of group(s) {', '.join(differ)} cover different areas"


def _group_areas(path: Path) -> dict[str, tuple[str, object]]:
    """{group key: (group name, union of its polygons)} of the file ``path`` as ASAP XML holds it (holes as
    polygons of the default hole group ``_2``); annotations that enclose no area are left out."""
    from wsi_milssl.annotations.groups import DEFAULT_GROUP_MAP, _key

    polygons, _ = _read_raw(path, [])
    hole_group = DEFAULT_GROUP_MAP.first_non_tumor()
    parts: dict[str, tuple[str, list]] = {}
    for ann in _asap_polygons(polygons, DEFAULT_GROUP_MAP, path=None):
        if ann.type not in AREA_TYPES:
            continue
        for group, ring in [(ann.group, ann.coords_lv0)] + [(hole_group, hole) for hole in ann.holes_lv0]:
            geometry = annotation_geometry(PolygonAnnotation(name=ann.name, group=group, coords_lv0=ring))
            if geometry is not None:
                parts.setdefault(_key(group), (group, []))[1].append(geometry)
    return {key: (name, polygonal(shapely.union_all(geoms))) for key, (name, geoms) in parts.items()}


#: two regions are the same when what lies in one and not the other is nowhere thicker than twice this (px)
SAME_REGION_PX = 0.25


def _same_area(a, b) -> bool:
    """Whether two (Multi)Polygons cover the same area, up to slivers no thicker than 0.5 px: their symmetric
    difference vanishes when eroded by :data:`SAME_REGION_PX`. Coordinates rounded to 0.001 or 0.1 px (a GeoJSON
    written by QuPath, float32 coordinates) leave slivers of a fraction of that; a vertex moved by a pixel, an
    edge shifted by one or a region added leaves a difference that survives the erosion."""
    difference = shapely.symmetric_difference(a, b)
    return difference.is_empty or difference.buffer(-SAME_REGION_PX).is_empty


@functools.lru_cache(maxsize=8)
def _folder_index(directory: str, inode: tuple[int, int], mtime_ns: int) -> dict[str, tuple[Path, ...]]:
    """The files of ``directory`` by :func:`name_key` of their names, for find_annotation's case-insensitive
    fallback: listed once per folder state (device, inode and modification time, which an added, removed or renamed
    entry changes), not once per slide (a 2,000-slide cohort without annotations was 2,000 listings)."""
    from wsi_milssl.cohorts.names import name_key

    index: dict[str, list[Path]] = {}
    for p in sorted(Path(directory).iterdir()):
        if p.is_file():
            index.setdefault(name_key(p.name), []).append(p)
    return {k: tuple(v) for k, v in index.items()}


def _not_a_folder(directory: Path) -> str:
    """The error of an annotations path that is no folder: a file there is said to be one (review EW: "not found"
    of a file that is there)."""
    if directory.is_file():
        return (f"{directory}: is a file, not the annotation folder. Fix: pass the folder that holds the "
                f"<slide name>.xml or .geojson files with --annotations (this file's is {directory.parent}).")
    return f"{directory}: annotation folder not found; check --annotations."


def list_annotation_files(annotations_dir: str | os.PathLike) -> list[Path]:
    """Annotation files in ``annotations_dir``: every ``.xml`` and ``.geojson``, and ``.json`` files
    that look like GeoJSON (so a ``manifest.json`` beside them is not mistaken for one); sorted."""
    directory = Path(annotations_dir)
    if not directory.is_dir():
        raise AnnotationError(_not_a_folder(directory))
    out = []
    try:
        entries = sorted(directory.iterdir())
    except PermissionError:  # mode 711 (review CB): the files are read by name, the folder cannot be listed
        raise AnnotationError(f"{directory}: cannot list this annotation folder (permission denied). Fix: ask for "
                              "permission to list it, or copy the annotation files to a folder you can.") from None
    for p in entries:
        suffix = p.suffix.lower()
        if not p.is_file() or suffix not in ANNOTATION_SUFFIXES:
            continue
        if suffix == ".json" and not looks_like_geojson(p):
            continue
        out.append(p)
    return out
