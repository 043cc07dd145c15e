"""``wsi-milssl train INPUTS... --labels labels.csv --out RUN_DIR``: MIL-SSL training.

Inputs are patch stores (image mode, ResNet18 by default), HDF5 feature files (feature mode) or one MIL
CSV file ``label,bag_id,f1,...,fn`` (feature mode; bag labels come from the file). ``--resume RUN_DIR``
continues an interrupted run with its saved settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
from pathlib import Path

from wsi_milssl.cli.options import output_folder
from wsi_milssl.paths import folder_place

__all__ = ["SUMMARY", "register", "run", "add_train_options", "train_config_from_args", "load_instances", "detect_mode",
           "refuse_inputs_being_written", "warn_unfinished_inputs"]

#: one line for ``wsi-milssl --help``
SUMMARY = "train an instance classifier with MIL-SSL (slide labels only)"

# CLI option -> TrainConfig field for options that are plain values.
_VALUE_OPTIONS = {
    "model": "model", "weights": "weights_path", "hidden_dims": "hidden_dims", "dropout": "dropout",
    "epochs": "epochs", "batch_size": "batch_size", "eval_batch_size": "eval_batch_size",
    "optimizer": "optimizer", "lr": "lr", "momentum": "momentum", "weight_decay": "weight_decay",
    "scheduler": "scheduler", "mu": "mu", "mu_ramp_epochs": "mu_ramp_epochs", "lam": "lam",
    "refresh_every": "refresh_every", "warmup_epochs": "warmup_epochs",
    "pseudo_negative_weight": "pseudo_negative_weight", "bag_pooling": "bag_pooling",
    "colour_jitter": "colour_jitter",
    "select_metric": "select_metric", "seed": "seed", "device": "device", "amp": "amp",
    "workers": "num_workers", "threads": "threads", "sinkhorn_max_iter": "sinkhorn_max_iter",
    "sinkhorn_tol": "sinkhorn_tol", "shuffle_block": "shuffle_block", "decode": "decode", "compile": "compile",
}
# CLI flag -> (TrainConfig field, value when the flag is given)
_FLAG_OPTIONS = {
    "fixed_mu": ("fixed_mu", True), "hard_labels": ("soft_labels", False),
    "no_global_constraint": ("global_constraint", False), "no_local_constraint": ("local_constraint", False),
    "online_pseudo_labels": ("online_pseudo_labels", True), "no_augment": ("augment", False),
    "no_channels_last": ("channels_last", False), "no_plots": ("plots", False),
}


def add_train_options(p: argparse.ArgumentParser) -> None:
    """The TrainConfig options (shared by ``train`` and ``benchmark``). Unset options keep the config's
    defaults, which depend on the mode (see ``wsi_milssl.config.train``)."""
    from wsi_milssl.config.train import BAG_POOLINGS, COMPILE_MODES, TrainConfig
    from wsi_milssl.mil.models import list_models

    d = TrainConfig()
    m = p.add_argument_group("model and optimisation (defaults per mode: images | features)")
    m.add_argument("--model", choices=list_models(), default=None, help="instance classifier [resnet18 | mlp]")
    m.add_argument("--weights", default=None, metavar="PATH", help="local state dict to start from (never downloaded)")
    m.add_argument("--hidden-dims", type=int, nargs="+", default=None, metavar="N",
                   help=f"hidden layer widths of the mlp head [{' '.join(map(str, d.hidden_dims))}]")
    m.add_argument("--dropout", type=float, default=None, help=f"dropout of the mlp head [{d.dropout}]")
    m.add_argument("--epochs", type=int, default=None, help="training epochs [10 | 100]")
    m.add_argument("--batch-size", type=int, default=None, help="instances per step [64 | 512]")
    m.add_argument("--eval-batch-size", type=int, default=None, help=f"instances per inference batch [{d.eval_batch_size}]")
    m.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None, help="optimizer [sgd | adam]")
    m.add_argument("--lr", type=float, default=None, help="learning rate [1e-3 | 1e-3]")
    m.add_argument("--momentum", type=float, default=None, help=f"SGD momentum [{d.momentum}]")
    m.add_argument("--weight-decay", type=float, default=None, help=f"L2 weight decay [{d.weight_decay}]")
    m.add_argument("--scheduler", choices=("none", "cosine"), default=None, help=f"learning-rate schedule [{d.scheduler}]")
    m.add_argument("--bag-pooling", choices=BAG_POOLINGS, default=None,
                   help=f"bag score from instance probabilities (eq. 11) [{d.bag_pooling}]")
    s = p.add_argument_group("pseudo labels (paper eq. 4-10; table-8 ablation switches)")
    s.add_argument("--mu", type=float, default=None, help=f"expected positive ratio in positive bags, μ [{d.mu}]")
    s.add_argument("--mu-ramp-epochs", type=int, default=None, metavar="T",
                   help="epochs over which μ_t goes linearly from 0.5 to μ (eq. 10) [5 | 10]")
    s.add_argument("--fixed-mu", action="store_true", help="use μ from the first epoch (no adaptive schedule)")
    s.add_argument("--lam", type=float, default=None, help=f"entropic regularisation λ (eq. 6) [{d.lam}]")
    s.add_argument("--hard-labels", action="store_true", help="binarise the pseudo labels (no soft labels)")
    s.add_argument("--no-global-constraint", action="store_true",
                   help="take pseudo labels straight from the predictions (no optimal transport)")
    s.add_argument("--no-local-constraint", action="store_true",
                   help="do not force each positive bag's top instance to 1")
    s.add_argument("--refresh-every", type=int, default=None, metavar="STEPS",
                   help="refresh pseudo labels every STEPS optimizer steps (0 = every epoch) [0]")
    s.add_argument("--warmup-epochs", type=int, default=None, metavar="W",
                   help="train W epochs with every positive-bag instance labelled 1 before the first refresh "
                        f"[{d.warmup_epochs}]")
    s.add_argument("--pseudo-negative-weight", type=float, default=None, metavar="W",
                   help="weight of the negative part of positive-bag pseudo labels in the loss (1 = the paper's "
                        f"eq. 9; 0 = positive bags teach positives only) [{d.pseudo_negative_weight}]")
    s.add_argument("--online-pseudo-labels", action="store_true",
                   help="reuse the probabilities of the training pass instead of an extra forward pass")
    s.add_argument("--sinkhorn-max-iter", type=int, default=None, help=f"Sinkhorn iteration cap [{d.sinkhorn_max_iter}]")
    s.add_argument("--sinkhorn-tol", type=float, default=None, help=f"Sinkhorn tolerance [{d.sinkhorn_tol}]")
    r = p.add_argument_group("data, runtime and reproducibility")
    r.add_argument("--no-augment", action="store_true", help="no flips/rotations/colour jitter (image mode)")
    r.add_argument("--colour-jitter", type=float, default=None,
                   help=f"brightness/contrast/saturation jitter amplitude [{d.colour_jitter}]")
    r.add_argument("--select-metric", choices=("bag_auc", "instance_auc", "bag_nll"), default=None,
                   help="validation metric that picks best.pt: bag_auc (slide labels; needs validation slides of "
                        "both classes), bag_nll (the bag loss on slide labels; works with one class) or "
                        "instance_auc (reads the instance labels, from annotations, of the validation slides: "
                        "never give it the test slides) "
                        f"[{d.select_metric}]")
    r.add_argument("--seed", type=int, default=None, help=f"seed of every random stream [{d.seed}]")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help=f"[{d.device}]")
    r.add_argument("--amp", choices=("auto", "off", "bf16", "fp16"), default=None,
                   help="autocast precision; auto = bf16 on CUDA and for ResNet on CPU [auto]")
    r.add_argument("--no-channels-last", action="store_true", help="keep NCHW memory layout for the ResNet")
    r.add_argument("--workers", type=int, default=None,
                   help="patch-reading processes, alive for the whole run (-1 = auto: CPUs - 2 up to 16 on CUDA; "
                        "min(4, CPUs - 1) on the CPU, none on <= 2 CPUs; under torchrun divided by the ranks per "
                        "node, LOCAL_WORLD_SIZE) [-1]")
    r.add_argument("--shuffle-block", type=int, default=None, metavar="N",
                   help="image mode: shuffle blocks of N consecutive patches of a slide, then the patches in each "
                        f"block (sequential reads; 1 = a uniform permutation) [{d.shuffle_block}]")
    r.add_argument("--decode", choices=("workers", "device"), default=None,
                   help="where stored JPEG patches are decoded: in the readers, or on the training device in "
                        f"batches (torchvision; nvJPEG on CUDA) [{d.decode}]")
    r.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="run the training step through torch.compile in this mode (up to a minute of compilation "
                        "first); on a GPU reduce-overhead (CUDA graphs) doubled the training pass at 224 px on an "
                        "H100, default slowed it (README, Speed) [off]")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads (0 = torch default) [0]")
    r.add_argument("--no-plots", action="store_true", help="do not draw metrics.png")
    r.add_argument("--config", type=Path, default=None, metavar="TOML",
                   help="TOML file of TrainConfig fields (top level or a [train] table); options override it")


def train_config_from_args(args: argparse.Namespace, *, mode: str, base: dict | None = None):
    """Build a TrainConfig: ``base`` values, then ``--config`` TOML, then the options given."""
    from wsi_milssl.cli.options import config_table
    from wsi_milssl.config.base import config_from_mapping
    from wsi_milssl.config.train import TrainConfig

    values: dict = dict(base or {})
    if getattr(args, "config", None) is not None:
        values.update(config_table(args.config, "train"))
    for opt, field in _VALUE_OPTIONS.items():
        value = getattr(args, opt, None)
        if value is not None:
            values[field] = tuple(value) if isinstance(value, list) else value
    for opt, (field, value) in _FLAG_OPTIONS.items():
        if getattr(args, opt, False):
            values[field] = value
    values["mode"] = mode
    return config_from_mapping(TrainConfig, values, source=str(getattr(args, "config", None) or "options"))


def detect_mode(inputs: list[Path]) -> str:
    """'mil-csv' for .csv inputs; 'features' when the first readable HDF5 file given, or found in a folder
    given, holds 'features' and no 'patches' (this project's, TRIDENT's and CLAM's feature files); else
    'images'. A file that cannot be opened (a damaged one) does not decide: its reader names it later."""
    import h5py

    from wsi_milssl.features.schema import feature_files_of, is_feature_file

    if inputs and all(p.suffix.lower() == ".csv" for p in inputs):
        return "mil-csv"
    h5 = [p for p in feature_files_of(inputs) if p.suffix.lower() in (".h5", ".hdf5") and p.is_file()]
    for path in h5:
        try:
            with h5py.File(path, "r"):
                pass
        except OSError:
            continue
        return "features" if is_feature_file(path) else "images"
    if not h5:  # a CLAM or TRIDENT job folder: said before a feature model is refused for images (review CW)
        from wsi_milssl.errors import ConfigError
        from wsi_milssl.mil.data import nested_feature_folders
        from wsi_milssl.store import find_stores

        folders = [p for p in inputs if p.is_dir()]
        hint = nested_feature_folders(folders) if folders and not find_stores(folders) else ""
        if hint:
            raise ConfigError(f"no patch stores or feature files directly in {', '.join(map(str, folders[:3]))}, but "
                              f"{hint}")
    return "images"


def _input_folders(inputs: list[Path]) -> list[Path]:
    """The folders of ``inputs``: a folder given, or the folder of a store or feature file given (once each)."""
    folders: list[Path] = []
    for path in map(Path, inputs):
        folder = path.parent if path.is_file() or path.suffix.lower() == ".zarr" else path  # a .zarr store is a folder
        if folder not in folders:
            folders.append(folder)
    return folders


def refuse_inputs_being_written(inputs: list[Path], *, option: str = "INPUTS") -> None:
    """Refuse inputs in a folder that another run still writes: a live process holds the folder's lock
    (:func:`wsi_milssl.locks.folder_writer`), as ``tile`` and ``features`` do while slides are still to come
    and ``label`` while it rewrites the stores. Training would take the slides written so far without a
    word. A folder is checked for itself and for the files (stores, feature files) given in it; a run of
    this process (a pipeline's own stages) does not count. ``option`` names the inputs in the error."""
    from wsi_milssl.errors import FolderLockedError
    from wsi_milssl.locks import folder_writer

    for folder in _input_folders(inputs):
        writer = folder_writer(folder)
        if writer is not None:
            raise FolderLockedError(f"{option} {folder}: {writer} is still writing this folder, so the slides in it "
                                    "are not complete. Fix: wait until that run (every shard of it) finishes, then "
                                    "train.")


def warn_unfinished_inputs(inputs: list[Path], *, mode: str, labels_path: Path | None, bag_names: list[str],
                           option: str = "INPUTS") -> None:
    """Warn about inputs in a folder whose last ``tile`` run (image mode; ``features`` run: feature mode) did
    not finish (Ctrl-C, SIGTERM, kill -9, a crash: it left its mark,
    :func:`wsi_milssl.tiling.status.unfinished_runs`) when slides that run was to make have no store (feature
    file) there and are labelled in ``labels_path``: training goes on without them. A warning, not a refusal:
    training on the slides there may be what is wanted. ``bag_names``: the bags read (training and
    validation), so a slide read from another input is not missing. ``option`` names the inputs."""
    import time

    from wsi_milssl.features.schema import feature_files_of
    from wsi_milssl.mil.data import read_labels_csv
    from wsi_milssl.store import find_stores
    from wsi_milssl.tiling.status import unfinished_runs

    if mode not in ("images", "features") or labels_path is None:
        return
    stage, what = ("tile", "store") if mode == "images" else ("features", "feature file")
    read = {name.casefold() for name in bag_names}
    labels = None
    for folder in _input_folders(inputs):
        runs = unfinished_runs(folder, stage)
        if not runs:
            continue
        if labels is None:
            labels = read_labels_csv(labels_path)
        if all(isinstance(r.get("slides"), list) for r in runs):
            planned = sorted({str(stem) for r in runs for stem in r["slides"]})
        else:  # a mark that cannot be read: every labelled slide may be one of the run's
            planned = list(labels)
        files = find_stores(folder) if mode == "images" else feature_files_of([folder])
        made = {p.stem for p in files}  # <stem>.h5, <stem>.zarr
        missing = [stem for stem in planned if stem in labels and stem.casefold() not in read and stem not in made]
        if not missing:
            continue
        last = runs[-1]
        started = last.get("started")
        since = (time.strftime("; started %Y-%m-%d %H:%M:%S", time.localtime(started))
                 if isinstance(started, (int, float)) else "")
        command = str(last.get("command") or f"wsi-milssl {stage}")
        names = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        logging.getLogger(__name__).warning(
            "%s %s: the last `wsi-milssl %s` run into this folder did not finish (stopped or killed%s: %s): %d "
            "slide%s of %s that it was to make %s no %s here (%s), so training goes on without %s; the folder "
            "holds %d %s%s. Fix, unless that is what you want: run that command again to finish the folder (it "
            "skips the slides done), then train again.",
            option, folder, stage, since, command, len(missing), "" if len(missing) == 1 else "s",
            Path(labels_path).name, "has" if len(missing) == 1 else "have", what, names,
            "it" if len(missing) == 1 else "them", len(files), what, "" if len(files) == 1 else "s")


def load_instances(inputs: list[Path], *, mode: str, labels_path: Path | None, option: str = "INPUTS"):
    """Read the InstanceSet for ``mode`` ('images', 'features' or 'mil-csv'); stores and feature files in a
    folder that another run still writes are refused (:func:`refuse_inputs_being_written`, ``option``
    naming them)."""
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.mil.data import read_feature_files, read_labels_csv, read_mil_csv, read_patch_stores

    if mode != "mil-csv":
        refuse_inputs_being_written(inputs, option=option)
    if mode == "mil-csv":
        if len(inputs) != 1:
            raise ConfigError(f"mil-csv mode reads one CSV file; got {len(inputs)} inputs.")
        return read_mil_csv(inputs[0])
    if labels_path is None:
        raise ConfigError(f"{mode} mode needs --labels labels.csv (slide,label) for the bag labels.")
    labels = read_labels_csv(labels_path)
    if mode == "features":
        return read_feature_files(inputs, labels, labels_path=str(labels_path))  # folders: their files
    return read_patch_stores(inputs, labels, labels_path=str(labels_path))


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "train",
        help=SUMMARY,
        description=(
            "MIL-SSL: every patch of a negative slide is a negative; the patches of positive slides get\n"
            "optimal-transport pseudo labels (a fraction μ positive, each slide's top patch positive) that\n"
            "are refreshed as the model learns. Writes RUN_DIR/last.pt every epoch, best.pt (chosen on\n"
            "--val), metrics.jsonl, metrics.png and config.json.\n\n"
            "examples:\n"
            "  wsi-milssl train stores/ --labels slides/labels.csv --out runs/r1 --val val_stores/\n"
            "  wsi-milssl train musk1.csv --out runs/musk1          (MIL CSV: label,bag_id,f1..fn)\n"
            "  wsi-milssl train feats/ --labels labels.csv --out runs/f1   (HDF5 'features': files of\n"
            "                        `wsi-milssl features`, TRIDENT or CLAM, as they are)\n"
            "  wsi-milssl train --resume runs/r1                     (continue an interrupted run)"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("inputs", nargs="*", type=Path, metavar="INPUTS",
                   help="patch stores or folders of them, HDF5 feature files (wsi-milssl features, TRIDENT, CLAM) "
                        "or folders of them, or one MIL CSV")
    p.add_argument("--labels", type=Path, default=None, metavar="CSV", help="slide,label CSV (1 = tumour)")
    p.add_argument("--out", type=output_folder, default=None, metavar="RUN_DIR", help="run folder (created)")
    p.add_argument("--val", type=Path, nargs="+", default=None, metavar="INPUTS",
                   help="validation stores/files (selects best.pt; never use the test set)")
    p.add_argument("--val-labels", type=Path, default=None, metavar="CSV", help="labels of --val [--labels]")
    p.add_argument("--mode", choices=("auto", "images", "features", "mil-csv"), default="auto",
                   help="input kind; auto looks at the files")
    p.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR/last.pt with the run's saved inputs and settings")
    add_train_options(p)
    p.set_defaults(run=run)


def _resume_setup(args: argparse.Namespace):
    import math

    from wsi_milssl.config.base import config_from_mapping
    from wsi_milssl.config.train import TrainConfig
    from wsi_milssl.errors import CheckpointError, ConfigError
    from wsi_milssl.mil.sinkhorn import LAM_MAX

    run_dir = args.resume
    cfg_path = run_dir / "config.json"
    if not (run_dir / "last.pt").is_file():
        from wsi_milssl.mil.run_folder import missing_checkpoint_error

        raise missing_checkpoint_error(run_dir)
    if not cfg_path.is_file():
        raise CheckpointError(f"{run_dir}: no config.json to resume from; start the run without --resume.")
    fix = "restore it from the run's last.pt (its 'config'), or start a new run without --resume"
    try:
        saved = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_path}: cannot read the run's settings ({type(exc).__name__}: {exc}); "
                              f"the file is damaged. Fix: {fix}.") from None
    data = saved.get("data") if isinstance(saved, dict) else None
    data = {} if data is None else data
    if not isinstance(saved, dict) or not isinstance(data, dict):
        raise CheckpointError(f"{cfg_path}: not the settings of a `wsi-milssl train` run (expected a JSON object "
                              f"with a 'data' object). Fix: {fix}.")
    inputs, labels = data.get("inputs", []), data.get("labels")
    val, val_labels = data.get("val_inputs"), data.get("val_labels")
    input_mode = data.get("input_mode", "images")
    if (not isinstance(inputs, list) or not all(isinstance(p, str) and p for p in inputs)
            or not (val is None or isinstance(val, list) and all(isinstance(p, str) and p for p in val))
            or not all(v is None or isinstance(v, str) for v in (labels, val_labels))
            or input_mode not in ("images", "features", "mil-csv")):
        raise CheckpointError(f"{cfg_path}: 'data' does not list the run's inputs as paths (inputs, labels, "
                              f"val_inputs, val_labels, input_mode). Fix: {fix}.")
    fields = {f for f in TrainConfig.__dataclass_fields__}
    base = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in fields}
    base.pop("mode", None)
    mode = "images" if input_mode == "images" else "features"
    lam = base.get("lam")
    if isinstance(lam, (int, float)) and not isinstance(lam, bool) and math.isfinite(lam) and lam > LAM_MAX:
        # allowed before the cap: correcting it would not resume the run either (the checkpoint's λ differs)
        raise ConfigError(
            f"{cfg_path}: this run was saved with λ (lam) = {lam:g}, above the {LAM_MAX:g} that this version "
            f"allows (at {LAM_MAX:g} the pseudo labels are already 0/1; from about 1e15 float64 cannot place "
            "their cut), and a run resumes with its own settings, so it cannot be resumed on this version. Fix: "
            f"start a new run without --resume, with a λ of at most {LAM_MAX:g} (the paper's is 25); if "
            f"{cfg_path.name} was edited, restore its λ from the run's last.pt instead.")
    try:
        config_from_mapping(TrainConfig, {**base, "mode": mode}, source=str(cfg_path))
    except ConfigError as exc:  # its own fix is for settings given now (review CZ: two Fix: sentences)
        problem = str(exc).split(" Fix: ")[0].rstrip(".")
        raise ConfigError(f"{problem}. Fix: correct that value in {cfg_path.name}, or start a new run without "
                          "--resume.") from None
    missing = [p for p in [*inputs, labels, *(val or []), val_labels] if p and not Path(p).exists()]
    was = data.get("run_dir") if isinstance(data.get("run_dir"), str) and Path(data["run_dir"]).is_absolute() else None
    moved = (_moved_with_the_run(missing, run_dir, Path(was)) if missing and was is not None
             and all(Path(p).is_absolute() for p in missing) else None)
    if moved is not None:  # review DD: a pipeline's OUT moved: its stores are below it still
        old, new = moved
        was = str(folder_place(run_dir))  # where the inputs are recorded from now on (review DU)
        logging.getLogger(__name__).warning(
            "%s: the run's inputs recorded below %s are read from below %s, where the run folder is now (moved "
            "with it).", cfg_path, old, new)

        def now(p):
            return str(new / Path(p).relative_to(old)) if p in missing else p

        inputs, labels = [now(p) for p in inputs], labels and now(labels)
        val, val_labels = (None if val is None else [now(p) for p in val]), val_labels and now(val_labels)
        missing = []
    if missing and all(Path(p).is_absolute() for p in missing):  # this version records absolute paths
        raise CheckpointError(f"{cfg_path}: the run's inputs {', '.join(missing[:3])} are not found; the run "
                              "recorded them as absolute paths, so they were moved or removed since. Fix: put the "
                              "inputs back at those paths, or start a new run (a new --out, without --resume) with "
                              "the inputs where they are now.")
    if missing:
        raise CheckpointError(f"{cfg_path}: the run's inputs {', '.join(missing[:3])} are not found from {Path.cwd()}"
                              " (runs of earlier versions recorded paths as typed). Fix: run `train --resume` from "
                              "the folder the run was started in, or put the inputs back.")
    return (run_dir, base, input_mode, [Path(p) for p in inputs], Path(labels) if labels else None,
            [Path(p) for p in val or []] or None, Path(val_labels) if val_labels else None, was)


