"""What ``prepare`` writes: the slide lists, label files and annotations of each set, ``prepare.json`` and the
pipeline (from its template, with [data] pointing at them), ``pipeline.toml`` last; one edited since is kept."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Mapping

from wsi_milssl.atomic import atomic_open, atomic_write_bytes, atomic_write_text
from wsi_milssl.cohorts.checks import _names
from wsi_milssl.cohorts.discover import ANNOTATION_SUFFIXES, _Annotation, _real
from wsi_milssl.errors import ConfigError
from wsi_milssl.hashing import file_sha256

logger = logging.getLogger(__name__)
#: The attribute set on the warning record of each note (:attr:`PreparedCohort.notes`): the command line, which
#: prints the notes on stdout, keeps them off stderr with it.
NOTE_RECORD = "prepare_note"


@dataclass(frozen=True)
class CohortSet:
    """One set of a prepared cohort: ``slides`` {stem: path}, ``labels`` {stem: 0/1},
    ``annotations`` {stem: source file (or ``archive.zip:member``)}; the files written for it."""

    name: str
    slides: dict[str, Path]
    labels: dict[str, int]
    annotations: dict[str, str]
    slides_csv: Path
    labels_csv: Path
    annotations_dir: Path

    @property
    def n_tumor(self) -> int:
        return sum(self.labels.values())


@dataclass(frozen=True)
class PreparedCohort:
    """What :func:`prepare_camelyon16` / :func:`prepare_folder` wrote; ``pipeline_toml`` is the pipeline to run,
    and ``ready`` says whether `run` accepts it as it is (else the notes say what to edit); ``split``: how
    :func:`prepare_folder` split the slides (which column kept patients whole, or slide by slide)."""

    out_dir: Path
    pipeline_toml: Path
    sets: dict[str, CohortSet]
    summary_json: Path
    notes: tuple[str, ...] = field(default_factory=tuple)
    excluded: tuple[str, ...] = field(default_factory=tuple)
    split: str = ""
    ready: bool = True


def _csv_text(header: tuple[str, ...], rows: Iterable[tuple]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def _write_set(out: Path, name: str, slides: Mapping[str, Path], labels: Mapping[str, int],
               annotations: Mapping[str, _Annotation], patients: Mapping[str, str] | None = None) -> CohortSet:
    """Write one set; ``annotations`` already read (:func:`_read_annotations`); ``patients`` {stem: patient}
    (from the labels file's patient column; None: no column) adds a ``patient`` column to the labels file."""
    slides_path, labels_path, ann_dir = _set_paths(out, name)
    ann_dir.mkdir(parents=True, exist_ok=True)
    stems = sorted(slides, key=str.casefold)
    slides_csv = atomic_write_text(slides_path,
                                   _csv_text(("slide", "path"), ((s, str(slides[s].absolute())) for s in stems)))
    if patients is not None:
        labels_text = _csv_text(("slide", "label", "patient"),
                                ((s, int(labels[s]), patients.get(s, "")) for s in stems))
    else:
        labels_text = _csv_text(("slide", "label"), ((s, int(labels[s])) for s in stems))
    labels_csv = atomic_write_text(labels_path, labels_text)
    keep = set()
    sources = {}
    for stem in stems:
        if stem not in annotations:
            continue
        annotation = annotations[stem]
        target = ann_dir / f"{stem}{annotation.suffix}"
        if not (target.is_file() and target.read_bytes() == annotation.data):
            atomic_write_bytes(target, annotation.data)
        keep.add(target.name)
        sources[stem] = annotation.source
    for old in ann_dir.iterdir():  # the folder is ours: files of slides no longer in the set go
        if old.is_file() and old.name not in keep and old.suffix.lower() in ANNOTATION_SUFFIXES:
            old.unlink()
    return CohortSet(name, {s: slides[s] for s in stems}, {s: int(labels[s]) for s in stems}, sources,
                     slides_csv, labels_csv, ann_dir)


def default_template() -> Path:
    """``pipelines/camelyon16.toml`` as shipped in the package (the paper's settings)."""
    from importlib.resources import files

    path = Path(str(files("wsi_milssl") / "pipelines" / "camelyon16.toml"))
    if not path.is_file():
        raise ConfigError(f"{path}: the packaged pipeline template is missing. Fix: pass --template PIPELINE.toml.")
    return path


_TABLE = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")


def _template_body(template: Path, *, challenge_froc: bool = True) -> str:
    """The template's text without its leading comments and without its [pipeline], [data] and [synth.*]
    tables (the cohort's slides are real, not generated; every other table, with its comments, is kept
    as written). Without ``challenge_froc`` (another cohort than CAMELYON16 on the packaged template) the
    [evaluate] table's ``froc_mpp`` line is commented out: CAMELYON16's 0.243 µm/px is no other cohort's, whose
    FROC is measured at each slide's own µm/px."""
    lines = template.read_text(encoding="utf-8").splitlines()
    out: list[str] = []
    skipping = True  # the preamble before the first table describes the template, not this cohort
    table = ""
    for line in lines:
        m = _TABLE.match(line)
        if m:
            table = m.group(1).strip()
            skipping = table in ("pipeline", "data", "synth") or table.startswith(("pipeline.", "data.", "synth."))
        if not challenge_froc and table == "evaluate" and re.match(r"^\s*froc_mpp\s*=", line):
            line = f"# {line.strip()}    # CAMELYON16's: left out by `prepare folder` (each slide's own µm/px)"
        if not skipping:
            out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out) + "\n"


