"""Annotation geometry in level-0 pixels: the tumour region, exact per-patch fractions, masks.

``AnnotationSet`` turns annotations into shapely geometry: tumour = union of the tumour-group
polygons, non-tumour = union of the non-tumour-group polygons, region = tumour minus non-tumour.
Polygons that are invalid as drawn (self-intersections, duplicate or collinear points) are
repaired with ``shapely.make_valid``; with the slide size known, parts outside the slide are
clipped with a warning. A file whose tumour-group polygons all turn out unusable (no area, or
wholly outside the slide) is an error, not a normal slide.

``tumor_fraction`` computes, for every patch square, area(region ∩ square) / area(square) exactly
(polygon clipping, not point sampling) with shapely 2's vectorised functions and an STRtree.
``rasterize_region`` draws the region on a coarse grid (pixel centre rule) for evaluation masks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np
import shapely
from shapely.geometry.base import BaseGeometry

from wsi_milssl.annotations.asap import AREA_TYPES, PolygonAnnotation
from wsi_milssl.annotations.groups import DEFAULT_GROUP_MAP, GroupMap
from wsi_milssl.artifacts import MAX_COORDINATE_LV0
from wsi_milssl.errors import AnnotationError

__all__ = [
    "MAX_COORDINATE",
    "AnnotationSet",
    "annotation_geometry",
    "polygonal",
    "tumor_fraction",
    "rasterize_region",
    "subdivide",
    "without_holes",
]

logger = logging.getLogger(__name__)

_EMPTY = shapely.MultiPolygon()

#: Largest coordinate magnitude (level-0 px) turned into geometry: beyond any slide, and small enough
#: that areas and intersections stay finite and exact in float64. Readers keep any finite value (so
#: conversions are lossless); a tumour or non-tumour polygon beyond it is an AnnotationError.
MAX_COORDINATE = MAX_COORDINATE_LV0


def _explode_polygons(geoms: np.ndarray) -> np.ndarray:
    """Every non-empty Polygon inside ``geoms`` (multi-part and collections exploded)."""
    geoms = np.asarray(geoms, dtype=object).ravel()
    out = []
    while geoms.size:
        geoms = geoms[~shapely.is_empty(geoms) & ~shapely.is_missing(geoms)]
        types = shapely.get_type_id(geoms)
        out.append(geoms[types == 3])  # Polygon
        multi = geoms[(types == 6) | (types == 7)]  # MultiPolygon, GeometryCollection
        geoms = shapely.get_parts(multi) if multi.size else multi
    polys = np.concatenate(out) if out else np.empty(0, dtype=object)
    return polys[shapely.area(polys) > 0] if polys.size else polys


def polygonal(geom: BaseGeometry | None) -> BaseGeometry:
    """The polygonal part of ``geom`` as a Polygon or MultiPolygon (empty MultiPolygon when none)."""
    if geom is None or geom.is_empty:
        return _EMPTY
    if geom.geom_type in ("Polygon", "MultiPolygon"):
        return geom
    parts = _explode_polygons(np.array([geom], dtype=object))
    if not parts.size:
        return _EMPTY
    return parts[0] if parts.size == 1 else shapely.MultiPolygon(list(parts))


def _repaired_geometry(annotation: PolygonAnnotation) -> tuple[BaseGeometry | None, bool]:
    """(valid geometry or None, whether it had to be repaired)."""
    if annotation.type not in AREA_TYPES:
        return None, False
    shell = np.asarray(annotation.coords_lv0, dtype=np.float64).reshape(-1, 2)
    if len(np.unique(shell, axis=0)) < 3:
        return None, False
    holes = [np.asarray(h, dtype=np.float64).reshape(-1, 2) for h in annotation.holes_lv0]
    holes = [h for h in holes if len(np.unique(h, axis=0)) >= 3]
    poly = shapely.Polygon(shell, holes)
    repaired = not poly.is_valid
    if repaired:
        poly = shapely.make_valid(poly, method="structure", keep_collapsed=False)
    poly = polygonal(poly)
    return (None if poly.is_empty or poly.area <= 0 else poly), repaired


def annotation_geometry(annotation: PolygonAnnotation) -> BaseGeometry | None:
    """A valid Polygon/MultiPolygon for one area annotation (holes included), or None.

    None for non-area types (points, lines) and for rings with fewer than 3 distinct vertices.
    Invalid rings are repaired with ``shapely.make_valid(method="structure")``, which keeps the
    area enclosed by the drawn outline (a loop drawn twice stays filled) minus the holes.
    """
    return _repaired_geometry(annotation)[0]


@dataclass(frozen=True, eq=False)
class AnnotationSet:
    """Annotations of one slide and the geometry they define, in level-0 pixels.

    ``polygons``: every annotation read (areas, and points/lines kept for conversion);
    ``groups``: declared groups ``{name: "#RRGGBB"}``; ``group_details``: their ASAP parent groups and
    attributes, kept for conversions (:func:`wsi_milssl.annotations.asap.check_group_details`);
    ``group_map``: which groups are tumour;
    ``source``: the file read; ``dimensions_lv0``: (width, height) of the slide, when known, to clip
    the geometry to. ``tumor``, ``non_tumor`` and ``region`` are computed once, on first use, and
    log a warning for repaired, clipped, unknown-group and non-area annotations. They raise
    AnnotationError when the file has tumour-group polygons but none of them is usable (every one
    without area or outside the slide): such a file contradicts itself, and reading it as "no
    tumour" would turn a tumour slide into a normal one.
    """

    polygons: list[PolygonAnnotation]
    group_map: GroupMap = DEFAULT_GROUP_MAP
    groups: dict[str, str] = field(default_factory=dict)
    source: Path | None = None
    dimensions_lv0: tuple[int, int] | None = None
    group_details: dict[str, dict] = field(default_factory=dict)

    def with_dimensions(self, dimensions_lv0: tuple[int, int] | None) -> "AnnotationSet":
        """The same annotations, clipped to a slide of ``dimensions_lv0`` = (width, height) px."""
        dims = None if dimensions_lv0 is None else (int(dimensions_lv0[0]), int(dimensions_lv0[1]))
        return dataclasses.replace(self, dimensions_lv0=dims)

    @property
    def _label(self) -> str:
        return str(self.source) if self.source is not None else "annotations"

    @cached_property
    def _geometries(self) -> tuple[list[BaseGeometry], list[BaseGeometry]]:
        """(tumour geometries, non-tumour geometries), each valid and clipped."""
        tumor: list[BaseGeometry] = []
        non_tumor: list[BaseGeometry] = []
        unknown: Counter[str] = Counter()
        no_area: Counter[str] = Counter()
        degenerate: list[str] = []
        repaired: list[str] = []
        clipped: list[str] = []
        outside: list[str] = []
        slide_box = None
        if self.dimensions_lv0 is not None:
            slide_box = shapely.box(0, 0, *self.dimensions_lv0)
            shapely.prepare(slide_box)
        unusable_tumor: Counter[str] = Counter()  # why tumour-group polygons were dropped
        for ann in self.polygons:
            role = self.group_map.role(ann.group)
            if ann.type not in AREA_TYPES:
                no_area[ann.type] += 1
                continue
            if role is None:
                unknown[ann.group] += 1
                continue
            self._check_range(ann)
            geom, was_repaired = _repaired_geometry(ann)
            if was_repaired:
                repaired.append(ann.name)
            if geom is None:
                degenerate.append(ann.name)
                if role == "tumor":
                    unusable_tumor["without area"] += 1
                continue
            if slide_box is not None and not slide_box.contains(geom):
                geom = polygonal(shapely.intersection(geom, slide_box))
                if geom.is_empty:
                    outside.append(ann.name)
                    if role == "tumor":
                        unusable_tumor["outside the slide"] += 1
                    continue
                clipped.append(ann.name)
            (tumor if role == "tumor" else non_tumor).append(geom)
        n_unusable = sum(unusable_tumor.values())
        if n_unusable and not tumor:
            size = "" if self.dimensions_lv0 is None else " ({} x {} px at level 0)".format(*self.dimensions_lv0)
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(unusable_tumor.items()))
            raise AnnotationError(
                f"{self._label}: none of its {n_unusable} tumour polygon(s) (groups "
                f"{', '.join(self.group_map.tumor)}) encloses an area on the slide{size}: {why}. Reading it as "
                "'no tumour' would label a tumour slide normal. Fix: check that the file belongs to this slide "
                "and that its coordinates are level-0 pixels, or delete the empty tumour annotations."
            )

        def names(items: Sequence[str]) -> str:
            return ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")

        if unknown:
            logger.warning(
                "%s: ignored %d polygon(s) in group(s) %s, which are neither tumour (%s) nor non-tumour (%s); "
                "to use them, add the group to --tumor-groups or --non-tumor-groups (in a pipeline: [label] "
                "tumor_groups or non_tumor_groups).",
                self._label, sum(unknown.values()), ", ".join(repr(g) for g in sorted(unknown)),
                ", ".join(self.group_map.tumor), ", ".join(self.group_map.non_tumor),
            )
        if no_area:
            logger.warning(
                "%s: ignored %d annotation(s) of type(s) %s: they enclose no area.",
                self._label, sum(no_area.values()), ", ".join(sorted(no_area)),
            )
        if degenerate:
            logger.warning("%s: ignored %d polygon(s) without area (fewer than 3 distinct vertices or "
                           "collapsed when repaired): %s.", self._label, len(degenerate), names(degenerate))
        if repaired:
            logger.warning("%s: repaired %d invalid polygon(s) (self-intersections or repeated points) with "
                           "shapely.make_valid: %s.", self._label, len(repaired), names(repaired))
        if clipped:
            logger.warning("%s: %d polygon(s) extend beyond the slide (%d x %d px at level 0) and were clipped "
                           "to it: %s.", self._label, len(clipped), *self.dimensions_lv0, names(clipped))
        if outside:
            logger.warning("%s: ignored %d polygon(s) lying entirely outside the slide (%d x %d px at level 0; "
                           "wrong slide, or coordinates not at level 0?): %s.",
                           self._label, len(outside), *self.dimensions_lv0, names(outside))
        return tumor, non_tumor

    def _check_range(self, ann: PolygonAnnotation) -> None:
        for ring in (ann.coords_lv0, *ann.holes_lv0):
            arr = np.asarray(ring, dtype=np.float64)
            if arr.size and not np.abs(arr).max() <= MAX_COORDINATE:  # also NaN
                raise AnnotationError(
                    f"{self._label}: polygon {ann.name!r} has a vertex at {np.abs(arr).max():.6g} px, outside any "
                    f"slide (level-0 coordinates are below {MAX_COORDINATE:.0f}). Fix: check that its coordinates "
                    "are level-0 pixels, or delete that polygon."
                )

    @cached_property
    def tumor(self) -> BaseGeometry:
        """Union of the tumour polygons (Polygon or MultiPolygon, level-0 px; empty when none)."""
        return polygonal(shapely.union_all(self._geometries[0])) if self._geometries[0] else _EMPTY

    @cached_property
    def non_tumor(self) -> BaseGeometry:
        """Union of the non-tumour polygons (Polygon or MultiPolygon, level-0 px; empty when none)."""
        return polygonal(shapely.union_all(self._geometries[1])) if self._geometries[1] else _EMPTY

    @cached_property
    def region(self) -> BaseGeometry:
        """Tumour minus non-tumour (Polygon or MultiPolygon, level-0 px; empty when no tumour)."""
        if self.tumor.is_empty:
            return _EMPTY
        if self.non_tumor.is_empty:
            return self.tumor
        return polygonal(shapely.difference(self.tumor, self.non_tumor))

    @property
    def has_tumor(self) -> bool:
        """True when at least one tumour-group polygon encloses an area."""
        return bool(self._geometries[0])

    def tumor_annotations(self) -> list[PolygonAnnotation]:
        """The annotations whose group maps to tumour."""
        return [a for a in self.polygons if self.group_map.role(a.group) == "tumor"]


def subdivide(geometry: BaseGeometry, *, max_vertices: int = 256, max_rounds: int = 24) -> np.ndarray:
    """Split ``geometry`` into disjoint polygons of at most ``max_vertices`` vertices (object array).

    Pieces with more vertices are cut in half across the longer side of their bounding box, round
    by round (vectorised), as PostGIS ``ST_Subdivide`` does. The pieces cover the same area.
    """
    todo = _explode_polygons(np.array([geometry], dtype=object))
    done = []
    for _ in range(max_rounds):
        if not todo.size:
            break
        small = shapely.get_num_coordinates(todo) <= max_vertices
        done.append(todo[small])
        big = todo[~small]
        if not big.size:
            todo = big
            break
        b = shapely.bounds(big)
        split_x = (b[:, 2] - b[:, 0]) >= (b[:, 3] - b[:, 1])
        mid_x = (b[:, 0] + b[:, 2]) / 2
        mid_y = (b[:, 1] + b[:, 3]) / 2
        lo = shapely.box(b[:, 0], b[:, 1], np.where(split_x, mid_x, b[:, 2]), np.where(split_x, b[:, 3], mid_y))
        hi = shapely.box(np.where(split_x, mid_x, b[:, 0]), np.where(split_x, b[:, 1], mid_y), b[:, 2], b[:, 3])
        halves = np.concatenate([shapely.intersection(big, lo), shapely.intersection(big, hi)])
        todo = _explode_polygons(halves)
    if todo.size:
        done.append(todo)
    return np.concatenate(done) if done else np.empty(0, dtype=object)


def without_holes(geometry: BaseGeometry, *, max_rounds: int = 32) -> np.ndarray:
    """Split ``geometry`` into polygons without interior rings that together cover it (object array).

    ASAP XML has no holes: an area with a hole (an annulus around a tumour island) can only be written
    as polygons without holes. Each polygon with holes is split along a vertical line through a point
    inside its median hole (by x; ``shapely.ops.split``), which opens that hole (and any other it crosses)
    onto the cut and leaves about half of the rest on each side; the pieces are split again the same way,
    so n holes take about log2(n) rounds and O(n) pieces (one line per hole at once cut every hole's strip
    into pieces again: O(n^2)). The pieces share the vertices on the cut lines, so their union is
    ``geometry`` again. Polygons without holes are returned as they are. A piece that still has a hole
    after ``max_rounds`` (a numerical corner case) is split into its constrained Delaunay triangles, which
    have no holes by construction.
    """
    from shapely.ops import split

    todo = _explode_polygons(np.array([geometry], dtype=object))
    done = []
    for _ in range(max_rounds):
        if not todo.size:
            break
        holed = shapely.get_num_interior_rings(todo) > 0
        done.append(todo[~holed])
        pieces = []
        for poly in todo[holed]:
            _, y0, _, y1 = poly.bounds
            xs = sorted(shapely.Polygon(ring).representative_point().x for ring in poly.interiors)
            x = xs[len(xs) // 2]
            pieces.extend(split(poly, shapely.LineString([(x, y0 - 1.0), (x, y1 + 1.0)])).geoms)
        todo = _explode_polygons(np.array(pieces, dtype=object))
    if todo.size:
        done.append(_explode_polygons(shapely.constrained_delaunay_triangles(todo)))
    return np.concatenate(done) if done else np.empty(0, dtype=object)


def tumor_fraction(
    region: BaseGeometry | None,
    coords_lv0: np.ndarray,
    patch_size_lv0: float,
) -> np.ndarray:
    """Exact fraction of each patch square covered by ``region``: float32 (N,) in [0, 1].

    ``coords_lv0``: (N, 2) level-0 top-left (x, y) of each patch; ``patch_size_lv0``: side of the
    square in level-0 px. Fraction = area(region ∩ [x, x+s] x [y, y+s]) / s². The region is cut
    into small disjoint pieces (``subdivide``), an STRtree over the pieces finds the pieces each
    square intersects, and the intersection areas are summed per square (all vectorised).
    """
    coords = np.asarray(coords_lv0, dtype=np.float64)
    if coords.ndim != 2 or coords.shape[1] != 2:
        raise ValueError(f"coords_lv0 must have shape (N, 2); got {coords.shape}.")
    size = float(patch_size_lv0)
    if not np.isfinite(size) or size <= 0:
        raise ValueError(f"patch_size_lv0 must be a positive number of level-0 px; got {patch_size_lv0!r}.")
    n = len(coords)
    out = np.zeros(n, dtype=np.float32)
    region = polygonal(region)
    if n == 0 or region.is_empty:
        return out
    x0, y0 = coords[:, 0], coords[:, 1]
    boxes = shapely.box(x0, y0, x0 + size, y0 + size)
    # Squares wholly inside the region need no clipping: one prepared, vectorised test.
    shapely.prepare(region)
    inside = shapely.contains_properly(region, boxes)
    rest = np.flatnonzero(~inside)
    area = np.zeros(n, dtype=np.float64)
    area[inside] = size * size
    if rest.size:
        pieces = subdivide(region)
        tree = shapely.STRtree(pieces)
        box_i, piece_i = tree.query(boxes[rest], predicate="intersects")
        if box_i.size:
            inter = shapely.area(shapely.intersection(pieces[piece_i], boxes[rest][box_i]))
            area[rest] += np.bincount(box_i, weights=inter, minlength=rest.size)
    np.clip(area / (size * size), 0.0, 1.0, out=area)
    out[:] = area
    return out


def rasterize_region(
    region: BaseGeometry | None,
    *,
    dimensions_lv0: tuple[int, int],
    downsample: float = 32,
) -> np.ndarray:
    """Rasterise ``region`` on a grid of ``downsample`` x ``downsample`` level-0 px cells.

    Returns bool (ceil(H / ds), ceil(W / ds)) for ``dimensions_lv0`` = (W, H): pixel (i, j) covers
    level-0 [j*ds, (j+1)*ds) x [i*ds, (i+1)*ds) and is True when its centre ((j+0.5)*ds,
    (i+0.5)*ds) lies in the region (holes carved). Scanline fill with the even-odd rule over every
    ring of the region (valid geometry: rings do not cross), vectorised in numpy.
    """
    width, height = int(dimensions_lv0[0]), int(dimensions_lv0[1])
    ds = float(downsample)
    if width <= 0 or height <= 0:
        raise ValueError(f"dimensions_lv0 must be positive (width, height); got {dimensions_lv0!r}.")
    if not np.isfinite(ds) or ds <= 0:
        raise ValueError(f"downsample must be a positive number; got {downsample!r}.")
    rows, cols = int(np.ceil(height / ds)), int(np.ceil(width / ds))
    mask = np.zeros((rows, cols), dtype=bool)
    region = polygonal(region)
    if region.is_empty:
        return mask
    polys = shapely.get_parts(region)
    rings = shapely.get_rings(polys)
    pts, ring_id = shapely.get_coordinates(rings, return_index=True)
    same = ring_id[:-1] == ring_id[1:]
    ax, ay = pts[:-1][same, 0], pts[:-1][same, 1]
    bx, by = pts[1:][same, 0], pts[1:][same, 1]
    keep = ay != by
    ax, ay, bx, by = ax[keep], ay[keep], bx[keep], by[keep]
    # Row i's centre line y_c = (i + 0.5) * ds crosses edge when min(y) <= y_c < max(y).
    ymin, ymax = np.minimum(ay, by), np.maximum(ay, by)
    i_lo = np.clip(np.ceil(ymin / ds - 0.5), 0, rows).astype(np.int64)
    i_hi = np.clip(np.ceil(ymax / ds - 0.5), 0, rows).astype(np.int64)
    counts = np.maximum(i_hi - i_lo, 0)
    total = int(counts.sum())
    if total == 0:
        return mask
    edge = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    row = i_lo[edge] + (np.arange(total) - starts[edge])
    yc = (row + 0.5) * ds
    xc = ax[edge] + (yc - ay[edge]) * (bx[edge] - ax[edge]) / (by[edge] - ay[edge])
    order = np.lexsort((xc, row))
    row, xc = row[order], xc[order]
    # Each row holds an even number of crossings; consecutive pairs bound the inside spans.
    r = row[0::2]
    j0 = np.clip(np.ceil(xc[0::2] / ds - 0.5), 0, cols).astype(np.int64)
    j1 = np.clip(np.ceil(xc[1::2] / ds - 0.5), 0, cols).astype(np.int64)
    span = j1 > j0
    diff = np.zeros((rows, cols + 1), dtype=np.int8)
    np.add.at(diff, (r[span], j0[span]), 1)
    np.add.at(diff, (r[span], j1[span]), -1)
    return np.cumsum(diff[:, :cols], axis=1, dtype=np.int8) > 0
