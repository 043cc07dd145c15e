"""What a stage's stamp digest covers (:mod:`wsi_milssl.pipeline.stamps` writes and compares the stamps) and what a
training run folder is started with: each stage's settings (every setting, or, as stamps of earlier versions
recorded them, those that differed from their defaults), the stages it reads and the fingerprints of the files
from outside the pipeline it reads; for a training run, its settings, split and the training set's data. The
forms earlier versions recorded are computed here too, so that their finished work stays up to date."""

from __future__ import annotations

import json
import os
from pathlib import Path

from wsi_milssl.config import config_from_mapping, config_to_dict
from wsi_milssl.config.features import FEATURES_RUNTIME_ONLY_FIELDS
from wsi_milssl.config.heatmap import HEATMAP_RUNTIME_ONLY_FIELDS
from wsi_milssl.config.tile import TILE_RUNTIME_ONLY_FIELDS
from wsi_milssl.config.train import RUNTIME_ONLY_FIELDS
from wsi_milssl.pipeline.spec import PipelineSpec, label_taken, stage_config
from wsi_milssl.pipeline.stamps import fingerprint_paths, read_stamp

__all__ = ["UPSTREAM", "EMBEDDED_UPSTREAM", "SPEED_ONLY", "EARLIER_DEFAULTS", "ADDED_SETTINGS", "recorded_settings",
           "stage_settings", "setting_names", "digest_parts", "external_inputs", "with_label_settings",
           "run_fingerprints", "training_data", "training_data_forms", "feature_file_bags", "feature_files",
           "train_weights", "weights_fingerprint", "weights_older_than", "unweighted_stamp_accepted"]


#: the stages each stage reads (their stamps' digests count in its own); with a [features] table, EMBEDDED_UPSTREAM
UPSTREAM = {"synth": (), "tile": ("synth",), "label": ("tile",), "features": ("label",), "train": ("label",),
            "heatmap": ("train", "label"), "evaluate": ("heatmap",)}


EMBEDDED_UPSTREAM = {**UPSTREAM, "train": ("features",), "heatmap": ("train", "features")}


#: settings that change how fast a stage runs, not what it makes: left out of its stamp digest
SPEED_ONLY = {"tile": TILE_RUNTIME_ONLY_FIELDS, "features": FEATURES_RUNTIME_ONLY_FIELDS, "train": RUNTIME_ONLY_FIELDS,
              "heatmap": HEATMAP_RUNTIME_ONLY_FIELDS}


#: the defaults, as stamps of the "changed" form knew them, of the settings whose default changed since:
#: {stage: {setting: default then}}. Those stamps (written before 2026-11-28, package 0.1.0) recorded only the
#: settings that differed from their defaults, so one of them matches a setting now at that earlier default, whatever
#: the default is now. Add a setting here when its default changes.
EARLIER_DEFAULTS: dict[str, dict[str, object]] = {"train": {"mu_ramp_epochs": 10}}  # image mode's T is 5 since

#: the settings added to a stage ("synth" included) since stamps and run records hold every setting (2026-11-28),
#: each with the value that does what the stage did before it existed: {stage: {setting: value}}. At that value a
#: stamp or record leaves it out (:func:`recorded_settings`), so a finished run stays up to date when a version adds
#: a setting; at another value it counts. Add a setting here when you add it to a stage's config
#: (tests/pipeline/test_pipeline_changed_defaults.py lists each stage's settings of 2026-11-28 and checks).
#: (values as config_to_dict writes them: a tuple is a list)
ADDED_SETTINGS: dict[str, dict[str, object]] = {"evaluate": {"lesion_exclude": []}}  # 2026-11-29


def recorded_settings(stage: str, settings: dict) -> dict:
    """``settings`` ({name: value}, a stage's whole config) as stamps and training run records hold them: without
    the speed-only settings (:data:`SPEED_ONLY`) and without the settings of :data:`ADDED_SETTINGS` at the value
    they were added with."""
    added = ADDED_SETTINGS.get(stage, {})
    return {k: v for k, v in settings.items()
            if k not in SPEED_ONLY.get(stage, ()) and not (k in added and v == added[k])}


