"""``wsi-milssl info SLIDE``: dimensions, pyramid, resolution and how 10x/20x would be read."""

from __future__ import annotations

import argparse
from pathlib import Path

from wsi_milssl.cli.options import add_slide_mpp_option
from wsi_milssl.config.base import SLIDE_MPP_RANGE

__all__ = ["SUMMARY", "register", "run", "describe_slide"]

#: one line for ``wsi-milssl --help``
SUMMARY = "describe a slide: levels, MPP, objective power, and the level serving 10x/20x"


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "info",
        help=SUMMARY,
        description="Print a slide's level-0 size, pyramid levels and downsamples, MPP, objective power,\n"
        "vendor, and which pyramid level plus residual scale would serve each magnification. A 256 px\n"
        "square at the centre of the highest- and the lowest-resolution level is decoded, so a slide\n"
        "whose header or those tiles are corrupt is reported as an error (corrupt tiles elsewhere show\n"
        "only when `tile` reads them). Exit code 1 when any slide failed.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("slides", type=Path, nargs="+", metavar="SLIDE", help="slide file(s)")
    add_slide_mpp_option(p, default=None, help="level-0 µm per pixel, overriding the slide's metadata (for slides "
                                               "without MPP; --mpp is the older name)")
    p.add_argument("--magnifications", type=float, nargs="+", default=[10.0, 20.0], metavar="MAG",
                   help="objective magnifications to plan reads for")
    p.add_argument("--mpp-at-40x", type=float, default=0.25,
                   help="µm per pixel of a 40x objective; 10x is then 4 times that")
    p.set_defaults(run=run)


def describe_slide(path: Path, *, mpp: float | None, magnifications: list[float], mpp_at_40x: float) -> str:
    """A human-readable description of the slide at ``path``.

    Raises SlideReadError when the slide cannot be opened or its pixels cannot be decoded, and
    MissingResolutionError when its physical scale is unknown.
    """
    from wsi_milssl.errors import ResolutionError
    from wsi_milssl.slide import magnification_to_mpp, open_slide

    with open_slide(path, mpp_override=mpp, mpp_at_40x=mpp_at_40x) as slide:
        slide.check_pixels()  # opening reads the header only; corrupt tiles fail here
        w, h = slide.dimensions
        lines = [
            f"slide:            {slide.path}",
            f"vendor:           {slide.vendor}",
            f"dimensions:       {w} x {h} px (level 0)",
            f"objective power:  {slide.objective_power if slide.objective_power is not None else 'unknown'}",
        ]
        slide_mpp = slide.mpp  # raises MissingResolutionError with the --slide-mpp fix
        lines.append(f"mpp:              {slide_mpp:.4f} µm/px (from {slide.mpp_source})")
        lines.append(f"levels:           {slide.level_count}")
        for i, ((lw, lh), ds) in enumerate(zip(slide.level_dimensions, slide.level_downsamples)):
            lines.append(f"  level {i}: {lw:>7} x {lh:<7} px  downsample {ds:8.3f}  ({slide_mpp * ds:.3f} µm/px)")
        for mag in magnifications:
            target = magnification_to_mpp(mag, mpp_at_40x=mpp_at_40x)
            try:
                plan = slide.plan(target_mpp=target)
            except ResolutionError:
                lines.append(f"{mag:g}x ({target:.3f} µm/px): finer than the slide; refused unless --allow-upsample")
                continue
            lines.append(
                f"{mag:g}x ({target:.3f} µm/px): read level {plan.level} (downsample {plan.level_downsample:.3f}), "
                f"residual scale {plan.residual_scale:.3f}"
            )
    return "\n".join(lines)


# The ranges the other stages accept: --slide-mpp as heatmap/tile/features, --magnifications as
# tile's --magnification; a 40x objective's µm per pixel is an MPP like any other.
_OPTION_RANGES = {"--slide-mpp": SLIDE_MPP_RANGE, "--mpp-at-40x": SLIDE_MPP_RANGE, "--magnifications": (0.1, 200.0)}


def check_options(args: argparse.Namespace) -> None:
    """OptionError (exit code 2) for an option value that is no resolution or magnification (NaN, infinite, 0,
    negative, absurdly large), before any slide is described."""
    from wsi_milssl.errors import OptionError

    given = {"--slide-mpp": [] if args.mpp is None else [args.mpp], "--mpp-at-40x": [args.mpp_at_40x],
             "--magnifications": args.magnifications}
    for option, values in given.items():
        low, high = _OPTION_RANGES[option]
        for value in values:
            if not low <= value <= high:  # False for NaN too
                raise OptionError(f"{option} must be between {low:g} and {high:g}; got {value!r}.")


def run(args: argparse.Namespace) -> int:
    import sys

    from wsi_milssl.cli import report_error
    from wsi_milssl.errors import WsiMilsslError

    check_options(args)
    failed = 0
    for i, path in enumerate(args.slides):
        if i:
            print()
        try:
            text = describe_slide(path, mpp=args.mpp, magnifications=args.magnifications, mpp_at_40x=args.mpp_at_40x)
        except WsiMilsslError as exc:  # one bad slide is reported, the others are still described
            sys.stdout.flush()
            report_error(exc, code=1)
            failed += 1
            continue
        print(text)
    return 1 if failed else 0
