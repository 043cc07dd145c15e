"""Annotation files (ASAP XML, GeoJSON) <-> shapely geometry in level-0 pixels."""

from wsi_milssl.annotations.asap import PolygonAnnotation, write_asap_xml

__all__ = ["PolygonAnnotation", "write_asap_xml"]
