"""``wsi-milssl annotations convert IN OUT``: ASAP XML <-> GeoJSON without losing vertices or groups."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["SUMMARY", "register", "run_convert"]

#: one line for ``wsi-milssl --help``
SUMMARY = "annotation file tools (convert ASAP XML <-> GeoJSON)"


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "annotations",
        help=SUMMARY,
        description="Tools for annotation files: ASAP XML (CAMELYON16) and GeoJSON (QuPath).",
        formatter_class=HelpFormatter,
    )
    sub = p.add_subparsers(dest="annotations_command", metavar="ACTION", required=True)
    c = sub.add_parser(
        "convert",
        help="convert ASAP XML <-> GeoJSON (format from the suffixes)",
        description=(
            "Convert an annotation file between ASAP XML (.xml) and GeoJSON (.geojson / .json); the\n"
            "formats come from the suffixes. Every vertex (repr-exact), annotation name, type, colour and\n"
            "group (with its parent group and <Attributes>, kept in GeoJSON's asapGroups) is kept:\n"
            "XML -> GeoJSON -> XML gives the same annotations and groups (the same bytes for a file this\n"
            "package wrote; another writer's layout is not kept). ASAP groups become QuPath\n"
            "classification names. ASAP XML has no holes: holes of tumour polygons become polygons of the\n"
            "first non-tumour group (_2); a hole that holds tumour (an island) is written as the hole minus\n"
            "that tumour in pieces without holes, so the region read back is the same; other holes of\n"
            "non-tumour polygons are dropped with a warning.\n"
            "XML with a DOCTYPE or entity declarations is refused."
        ),
        formatter_class=HelpFormatter,
    )
    c.add_argument("source", type=Path, metavar="IN", help="annotation file to read (.xml, .geojson, .json)")
    c.add_argument("destination", type=Path, metavar="OUT", help="file to write (.xml or .geojson); replaced")
    c.add_argument("--tumor-groups", default=None, metavar="G1,G2",
                   help="groups that are tumour (decides where GeoJSON holes go in XML; default _0,_1,Tumor)")
    c.add_argument("--non-tumor-groups", default=None, metavar="G1,G2",
                   help="non-tumour groups; the first receives the holes (default _2,Exclusion,None)")
    c.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from wsi_milssl.annotations import DEFAULT_NON_TUMOR_GROUPS, DEFAULT_TUMOR_GROUPS, GroupMap, convert_annotations

    def names(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
        return default if text is None else tuple(n.strip() for n in text.split(",") if n.strip())

    group_map = GroupMap(tumor=names(args.tumor_groups, DEFAULT_TUMOR_GROUPS),
                         non_tumor=names(args.non_tumor_groups, DEFAULT_NON_TUMOR_GROUPS))
    out = convert_annotations(args.source, args.destination, group_map=group_map)
    print(f"wrote {out}")
    return 0