def stage_settings(spec: PipelineSpec, stage: str, *, form: str = "all"):
    """What a stage's stamp digest covers, in one of three forms. ``"all"``: every setting of the stage (defaults
    spelled out, so a default that changes between versions changes it, and the pipeline's own
    resolved_pipeline.toml, which spells out every default, gives the same), speed-only settings
    (:data:`SPEED_ONLY`) aside, and its [train.grid]. ``"changed"``: only the settings that differ from their
    defaults as that form's stamps knew them (:data:`EARLIER_DEFAULTS`), as stamps of earlier versions recorded
    them. ``"legacy"``: the raw table, as stamps of versions before that recorded it."""
    if stage == "synth":
        tables = {name: config_to_dict(ds.synth) for name, ds in spec.sets.items()}
        return {name: recorded_settings("synth", t) if form == "all" else t for name, t in tables.items()}
    if form == "legacy":
        settings = {"section": spec.section(stage)}
    else:
        # evaluate counts [label]'s groups and positive_fraction where it takes them (:func:`with_label_settings`):
        # an evaluation of earlier versions, made with the default ones, runs again
        chosen = config_to_dict(with_label_settings(spec, stage) if stage == "evaluate" else stage_config(spec, stage))
        section = recorded_settings(stage, chosen)
        grid = spec.section(stage).get("grid") or {}
        if form == "all":
            # a setting every grid point sets is not the table's: its top-level value is not used
            section = {k: v for k, v in section.items() if k not in grid}
        else:
            current = config_to_dict(stage_config(spec, stage, defaults_only=True))
            default = {**current, **EARLIER_DEFAULTS.get(stage, {})}
            # one that the grid sets, left at its default now, was left at its default then (a changed default
            # of it is not used)
            section = {k: v for k, v in section.items()
                       if v != default.get(k) and not (k in grid and v == current.get(k))}
        if "grid" in spec.section(stage):
            section["grid"] = grid
        settings = {"section": section}
    if stage == "train":
        settings.update(val_fraction=spec.val_fraction, split_seed=spec.split_seed)
    return settings


def setting_names(stage: str, settings: dict) -> dict:
    """A stage's digest settings (:func:`stage_settings`) by the names ``--set`` gives them: ``train.epochs``,
    ``train.grid``, ``data.val_fraction``, ``synth.train.seed``."""
    if stage == "synth":
        return {f"synth.{set_name}.{k}": v for set_name, table in settings.items() for k, v in table.items()}
    names = {f"{stage}.{k}": v for k, v in settings["section"].items()}
    names.update({f"data.{k}": v for k, v in settings.items() if k != "section"})
    return names


def digest_parts(spec: PipelineSpec, stage: str, chain: dict[str, str], state: Path, *, form: str,
                 weights: bool = True) -> tuple[dict, dict]:
    """(settings in ``form``, inputs) that a stage's stamp digest covers (:func:`stage_settings`); the stages it
    reads from count by their digest in ``chain`` (this run's) or else their stamp's. ``weights=False``: train's
    without its weights files, as stamps written before 2026-11-29 recorded it (:func:`unweighted_stamp_accepted`)."""
    reads = (EMBEDDED_UPSTREAM if spec.feature_stage else UPSTREAM)[stage]
    upstream = {u: chain.get(u) or (read_stamp(state, u) or {}).get("digest") for u in reads}
    external = external_inputs(spec, stage, legacy=form == "legacy")
    if stage == "train" and form != "legacy" and weights:
        external += [weights_fingerprint(p) for p in train_weights(spec)]
    return stage_settings(spec, stage, form=form), {"upstream": upstream, "external": external}


def train_weights(spec: PipelineSpec) -> list[str]:
    """The weights files training starts from: [train] weights_path and those of [train.grid], as training reads
    them (``~`` expanded, a relative path against the current folder), absolute, sorted."""
    train = spec.section("train")
    grid = train.get("grid") if isinstance(train.get("grid"), dict) else {}
    listed = grid.get("weights_path") if isinstance(grid.get("weights_path"), list) else []
    paths = [train.get("weights_path"), *listed]
    return sorted({os.path.abspath(os.path.expanduser(p)) for p in paths if isinstance(p, str)})


