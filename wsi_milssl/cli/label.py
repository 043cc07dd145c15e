"""``wsi-milssl label STORES... --annotations DIR``: exact tumour fractions, instance labels, tumour masks."""

from __future__ import annotations

import argparse
from pathlib import Path

from wsi_milssl.cli.options import output_folder
from wsi_milssl.config.label import LabelConfig
from wsi_milssl.errors import ConfigError

__all__ = ["SUMMARY", "register", "run", "label_config_from_args"]

#: one line for ``wsi-milssl --help``
SUMMARY = "label patches from annotations: exact tumour fractions, instance labels, tumour masks"


def _groups(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names and text.strip():
        raise argparse.ArgumentTypeError(f"no group names in {text!r}; give a comma-separated list.")
    return names


def label_config_from_args(args: argparse.Namespace) -> LabelConfig:
    return LabelConfig(
        positive_fraction=args.positive_fraction, tumor_groups=args.tumor_groups,
        non_tumor_groups=args.non_tumor_groups, mask_downsample=args.mask_downsample,
        write_masks=not args.no_masks,
    )


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.cli.sharding import add_shard_argument

    d = LabelConfig()
    p = subparsers.add_parser(
        "label",
        help=SUMMARY,
        description=(
            "For every patch store: tumour fraction = area((tumour polygons) - (non-tumour polygons) within\n"
            "the patch square) / patch area, computed exactly with shapely (not by sampling points);\n"
            "instance_label = fraction >= --positive-fraction. Both are written into the store with the\n"
            "slide label (from --labels, else 1 when the slide has a tumour polygon). Instance labels are\n"
            "for evaluation only; training never reads them.\n\n"
            "Annotations are matched by name: store DIR/<stem>.h5 takes <stem>.xml (ASAP, CAMELYON16\n"
            "groups) or <stem>.geojson (QuPath) from --annotations. Annotation files and stores whose\n"
            "names do not match are listed. A tumour mask per slide (<stem>_tumor_mask.png, 255 = tumour,\n"
            "32x downsample = CAMELYON16 level 5, holes carved) with a JSON sidecar, to view and check the\n"
            "labelled region (evaluate does not read it: it draws its FROC masks from the annotations), plus\n"
            "label_status.csv and label_config.json, go to --out. XML with a DOCTYPE or entity\n"
            "declarations is refused and the store is left unchanged.\n\n"
            "Re-running skips stores already labelled with the same settings, annotation file and slide\n"
            "label whose mask is in --out (status 'skipped'; --overwrite labels them again). --shard I/N\n"
            "labels shard I of N of the stores (a job array task; a store's shard is fixed by a hash of its\n"
            "slide's name), a torchrun rank every N-th store (sorted by path) from the I-th; the shards of\n"
            "one run write one --out at once and their label_status.csv rows merge, sorted by slide.\n\n"
            "The labels are written into the stores in place: label locks --out and the folders of the\n"
            "stores (it stops while tile or another label writes there, so two label runs on stores of one\n"
            "folder run one after the other) and removes the temporaries killed runs left there. A stores\n"
            "folder it cannot write (read-only, no permission) is not locked: its labelled stores are\n"
            "skipped and a store that needs rewriting fails (make the folder writable, or label a copy)."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("stores", nargs="+", type=Path, metavar="STORES",
                   help="patch stores (.h5 / .zarr) or folders holding them")
    p.add_argument("--annotations", type=Path, required=True, default=argparse.SUPPRESS, metavar="DIR",
                   help="folder with <stem>.xml (ASAP) or <stem>.geojson / .json (QuPath) per annotated slide")
    p.add_argument("--labels", type=Path, default=argparse.SUPPRESS, metavar="CSV",
                   help="slide labels 'slide,label' (1 tumour, 0 normal) or CAMELYON16 reference.csv; "
                        "default: 1 when the slide has a tumour polygon")
    p.add_argument("--positive-fraction", type=float, default=d.positive_fraction,
                   help="a patch is positive when at least this fraction of its area is tumour")
    p.add_argument("--tumor-groups", type=_groups, default=",".join(d.tumor_groups), metavar="G1,G2",
                   help="annotation groups / QuPath classes that are tumour (case-insensitive)")
    p.add_argument("--non-tumor-groups", type=_groups, default=",".join(d.non_tumor_groups), metavar="G1,G2",
                   help="groups carved out of tumour (case-insensitive)")
    p.add_argument("--out", type=output_folder, default=argparse.SUPPRESS, metavar="DIR",
                   help="folder for the tumour masks, label_status.csv and label_config.json "
                        "(default: 'labels' beside the first store)")
    p.add_argument("--mask-downsample", type=int, default=d.mask_downsample, metavar="DS",
                   help="level-0 pixels per tumour-mask pixel (32 = CAMELYON16 level 5); the masks are for "
                        "checking the labels and do not change the FROC")
    p.add_argument("--no-masks", action="store_true",
                   help="do not write the tumour masks (no stage reads them; evaluate draws its own)")
    p.add_argument("--overwrite", action="store_true",
                   help="label every store again, also those already labelled with these settings")
    add_shard_argument(p, items="stores")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cli import report_error
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.cli.sharding import failed_exit, shard_from_args
    from wsi_milssl.labeling import label_stores
    from wsi_milssl.parent_watch import watch_launcher

    # a rank of a torchrun killed stops instead of going on, holding its shard's lock of --out
    watch_launcher(message="The same command again finishes the labels (the slides done are "
                                         "skipped).")

    try:
        shard = shard_from_args(args)
        config = label_config_from_args(args)  # a bad option value is a usage error, as in tile (review BQ)
    except ConfigError as exc:
        return report_error(exc, code=2)
    with TqdmProgress() as progress:
        report = label_stores(
            args.stores, annotations_dir=args.annotations, labels_csv=getattr(args, "labels", None), config=config,
            out_dir=getattr(args, "out", None), progress=progress, shard=shard, overwrite=args.overwrite,
        )
    if shard[1] > 1:  # each rank or --shard task prints its own table
        print(f"labels of {len(report.results)} store(s) (shard {shard[0]}/{shard[1]})"
              + (":" if report.results else ""))
    width = max([len(r.stem) for r in report.results] + [5])
    if report.results or shard[1] == 1:  # review DA: a shard without stores printed a bare header
        print(f"{'slide':<{width}}  {'status':<7} {'labels':<11} {'patches':>8} {'positive':>8}  slide label")
    for r in report.results:
        label = "" if r.slide_label is None else f"{r.slide_label} ({r.slide_label_source})"
        print(f"{r.stem:<{width}}  {r.status:<7} {r.label_status:<11} {r.n_patches:>8} {r.n_positive:>8}  {label}")
        if r.error:
            print(f"  error: {r.error}")
    if report.unmatched_annotations and shard[0] == 0:  # about the whole folder: shard 0 alone (review DA)
        print(f"annotation files matching no store ({len(report.unmatched_annotations)}): "
              + ", ".join(p.name for p in report.unmatched_annotations))
    others = [s for s in report.stores_without_annotation if s not in report.unannotated_tumor_slides]
    if others:
        shown = ", ".join(others[:20]) + (f" and {len(others) - 20} more" if len(others) > 20 else "")
        print(f"stores without an annotation file (no tumour patches; {len(others)}): {shown}")
    if report.unannotated_tumor_slides:
        print(f"tumour slides without annotations ({len(report.unannotated_tumor_slides)}): "
              + ", ".join(report.unannotated_tumor_slides))
    if report.stores_missing_from_labels:
        print(f"stores missing from {getattr(args, 'labels', None)} ({len(report.stores_missing_from_labels)}): "
              + ", ".join(report.stores_missing_from_labels))
    print(f"status: {report.status_csv}")
    return failed_exit(args, shard, report.n_failed, status_csv=report.status_csv, what="store(s) failed")