def _moved_with_the_run(missing: list[str], run_dir: Path, was: Path) -> tuple[Path, Path] | None:
    """(old folder, new folder) when the run folder, recorded at ``was``, moved with a folder that held it (up to
    four levels up: the same names below it, at another place) and every one of the run's ``missing`` inputs
    (absolute paths) is found at the same place below that folder's new place: the run moved together with its
    inputs (a pipeline's OUT with its stores), else None. A folder whose inputs alone are gone, beside other data of
    the same layout, is not taken for one (review DT)."""
    here = folder_place(run_dir)
    for up in range(1, 5):
        if up >= len(here.parts) or up >= len(was.parts):
            break
        holder, old = here.parents[up - 1], was.parents[up - 1]
        if holder == old or here.relative_to(holder) != was.relative_to(old):
            continue
        if all(Path(p).is_relative_to(old) and (holder / Path(p).relative_to(old)).exists() for p in missing):
            return old, holder
    return None


def _check_same_encoder(train, val) -> None:
    """Refuse validation features of another encoder or other weights than the training features, where
    both sets record them (:func:`~wsi_milssl.features.schema.encoders_differ`, the rule heatmap applies),
    and validation files that record other feature settings (encoder settings, dtype, input size,
    precision, resolution, patch size) than the training files
    (:func:`~wsi_milssl.mil.data.feature_settings_clash`). Inside one set
    :func:`~wsi_milssl.mil.data.read_feature_files` is stricter: files that record weights and files that
    do not (random weights, other tools) are not mixed."""
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.features.schema import encoder_label, encoders_differ
    from wsi_milssl.mil.data import feature_settings_clash

    keys = ("feature_encoder", "feature_encoder_weights_sha256")
    trained, checked = (tuple(s.settings.get(k) for k in keys) for s in (train, val))
    if encoders_differ(checked, trained):
        raise ConfigError(f"the validation features ({val.source}) are of {encoder_label(*checked)}, but the training "
                          f"features ({train.source}) of {encoder_label(*trained)}; a head needs one encoder's "
                          "features. Fix: extract the validation slides with the training encoder and weights.")
    clash = feature_settings_clash(train, val)
    if clash is not None:
        trained_file, val_file, diffs = clash
        raise ConfigError(f"the validation features {val_file} were made with other settings than the training "
                          f"features {trained_file} ({'; '.join(diffs)}); validation must see features like the "
                          "ones the head trains on. Fix: extract the validation slides with the training settings "
                          "(the same encoder options, resolution and patch size).")


