"""``wsi-milssl evaluate``: instance AUC, bag AUC, CAMELYON16 FROC and an HTML report."""

from __future__ import annotations

import argparse
from pathlib import Path

from wsi_milssl.cli.label import _groups
from wsi_milssl.cli.options import add_slide_mpp_option, output_folder
from wsi_milssl.config.evaluate import EvaluateConfig

__all__ = ["SUMMARY", "register", "run", "evaluate_config_from_args"]

#: one line for ``wsi-milssl --help``
SUMMARY = "score predictions: instance AUC, bag AUC, CAMELYON16 FROC, HTML report"


#: the option of each EvaluateConfig field, to name it in an error
_OPTIONS = {"positive_fraction": "--positive-fraction", "margin_um": "--margin-um",
            "itc_major_axis_um": "--itc-major-axis-um", "mpp": "--slide-mpp", "froc_mpp": "--froc-mpp", "thumbnail_px": "--thumbnail-px",
            "title": "--title", "tumor_groups": "--tumor-groups", "non_tumor_groups": "--non-tumor-groups",
            "lesion_exclude": "--lesion-exclude"}


def evaluate_config_from_args(args: argparse.Namespace) -> EvaluateConfig:
    """The EvaluateConfig of the parsed options; ConfigError (naming the option) for a value it refuses."""
    from wsi_milssl.errors import ConfigError

    try:
        return EvaluateConfig(
            positive_fraction=args.positive_fraction, margin_um=args.margin_um,
            itc_major_axis_um=args.itc_major_axis_um, mpp=getattr(args, "mpp", None),
            froc_mpp=getattr(args, "froc_mpp", None),
            thumbnail_px=args.thumbnail_px, title=args.title, tumor_groups=args.tumor_groups,
            non_tumor_groups=args.non_tumor_groups, lesion_exclude=tuple(args.lesion_exclude),
        )
    except ConfigError as exc:
        text = str(exc)
        named = [opt for field, opt in _OPTIONS.items() if text.startswith(f"EvaluateConfig.{field} ")]
        raise ConfigError(f"{named[0]}: {text}" if named else text) from None


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    d = EvaluateConfig()
    p = subparsers.add_parser(
        "evaluate",
        help=SUMMARY,
        description=(
            "Evaluate the heatmap stage's predictions (or CAMELYON16 detection CSVs 'prob,x,y' in level-0\n"
            "pixels from any tool) against annotations and slide labels. Writes metrics.json,\n"
            "per_slide.csv, detection_outcomes.csv, froc_curve.csv, froc.png, roc_*.png, config.json\n"
            "and a self-contained report.html into OUT.\n\n"
            "FROC follows CAMELYON16: evaluation mask at level 5 (32x), tumour dilated by 75 µm / 2,\n"
            "holes filled, 8-connected regions; regions with a major axis under 275 µm are isolated tumour\n"
            "cells (neither TP nor FP); score = mean sensitivity at 1/4, 1/2, 1, 2, 4 and 8 false positives\n"
            "per slide. The 75 and 275 µm are measured at each slide's own µm/px; the challenge's script\n"
            "assumes 0.243 µm/px for every slide (also its Utrecht slides, about 0.226), so for the\n"
            "leaderboard number pass --froc-mpp 0.243. Instance AUC needs <stem>_patches.csv and\n"
            "<stem>_probs.json; bag AUC takes each slide's score from its <stem>_probs.json (a folder of\n"
            "another tool, without them: from scores.csv). A metric that cannot be computed is null in\n"
            "metrics.json, with its reason.\n\n"
            "Annotations are read as label reads them (--tumor-groups, --non-tumor-groups); a tumour slide\n"
            "whose polygons are all in other groups, or in ASAP's 'None' (no group), is refused. So is a\n"
            "slide whose latest heatmap run failed (heatmap_status.csv), and a folder whose slides'\n"
            "<stem>_probs.json record different heatmap runs (another checkpoint or settings): run heatmap\n"
            "again with --overwrite on all of them."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--predictions", type=Path, required=True, default=argparse.SUPPRESS, metavar="DIR",
                   help="heatmap output folder (<stem>_detections.csv, <stem>_patches.csv, scores.csv, ...)")
    p.add_argument("--annotations", type=Path, required=True, default=argparse.SUPPRESS, metavar="DIR",
                   help="folder with <stem>.xml (ASAP) or <stem>.geojson per tumour slide")
    p.add_argument("--slides", type=Path, required=True, default=argparse.SUPPRESS, metavar="DIR|CSV",
                   help="folder of slides, or a CSV slide list as tile reads it (a 'path' or 'slide_path' column, "
                        "or only a 'slide' column of paths or names); gives each tumour slide's size and MPP")
    p.add_argument("--labels", type=Path, required=True, default=argparse.SUPPRESS, metavar="CSV",
                   help="slide labels 'slide,label' (1 tumour, 0 normal)")
    p.add_argument("--out", type=output_folder, required=True, default=argparse.SUPPRESS, metavar="DIR",
                   help="output folder (created)")
    p.add_argument("--positive-fraction", type=float, default=d.positive_fraction,
                   help="a patch is a positive instance when its tumour-area fraction is at least this")
    p.add_argument("--tumor-groups", type=_groups, default=",".join(d.tumor_groups), metavar="G1,G2",
                   help="annotation groups / QuPath classes that are tumour (case-insensitive), as label's")
    p.add_argument("--non-tumor-groups", type=_groups, default=",".join(d.non_tumor_groups), metavar="G1,G2",
                   help="groups carved out of tumour (case-insensitive), as label's")
    add_slide_mpp_option(p, default=argparse.SUPPRESS,
                         help="level-0 µm per pixel for every slide (0.01-100), for folders whose slides record none "
                              "(refused where it contradicts the µm/px the heatmaps were made at); --mpp is the older "
                              "name (default: what each slide's <stem>_probs.json records, else the slide's metadata)")
    p.add_argument("--froc-mpp", dest="froc_mpp", type=float, default=argparse.SUPPRESS, metavar="UM_PER_PX",
                   help="µm per level-0 pixel at which --margin-um and --itc-major-axis-um become pixels of the "
                        "FROC mask (0.01-100); the CAMELYON16 script uses 0.243 for every slide: pass 0.243 for "
                        "the challenge's (leaderboard) FROC. Detections and annotations stay in level-0 pixels "
                        "(default: each slide's own µm/px, as --slide-mpp sets it)")
    p.add_argument("--margin-um", type=float, default=d.margin_um,
                   help="tumour is dilated by half of this distance in µm (CAMELYON16: 75; 0: the tumour "
                        "undilated; at most 100000)")
    p.add_argument("--itc-major-axis-um", type=float, default=d.itc_major_axis_um,
                   help="regions with a shorter major axis (µm) are isolated tumour cells (CAMELYON16: 275; at "
                        "most 100000)")
    p.add_argument("--lesion-exclude", nargs="+", action="extend", default=[], metavar="NAME",
                   help="slides left out of the FROC and the instance AUC (the metrics that read annotations) and "
                        "kept in the bag AUC, by name without case: CAMELYON16's organisers left Test_114 (not "
                        "exhaustively annotated) out of the lesion task so (a name of no evaluated slide: a warning)")
    p.add_argument("--thumbnail-px", type=int, default=d.thumbnail_px,
                   help="longer side of each per-slide image in report.html, in pixels")
    p.add_argument("--title", default=d.title, help="heading of report.html")
    p.set_defaults(run=run)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cli import report_error
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.evaluation import evaluate_predictions, froc_protocol_summary

    from wsi_milssl.errors import ConfigError

    try:
        config = evaluate_config_from_args(args)
    except ConfigError as exc:
        return report_error(exc, code=2)
    with TqdmProgress() as progress:
        result = evaluate_predictions(
            args.predictions, labels_csv=args.labels, out_dir=args.out, annotations_dir=args.annotations,
            slides=args.slides, config=config, progress=progress,
        )
    m = result.metrics
    protocol = froc_protocol_summary(m)
    print(f"slides {m['n_slides']}  lesions {m['n_lesions']}  FROC {_fmt(m['froc'])}"
          f"{f' ({protocol})' if protocol else ''}  "
          f"instance AUC {_fmt(m['instance_auc'])}  bag AUC {_fmt(m['bag_auc'])}")
    for key, reason in m["reasons"].items():
        print(f"  {key}: n/a ({reason})")
    if m["not_evaluated"]:
        print(f"  not evaluated: {len(m['not_evaluated'])} labelled slide(s) without predictions (metrics.json lists "
              "them)")
    files = m.get("not_evaluated_files") or []
    if files:
        print(f"  not evaluated: {len(files)} CSV files (of no labelled slide, or beside a slide's _detections.csv): "
              f"{', '.join(files[:5])}"
              f"{' ...' if len(files) > 5 else ''} (metrics.json lists them under not_evaluated_files)")
    print(f"report: {result.paths['report']}")
    return 0