def weights_fingerprint(path: str | os.PathLike) -> list:
    """[absolute path, size, SHA-256] of a weights file (review CG: new weights behind the same [train]
    weights_path left a finished model and its report up to date); [path, None, None] when it is missing or
    cannot be read (training says so). The content, not the modification time, counts: a file touched or
    copied again trains nothing again. Hashed once per run (:func:`wsi_milssl.hashing.file_reads_kept`)."""
    from wsi_milssl.hashing import file_sha256, kept_file_read

    path = os.path.abspath(os.path.expanduser(path))
    try:
        st = os.stat(path)
        return [path, st.st_size, kept_file_read("sha256", path, st, lambda: file_sha256(path))]
    except OSError:
        return [path, None, None]


def weights_older_than(paths: list[str], record: Path) -> bool:
    """Whether the file ``record`` (a stamp, a run folder's record of a version that did not count the weights
    files, before 2026-11-29) was written after each weights file of ``paths`` was last modified: then the run
    it records read those weights, and is accepted without them (an upgrade trains nothing again); weights
    changed since (or a record that cannot be read) make it a change (review CL: such records were accepted
    whatever the weights, and a model trained from the old weights was recorded under the new ones)."""
    try:
        written = record.stat().st_mtime_ns
        return all(os.stat(os.path.expanduser(p)).st_mtime_ns < written for p in paths)
    except OSError:
        return False


def unweighted_stamp_accepted(spec: PipelineSpec, stamp: dict | None, state: Path) -> bool:
    """Whether a train stamp is compared without the weights files: one written before 2026-11-29 records none,
    and stays up to date while the weights files are older than it (:func:`weights_older_than`)."""
    if stamp is None or not train_weights(spec):
        return False
    rows = ((stamp.get("inputs") or {}).get("external") if isinstance(stamp.get("inputs"), dict) else None) or []
    recorded = {os.path.basename(str(r[0])) for r in rows if isinstance(r, list) and r}
    if all(os.path.basename(p) in recorded for p in train_weights(spec)):
        return False  # a stamp of this version: compared with them
    return weights_older_than(train_weights(spec), state / "train.json")


def external_inputs(spec: PipelineSpec, stage: str, *, legacy: bool = False, only: str | None = None) -> list:
    """Fingerprints of the inputs from outside the pipeline a stage reads: small files by content, the
    slides (those a slide list names too) by size and modification time; ``legacy``: every file by size
    and modification time and a slide list as a file, as stamps of earlier versions recorded them;
    ``only``: those of that set ("train", "test") alone. (Train's weights files: :func:`digest_parts`.)"""
    sets = [ds for name, ds in spec.sets.items() if only in (None, name)]
    if spec.mode == "features":
        return fingerprint_paths([p for ds in sets for p in (ds.features, ds.labels)], content=not legacy)
    if stage == "features" and not legacy:
        # the encoder's weights file by size and modification time: new weights behind the same path count
        # ('cached' weights: the library cache is not looked up here; `run --force features` after replacing it)
        weights = str(spec.section("features").get("weights", "cached"))
        return [] if weights in ("cached", "random") else fingerprint_paths([Path(os.path.expanduser(weights))])
    if spec.sets["train"].synth is not None:
        return []
    if stage == "tile":
        if legacy:
            return fingerprint_paths([ds.slides for ds in sets])
        from wsi_milssl.errors import WsiMilsslError
        from wsi_milssl.tiling import find_slides

        lists = [ds.slides for ds in sets if Path(ds.slides).is_file()]
        try:
            listed = [p for ds in sets for p in find_slides([ds.slides], keep_missing=True)]
        except WsiMilsslError:  # the tile stage says what is wrong with them
            listed = [ds.slides for ds in sets]
        return fingerprint_paths(lists, content=True) + fingerprint_paths(listed)
    if stage == "label":
        return fingerprint_paths([p for ds in sets for p in (ds.labels, ds.annotations)], content=not legacy)
    return []