def _toml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _set_paths(out: Path, name: str) -> tuple[Path, Path, Path]:
    """(slides CSV, labels CSV, annotations folder) of the set ``name`` under ``out``."""
    cohort = out / "cohort"
    return cohort / f"{name}_slides.csv", cohort / f"{name}_labels.csv", cohort / "annotations" / name


#: how the header of a written pipeline says to run it (replaced when run would refuse it as it is)
RUN_AS_IS = "Run it as it is:  wsi-milssl run"


def _pipeline_text(out: Path, *, name: str, template: Path, set_names: Iterable[str],
                   val_fraction: float | None, split_seed: int | None, command: str,
                   file_name: str = "pipeline.toml", challenge_froc: bool = True) -> str:
    from wsi_milssl.config import load_toml

    raw = load_toml(template)  # a template that is not TOML fails here, naming the file
    data = raw.get("data", {}) if isinstance(raw.get("data"), dict) else {}
    val = float(data.get("val_fraction", 0.2)) if val_fraction is None else float(val_fraction)
    seed = int(data.get("split_seed", 0)) if split_seed is None else int(split_seed)
    rel = lambda p: os.path.relpath(p, out)  # noqa: E731 - data paths are resolved against this file's folder
    lines = [
        f"# Written by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"# Stage settings from {template}; [data] points at the slide lists, labels and annotations",
        f"# found by prepare (cohort/). {RUN_AS_IS} " + shlex.quote(str(out / file_name)),
        "",
        "[pipeline]",
        f"name = {_toml_str(name)}",
        f"out_dir = {_toml_str(str((out / 'run').resolve()))}",
        "",
        "[data]",
    ]
    for set_name in set_names:
        slides_csv, labels_csv, ann_dir = _set_paths(out, set_name)
        lines += [f"{set_name}_slides = {_toml_str(rel(slides_csv))}",
                  f"{set_name}_labels = {_toml_str(rel(labels_csv))}",
                  f"{set_name}_annotations = {_toml_str(rel(ann_dir))}"]
    lines += [f"val_fraction = {val!r}      # training slides held out to choose best.pt (never the test set)",
              f"split_seed = {seed}", "", ""]
    return "\n".join(lines) + _template_body(template, challenge_froc=challenge_froc)


def _command(layout: str, positional: Iterable[str | os.PathLike], options: Mapping[str, object]) -> str:
    """The command line that prepares this cohort again, from any folder: ``wsi-milssl prepare LAYOUT`` with
    ``positional`` and every option given (``options`` {flag: value}, None left out), paths made absolute,
    quoted for a POSIX shell (prepare.json and pipeline.toml quote it; tile names it as the fix for slides
    gone from a list prepare wrote)."""
    def text(value: object) -> str:
        return str(Path(value).absolute()) if isinstance(value, os.PathLike) else str(value)

    words = ["wsi-milssl", "prepare", layout, *(text(p) for p in positional)]
    for flag, value in options.items():
        if isinstance(value, (list, tuple)):  # --exclude A B: one flag, every value
            if value:
                words += [flag, *(text(v) for v in value)]
        elif value is not None:
            words += [flag, text(value)]
    return shlex.join(words)


def _path(value: str | os.PathLike | None) -> Path | None:
    return None if value is None else Path(value)


#: What prepare writes beside a pipeline.toml it keeps (one edited since prepare wrote it, or not prepare's).
NEW_PIPELINE_NAME = "pipeline.new.toml"


