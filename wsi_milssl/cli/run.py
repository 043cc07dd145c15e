"""``wsi-milssl run PIPELINE.toml``: every stage in order, skipping those already up to date."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wsi_milssl.cli.options import output_folder

__all__ = ["SUMMARY", "register", "run", "run_and_report"]

#: one line for ``wsi-milssl --help``
SUMMARY = "run a pipeline file (synth -> tile -> label -> train -> heatmap -> evaluate)"


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter
    from wsi_milssl.pipeline import STAGES

    p = subparsers.add_parser(
        "run",
        help=SUMMARY,
        description="Run the stages of a pipeline TOML file in order. A stage whose settings and inputs\n"
        "match its last run, and whose outputs still exist, is skipped. Ready-made files are in\n"
        "pipelines/ of a checkout and in the installed package (demo, camelyon16, camelyon16-features,\n"
        "tcga-features; a missing PIPELINE.toml names their folder); `wsi-milssl prepare` writes one\n"
        "for your slides.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("pipeline", type=Path, metavar="PIPELINE.toml", help="pipeline file")
    p.add_argument("--out", type=output_folder, default=None,
                   help="output folder, overriding [pipeline].out_dir (default: as in the file); either, when "
                        "relative, is below the current folder")
    p.add_argument("--force", nargs="+", default=[], choices=STAGES, metavar="STAGE",
                   help="re-run these stages (and everything after them) even when up to date")
    p.add_argument("--until", default=None, choices=STAGES, metavar="STAGE", help="stop after this stage")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="TABLE.KEY=VALUE",
                   help="override one setting of the file, repeatable: --set train.epochs=3 --set "
                        "heatmap.colormap=magma --set 'train.grid.mu=[0.1, 0.2]' (values in TOML syntax; a "
                        "bare word is a string). A run of every stage (no --until) writes the pipeline as it ran to "
                        "OUT/resolved_pipeline.toml when it finishes")
    p.set_defaults(run=run)


def run_and_report(pipeline: Path, *, out: Path | None, force=(), until=None, overrides=(),
                   out_named_by: str = "--out") -> int:
    from wsi_milssl.cli.progress import TqdmProgress
    from wsi_milssl.pipeline import run_pipeline

    spec = _load(pipeline, out=out, overrides=overrides)
    print(f"pipeline {spec.name!r} from {spec.source} -> {spec.out_dir}"
          + (f" (with --set {' --set '.join(spec.overrides)})" if spec.overrides else ""))

    def show(outcome) -> None:
        if outcome.status == "skipped":
            print(f"[{outcome.stage}] skipped ({outcome.summary or 'up to date'})", flush=True)
        else:
            why = f" ({outcome.reason})" if outcome.reason else ""
            print(f"[{outcome.stage}] {outcome.seconds:.1f} s{why}: {outcome.summary}", flush=True)

    with TqdmProgress() as progress:
        run_pipeline(spec, force=force, until=until, progress=progress, on_stage=show, out_named_by=out_named_by)
    report = spec.out_dir / "evaluation" / "report.html"
    metrics = report.with_name("metrics.json")
    if until in (None, "evaluate") and (report.exists() or metrics.exists()):
        # a feature pipeline's evaluation has metrics.json and no report (review BS: it ended without a pointer)
        print(f"report: {report}" if report.exists() else f"metrics: {metrics}")
    sys.stdout.flush()
    return 0


def _load(pipeline: Path, *, out: Path | None, overrides):
    """The pipeline with its --set values ([data] paths checked); an error the --set values alone cause is a
    usage error (OptionError, exit code 2), as a wrong option of any other command is (review CX)."""
    from wsi_milssl.errors import ConfigError, OptionError
    from wsi_milssl.pipeline import load_pipeline

    try:
        return load_pipeline(pipeline, out_dir=out, overrides=overrides, check_paths=True)
    except ConfigError as exc:
        if not overrides or isinstance(exc, OptionError):
            raise
        try:
            load_pipeline(pipeline, out_dir=out, check_paths=True)
        except ConfigError:
            raise exc from None  # the file itself is wrong: exit code 1, as without --set
        raise OptionError(str(exc)) from None


def packaged_pipelines() -> Path:
    """The folder of the ready-made pipelines installed with the package (``wsi_milssl/pipelines``)."""
    from importlib.resources import files

    return Path(str(files("wsi_milssl") / "pipelines"))


def run(args: argparse.Namespace) -> int:
    if not args.pipeline.exists():  # e.g. `run pipelines/camelyon16.toml` after a pip install (no checkout)
        from wsi_milssl.errors import ConfigError

        folder = packaged_pipelines()
        names = ", ".join(sorted(p.name for p in folder.glob("*.toml")))
        raise ConfigError(f"{args.pipeline}: pipeline file not found. Fix: check the path; the ready-made pipelines "
                          f"installed with the package are in {folder} ({names}): copy one beside your data (its "
                          "data paths are relative to its own folder), or write one for your slides with "
                          "`wsi-milssl prepare`.")
    return run_and_report(args.pipeline, out=args.out, force=args.force, until=args.until, overrides=args.overrides)
