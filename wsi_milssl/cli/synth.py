"""``wsi-milssl synth OUT_DIR``: generate synthetic slides, ASAP XML annotations and labels.csv."""

from __future__ import annotations

import argparse
import shlex

from wsi_milssl.cli.options import add_out_dir_argument, out_dir_of
from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import ConfigError, OptionError

__all__ = ["SUMMARY", "register", "run", "add_synth_options", "synth_config_from_args"]

#: one line for ``wsi-milssl --help``
SUMMARY = "generate synthetic H&E-like slides with ASAP XML annotations"


def add_synth_options(parser: argparse.ArgumentParser, *, default_slides: int = 4) -> None:
    """Options shared by ``synth`` and ``demo``."""
    d = SynthConfig()
    parser.add_argument("--slides", type=int, default=default_slides, metavar="N", help="number of slides to generate")
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed; the same seed gives identical files")
    parser.add_argument("--size-px", type=int, nargs=2, default=(d.width_px, d.height_px), metavar=("W", "H"),
                        help="level-0 slide size in pixels")
    parser.add_argument("--mpp", type=float, default=d.mpp, help="level-0 resolution in µm per pixel (0.25 = 40x)")
    parser.add_argument("--tumor-slide-fraction", type=float, default=d.tumor_slide_fraction,
                        help="fraction of slides that carry tumour (rounded to the nearest whole number of slides, a "
                             "half to the even one: 1 slide at 0.5 carries none, 3 carry 2)")


def synth_config_from_args(args: argparse.Namespace, **overrides) -> SynthConfig:
    values = dict(
        n_slides=args.slides, seed=args.seed, width_px=args.size_px[0], height_px=args.size_px[1],
        mpp=args.mpp, tumor_slide_fraction=args.tumor_slide_fraction,
    )
    values.update(overrides)
    return SynthConfig(**values)


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "synth",
        help=SUMMARY,
        description=(
            "Write pyramidal, tiled, JPEG-compressed TIFF slides that OpenSlide opens, an ASAP XML file\n"
            "(CAMELYON16's XML format, level-0 pixels) beside each tumour slide, labels.csv (slide,label; 1 =\n"
            "tumour) and manifest.json. Tumour and normal tissue share one stain palette and differ in\n"
            "structure; normal tissue carries tumour-like confounders (follicles, folds, pen, blur).\n\n"
            "--layout camelyon16 lays them out as the CAMELYON16 download instead (training/normal/normal_NNN.tif,\n"
            "training/tumor/tumor_NNN.tif, testing/images/test_NNN.tif, lesion_annotations.zip of each set,\n"
            "testing/reference.csv; half of each label's slides are test slides), to try `wsi-milssl prepare\n"
            "camelyon16 OUT_DIR --out DIR` and its pipeline before downloading the real one."
        ),
        formatter_class=HelpFormatter,
    )
    add_out_dir_argument(p, help="folder to write the slides into (created)")
    add_synth_options(p)
    p.add_argument("--layout", choices=("flat", "camelyon16"), default="flat",
                   help="flat: synth_NNN.tif, .xml and labels.csv in OUT_DIR; camelyon16: the CAMELYON16 download's "
                        "folders and names (see above)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.synth import generate_slides

    args.out_dir = out_dir_of(args)
    try:
        config = synth_config_from_args(args)
    except ConfigError as exc:  # a bad option value is a usage error, exit code 2 as in tile (review BQ)
        raise OptionError(str(exc)) from None
    if args.layout == "camelyon16":
        from wsi_milssl.synth.camelyon16 import write_camelyon16_tree

        try:
            with TqdmProgress() as progress:
                records = write_camelyon16_tree(config, args.out_dir, progress=progress)["slides"]
        except ConfigError as exc:  # too few slides, a folder of other files: usage errors, exit code 2
            raise OptionError(str(exc)) from None
        sets = {s: [r for r in records if r["set"] == s] for s in ("train", "test")}
        print(f"wrote a CAMELYON16-shaped folder to {args.out_dir}: {len(sets['train'])} training slide(s) "
              f"({sum(r['label'] for r in sets['train'])} tumour) and {len(sets['test'])} test slide(s) "
              f"({sum(r['label'] for r in sets['test'])} tumour); next: wsi-milssl prepare camelyon16 "
              f"{shlex.quote(str(args.out_dir))} --out DIR")
        return 0
    with TqdmProgress() as progress:
        slides = generate_slides(config, args.out_dir, progress=progress)
    n_tumor = sum(s.label for s in slides)
    print(f"wrote {len(slides)} slide(s) ({n_tumor} tumour, {len(slides) - n_tumor} normal) to {args.out_dir}")
    return 0