def _check_held_out(train, val, val_inputs, *, input_mode: str = "images") -> None:
    """Refuse validation bags that are training bags (``train X --val X``, or a training store among the
    validation inputs; for a MIL CSV, whose bag ids are local to their file, a bag of the same file or a copy):
    best.pt would be chosen, in part or in whole, on the data the model trains on (review CK: a partial overlap
    was a warning, which ``-q`` hides). ``fit`` itself, from Python, warns."""
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.mil.data import held_out_bags

    held_out = set(held_out_bags(train, val))
    shared = [n for n in val.bag_names if n not in held_out]
    if not shared:
        return
    names = ", ".join(shared[:5]) + (", ..." if len(shared) > 5 else "")
    held = ("bags held out from training (their own MIL CSV)" if input_mode == "mil-csv"
            else "slides held out from training (their own stores or feature files)")
    which = f"all {val.n_bags}" if len(shared) == val.n_bags else f"{len(shared)} of the {val.n_bags}"
    are = "is a training bag" if len(shared) == 1 and val.n_bags > 1 else "are training bags"
    drop = ("drop --val" if len(shared) == val.n_bags else "remove those bags' rows from the validation CSV"
            if input_mode == "mil-csv" else "drop those from --val or from INPUTS")
    raise ConfigError(f"--val {' '.join(str(p) for p in val_inputs)}: {which} validation bags {are} "
                      f"({names}), so best.pt would be chosen on the data the model trains on. Fix: validate on "
                      f"{held}, or {drop}.")


