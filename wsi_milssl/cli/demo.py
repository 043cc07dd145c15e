"""``wsi-milssl demo OUT_DIR``: the whole pipeline on freshly generated slides, on the CPU.

It runs ``pipelines/demo.toml`` (shipped inside the package) with OUT_DIR as its output folder.
"""

from __future__ import annotations

import argparse
from importlib.resources import as_file, files
from pathlib import Path

from wsi_milssl.cli.options import add_out_dir_argument, out_dir_of

__all__ = ["SUMMARY", "register", "run", "demo_pipeline_file"]

#: one line for ``wsi-milssl --help``
SUMMARY = "run every stage end to end on generated slides (CPU, a few minutes)"


def demo_pipeline_file():
    """The packaged ``pipelines/demo.toml`` (a Traversable; use with ``importlib.resources.as_file``)."""
    return files("wsi_milssl") / "pipelines" / "demo.toml"


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.pipeline import STAGES

    p = subparsers.add_parser(
        "demo",
        help=SUMMARY,
        description="Generate slides and run synth -> tile -> label -> train -> heatmap -> evaluate on them,\n"
        "as pipelines/demo.toml describes, ending with OUT_DIR/evaluation/report.html. Re-running\n"
        "skips the stages that are up to date.",
        formatter_class=HelpFormatter,
    )
    add_out_dir_argument(p, help="folder for every artifact of the demo")
    p.add_argument("--until", default=None, choices=[s for s in STAGES if s != "features"], metavar="STAGE",
                   help="stop after this stage (e.g. tile)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cli.run import run_and_report

    out_dir = out_dir_of(args)
    with as_file(demo_pipeline_file()) as path:
        return run_and_report(Path(path), out=out_dir, until=args.until, out_named_by="OUT_DIR")
