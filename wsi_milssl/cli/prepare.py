"""``wsi-milssl prepare camelyon16 ROOT --out DIR`` / ``prepare folder --slides DIR --labels CSV --out DIR``."""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from wsi_milssl.cli.options import output_folder

__all__ = ["SUMMARY", "register", "run"]

#: one line for ``wsi-milssl --help``
SUMMARY = "turn a downloaded cohort (CAMELYON16 or any folder) into slide lists, labels and a ready pipeline"


def _seed(text: str) -> int:
    """A split seed: a whole number >= 0 (numpy's generators take no negative seed)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "prepare",
        help=SUMMARY,
        description=(
            "Find the slides of a cohort (recursively), match them to their labels and annotations by name\n"
            "(case-insensitive) and write OUT/cohort/{train,test}_slides.csv, {train,test}_labels.csv,\n"
            "annotations/{train,test}/ and OUT/pipeline.toml, ready for `wsi-milssl run OUT/pipeline.toml`\n"
            "(outputs in OUT/run). Every unmatched name is listed in one error (exit code 1).\n"
            "Preparing again keeps a pipeline.toml edited since (or not written by prepare) and writes the\n"
            "new one beside it as pipeline.new.toml, with a note.\n"
            "Slide files that hold the same bytes are left out with a note: a training slide identical to a\n"
            "test slide (out of training), identical slides with different labels (all), or with the same\n"
            "label (all but one).\n\n"
            "examples:\n"
            "  wsi-milssl prepare camelyon16 /data/CAMELYON16 --out /data/c16\n"
            "  wsi-milssl prepare camelyon16 /data/CAMELYON16 --exclude Test_114 --out /data/c16\n"
            "  wsi-milssl prepare folder --slides /data/cohort --labels /data/cohort/labels.csv --out /data/prep\n"
            "  wsi-milssl run /data/c16/pipeline.toml"
        ),
        formatter_class=HelpFormatter,
    )
    layouts = p.add_subparsers(dest="layout", metavar="LAYOUT", required=True)

    c = layouts.add_parser(
        "camelyon16",
        help="the CAMELYON16 folder as downloaded",
        description=(
            "ROOT as downloaded: training/normal/Normal_NNN.tif, training/tumor/Tumor_NNN.tif,\n"
            "testing/images/Test_NNN.tif (or every slide in one folder), the lesion annotations (ASAP XML,\n"
            "loose or in lesion_annotations.zip) and the test set's reference.csv as shipped (no header:\n"
            "Test_001,Tumor,Macro,...). Training labels come from the names, test labels from reference.csv."
        ),
        formatter_class=HelpFormatter,
    )
    c.add_argument("root", type=Path, metavar="ROOT", help="the CAMELYON16 folder")
    c.add_argument("--reference", type=Path, default=None, metavar="CSV",
                   help="the test labels (default: the reference.csv found below ROOT)")
    c.add_argument("--annotations", type=Path, default=None, metavar="DIR",
                   help="a folder of lesion annotations (XML, or lesion_annotations.zip) searched too, for "
                        "annotations downloaded apart from the slides (default: those below ROOT only)")
    _common(c)

    f = layouts.add_parser(
        "folder",
        help="any folder of slides with a labels file",
        description=(
            "Slides below --slides (recursively), labels from --labels ('slide,label' with or without a\n"
            "header, Tumor/Normal or 1/0), annotations (<name>.xml / .geojson) below --annotations (default:\n"
            "the slides folder). The test set is --test-slides/--test-labels, or a stratified, seeded\n"
            "--test-fraction of the slides. A labels file with a header naming a patient column\n"
            "('slide,patient,label'; patient, patient_id, case_id or case_submitter_id, any case; or the\n"
            "column --patient-column names) holds out whole patients: a patient's slides are all in the\n"
            "training or all in the test set (patients stratified by their highest label), and the labels\n"
            "files written keep a patient column. A column named 'case' is not read as patients (datasets\n"
            "use it for other things). The output's 'split:' line says which column kept patients whole.\n"
            "Tumour test slides need their annotation (the FROC does)."
        ),
        formatter_class=HelpFormatter,
    )
    f.add_argument("--slides", type=Path, required=True, metavar="DIR", help="folder of slides (searched recursively)")
    f.add_argument("--labels", type=Path, required=True, metavar="CSV", help="slide labels")
    f.add_argument("--annotations", type=Path, default=None, metavar="DIR",
                   help="folder of annotations (default: the slides folder)")
    f.add_argument("--test-slides", type=Path, default=None, metavar="DIR", help="a separate test set's slides")
    f.add_argument("--test-labels", type=Path, default=None, metavar="CSV", help="its labels")
    f.add_argument("--test-annotations", type=Path, default=None, metavar="DIR",
                   help="its annotations (default: the test slides folder)")
    f.add_argument("--test-fraction", type=float, default=0.25, metavar="F",
                   help="share of each class held out as the test set when there is no --test-slides")
    f.add_argument("--seed", type=_seed, default=0, help="seed of that split (a whole number >= 0)")
    f.add_argument("--name", default=None, help="pipeline name (default: the --out folder's name)")
    f.add_argument("--patient-column", default=None, metavar="COLUMN",
                   help="the --labels header column naming each slide's patient, any case (default: the first of "
                        "patient, patient_id, case_id, case_submitter_id it has); 'none' splits slide by slide")
    _common(f)
    p.set_defaults(run=run)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=output_folder, required=True, metavar="DIR",
                   help="folder for cohort/ and pipeline.toml (the run's outputs go to DIR/run)")
    p.add_argument("--template", type=Path, default=None, metavar="PIPELINE.toml",
                   help="pipeline whose stage settings to use (default: the packaged pipelines/camelyon16.toml)")
    p.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help="training slides held out to choose best.pt [the template's, else 0.2]")
    p.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="NAME",
                   help="slides left out of every set, by name (as Test_114, not exhaustively annotated; matched "
                        "without folder, suffix and case; a name of no slide is an error); recorded in "
                        "cohort/prepare.json. It takes every name up to the next option: give it after the "
                        "positional arguments (or end its names with another option)")


def _not_a_note(record: logging.LogRecord) -> bool:
    """A filter of prepare's logger that drops the warnings of its notes: the command prints every note on stdout
    as a ``note:`` line, which ``--log-file`` records too (review CS: each was shown twice)."""
    from wsi_milssl.cohorts.write import NOTE_RECORD

    return not getattr(record, NOTE_RECORD, False)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.cohorts import write

    write.logger.addFilter(_not_a_note)
    try:
        return _run(args)
    finally:
        write.logger.removeFilter(_not_a_note)


def _check_options(args: argparse.Namespace) -> None:
    """OptionError (a usage error, exit code 2) for a fraction out of range or a blank --name, named by its option
    (not by the pipeline key it becomes; review CX)."""
    from wsi_milssl.errors import OptionError

    if getattr(args, "name", None) is not None and not args.name.strip():
        raise OptionError("--name must not be empty (or blank); leave it out for the --out folder's name.")
    for option, value, zero_ok in (("--test-fraction", getattr(args, "test_fraction", None), False),
                                   ("--val-fraction", args.val_fraction, True)):
        if value is not None and not (0.0 <= value < 1.0 and (zero_ok or value > 0.0)):  # NaN too
            raise OptionError(f"{option} must satisfy {'0 <=' if zero_ok else '0 <'} F < 1; got {value!r}.")


def _run(args: argparse.Namespace) -> int:
    from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder

    _check_options(args)
    if args.layout == "camelyon16":
        result = prepare_camelyon16(args.root, args.out, template=args.template, reference=args.reference,
                                    annotations_dir=args.annotations, val_fraction=args.val_fraction,
                                    exclude=args.exclude)
    else:
        result = prepare_folder(args.slides, args.labels, args.out, annotations_dir=args.annotations,
                                test_slides_dir=args.test_slides, test_labels_csv=args.test_labels,
                                test_annotations_dir=args.test_annotations, test_fraction=args.test_fraction,
                                seed=args.seed, template=args.template, name=args.name,
                                val_fraction=args.val_fraction, exclude=args.exclude,
                                patient_column=args.patient_column)
    for name, s in result.sets.items():
        print(f"{name}: {len(s.slides)} slides ({s.n_tumor} tumour, {len(s.slides) - s.n_tumor} normal), "
              f"{len(s.annotations)} annotated -> {s.slides_csv.parent}")
    if result.split:
        print(f"split: {result.split}")
    if result.excluded:
        print(f"excluded: {len(result.excluded)} slide(s) left out of every set (--exclude): "
              f"{', '.join(result.excluded)}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"pipeline: {result.pipeline_toml}")
    run = f"wsi-milssl run {shlex.quote(str(result.pipeline_toml))}"
    print(f"next: {run}" if result.ready else
          f"next: edit {result.pipeline_toml} (the notes above say why `run` refuses it as it is), then: {run}")
    return 0
