"""Annotation files (ASAP XML, GeoJSON) <-> shapely geometry in level-0 pixels.

- ``read_annotations(path, *, group_map=None, dimensions_lv0=None) -> AnnotationSet`` reads ASAP XML
  (defusedxml, DTDs refused) or QuPath GeoJSON; ``AnnotationSet.tumor``, ``.non_tumor``, ``.region``.
- ``tumor_fraction(region, coords_lv0, patch_size_lv0)`` -> float32 (N,) exact area fraction per patch.
- ``rasterize_region(region, *, dimensions_lv0, downsample=32)`` -> bool mask (pixel-centre rule).
- ``find_annotation(slide_stem, annotations_dir)``; ``convert_annotations(src, dst)`` XML <-> GeoJSON.
"""

from wsi_milssl.annotations.asap import PolygonAnnotation, read_asap_xml, write_asap_xml
from wsi_milssl.annotations.geojson import read_geojson, write_geojson
from wsi_milssl.annotations.geometry import (
    AnnotationSet,
    annotation_geometry,
    polygonal,
    rasterize_region,
    subdivide,
    tumor_fraction,
)
from wsi_milssl.annotations.groups import (
    DEFAULT_GROUP_MAP,
    DEFAULT_NON_TUMOR_GROUPS,
    DEFAULT_TUMOR_GROUPS,
    UNCLASSIFIED,
    GroupMap,
    as_group_map,
)
from wsi_milssl.annotations.io import (
    ANNOTATION_SUFFIXES,
    annotation_format,
    annotation_version,
    convert_annotations,
    find_annotation,
    list_annotation_files,
    read_annotations,
    same_annotation_version,
    write_annotations,
)

__all__ = [
    "ANNOTATION_SUFFIXES",
    "AnnotationSet",
    "DEFAULT_GROUP_MAP",
    "DEFAULT_NON_TUMOR_GROUPS",
    "DEFAULT_TUMOR_GROUPS",
    "GroupMap",
    "PolygonAnnotation",
    "UNCLASSIFIED",
    "annotation_format",
    "annotation_version",
    "annotation_geometry",
    "as_group_map",
    "convert_annotations",
    "find_annotation",
    "list_annotation_files",
    "polygonal",
    "rasterize_region",
    "read_annotations",
    "same_annotation_version",
    "read_asap_xml",
    "read_geojson",
    "subdivide",
    "tumor_fraction",
    "write_annotations",
    "write_asap_xml",
    "write_geojson",
]