def with_label_settings(spec: PipelineSpec, stage: str):
    """The config of [evaluate] or [heatmap], with [label]'s settings of :data:`~wsi_milssl.pipeline.spec.LABEL_SETTINGS`
    where the table leaves them at their defaults (absent, or spelled out as in resolved_pipeline.toml:
    :func:`~wsi_milssl.pipeline.spec.label_taken`): the
    evaluation reads the annotations, and the overlays outline them, as the label stage read them. The
    evaluation's ``mpp`` is [tile]'s ``slide_mpp`` unless [evaluate] sets one: lesions are measured at the
    µm/px the slides were cut at (evaluate refuses an [evaluate] mpp that the heatmaps' sidecars contradict)."""
    import dataclasses

    from wsi_milssl.config import EvaluateConfig, HeatmapConfig, LabelConfig, TileConfig
    from wsi_milssl.errors import ConfigError

    cls = {"evaluate": EvaluateConfig, "heatmap": HeatmapConfig}[stage]
    config = config_from_mapping(cls, spec.section(stage), source=f"{spec.source} [{stage}]")
    label = config_from_mapping(LabelConfig, spec.section("label"), source=f"{spec.source} [label]")
    taken = {k: getattr(label, k) for k in label_taken(spec, stage)}
    if stage == "evaluate" and config.mpp is None:
        tile = config_from_mapping(TileConfig, spec.section("tile"), source=f"{spec.source} [tile]")
        config = dataclasses.replace(config, mpp=tile.slide_mpp)
    try:
        return dataclasses.replace(config, **taken)
    except ConfigError as exc:  # e.g. [label]'s tumour group is [evaluate]'s non-tumour group
        raise ConfigError(f"{spec.source} [{stage}] with [label]'s {', '.join(sorted(taken))}: {exc}") from None


def run_fingerprints(spec: PipelineSpec, state: Path, config, split: dict, *, kind: str, data: tuple[dict, ...]
                     ) -> list[dict]:
    """The fingerprint a training run folder is started with now (:func:`_run_fingerprint`), then the forms
    of the same run that earlier versions recorded, also accepted
    (:func:`wsi_milssl.pipeline.run_folders.prepare_run_dir`); ``data``: the forms of :func:`training_data_forms`.
    Records written before 2026-11-29 hold no weights file: accepted without it (and rewritten with it) when
    written after the weights file was last modified (:data:`~wsi_milssl.pipeline.run_folders.WEIGHTS_BEFORE`)."""
    now = [_run_fingerprint(spec, state, config, split, kind=kind, data=d) for d in data]
    if config.weights_path:  # accepted only from a record written after the weights file (WEIGHTS_BEFORE)
        from wsi_milssl.pipeline.run_folders import WEIGHTS_BEFORE

        now += [{**_run_fingerprint(spec, state, config, split, kind=kind, data=d, weights=False),
                 WEIGHTS_BEFORE: config.weights_path} for d in data]
    return [*now, _run_fingerprint(spec, state, config, split, kind=kind, legacy=True)]


def _run_fingerprint(spec: PipelineSpec, state: Path, config, split: dict, *, kind: str, data: dict | None = None,
                     legacy: bool = False, weights: bool = True) -> dict:
    """What a training run folder is started with: the settings that change the result, the data split,
    what the training set's data come from (``data``, default :func:`training_data`) and the weights file it
    starts from (its name, size and SHA-256); ``legacy``: as earlier versions recorded it, with the stamp digest
    of the stage it trains on and the inputs of both sets instead (so a change to the test set's files made them
    train again); ``weights=False``: without the weights file, as versions before 2026-11-29 recorded it."""
    settings = recorded_settings("train", config_to_dict(config))
    fingerprint = {"kind": kind, "settings": settings, "split": {k: list(v) for k, v in split.items()}}
    if not legacy:
        if config.weights_path and weights:
            fingerprint["weights"] = _by_content([weights_fingerprint(config.weights_path)])[0]
        return {**fingerprint, "data": training_data(spec) if data is None else data}
    upstream = "features" if spec.feature_stage else ("label" if spec.mode == "images" else None)
    digest = None if upstream is None else (read_stamp(state, upstream) or {}).get("digest")
    return {**fingerprint, "upstream": digest, "external": external_inputs(spec, "train")}


