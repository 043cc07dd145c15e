"""``wsi-milssl demo OUT_DIR``: the whole pipeline on freshly generated slides, on the CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "run"]


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "demo",
        help="run every stage end to end on generated slides (CPU, a few minutes)",
        description="Generate slides and run the pipeline that exists on them, end to end.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder for every artifact of the demo")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cli.info import describe_slide
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.config import SynthConfig
    from wsi_milssl.synth import generate_slides

    slides_dir = args.out_dir / "slides"
    with TqdmProgress() as progress:
        slides = generate_slides(SynthConfig(n_slides=4, seed=0), slides_dir, progress=progress)
    print(f"[synth] {len(slides)} slides in {slides_dir}")
    print(describe_slide(slides[0].slide_path, mpp=None, magnifications=[10.0, 20.0], mpp_at_40x=0.25))
    return 0
