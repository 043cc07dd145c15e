"""``wsi-milssl tile SLIDES... --out DIR``: cut slides into patch stores (HDF5 or Zarr)."""

from __future__ import annotations

import argparse
from pathlib import Path

from wsi_milssl.cli.options import output_folder
from wsi_milssl.config.tile import DEFAULT_MAGNIFICATION, TileConfig
from wsi_milssl.errors import ConfigError, StoreError

__all__ = ["SUMMARY", "register", "run", "tile_config_from_args"]

#: one line for ``wsi-milssl --help``
SUMMARY = "cut slides into patches at a physical resolution and store them (HDF5 or Zarr)"


def tile_config_from_args(args: argparse.Namespace) -> TileConfig:
    return TileConfig(
        magnification=getattr(args, "magnification", None), target_mpp=getattr(args, "mpp", None),
        patch_size_px=args.patch_size, stride_px=getattr(args, "stride", None), entropy_threshold_bits=args.entropy_threshold, tissue=args.tissue,
        min_tissue=args.min_tissue, mask_mpp=args.mask_mpp, pixels=args.pixels, jpeg_quality=args.jpeg_quality,
        format=args.format, slide_mpp=getattr(args, "slide_mpp", None), workers=args.workers, threads=args.threads,
        batch_size=args.batch_size, direct_tiff_read=not args.openslide_only,
        allow_upsample=getattr(args, "allow_upsample", False),
    )


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.cli.sharding import add_shard_argument

    d = TileConfig()
    p = subparsers.add_parser(
        "tile",
        help=SUMMARY,
        description=(
            "For each slide: a tissue mask on a thumbnail (Otsu on HSV saturation after a median blur,\n"
            "small objects and holes removed), a grid at the target resolution, patches with enough\n"
            "tissue read and kept when their greyscale-histogram entropy reaches the threshold.\n\n"
            "Writes DIR/<slide>.h5 or DIR/<slide>.zarr (level-0 coordinates, pixels, entropy, tissue\n"
            "fraction; `wsi-milssl docs artifacts`), DIR/qc/<slide>.png (tissue outline in green, kept patches\n"
            "in blue, entropy-dropped in orange), DIR/tile_status.csv (slide,status,n_patches,seconds,error)\n"
            "and DIR/tile_config.json. Re-running skips slides whose store is complete with the same\n"
            "settings and was cut from the same, unchanged slide file (path, size, modification time);\n"
            "a changed slide is tiled again. Exit code 1 when any slide failed, 2 for usage errors.\n\n"
            "--shard I/N tiles shard I of N of the slides (a job array task; a slide's shard is fixed by a\n"
            "hash of its name), a torchrun rank every N-th slide from the I-th; the shards of one run write\n"
            "one --out at once, their tile_status.csv rows merge (sorted by slide, as one run writes them)\n"
            "and every shard writes the same tile_config.json. A second copy of a shard, or an unsharded\n"
            "run, into a folder that shards are writing is refused.\n\n"
            "SLIDES are slide files, folders of slides, or CSV files with a 'slide' column (paths or\n"
            "names of slides beside the CSV, e.g. labels.csv from `wsi-milssl synth`)."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("slides", nargs="+", type=Path, metavar="SLIDES", help="slide files, folders or CSV lists")
    p.add_argument("--out", type=output_folder, required=True, default=argparse.SUPPRESS, metavar="DIR",
                   help="output folder for the stores (created)")
    res = p.add_mutually_exclusive_group()
    res.add_argument("--magnification", type=float, default=argparse.SUPPRESS, metavar="X",
                     help=f"target objective magnification (40x = 0.25 µm/px); default {DEFAULT_MAGNIFICATION:g}x "
                          "when --mpp is not given")
    res.add_argument("--mpp", type=float, default=argparse.SUPPRESS, help="target resolution in µm per pixel (instead of "
                                                              "--magnification)")
    p.add_argument("--patch-size", type=int, default=d.patch_size_px, metavar="PX",
                   help="patch side in pixels at the target resolution")
    p.add_argument("--stride", type=int, default=argparse.SUPPRESS, metavar="PX",
                   help="grid step in pixels at the target resolution (default: the patch size)")
    p.add_argument("--entropy-threshold", type=float, default=d.entropy_threshold_bits, metavar="BITS",
                   help="drop patches whose greyscale-histogram entropy is below this many bits (0-8)")
    p.add_argument("--tissue", default=d.tissue, metavar="NAME",
                   help="registered tissue detector run on a thumbnail before any patch is read: 'otsu', or "
                        "'none' to read every grid cell")
    p.add_argument("--min-tissue", type=float, default=d.min_tissue, metavar="FRACTION",
                   help="fraction of a patch that must be tissue for it to be read")
    p.add_argument("--mask-mpp", type=float, default=d.mask_mpp, metavar="MPP",
                   help="resolution of the tissue-mask thumbnail in µm per pixel")
    p.add_argument("--format", default=d.format, choices=("h5", "zarr"), help="store format")
    p.add_argument("--pixels", default=d.pixels, choices=("jpeg", "raw", "none"),
                   help="keep patch pixels as JPEG bytes, raw uint8, or not at all (coordinates only)")
    p.add_argument("--jpeg-quality", type=int, default=d.jpeg_quality, metavar="Q", help="JPEG quality 1-100")
    p.add_argument("--slide-mpp", type=float, default=argparse.SUPPRESS, metavar="MPP",
                   help="level-0 µm per pixel for every slide, overriding the slide metadata "
                        "(for slides without an MPP; default: each slide's own)")
    p.add_argument("--workers", type=int, default=d.workers, metavar="N",
                   help="slides tiled in parallel (processes; 0 or 1: in this process)")
    p.add_argument("--threads", type=int, default=d.threads, metavar="N",
                   help="reader threads per worker (reading, entropy and JPEG encoding overlap)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, metavar="N",
                   help="patches per write to the store (bounds memory)")
    p.add_argument("--openslide-only", action="store_true",
                   help="read every pixel through OpenSlide (by default tiled JPEG TIFF/SVS tiles are decoded "
                        "directly, several times faster, after a check that the pixels are identical)")
    p.add_argument("--allow-upsample", action="store_true",
                   help="tile slides scanned coarser than the target resolution by enlarging them (by default "
                        "such a slide fails: upsampled patches hold no more detail than the scan)")
    p.add_argument("--overwrite", action="store_true",
                   help="re-tile slides whose store exists, replacing it (also when made with other settings)")
    add_shard_argument(p, items="slides")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cli import rank_tag, report_error, stderr_line
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.cli.sharding import failed_exit, shard_from_args
    from wsi_milssl.tiling import find_slides, tile_slides
    from wsi_milssl.parent_watch import watch_launcher

    # a rank of a torchrun killed stops instead of going on, holding its shard's lock of --out
    watch_launcher(message="The same command again finishes the tiles (the slides done are "
                                         "skipped).")

    try:
        shard = shard_from_args(args)
        config = tile_config_from_args(args)
        slides = find_slides(args.slides, keep_missing=True)  # a missing slide fails alone
    except ConfigError as exc:
        return report_error(exc, code=2)
    try:
        with TqdmProgress() as progress:
            result = tile_slides(slides, args.out, config, overwrite=args.overwrite, progress=progress, shard=shard)
    except StoreError as exc:
        return report_error(exc, code=2)
    counts = {k: sum(r.status == k for r in result.results) for k in ("ok", "skipped", "failed")}
    n_patches = sum(r.n_patches for r in result.results)
    part = f" (shard {shard[0]}/{shard[1]})" if shard[1] > 1 else ""
    print(f"tiled {len(result.results)} slide(s){part}: {counts['ok']} ok, {counts['skipped']} skipped, "
          f"{counts['failed']} failed; {n_patches} patches in {args.out}")
    print(f"status: {result.status_csv}")
    for r in result.results:
        if r.status == "failed":
            stderr_line(f"{rank_tag()}failed: {r.slide}: {r.error}")
    return failed_exit(args, shard, counts["failed"], status_csv=result.status_csv)