def _set_up(args: argparse.Namespace):
    """The run's folder, TrainConfig, training and validation InstanceSets and run info (its inputs) from
    the command line (or the run's saved settings for --resume); warns about inputs a stopped run left short."""
    from wsi_milssl.errors import ConfigError, OptionError

    if args.resume is not None:
        given = [name for name, value in (("INPUTS", args.inputs), ("--labels", args.labels), ("--out", args.out),
                                          ("--val", args.val), ("--val-labels", args.val_labels))
                 if value] + (["--mode"] if args.mode != "auto" else [])
        if given:
            raise ConfigError(f"--resume {args.resume} continues the run with the inputs it saved; {', '.join(given)} "
                              "would be ignored. Fix: drop them, or start a new run (a new --out) with them.")
        if Path(args.resume).is_dir():  # a live run's folder lacks last.pt in its first epoch (review CQ): said first
            from wsi_milssl.locks import refuse_written_folder

            refuse_written_folder(args.resume)
        out, base, input_mode, inputs, labels, val_inputs, val_labels, recorded_dir = _resume_setup(args)
    else:
        if not args.inputs:
            took = ("" if not args.val or len(args.val) < 2 else
                    f" (--val took {' '.join(shlex.quote(str(v)) for v in args.val)}: it takes every path after it, "
                    "so put the training inputs before --val)")  # (review EW: the inputs were given)
            raise OptionError(f"no inputs; pass patch stores, feature files or a MIL CSV (or --resume RUN_DIR){took}.")
        if args.out is None:
            raise OptionError("--out RUN_DIR is required (where checkpoints and metrics go).")
        out, base, recorded_dir = args.out, {}, None
        inputs, labels, val_inputs = list(args.inputs), args.labels, args.val
        val_labels = args.val_labels or args.labels
        input_mode = detect_mode(inputs) if args.mode == "auto" else args.mode
        if (out / "last.pt").exists():  # before the inputs are read (fit checks it too)
            from wsi_milssl.locks import refuse_written_folder
            from wsi_milssl.mil.run_folder import existing_run_error

            refuse_written_folder(out, named_by="--out")  # a live run's folder: not "pass --resume" (review DA)
            raise existing_run_error(out)
    if Path(out).is_dir():  # before the inputs are read and the ranks meet (fit takes the lock itself)
        from wsi_milssl.locks import refuse_written_folder

        refuse_written_folder(out, named_by=None if args.resume is not None else "--out")
    if args.resume is not None:  # a read-only run folder: refused before the inputs are read and the start line
        from wsi_milssl.atomic import check_writable
        from wsi_milssl.errors import OutputError
        from wsi_milssl.locks import folder_write_error

        try:
            check_writable(Path(out) / "last.pt")
        except OutputError as exc:  # a resume writes where the run is: no "another --out" (review EV)
            if not exc.errno:
                raise
            raise folder_write_error(Path(out), OSError(exc.errno, os.strerror(exc.errno)), "cannot write to this run",
                                     None) from None
    mode = "images" if input_mode == "images" else "features"
    try:
        config = train_config_from_args(args, mode=mode, base=base)
    except ConfigError as exc:  # a bad option value is a usage error, exit code 2 as in tile (review BQ)
        raise OptionError(str(exc)) from None
    resumed = args.resume is not None
    if config.weights_path and not resumed:  # absolute, as the inputs below (a resume does not read the weights)
        config = dataclasses.replace(config, weights_path=str(Path(config.weights_path).expanduser().resolve()))
    train = load_instances(inputs, mode=input_mode, labels_path=labels,
                           option="the run's input" if resumed else "INPUTS")
    val = (load_instances(val_inputs, mode=input_mode, labels_path=val_labels,
                          option="the run's --val input" if resumed else "--val") if val_inputs else None)
    # a tile or features run stopped before its last slide: the slides it did not make are missing without a word
    read = [*train.bag_names, *(val.bag_names if val is not None else [])]
    warn_unfinished_inputs(inputs, mode=input_mode, labels_path=labels, bag_names=read,
                           option="the run's input" if resumed else "INPUTS")
    if val_inputs:
        warn_unfinished_inputs(val_inputs, mode=input_mode, labels_path=val_labels, bag_names=read,
                               option="the run's --val input" if resumed else "--val")
    if val is not None:
        _check_same_encoder(train, val)
        if args.resume is None:
            _check_held_out(train, val, val_inputs, input_mode=input_mode)
    # absolute paths: `train --resume` may run from another folder
    run_info = {"data": {"inputs": [str(Path(p).resolve()) for p in inputs],
                         "labels": str(Path(labels).resolve()) if labels else None,
                         "val_inputs": [str(Path(p).resolve()) for p in val_inputs] if val_inputs else None,
                         "val_labels": str(Path(val_labels).resolve()) if val_inputs and val_labels else None,
                         "input_mode": input_mode,
                         # where the run folder was when its inputs were recorded (a resume of a run moved with its
                         # inputs finds them; the recorded place is kept while they are read from where they were)
                         "run_dir": recorded_dir or str(folder_place(out))}}
    return out, config, train, val, run_info