#: [label] settings that shape only the mask PNGs, not the labels in the stores (``label_config_hash`` leaves
#: them out too): they do not count in what training reads
MASK_ONLY = ("mask_downsample", "write_masks")


def training_data(spec: PipelineSpec) -> dict:
    """Where the data training reads come from, the training set's only (the test set's files never reach
    training): its stores (the tile settings and its slides and slide list, or its synth settings), the
    instance labels the label stage wrote into them (the label settings but those of the masks alone,
    :data:`MASK_ONLY`; its labels CSV and annotations by content) and, with a [features] table, the features
    settings; in feature mode its feature files and labels. The files fingerprinted by content (slide list,
    annotations, small feature files) count by name and content, not by folder (:func:`_by_content`): a
    cohort folder moved or copied with its run trains nothing again."""
    return training_data_forms(spec)[0]


def training_data_forms(spec: PipelineSpec) -> tuple[dict, ...]:
    """(:func:`training_data`, then the same as earlier versions recorded it, also accepted for a run folder they
    started: in feature mode every file of the training features folder (a labels CSV or notes kept there, review
    CG); with the settings that differ from their defaults then (:data:`EARLIER_DEFAULTS`) in place of every
    setting; the same as the version before that: files by absolute path, every label setting)."""
    forms = []
    if spec.mode == "features":  # the feature files training reads, not every file of their folder (2026-11-29)
        try:
            files = fingerprint_paths(feature_files(Path(spec.sets["train"].features)), content=True)
        except OSError:  # no such folder: the train stage says so
            files = fingerprint_paths([spec.sets["train"].features], content=True)
        forms.append({"external": _by_content(files + _training_bag_labels(spec))})
    for form in ("all", "changed"):
        recorded = _recorded_training_data(spec, form)
        now = {**recorded, "external": _by_content(recorded["external"])}
        if "label" in now:
            now["label"] = {"section": {k: v for k, v in recorded["label"]["section"].items() if k not in MASK_ONLY}}
        forms.append(now)
    return (*forms, _recorded_training_data(spec, "changed"))