def _earlier_record(out: Path) -> dict:
    """The prepare.json of an earlier prepare into ``out`` ({} when there is none or it cannot be read)."""
    try:
        record = json.loads((out / "cohort" / "prepare.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _file_sha256(path: Path) -> str | None:
    """The SHA-256 of the file ``path``; None when there is no file (a folder there counts as a file: kept)."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return file_sha256(path)
    except OSError:
        return "unreadable"


def _group_check(sets: Mapping[str, tuple[Mapping[str, Path], Mapping[str, int], Mapping[str, _Annotation]]],
                 spec, toml: Path) -> list[str]:
    """Notes for annotation groups the pipeline ``spec``'s label stage ignores (neither its tumour nor its
    non-tumour groups: it warns and leaves their polygons out); ConfigError, as the label stage would stop
    there, for a tumour slide whose annotation has no polygon in a tumour group and some in such groups."""
    from wsi_milssl.annotations.groups import UNCLASSIFIED, groups_hiding_the_tumour
    from wsi_milssl.pipeline.spec import stage_config

    gmap = stage_config(spec, "label").group_map()

    def unknown(groups) -> list[str]:
        return sorted({UNCLASSIFIED if g is None else str(g) for g in groups if gmap.role(g) is None},
                      key=str.casefold)

    stop, ignored, new_groups, stop_groups = [], [], [], []
    hidden, hidden_stems = [], []  # tumour slides whose polygons are all in ASAP's group "None" (review EC B1)
    no_area, normal_area = [], []  # test slides whose annotation contradicts their label (review BH)
    normal_train_area = []  # the same of training slides (review EC C2; the label stage warns about them)
    for set_name, (_, labels, set_annotations) in sets.items():
        for stem, ann in sorted(set_annotations.items(), key=lambda kv: kv[0].casefold()):
            tumour = any(gmap.role(g) == "tumor" for g in ann.area_groups)
            # the label stage's own refusal (labeling/stage.py _refuse_hidden_tumour), made before anything is written
            why = groups_hiding_the_tumour(ann.groups, gmap) if labels.get(stem) == 1 and not tumour else None
            if set_name == "test" and labels.get(stem) == 1 and not tumour and why is None:
                no_area.append(ann.where)
            elif set_name == "test" and labels.get(stem) == 0 and tumour:
                normal_area.append(ann.where)
            elif set_name == "train" and labels.get(stem) == 0 and tumour:
                normal_train_area.append(ann.where)
            if labels.get(stem) == 1 and not tumour and unknown(ann.groups):
                stop.append(f"{ann.where} ({', '.join(map(repr, unknown(ann.groups)))})")
                new_groups += unknown(ann.groups)
                stop_groups += unknown(ann.groups)
            elif why is not None:
                hidden.append(f"{ann.where} ({len(ann.groups)} polygon(s); {why})")
                hidden_stems.append(stem)
            elif unknown(ann.area_groups):
                ignored.append(f"{ann.where} ({', '.join(map(repr, unknown(ann.area_groups)))})")
                new_groups += unknown(ann.area_groups)
    groups, non_tumour = ", ".join(gmap.tumor), ", ".join(gmap.non_tumor)
    example = json.dumps([*gmap.tumor, *dict.fromkeys(new_groups)], ensure_ascii=False)
    hidden_error = (
        f"{len(hidden)} annotation file(s) of tumour slides have no polygon in a tumour group of the pipeline's "
        f"[label] stage ({groups}), so that stage would stop at them (after every slide is tiled): {_names(hidden)}. "
        "Nothing was written. Fix: correct each annotation file (in ASAP, put the tumour polygons in a tumour group, "
        f"{groups}, and save it again); or, if the ungrouped polygons ('None') are the tumour in every file, count "
        "them as tumour: prepare again with --template PIPELINE.toml, a copy of the template whose [label] table has "
        "tumor_groups with \"None\" added and non_tumor_groups without it"
        + (f" (or after editing {toml} so: prepare keeps an edited pipeline.toml)" if toml.is_file() else "")
        + "; or prepare again with --exclude "
        f"{' '.join(hidden_stems)} to leave the slide(s) out of every set ([evaluate] lesion_exclude does not help: "
        "the label stage reads every slide of both sets).") if hidden else ""
    if stop:
        raise ConfigError(
            f"{len(stop)} annotation file(s) of tumour slides have no area in a tumour group of the pipeline's "
            f"[label] stage ({groups}) but polygons in groups it does not know, so that stage would stop at them: "
            f"{_names(stop)}. Nothing was written. Fix: add {', '.join(map(repr, dict.fromkeys(stop_groups)))} to "
            f"[label] tumor_groups (or to non_tumor_groups, now {non_tumour}, for regions that are not tumour) and "
            "prepare again with --template PIPELINE.toml, a copy of the template whose [label] table has "
            f"tumor_groups = {example}"
            + (f", or after adding that line to {toml} (prepare keeps an edited pipeline.toml)" if toml.is_file()
               else "")
            + "; or correct the annotation files." + (f" {hidden_error}" if hidden else ""))
    if hidden:
        raise ConfigError(hidden_error)
    notes = []
    if no_area:
        notes.append(f"{len(no_area)} tumour test slide(s) have an annotation without a tumour area (no polygon in a "
                     f"tumour group of the pipeline's [label] stage: {groups}): {_names(no_area)} (the FROC counts "
                     "every detection on them as a false positive and no lesion of them: correct the annotation, or "
                     "leave the slide out of the FROC with [evaluate] lesion_exclude, or of every set with "
                     "--exclude NAME)")
    if normal_area:
        notes.append(f"{len(normal_area)} normal test slide(s) have tumour areas in their annotation: "
                     f"{_names(normal_area)} (the evaluation goes by the label, normal: check the label or the "
                     "annotation)")
    if normal_train_area:
        notes.append(f"{len(normal_train_area)} normal training slide(s) have tumour areas in their annotation: "
                     f"{_names(normal_train_area)} (training goes by the label, normal: every patch of such a slide is "
                     "a negative; check the label or the annotation)")
    if not ignored:
        return notes
    return notes + [
        f"{len(ignored)} annotation file(s) have polygons in groups that the pipeline's [label] stage ignores "
        f"(neither tumour: {groups}; nor non-tumour: {non_tumour}): {_names(ignored)} (to use those polygons, add "
        f"the groups to [label] tumor_groups or non_tumor_groups in {toml}, or run with --set "
        f"{shlex.quote('label.tumor_groups=' + example)})"]


def _finish(out: Path, **kwargs) -> PreparedCohort:
    """:func:`_write_cohort` under the lock of ``out``: a second prepare (or a run) into the same folder is refused
    (review EV: two prepares at once each wrote their files in turn, and the last one won file by file)."""
    from wsi_milssl.locks import folder_lock

    with folder_lock(out):
        return _write_cohort(out, **kwargs)


def _write_cohort(out: Path, *, name: str, template: Path | None,
                 sets: dict[str, tuple[Mapping[str, Path], Mapping[str, int], Mapping[str, _Annotation]]],
                 val_fraction: float | None, split_seed: int | None, command: str, facts: dict,
                 notes: list[str], patients: Mapping[str, Mapping[str, str]] | None = None,
                 challenge_froc: bool = True, excluded: Iterable[str] = (), split: str = "") -> PreparedCohort:
    """Write everything: ``sets`` {name: (slides, labels, annotations read)}, all checked and read; ``patients``
    {set name: {stem: patient}} (per set: two files of one name, one in each set, are two slides).

    The pipeline is made and validated first (in a temporary file beside ``pipeline.toml``), so a
    template that gives no valid pipeline leaves ``out`` as it was; ``pipeline.toml`` gets its name last.
    prepare.json records the SHA-256 of the pipeline.toml prepare wrote: a ``pipeline.toml`` that differs (edited
    since, or not written by prepare) is kept, and the new pipeline is written beside it as
    :data:`NEW_PIPELINE_NAME`, with a note naming both. The annotations' groups are checked against the label
    stage of the pipeline the result names to run (:func:`_group_check`).
    """
    from wsi_milssl.pipeline.training import refuse_unusable_split
    from wsi_milssl.pipeline.spec import load_pipeline

    template = Path(template) if template is not None else default_template()
    toml = out / "pipeline.toml"
    new_toml = out / NEW_PIPELINE_NAME
    earlier = _earlier_record(out)
    ours = {earlier.get("pipeline_sha256"), earlier.get("pipeline_new_sha256")} - {None}
    current = _file_sha256(toml)
    keep = current is not None and current not in ours
    edited = keep and earlier.get("pipeline_sha256") is not None  # prepare wrote it, and it was changed since
    target = new_toml if keep else toml
    text = _pipeline_text(out, name=name, template=template, set_names=("train", "test"),
                          val_fraction=val_fraction, split_seed=split_seed, command=command, file_name=target.name,
                          challenge_froc=challenge_froc)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    run_toml = toml if edited else target  # the pipeline `next:` names
    notes = list(notes)
    if keep:
        take = f"mv {shlex.quote(str(new_toml))} {shlex.quote(str(toml))}"
        if edited:
            notes.append(f"{toml} was edited since prepare wrote it, so it is kept as it is (it reads the slide lists "
                         f"and labels written now); the pipeline prepare wrote now is {new_toml}. To take it instead: "
                         f"{take} (to see what differs: diff {shlex.quote(str(toml))} {shlex.quote(str(new_toml))})")
        else:
            notes.append(f"{toml} was not written by prepare (or by a version that recorded no digest of it), so it "
                         f"is kept as it is; the pipeline of this cohort is {new_toml}. Run that one, or take it as "
                         f"pipeline.toml: {take}")
    created = not out.exists()
    try:
        with atomic_open(target, "w") as fh:
            fh.write(text)
            fh.flush()
            try:
                spec = load_pipeline(fh.name)  # the file must be one `run` accepts
            except ConfigError as exc:
                raise ConfigError(f"{str(exc).replace(str(fh.name), str(target))} (in the pipeline written from "
                                  f"{template}; nothing was written)") from None
            # the split run will make of these slides (a grid needs validation slides of both classes): the
            # cohort is written, with a note, as the pipeline is there to be edited (drop the grid, another metric)
            train_labels = dict(sets["train"][1])
            train_lists = (train_labels, {k: v for k, v in (patients or {}).get("train", {}).items()
                                          if k in train_labels})

            def refused(pipeline, path: Path) -> str | None:
                try:
                    refuse_unusable_split(pipeline, read_lists=False, train_lists=train_lists)
                except ConfigError as exc:
                    return str(exc).replace(str(fh.name), str(path))
                return None

            why = refused(spec, target)
            ready = why is None
            if why is not None:
                notes.append(f"`wsi-milssl run` will refuse this pipeline until it is edited: {why}")
                # its header says so too, in place of "Run it as it is" (review BF)
                text = text.replace(RUN_AS_IS, "Edit it first (cohort/prepare.json's notes say why `run` refuses "
                                    "it as it is), then:  wsi-milssl run", 1)
                digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
                fh.seek(0)
                fh.truncate()
                fh.write(text)
                fh.flush()
            if run_toml != target:  # the kept pipeline.toml is the one run will read (review BI: the new file's
                try:                # header was chosen by checking the kept one)
                    spec = load_pipeline(run_toml)
                except ConfigError as exc:
                    notes.append(f"`wsi-milssl run` cannot read the kept {run_toml}: {exc}")
                    ready = False
                else:
                    why = refused(spec, run_toml)
                    ready = why is None
                    if why is not None:
                        notes.append(f"`wsi-milssl run` will refuse the kept pipeline until it is edited: {why}")
            try:
                notes += _group_check(sets, spec, run_toml)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace(str(fh.name), str(target))) from None
            with_patients = any((patients or {}).values())  # a patient column in every set's labels, or none
            written = {k: _write_set(out, k, *v, patients=patients.get(k, {}) if with_patients else None)
                       for k, v in sets.items()}
            real_out = Path(os.path.realpath(out))
            summary = {
                "command": command,
                "template": str(_real(template)),
                "pipeline": str(real_out / toml.name),
                "pipeline_sha256": earlier.get("pipeline_sha256") if keep else digest,
                **({"pipeline_new": str(real_out / new_toml.name), "pipeline_new_sha256": digest} if keep else {}),
                "sets": {k: {"slides": len(s.slides), "tumor": s.n_tumor, "normal": len(s.slides) - s.n_tumor,
                             "annotated": len(s.annotations), "slides_csv": str(_real(s.slides_csv)),
                             "labels_csv": str(_real(s.labels_csv)), "annotations": str(_real(s.annotations_dir)),
                             "annotation_sources": s.annotations} for k, s in written.items()},
                **facts,
                "excluded": list(excluded),
                "notes": notes,
            }
            summary_json = atomic_write_text(out / "cohort" / "prepare.json", json.dumps(summary, indent=2) + "\n")
    except BaseException:
        if created:
            try:
                out.rmdir()  # only when nothing is in it
            except OSError:
                pass
        raise
    if not keep and earlier.get("pipeline_new_sha256") and _file_sha256(new_toml) == earlier["pipeline_new_sha256"]:
        new_toml.unlink()  # prepare's own earlier pipeline.new.toml, unchanged: pipeline.toml is prepare's again
    for note in notes:
        logger.warning("%s", note, extra={NOTE_RECORD: True})
    if split:
        logger.info("%s", split)
    return PreparedCohort(out, run_toml, written, summary_json, tuple(notes), tuple(excluded), split, ready)