def run(args: argparse.Namespace) -> int:

    from wsi_milssl.cli import RANK0_WAIT_S
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.distributed import close_group, exit_now, init_group, reported_by_rank0
    from wsi_milssl.errors import ReaderLostError, StoreReadError
    from wsi_milssl.mil.selftrain import fit
    from wsi_milssl.parent_watch import watch_launcher

    # the inputs and settings are the same on every rank: torchrun's rank 0 alone reports their warnings and errors
    with reported_by_rank0(wait_s=RANK0_WAIT_S):
        out, config, train, val, run_info = _set_up(args)
    # a rank of a torchrun killed (kill -9, the OOM killer) stops instead of training on, holding the run's lock
    watch_launcher(message=f"`wsi-milssl train --resume {shlex.quote(str(out))}` continues the run from the last epoch saved (its "
                           "last.pt).")
    dist = init_group(config.device)  # under torchrun: this process's rank; else one process
    try:
        if not dist.is_main:  # rank 0 reports; the others train quietly
            # a bad training set is every rank's error; a patch only this rank reads, or its lost reader, its own
            with reported_by_rank0(wait_s=RANK0_WAIT_S, warnings=False, own_errors=(StoreReadError, ReaderLostError)):
                fit(train, config=config, out_dir=out, val=val, resume=args.resume is not None, run_info=run_info,
                    dist=dist)
            close_group(dist, finished=True)  # waits until rank 0 has written the run folder
            exit_now(0)  # without the interpreter's shutdown, which could abort (exit -6) a finished rank
        ranks = f" on {dist.world_size} ranks ({dist.backend})" if dist.enabled else ""
        print(f"training {config.model} on {len(train)} instances in {train.n_bags} bags "
              f"({int(train.bag_labels.sum())} positive){'' if val is None else f'; validation {val.n_bags} bags'}"
              f"{ranks}")
        with TqdmProgress() as progress:
            result = fit(train, config=config, out_dir=out, val=val, resume=args.resume is not None,
                         run_info=run_info, progress=progress, dist=dist)
        close_group(dist, finished=True)  # the other ranks wait here for rank 0's last files
    finally:
        close_group(dist)
    last = result.history[-1] if result.history else {}
    shown = {k: last.get(k) for k in ("loss", "pseudo_label_mean", "pseudo_precision", "val_instance_auc",
                                      "val_bag_auc", "val_bag_accuracy") if last.get(k) is not None}
    print(f"epoch {last.get('epoch')}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
    if result.best_epoch is not None:
        print(f"best epoch on validation: {result.best_epoch} -> {out / 'best.pt'}")
    elif val is None:  # (review EW: `heatmap --model RUN/best.pt` then failed, nothing having said why)
        print(f"no validation set (--val), so no best.pt: pass the run folder {out} (its last.pt) to heatmap")
    print(f"run folder: {out} (last.pt, metrics.jsonl{', metrics.png' if config.plots else ''}, config.json)")
    return 0
