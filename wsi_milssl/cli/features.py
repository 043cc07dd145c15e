"""``wsi-milssl features STORES... --encoder NAME --out DIR``: one feature file per slide, for CLAM, TRIDENT and ``train``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wsi_milssl.cli.options import output_folder

__all__ = ["SUMMARY", "register", "run", "features_config_from_args"]

#: one line for ``wsi-milssl --help``
SUMMARY = "embed every patch with a frozen encoder: one CLAM/TRIDENT-compatible HDF5 feature file per slide"

# CLI option -> FeaturesConfig field, for options that are plain values.
_VALUE_OPTIONS = {
    "encoder": "encoder", "weights": "weights", "dtype": "dtype", "input_size": "input_size_px",
    "batch_size": "batch_size", "workers": "num_workers", "device": "device", "amp": "amp", "decode": "decode",
    "threads": "threads", "slide_mpp": "slide_mpp",
}
_FLAG_OPTIONS = {"no_channels_last": ("channels_last", False), "no_fuse_batchnorm": ("fuse_batchnorm", False)}


def features_config_from_args(args: argparse.Namespace):
    """FeaturesConfig from ``--config`` TOML (top level or a [features] table), then the options given."""
    from wsi_milssl.cli.options import values_from_args
    from wsi_milssl.config.base import config_from_mapping
    from wsi_milssl.config.features import FeaturesConfig
    from wsi_milssl.errors import ConfigError

    values = values_from_args(args, table="features", value_options=_VALUE_OPTIONS, flag_options=_FLAG_OPTIONS)
    if getattr(args, "encoder_kwargs", None) is not None:
        try:
            kwargs = json.loads(args.encoder_kwargs)
        except ValueError as exc:
            raise ConfigError(f"--encoder-kwargs must be a JSON object; got {args.encoder_kwargs!r} ({exc}).") from None
        if not isinstance(kwargs, dict):
            raise ConfigError(f"--encoder-kwargs must be a JSON object ({{...}}); got {args.encoder_kwargs!r}.")
        values["encoder_kwargs"] = kwargs
    return config_from_mapping(FeaturesConfig, values, source=str(getattr(args, "config", None) or "options"))


def _tile_config(args: argparse.Namespace):
    """The TileConfig that cuts slides on the fly: ``--tile-config`` TOML ([tile] or top level), then
    --magnification / --mpp / --patch-size; None when none is given (stores' own plan, else defaults)."""
    from wsi_milssl.cli.options import config_table
    from wsi_milssl.config.base import config_from_mapping
    from wsi_milssl.config.tile import TileConfig

    values: dict = {}
    if args.tile_config is not None:
        values.update(config_table(args.tile_config, "tile"))
    for opt, name in (("magnification", "magnification"), ("mpp", "target_mpp"), ("patch_size", "patch_size_px")):
        value = getattr(args, opt, None)
        if value is not None:
            values[name] = value
            if name in ("magnification", "target_mpp"):
                values.pop("target_mpp" if name == "magnification" else "magnification", None)
    if not values:
        return None
    return config_from_mapping(TileConfig, values, source=str(args.tile_config or "options"))


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.config.features import FeaturesConfig

    d = FeaturesConfig()
    p = subparsers.add_parser(
        "features",
        help=SUMMARY,
        description=(
            "Embed every patch of each store (or of each slide, cut on the fly) with a frozen encoder,\n"
            "batched on the GPU when there is one, through the same reader pool as `heatmap`. Per slide,\n"
            "in DIR: <stem>.h5 with `features` (N, D) float32/float16, `coords` (N, 2) level-0 top-left and\n"
            "the attributes TRIDENT and CLAM write (their tools and `wsi-milssl train` read it as it is;\n"
            "`instance_label` copied from a labelled store); features_status.csv and features_config.json.\n"
            "Re-running skips slides whose file was made with the same settings from the same store.\n"
            "Exit code 1 when any slide failed, 2 for usage errors.\n\n"
            "Encoders: resnet50_trunc (CLAM's ImageNet ResNet50 up to layer3, 1024-d), resnet18 (512-d),\n"
            "timm:NAME (any timm model; pip install 'wsi-milssl[timm]'). Nothing is downloaded:\n"
            "  --weights PATH    a local state dict (.pth/.pt/.bin/.safetensors), e.g. the checkpoint of a\n"
            "                    foundation model you downloaded once; wrapper prefixes ('module.', 'model.',\n"
            "                    'encoder.', 'backbone.') are stripped\n"
            "  --weights cached  the file torchvision's or timm's own download left in their cache\n"
            "                    ($TORCH_HOME/hub/checkpoints/resnet50-0676ba61.pth, the Hugging Face cache)\n"
            "  --weights random  fixed random weights: speed tests only\n\n"
            "examples:\n"
            "  wsi-milssl features stores/ --out feats/ --weights ~/models/resnet50-0676ba61.pth\n"
            "  wsi-milssl features stores/ --out feats_uni/ --encoder timm:vit_large_patch16_224 \\\n"
            "      --encoder-kwargs '{\"init_values\": 1e-5, \"dynamic_img_size\": true}' \\\n"
            "      --weights ~/models/uni/pytorch_model.bin --dtype float16\n"
            "  wsi-milssl features slides/ --out feats/ --magnification 20 --patch-size 224 --weights cached\n"
            "  wsi-milssl train feats/ --labels labels.csv --out runs/f1       (a head on the features)"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("inputs", nargs="+", type=Path, metavar="STORES",
                   help="patch stores or folders of them; or slides, folders of slides or CSV lists (cut on the fly)")
    p.add_argument("--out", type=output_folder, required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--overwrite", action="store_true", help="make every feature file again")
    p.add_argument("--config", type=Path, default=None, metavar="TOML",
                   help="TOML file of FeaturesConfig fields (top level or a [features] table); options override it")
    e = p.add_argument_group("encoder")
    e.add_argument("--encoder", default=None, metavar="NAME",
                   help=f"resnet50_trunc, resnet18 or timm:NAME [{d.encoder}]")
    e.add_argument("--weights", default=None, metavar="PATH|cached|random",
                   help=f"encoder weights: a local file, 'cached' (torchvision/timm cache) or 'random' [{d.weights}]")
    e.add_argument("--encoder-kwargs", default=None, metavar="JSON",
                   help="JSON object of timm.create_model arguments, e.g. '{\"init_values\": 1e-5}' [{}]")
    e.add_argument("--dtype", choices=("float32", "float16"), default=None, help=f"feature dtype in the files [{d.dtype}]")
    e.add_argument("--input-size", type=int, default=None, metavar="PX",
                   help="resize patches to PX before the encoder [the encoder's fixed size, else as tiled]")
    r = p.add_argument_group("runtime")
    r.add_argument("--batch-size", type=int, default=None,
                   help="patches per encoder call (0 = auto: 256 on CUDA, 64 on the CPU) [0]")
    r.add_argument("--workers", type=int, default=None,
                   help="reader processes, one pool for all slides (-1 = auto: 2-4 low-priority readers on the CPU, "
                        "CPUs - 2 up to 16 with CUDA; 0 = read in this process) [-1]")
    r.add_argument("--decode", choices=("workers", "device"), default=None,
                   help=f"decode stored JPEG patches in the readers or on the device (nvJPEG) [{d.decode}]")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help=f"[{d.device}]")
    r.add_argument("--amp", choices=("auto", "off", "bf16", "fp16"), default=None,
                   help="autocast precision; auto = bf16 on CPU and bf16-capable GPUs, else fp16 [auto]")
    r.add_argument("--no-channels-last", action="store_true", help="keep the NCHW memory layout")
    r.add_argument("--no-fuse-batchnorm", action="store_true", help="do not fold BatchNorm into the convolutions")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads (0 = torch default) [0]")
    t = p.add_argument_group("slides cut on the fly (stores are read as they are)")
    res = t.add_mutually_exclusive_group()
    res.add_argument("--magnification", type=float, default=None, metavar="X",
                     help="target magnification (40x = 0.25 µm/px) [the stores' plan, else 10]")
    res.add_argument("--mpp", type=float, default=None, help="target µm per pixel (instead of --magnification)")
    t.add_argument("--patch-size", type=int, default=None, metavar="PX", help="patch side at the target resolution [512]")
    t.add_argument("--tile-config", type=Path, default=None, metavar="TOML",
                   help="TOML of TileConfig fields (top level or [tile]) for everything else (tissue, entropy, stride)")
    t.add_argument("--slide-mpp", type=float, default=None, metavar="MPP",
                   help="level-0 µm/px for slides without an MPP (overrides the metadata)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cli import rank_tag, report_error, stderr_line
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.features import extract_features

    try:  # under torchrun with several ranks wsi_milssl.cli.main refuses features before it gets here
        config = features_config_from_args(args)
        tile = _tile_config(args)
    except ConfigError as exc:
        return report_error(exc, code=2)
    with TqdmProgress() as progress:
        result = extract_features(args.inputs, args.out, config, tile=tile, overwrite=args.overwrite,
                                  progress=progress)
    counts = {s: sum(r.status == s for r in result.results) for s in ("ok", "empty", "skipped", "failed")}
    rate = f", {result.n_patches / result.seconds:.1f} patches/s" if result.seconds > 0 and result.n_patches else ""
    dim = result.results[0].feature_dim if result.results else 0
    print(f"features ({config.encoder}, {dim}-d) of {len(result.results)} slide(s): "
          + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; {result.n_patches} patches in "
          f"{result.seconds:.1f} s{rate} -> {result.out_dir}")
    print(f"status: {result.status_csv}")
    for r in result.results:
        if r.status == "failed":
            stderr_line(f"{rank_tag()}failed: {r.slide}: {r.error}")
    return 0 if result.ok else 1