def _recorded_training_data(spec: PipelineSpec, form: str) -> dict:
    """:func:`training_data` with files by absolute path and every label setting; the stages' settings in
    ``form`` (:func:`stage_settings`)."""
    train = spec.sets["train"]
    if spec.mode == "features":
        return {"external": fingerprint_paths([train.features], content=True) + _training_bag_labels(spec)}
    data = {"synth": None if train.synth is None else config_to_dict(train.synth),
            "tile": stage_settings(spec, "tile", form=form), "label": stage_settings(spec, "label", form=form),
            "external": external_inputs(spec, "tile", only="train") + _training_labels(spec)}
    if spec.feature_stage:
        # what made the training feature files: encoder, its weights by SHA-256, dtype, input size (as the
        # features stage recorded it), so new weights behind the same weights path count
        from wsi_milssl.features.stage import CONFIG_FILENAME as FEATURES_CONFIG

        data["features"] = stage_settings(spec, "features", form=form)
        try:
            made = json.loads((spec.out_dir / "features" / "train" / FEATURES_CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            made = {}
        data["features_settings_hash"] = made.get("settings_hash") if isinstance(made, dict) else None
    return data


def _by_content(rows: list) -> list:
    """Fingerprint rows (:func:`fingerprint_paths`) with those of files fingerprinted by content ([path, size,
    SHA-256]) keyed by the file's name instead of its path; rows by size and modification time (slides) and
    others are kept as they are."""
    return [[Path(row[0]).name, *row[1:]] if len(row) == 3 and isinstance(row[2], str) else row for row in rows]


def _training_bag_labels(spec: PipelineSpec) -> list:
    """Feature mode: the rows of the labels CSV for the bags of the training feature files, not the whole CSV,
    which a pipeline may share with the test set."""
    from wsi_milssl.cohorts import read_labels as read_labels_csv  # torch-free
    from wsi_milssl.errors import WsiMilsslError

    train = spec.sets["train"]
    bags = [feature_file_bags(f) for f in feature_files(Path(train.features))]
    try:
        labels = read_labels_csv(train.labels)
    except (WsiMilsslError, OSError):  # the train stage says what is wrong
        labels = None
    if labels is None or any(b is None for b in bags):
        return fingerprint_paths([train.labels], content=True)
    return [["labels", [[name, labels.get(name)] for name in sorted({n for names in bags for n in names})]]]


def _training_labels(spec: PipelineSpec) -> list:
    """What the label stage reads for the training slides: their rows of the labels CSV and their annotation
    files (by content), not the whole CSV and folder, which a pipeline may share with the test set."""
    from wsi_milssl.annotations.io import find_annotation
    from wsi_milssl.cohorts import read_labels as read_labels_csv  # torch-free
    from wsi_milssl.cohorts import slide_stem
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.tiling import find_slides

    train = spec.sets["train"]
    if train.synth is not None:
        return []
    try:
        stems = [slide_stem(p) for p in find_slides([train.slides], keep_missing=True)]
        labels = read_labels_csv(train.labels)
    except (WsiMilsslError, OSError):  # the tile and label stages say what is wrong
        return fingerprint_paths([train.labels, train.annotations], content=True)
    rows = [[stem, labels.get(stem)] for stem in sorted(stems)]
    notes = [find_annotation(stem, train.annotations) if Path(train.annotations).is_dir() else None
             for stem in sorted(stems)]
    return [["labels", rows]] + fingerprint_paths([n for n in notes if n is not None], content=True)


def feature_file_bags(path: Path) -> list[str] | None:
    """The bag names a feature file holds (its ``bag_ids``, else its slide stem), as
    :func:`wsi_milssl.mil.data.read_feature_files` names them; None when the file cannot be read."""
    record = _bag_record(path)
    return None if record is None else list(record[0])


def feature_file_slide(path: Path) -> str | None:
    """The slide file a feature file of one slide records (its ``slide_path``, resolved, as
    :func:`wsi_milssl.mil.data.held_out_bags` compares them); None when it records none (CLAM's, TRIDENT's, a file
    of several bags) or cannot be read."""
    record = _bag_record(path)
    return None if record is None else record[1]


def _bag_record(path: Path) -> tuple[list[str], str | None] | None:
    from wsi_milssl.hashing import kept_file_read

    try:
        st = os.stat(path)
    except OSError:
        return None
    return kept_file_read("bags", path, st, lambda: _read_bag_record(Path(path)))  # once per run (review CH)


def _read_bag_record(path: Path) -> tuple[list[str], str | None] | None:
    import h5py

    from wsi_milssl.features.schema import BAG_IDS, FEATURES

    def text(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value or "")

    try:
        with h5py.File(path, "r") as fh:
            shape = fh[FEATURES].shape  # (N, D), or (1, N, D) as read_feature_file reads it
            n = shape[0] if len(shape) == 2 else (shape[1] if len(shape) == 3 and shape[0] == 1 else 0)
            if n == 0:
                return [], None
            if BAG_IDS in fh:
                ids = [text(b) for b in fh[BAG_IDS][()].tolist()]
                return list(dict.fromkeys(ids)), None
            stem, slide = text(fh.attrs.get("slide_stem")), text(fh.attrs.get("slide_path"))
    except (OSError, KeyError, ValueError):
        return None
    return [stem or path.stem], (os.path.realpath(slide) if slide else None)


def feature_files(path: Path) -> list[Path]:
    """A feature file, or a folder's (:func:`wsi_milssl.features.schema.feature_files_in`), as `train` reads them."""
    from wsi_milssl.features.schema import feature_files_in

    return feature_files_in(path) if path.is_dir() else [path]
