"""``wsi-milssl heatmap SLIDE... --model RUN_DIR/best.pt --out DIR``: probability maps, overlays and exports.

With ``--features FILES_OR_DIRS`` and a feature-head checkpoint (``train`` in feature mode) the head's
instance probabilities are drawn on the coordinates of the feature files instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from wsi_milssl.cli.label import _groups
from wsi_milssl.cli.options import output_folder

__all__ = ["SUMMARY", "register", "run", "heatmap_config_from_args"]

#: one line for ``wsi-milssl --help``
SUMMARY = "per-patch tumour probabilities of slides: maps, overlays, QuPath GeoJSON, CAMELYON16 detections"

# CLI option -> HeatmapConfig field, for options that are plain values.
_VALUE_OPTIONS = {
    "batch_size": "batch_size", "workers": "num_workers", "decode": "decode", "device": "device", "amp": "amp", "threads": "threads",
    "tissue": "tissue", "min_tissue": "min_tissue", "mask_mpp": "mask_mpp", "slide_mpp": "slide_mpp",
    "colormap": "colormap", "alpha": "alpha", "vmin": "vmin", "vmax": "vmax",
    "overlay_threshold": "overlay_threshold", "smooth_um": "smooth_um", "thumbnail_px": "thumbnail_px",
    "annotation_color": "annotation_color", "annotation_width": "annotation_width_px",
    "detection_threshold": "detection_threshold", "nms_radius_um": "nms_radius_um",
    "tumor_threshold": "tumor_threshold", "ome_downsample": "ome_downsample",
    "tumor_groups": "tumor_groups", "non_tumor_groups": "non_tumor_groups",
}
# CLI flag -> (HeatmapConfig field, value when given)
_FLAG_OPTIONS = {
    "no_channels_last": ("channels_last", False),
    "no_fuse_batchnorm": ("fuse_batchnorm", False),
    "no_clip_tissue": ("clip_to_tissue", False),
    "no_colorbar": ("colorbar", False),
    "no_title": ("title", False),
    "no_scale_bar": ("scale_bar", False),
}


def heatmap_config_from_args(args: argparse.Namespace):
    """HeatmapConfig from ``--config`` TOML (top level or a [heatmap] table), then the options given."""
    from wsi_milssl.cli.options import values_from_args
    from wsi_milssl.config.base import config_from_mapping
    from wsi_milssl.config.heatmap import HeatmapConfig

    values = values_from_args(args, table="heatmap", value_options=_VALUE_OPTIONS, flag_options=_FLAG_OPTIONS)
    return config_from_mapping(HeatmapConfig, values, source=str(getattr(args, "config", None) or "options"))


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.cli.sharding import add_shard_argument
    from wsi_milssl.config.heatmap import HeatmapConfig
    from wsi_milssl.inference.colormaps import COLORMAPS
    from wsi_milssl.slide.tissue import TISSUE_DETECTORS

    d = HeatmapConfig()
    p = subparsers.add_parser(
        "heatmap",
        help=SUMMARY,
        description=(
            "Run a trained model over whole slides. Each slide is tiled on the fly with the settings\n"
            "recorded in the checkpoint (resolution, patch size, stride, entropy threshold, normalisation),\n"
            "or read from its patch store with --store. Per slide, in DIR:\n"
            "  <stem>_probs.npy/.tif  float32 probability map on the patch grid (NaN = no patch)\n"
            "  <stem>_probs.json      its level-0 origin, stride, patch size, mpp and shape\n"
            "  <stem>_heatmap.png     overlay on the thumbnail, colour bar, annotation outlines\n"
            "  <stem>_patches.csv     x_lv0,y_lv0,prob per patch (top-left, level-0 px)\n"
            "  <stem>_patches.geojson one QuPath detection per patch, measurement tumor_probability\n"
            "  <stem>_detections.csv  CAMELYON16 prob,x,y (level-0 px, no header): non-maximum suppression\n"
            "                         of the map down to --detection-threshold, radius --nms-radius-um\n"
            "and scores.csv (slide,score; max or mean pooling as trained), heatmap_status.csv and\n"
            "heatmap_config.json. Exit code 1 when any slide failed, 2 for usage errors.\n\n"
            "examples:\n"
            "  wsi-milssl heatmap slides/ --model runs/r1/best.pt --out heatmaps/\n"
            "  wsi-milssl heatmap slides/a.tif --model runs/r1 --out hm/ --annotations slides/\n"
            "  wsi-milssl heatmap --store stores/ --model runs/r1/best.pt --out hm/   (slides from the stores)\n"
            "  wsi-milssl heatmap slides/ --features feats/ --model runs/f1/best.pt --out hm/\n"
            "                        (a feature head: its probabilities on the feature files' coordinates;\n"
            "                         SLIDE is optional there, for overlays and for files without the µm/px)"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("slides", nargs="*", type=Path, metavar="SLIDE",
                   help="slide files, folders of slides or CSV lists (optional with --store)")
    p.add_argument("--model", type=Path, required=True, metavar="CHECKPOINT",
                   help="RUN_DIR/best.pt, RUN_DIR/last.pt or RUN_DIR (best.pt, else last.pt)")
    p.add_argument("--out", type=output_folder, required=True, metavar="DIR",
                   help="output folder (created); slides finished there with the same checkpoint and settings, "
                        "from the same unchanged slide and store files, are skipped (slides with no patch "
                        "are predicted again)")
    p.add_argument("--overwrite", action="store_true", help="predict every slide again, even those already done")
    add_shard_argument(p, items="slides")
    p.add_argument("--store", type=Path, nargs="+", default=None, metavar="STORE_OR_DIR",
                   help="read patches from these stores (files or folders) instead of tiling the slides")
    p.add_argument("--features", type=Path, nargs="+", default=None, metavar="FILE_OR_DIR",
                   help="feature files (wsi-milssl features, TRIDENT, CLAM) or folders of them, with a feature-head "
                        "--model: its per-patch probabilities on their coordinates")
    p.add_argument("--annotations", type=Path, default=None, metavar="DIR",
                   help="folder of <stem>.xml / <stem>.geojson annotations to outline on the overlays")
    p.add_argument("--config", type=Path, default=None, metavar="TOML",
                   help="TOML file of HeatmapConfig fields (top level or a [heatmap] table); options override it")
    r = p.add_argument_group("inference")
    r.add_argument("--batch-size", type=int, default=None,
                   help="patches per model call (0 = auto: 256 on CUDA, 64 on the CPU) [0]")
    r.add_argument("--workers", type=int, default=None,
                   help="reader processes, one pool for all slides (-1 = auto: 2-4 low-priority readers for a CPU "
                        "model, CPUs - 2 up to 16 for CUDA, under torchrun divided by the ranks per node, at least "
                        "1; 0 = read in this process) [-1]")
    r.add_argument("--decode", choices=("workers", "device"), default=None,
                   help=f"with --store: decode JPEG patches in the readers or on the device (nvJPEG) [{d.decode}]")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help=f"[{d.device}]")
    r.add_argument("--amp", choices=("auto", "off", "bf16", "fp16"), default=None,
                   help="autocast precision; auto = bf16 on CPU and bf16-capable GPUs, else fp16 [auto]")
    r.add_argument("--no-channels-last", action="store_true", help="keep the NCHW memory layout")
    r.add_argument("--no-fuse-batchnorm", action="store_true",
                   help="run the model as trained instead of folding BatchNorm into the convolutions")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads (0 = torch default) [0]")
    t = p.add_argument_group("tiling on the fly (the rest comes from the checkpoint)")
    t.add_argument("--tissue", choices=sorted(TISSUE_DETECTORS), default=None,
                   help="tissue detector [as recorded with the training stores, else otsu]")
    t.add_argument("--min-tissue", type=float, default=None, metavar="FRACTION",
                   help="fraction of a patch that must be tissue [as recorded, else 0.1]")
    t.add_argument("--mask-mpp", type=float, default=None, metavar="MPP",
                   help="tissue-mask resolution in µm/px [as recorded, else 16]")
    t.add_argument("--slide-mpp", type=float, default=None, metavar="MPP",
                   help="level-0 µm/px for slides without an MPP (overrides the metadata)")
    o = p.add_argument_group("overlay (<stem>_heatmap.png)")
    o.add_argument("--colormap", choices=sorted(COLORMAPS), default=None, help=f"colour map [{d.colormap}]")
    o.add_argument("--alpha", type=float, default=None, help=f"colour opacity 0-1 [{d.alpha}]")
    o.add_argument("--vmin", type=float, default=None, help=f"probability at the low end of the colours [{d.vmin}]")
    o.add_argument("--vmax", type=float, default=None, help=f"probability at the high end of the colours [{d.vmax}]")
    o.add_argument("--overlay-threshold", type=float, default=None, metavar="P",
                   help=f"leave patches below this probability uncoloured [{d.overlay_threshold}]")
    o.add_argument("--smooth-um", type=float, default=None, metavar="UM",
                   help=f"Gaussian sigma in µm applied to the map before drawing (0 = none) [{d.smooth_um}]")
    o.add_argument("--no-clip-tissue", action="store_true", help="colour patches outside the tissue mask too")
    o.add_argument("--thumbnail-px", type=int, default=None, metavar="PX",
                   help=f"longer side of the overlay thumbnail [{d.thumbnail_px}]")
    o.add_argument("--no-colorbar", action="store_true", help="no colour bar panel")
    o.add_argument("--no-title", action="store_true", help="no title (slide, score) below the thumbnail")
    o.add_argument("--no-scale-bar", action="store_true", help="no scale bar below the thumbnail")
    o.add_argument("--annotation-color", default=None, metavar="#RRGGBB",
                   help=f"outline colour of the annotations [{d.annotation_color}]")
    o.add_argument("--annotation-width", type=int, default=None, metavar="PX",
                   help=f"outline width [{d.annotation_width_px}]")
    o.add_argument("--tumor-groups", type=_groups, default=None, metavar="G1,G2",
                   help="annotation groups / QuPath classes outlined as tumour (case-insensitive), as label's "
                        f"[{','.join(d.tumor_groups)}]")
    o.add_argument("--non-tumor-groups", type=_groups, default=None, metavar="G1,G2",
                   help=f"groups carved out of the tumour outlines, as label's [{','.join(d.non_tumor_groups)}]")
    v = p.add_argument_group("viewer files (<stem>_probs.ome.tif, _patches.geojson, _lesions.geojson/.xml)")
    v.add_argument("--tumor-threshold", type=float, default=None, metavar="P",
                   help="patches at or above it are classified Tumor in the GeoJSON (else Normal); the predicted "
                        f"lesions are the map's contours at it [{d.tumor_threshold}]")
    v.add_argument("--ome-downsample", type=int, default=None, metavar="D",
                   help="level-0 px per pixel of the OME-TIFF (an integer: registered exactly; 1 = the slide's own "
                        f"grid); 0 = the largest power of two with >= 8 px per patch stride [{d.ome_downsample}]")
    x = p.add_argument_group("detections (<stem>_detections.csv)")
    x.add_argument("--detection-threshold", type=float, default=None, metavar="P",
                   help="report local maxima down to this probability; keep it low, FROC sweeps thresholds "
                        f"[{d.detection_threshold}]")
    x.add_argument("--nms-radius-um", type=float, default=None, metavar="UM",
                   help=f"suppress patches whose centre is within this distance of a detection [{d.nms_radius_um:g}]")
    p.set_defaults(run=run)


def _use_local_gpu(local_rank: int) -> None:
    """Under torchrun, rank ``LOCAL_RANK`` of a node takes that GPU (when there are GPUs)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def _run_features(args: argparse.Namespace) -> int:
    """``--features``: a feature head's probabilities on the feature files' coordinates."""
    from wsi_milssl.cli import report_error
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.cli.sharding import shard_from_args
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.inference.feature_maps import make_feature_heatmaps
    from wsi_milssl.tiling import find_slides

    try:
        if args.store is not None:
            raise ConfigError("--features and --store are two sources of the same patches; pass one.")
        if shard_from_args(args).count > 1:  # torchrun's ranks: refused by wsi_milssl.cli.main before this
            raise ConfigError(f"--shard {args.shard}: heatmaps of feature files (--features) are not split into shards (each "
                              "takes well under a second, and shards would overwrite each other's "
                              "heatmap_status.csv). Fix: drop --shard and run once (one process), or give each "
                              "process its own feature files and --out.")
        config = heatmap_config_from_args(args)
        slides = find_slides(args.slides) if args.slides else []
    except ConfigError as exc:
        return report_error(exc, code=2)
    ignored = [option for option, given in (("--workers", args.workers is not None),
                                            ("--decode", args.decode is not None),
                                            ("--min-tissue", args.min_tissue is not None),
                                            ("--no-channels-last", args.no_channels_last),
                                            ("--no-fuse-batchnorm", args.no_fuse_batchnorm)) if given]
    if ignored:  # review DB: accepted without a word
        import logging

        logging.getLogger(__name__).warning(
            "%s: for patches read from slides or stores; with --features (the patches are already embedded) "
            "they change nothing.", ", ".join(ignored))
    with TqdmProgress() as progress:
        result = make_feature_heatmaps(args.features, args.model, args.out, config, slides=slides,
                                       annotations_dir=args.annotations, progress=progress)
    return _report(result, "feature file(s)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "features", None) is not None:
        return _run_features(args)
    from wsi_milssl.cli import report_error
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.inference import make_heatmaps
    from wsi_milssl.tiling import find_slides

    from wsi_milssl.cli import RANK0_WAIT_S
    from wsi_milssl.cli.sharding import failed_exit, shard_from_args
    from wsi_milssl.distributed import reported_by_rank0, torchrun_env
    from wsi_milssl.parent_watch import watch_launcher

    # a rank of a torchrun killed stops instead of predicting on, holding its shard's lock of --out
    watch_launcher(message="The same command again finishes the heatmaps (the slides done are "
                                         "skipped).")
    try:  # the same on every rank: torchrun's rank 0 alone reports a bad setting
        with reported_by_rank0(wait_s=RANK0_WAIT_S):
            shard = shard_from_args(args)
            config = heatmap_config_from_args(args)
            slides = find_slides(args.slides) if args.slides else []
            if not slides and args.store is None:
                raise ConfigError("no slides given; pass SLIDE files or folders, or --store with patch stores.")
    except ConfigError as exc:
        return report_error(exc, code=2)
    if args.store is not None and args.slide_mpp is not None:  # review EW: accepted without a word
        import logging

        logging.getLogger(__name__).warning(
            "--slide-mpp %g: with --store the patches are the stores', cut at the µm/px each records, so it changes "
            "nothing. Fix: tile the slides again with --slide-mpp to cut them at another scale.", args.slide_mpp)
    with TqdmProgress() as progress:
        env = torchrun_env()
        if env is not None and config.device != "cpu":
            _use_local_gpu(env[2])
        # an error (the model, the output folder) is every rank's; a slide that fails is its rank's status row
        with reported_by_rank0(wait_s=RANK0_WAIT_S, warnings=False):
            result = make_heatmaps(slides, args.model, args.out, config, stores=args.store,
                                   annotations_dir=args.annotations, progress=progress, shard=shard,
                                   overwrite=args.overwrite)
    _report(result, "slide(s)", shard=shard)
    return failed_exit(args, shard, len(result.results) - _n_ok(result), status_csv=result.status_csv,
                       what="slide(s) failed or had no patch")


def _n_ok(result) -> int:
    return sum(r.status == "ok" for r in result.results)


def _report(result, what: str, *, shard=None) -> int:
    """Print a heatmap run's summary (patches per second of the slides predicted in this run, from the
    first input opened to the last file written; slides already done, or drawn again from their saved
    probabilities, are named as such, without a rate;
    ``shard`` I of N named when N > 1: each rank or --shard task prints its own), one line per slide, the
    files written, failures to stderr; the exit code: 0, or 1 when a slide failed or had no patch."""
    seconds = result.seconds
    ok = [r for r in result.results if r.status == "ok"]
    skipped = set(result.skipped)
    redrawn = set(getattr(result, "redrawn", ()))
    not_predicted = skipped | redrawn
    if skipped and len(skipped) == len(result.results):
        done = (f"{sum(r.n_patches for r in ok)} patches; every slide was already done with this checkpoint and "
                "settings (skipped, nothing predicted)")
    else:
        n_patches = sum(r.n_patches for r in ok if r.slide not in not_predicted)
        rate = f", {n_patches / seconds:.1f} patches/s" if seconds > 0 and n_patches else ""
        done = f"{n_patches} {'new ' if not_predicted else ''}patches in {seconds:.1f} s{rate}"
        if redrawn:
            done += (f"; {len(redrawn)} slide(s) drawn again from their saved probabilities (drawing settings "
                     "or outlines changed, or files were missing; nothing predicted)")
        if skipped:
            done += f"; {len(skipped)} slide(s) already done with this checkpoint and settings, skipped"
    part = f" (shard {shard[0]}/{shard[1]})" if shard is not None and shard[1] > 1 else ""
    print(f"heatmaps of {len(result.results)} {what}{part}: {len(ok)} ok, {result.n_failed} failed, "
          f"{result.n_empty} empty; {done} -> {result.out_dir}")
    for r in ok:
        print(f"  {r.slide}: score {r.score:.4f}, {r.n_patches} patches")
    files = [f"{name}: {path}" for name, path in (("scores", result.scores_csv), ("status", result.status_csv))
             if path.exists()]  # a shard without slides writes no scores.csv (a header-only status CSV)
    if files:
        print("; ".join(files))
    from wsi_milssl.cli import rank_tag, stderr_line

    for r in result.results:
        if r.status != "ok":
            stderr_line(f"{rank_tag()}{r.status}: {r.slide}: {r.error}")
    return 0 if result.ok else 1
