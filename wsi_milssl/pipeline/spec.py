"""Pipeline files (``pipelines/*.toml``): which data, and each stage's settings.

A pipeline file has one table per stage, whose keys are the fields of that stage's config
dataclass, plus ``[pipeline]`` and ``[data]``::

    [pipeline]
    name = "demo"
    out_dir = "demo_out"            # where every artifact goes (``wsi-milssl run --out`` overrides)
    grid_workers = "auto"           # [train.grid] points trained at once: "auto" = one per GPU, or a number

    [data]                          # either generated sets ...
    generate = true
    [synth.train]                   # SynthConfig fields, one table per set
    n_slides = 8
    seed = 0
    [synth.test]
    n_slides = 4
    seed = 1000

    [data]                          # ... or existing slides
    train_slides = "/data/camelyon16/training"      # folder or CSV with a `slide` column
    train_labels = "/data/camelyon16/training/labels.csv"
    train_annotations = "/data/camelyon16/training/annotations"
    test_slides = ...               # (same three keys for the test set)
    val_fraction = 0.2              # training slides held out to choose best.pt (never the test set)
    split_seed = 0

    [tile]      # TileConfig      [label]     # LabelConfig     [train]    # TrainConfig
    [heatmap]   # HeatmapConfig   [evaluate]  # EvaluateConfig

    [features]  # FeaturesConfig: with this table (image data only) the stores are embedded by a frozen
                # encoder (OUT/features/<set>), train fits a head on the features ([train].mode
                # "features"), heatmap draws its probabilities on the stores' grid, evaluate as usual

Relative data paths are resolved against the pipeline file's folder, a relative ``out_dir`` (and
``--out``) against the folder ``run`` starts in (``~`` is expanded in both); the spec holds them absolute, so
the same run started from another folder finds the same files. ``load_pipeline(..., check_paths=True)``
refuses [data] paths that do not exist, naming the key and the path each resolved to. A generated set lives in
``OUT/slides/<set>`` and serves as its own labels and annotations folder.

``overrides`` (``wsi-milssl run --set train.epochs=3``) replace values of the file before it is
validated (an error they cause names them); :func:`resolved_pipeline` gives the pipeline as it runs
(every stage table with all its settings, absolute paths), which ``run`` writes to
``OUT/resolved_pipeline.toml`` when a run of every stage finishes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from wsi_milssl.config import SynthConfig, check_range, check_type, config_from_mapping, config_to_dict, load_toml
from wsi_milssl.config.base import did_you_mean
from wsi_milssl.config.train import RUNTIME_ONLY_FIELDS
from wsi_milssl.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["PipelineSpec", "DataSet", "load_pipeline", "parse_override", "resolved_pipeline", "stage_config",
           "write_resolved_pipeline", "RESOLVED_FILENAME", "STAGES", "SETS"]

#: The resolved pipeline ``run`` writes into its output folder.
RESOLVED_FILENAME = "resolved_pipeline.toml"

STAGES = ("synth", "tile", "label", "features", "train", "heatmap", "evaluate")
SETS = ("train", "test")
_TOP_LEVEL = {"pipeline", "data", *STAGES}
#: the keys of [pipeline]
_PIPELINE_KEYS = ("name", "out_dir", "grid_workers")


@dataclass(frozen=True)
class DataSet:
    """One set of slides: where the slides, slide labels and annotations are."""

    name: str
    slides: Path | None
    labels: Path
    annotations: Path | None
    synth: SynthConfig | None = None
    features: Path | None = None


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    source: Path
    out_dir: Path
    sets: dict[str, DataSet]
    val_fraction: float
    split_seed: int
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    mode: str = "images"
    #: a [features] table: stores are embedded by a frozen encoder and the head trains on the features
    feature_stage: bool = False
    #: the ``--set`` overrides applied, as given (``train.epochs=3``)
    overrides: tuple[str, ...] = ()
    #: [train.grid] points trained at once: "auto" (one per visible GPU, one at a time without GPUs) or a count
    grid_workers: int | str = "auto"

    def section(self, stage: str) -> dict[str, Any]:
        """The raw table of ``stage`` (empty when absent)."""
        return dict(self.sections.get(stage, {}))

    @property
    def train_mode(self) -> str:
        """What the head trains on: "features" (pre-extracted, or embedded by a [features] table) or "images"."""
        return "features" if self.mode == "features" or self.feature_stage else "images"


def stage_config(spec: PipelineSpec, stage: str, *, defaults_only: bool = False):
    """The config object [stage] runs with ([train.grid] aside; [train].mode defaults to the pipeline's
    :attr:`PipelineSpec.train_mode`); ``defaults_only``: the same stage with every setting at its default."""
    section = {} if defaults_only else spec.section(stage)
    section.pop("grid", None)
    if stage == "train":
        section.setdefault("mode", spec.train_mode)
    return config_from_mapping(_stage_classes()[stage], section, source=f"{spec.source} [{stage}]")


#: settings of [evaluate] and [heatmap] that take [label]'s value unless the table sets them: the evaluation
#: reads the annotations, and the overlays outline them, as the label stage read them
LABEL_SETTINGS = {"evaluate": ("positive_fraction", "tumor_groups", "non_tumor_groups"),
                  "heatmap": ("tumor_groups", "non_tumor_groups")}


def label_taken(spec: PipelineSpec, stage: str) -> tuple[str, ...]:
    """The settings of :data:`LABEL_SETTINGS` that [evaluate] or [heatmap] (``stage``) takes from [label]: those its
    table leaves at their defaults, absent or spelled out (as the packaged templates, and so every pipeline
    ``prepare`` writes, spell [evaluate] positive_fraction = 0.25, and resolved_pipeline.toml every setting).
    A value equal to the default is therefore [label]'s too (:func:`label_defaults_spelled` warns where that
    differs from what the table says: review BR)."""
    config, default = stage_config(spec, stage), stage_config(spec, stage, defaults_only=True)
    return tuple(k for k in LABEL_SETTINGS[stage] if getattr(config, k) == getattr(default, k))


def label_defaults_spelled(spec: PipelineSpec) -> list[str]:
    """"[evaluate] positive_fraction = 0.25 (the default) ... [label]'s 0.5" for each setting of
    :data:`LABEL_SETTINGS` that a table spells out at its default while [label] sets another value: the table
    then takes [label]'s value (:func:`label_taken`), which its line does not say."""
    if _RESOLVED_LAST_LINE in _header(Path(spec.source)):  # resolved_pipeline.toml spells every default
        return []
    label = stage_config(spec, "label")
    found = []
    for stage, keys in LABEL_SETTINGS.items():
        section = spec.section(stage)
        for key in label_taken(spec, stage):
            if key in section and getattr(label, key) != getattr(stage_config(spec, stage), key):
                found.append(f"[{stage}] {key} = {section[key]!r} (the default) takes [label]'s "
                             f"{getattr(label, key)!r}")
    return found


def _path(base: Path, value: Any, key: str, source: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{source}: [data].{key} must be a path string; got {value!r}.")
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else (base / p)


def _check(where: str, table: str, key: str, value: Any, types: type | tuple[type, ...], *,
           low: float | None = None, high: float | None = None, high_inclusive: bool = True) -> Any:
    """``value`` of ``[table].key`` after checking its type (and range); ConfigError starting with ``where``
    (the file, and the --set overrides of the table: :func:`_set_by`)."""
    try:
        check_type(f"[{table}]", key, value, types)
        if low is not None or high is not None:
            check_range(f"[{table}]", key, value, low=low, high=high, high_inclusive=high_inclusive)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return value


def _set_by(overrides: Iterable[str], *tables: str) -> str:
    """``" with --set A --set B"``: the overrides of ``tables`` ("train", "synth.train"; every override
    without tables), as messages add them to the file's name, so that an error a --set caused says so;
    "" without such overrides."""
    prefixes = [tuple(table.split(".")) for table in tables]
    mine = [text for text in overrides
            if not prefixes or any(parse_override(text)[0][:len(p)] == p for p in prefixes)]
    return " with --set " + " --set ".join(mine) if mine else ""


def _table(source: Path, name: str, value: Any) -> dict[str, Any]:
    """``value`` if it is a TOML table, else ConfigError naming the file and the table."""
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} must be a table ([{name}] with key = value lines below it); got "
                          f"{value!r} ({type(value).__name__}).")
    return value


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``"train.epochs=3"`` -> ``(("train", "epochs"), 3)``: a dotted key, ``=``, and a TOML value
    (``0.1``, ``true``, ``[0.1, 0.2]``, ``"viridis"``); a value that is not TOML is taken as a string
    (``heatmap.colormap=magma``)."""
    import tomllib

    key, sep, value = str(text).partition("=")
    parts = tuple(p.strip() for p in key.split("."))
    if not sep or len(parts) < 2 or not all(parts) or not value.strip():
        raise ConfigError(f"--set {text!r}: expected TABLE.KEY=VALUE (e.g. train.epochs=3, heatmap.colormap=magma, "
                          "data.val_fraction=0.2).")
    value = value.strip()
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        # review CX: a list of bare words, or a number TOML does not read, fell back to a string, and the error
        # about its type then repeated the mistake in its fix
        if value.startswith(("[", "{")):
            raise ConfigError(f"--set {text!r}: {value} is not a TOML value. Fix: quote each word inside the brackets, "
                              f"--set '{'.'.join(parts)}=[\"a\", \"b\"]' (numbers stay bare: [0.1, 0.2]).") from None
        if re.fullmatch(r"[+-]?(\.\d+|\d+\.)([eE][+-]?\d+)?", value):  # .5, 5. (review CZ: not 2024-11 or 1.2.3)
            raise ConfigError(f"--set {text!r}: {value} is not a TOML number. Fix: write it in full (e.g. 0.5, "
                              "not .5; 1e-3 or 0.001).") from None
        parsed = value
    return parts, parsed


def _apply_overrides(raw: dict[str, Any], overrides: Iterable[str], source: Path) -> None:
    for text in overrides:
        parts, value = parse_override(text)
        if parts[0] not in _TOP_LEVEL:
            raise ConfigError(f"--set {text!r}: unknown table [{parts[0]}]; tables are {', '.join(sorted(_TOP_LEVEL))}.")
        table = raw
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"--set {text!r}: {'.'.join(parts[:-1])} in {source} is a value, not a table.")
        table[parts[-1]] = value


def load_pipeline(path: str | os.PathLike, *, out_dir: str | os.PathLike | None = None,
                  overrides: Iterable[str] = (), check_paths: bool = False) -> PipelineSpec:
    """Read and validate a pipeline file; every stage table is checked against its config class.

    ``overrides``: ``TABLE.KEY=VALUE`` texts (:func:`parse_override`) applied before validation; an error in a
    table they changed names them. ``out_dir`` (default: [pipeline].out_dir) is held absolute: ``~`` expanded,
    a relative one resolved against the current folder. ``check_paths``: every [data] path (after the
    overrides) must exist, one ConfigError naming each one that does not (for a run: a wrong path stops it
    before any stage); off by default, for a pipeline checked before the files it names are written
    (``prepare``) or one read for its settings.

    A [train.grid] that cannot choose a point on validation slides, or a select_metric that the validation
    slides can never give, is refused here (:func:`wsi_milssl.pipeline.training.refuse_unusable_split`): with
    ``check_paths`` from the split of the training slide list and labels; without it (their files not read)
    a grid with [data].val_fraction = 0 all the same, and generated sets, whose labels need no file.
    """
    source = Path(path)
    raw = load_toml(source)
    if not raw and not overrides:  # (review BW: a file emptied by a failed copy was "[data] is missing train_slides, ...")
        raise ConfigError(f"{source}: the pipeline file is empty (no table or setting). Fix: put its settings back "
                          "(a run's OUT/resolved_pipeline.toml holds every one), or start from a packaged "
                          "pipeline (pipelines/demo.toml).")
    overrides = tuple(overrides)
    generated_in_file = _asks_for_generated_slides(raw)
    _apply_overrides(raw, overrides, source)

    def at(*tables: str) -> str:  # the file, as an error in these tables (any table: none given) names it
        return f"{source}{_set_by(overrides, *tables)}"

    loose = sorted(k for k in set(raw) - _TOP_LEVEL if not isinstance(raw[k], dict))
    if loose:  # review CX: "unknown table" for a key written above every table
        raise ConfigError(f"{source}: {', '.join(loose)} at the top level, outside any table; a setting goes in its "
                          f"stage's table. Fix: move {'them' if len(loose) > 1 else 'it'} under the table it belongs "
                          "to (e.g. epochs under [train]; tables: " + ", ".join(sorted(_TOP_LEVEL)) + ").")
    unknown = sorted(set(raw) - _TOP_LEVEL)
    if unknown:
        raise ConfigError(
            f"{source}: unknown table(s) {', '.join(unknown)}; valid tables are {', '.join(sorted(_TOP_LEVEL))}."
        )
    for key, value in raw.items():
        _table(source, key, value)
    for key, value in raw.get("synth", {}).items():
        _table(source, f"synth.{key}", value)
    meta = raw.get("pipeline", {})
    extra = sorted(set(meta) - set(_PIPELINE_KEYS))
    if extra:
        raise ConfigError(f"{at('pipeline')}: unknown [pipeline] key(s) {', '.join(extra)}; valid keys are "
                          f"{', '.join(sorted(_PIPELINE_KEYS))} (a stage's settings go in its own table, e.g. "
                          "[train] epochs).")
    name = _check(at("pipeline"), "pipeline", "name", meta.get("name", source.stem), str)
    if not name.strip():
        raise ConfigError(f"{at('pipeline')}: [pipeline].name must not be empty (or blank).")
    grid_workers = meta.get("grid_workers", "auto")
    if grid_workers != "auto" and (isinstance(grid_workers, bool) or not isinstance(grid_workers, int)
                                   or grid_workers < 1):
        raise ConfigError(f"{at('pipeline')}: [pipeline].grid_workers must be \"auto\" or a whole number >= 1; got "
                          f"{grid_workers!r}.")
    if out_dir is None:
        if "out_dir" not in meta and ("/" in name or "\\" in name):
            raise ConfigError(f"{at('pipeline')}: [pipeline].name {name!r} names the default output folder "
                              f"{name}_out, which would not lie directly in the folder `run` starts in. "
                              "Fix: a name without '/' and '\\', or set [pipeline].out_dir.")
        out_dir = _check(at("pipeline"), "pipeline", "out_dir", meta.get("out_dir", f"{name}_out"), str)
        if not out_dir.strip():
            raise ConfigError(f"{at('pipeline')}: [pipeline].out_dir must not be empty (or blank).")
        own = source.resolve().parent
        if source.name == RESOLVED_FILENAME and (own / ".pipeline").is_dir():
            # a run's own resolved file belongs to the folder it lies in: moved or copied with it, it runs
            # there, not in the folder its out_dir names (the original, or nothing after a move)
            if Path(os.path.expanduser(out_dir)).resolve() != own:
                logger.info("%s: running in the folder of this resolved pipeline, %s (its out_dir %s is where "
                            "the run was made)", source, own, out_dir)
            out_dir = own
        elif (moved := _moved_prepare_folder(own, out_dir)) is not None:
            # a prepare folder moved or copied: its pipeline's out_dir names the original folder's run
            logger.info("%s: running in this folder's run, %s (its out_dir %s is the run of the folder prepare "
                        "wrote it in)", source, moved, out_dir)
            out_dir = moved
    # absolute: the stages' files, and the stamps that record them, are the same wherever a run starts
    out = Path(os.path.expanduser(os.fspath(out_dir))).resolve()
    data = dict(raw.get("data", {}))
    base = source.resolve().parent
    mode = _check(at("data"), "data", "mode", data.pop("mode", "images"), str)
    if mode not in ("images", "features"):
        raise ConfigError(f"{at('data')}: [data].mode must be 'images' or 'features'; got {mode!r}.")
    synth = raw.get("synth", {})
    generate = _check(at("data"), "data", "generate", data.pop("generate", "synth" in raw), bool)
    if synth and not (generate and mode == "images"):
        if mode == "features":  # generate = true cannot help: generated slides are images
            why = "[data].mode = 'features' trains on features that exist"
            fix = ("set [data].mode = 'images' (generated slides are images: their patches are tiled, or embedded "
                   "by a [features] table), or drop the [synth] tables to train on the feature files of [data]")
        else:
            why = "[data].generate = false"
            fix = "drop the [synth] tables, or set [data].generate = true (slides generated into OUT/slides)"
        tables = " and ".join(f"[synth.{k}]" for k in synth)
        raise ConfigError(f"{at('data', 'synth')}: {tables} describe{'s' if len(synth) == 1 else ''} generated "
                          f"slides, but {why}, so {'it' if len(synth) == 1 else 'they'} would be ignored. Fix: "
                          f"{fix}.")
    generate = generate and mode == "images"
    val_fraction = float(_check(at("data"), "data", "val_fraction", data.pop("val_fraction", 0.25), (int, float),
                                low=0.0, high=1.0, high_inclusive=False))
    split_seed = _check(at("data"), "data", "split_seed", data.pop("split_seed", 0), int, low=0)

    sets: dict[str, DataSet] = {}
    given: dict[str, tuple[Any, Path]] = {}  # [data] key: (its value, the path it resolves to)

    def path_of(key: str) -> Path:
        value = data.pop(key)
        given[key] = (value, _path(base, value, key, source))
        return given[key][1]

    if generate:
        # a file of existing slides that a --set made a generated pipeline: its errors say so
        note = "" if generated_in_file else (
            " (the --set makes it one: a [synth] table or data.generate = true means generated slides in place of "
            "[data]'s). Fix: drop that --set to run on the slides of [data]")
        extra = sorted(set(synth) - set(SETS))
        if extra:
            raise ConfigError(f"{at('synth')}: unknown table(s) {', '.join(f'[synth.{k}]' for k in extra)}; a "
                              f"generated pipeline has the sets {', '.join(f'[synth.{k}]' for k in SETS)}.")
        for set_name in SETS:
            if set_name not in synth:
                raise ConfigError(f"{at('synth', 'data')}: a generated pipeline needs a [synth.{set_name}] "
                                  f"table{note}.")
            cfg = config_from_mapping(SynthConfig, synth[set_name],
                                      source=f"{source} [synth.{set_name}]{_set_by(overrides, f'synth.{set_name}')}")
            folder = out / "slides" / set_name
            sets[set_name] = DataSet(set_name, folder, folder / "labels.csv", folder, cfg)
        unknown = _unknown_data_keys(data, ())
        if unknown:
            raise ConfigError(f"{at('data')}: {unknown}")
        if data:
            raise ConfigError(f"{at('data', 'synth')}: [data] keys {', '.join(sorted(data))} are not used with "
                              f"generated data{note}.")
    elif mode == "features":
        for set_name in SETS:
            keys = {k: f"{set_name}_{k}" for k in ("features", "labels")}
            missing = [v for v in keys.values() if v not in data]
            if missing:
                raise ConfigError(f"{at('data')}: [data] is missing {', '.join(missing)} (features mode).")
            features, labels = (path_of(keys[k]) for k in ("features", "labels"))
            sets[set_name] = DataSet(set_name, None, labels, None, None, features)
        if data:
            raise ConfigError(f"{at('data')}: {_unknown_data_keys(data, ('features', 'labels'))}")
    else:
        for set_name in SETS:
            keys = {k: f"{set_name}_{k}" for k in ("slides", "labels", "annotations")}
            missing = [v for v in keys.values() if v not in data]
            if missing:
                raise ConfigError(f"{at('data')}: [data] is missing {', '.join(missing)}.")
            sets[set_name] = DataSet(set_name, *(path_of(keys[k]) for k in ("slides", "labels", "annotations")))
        if data:
            raise ConfigError(f"{at('data')}: {_unknown_data_keys(data, ('slides', 'labels', 'annotations'))}")

    feature_stage = "features" in raw
    if feature_stage and mode == "features":
        raise ConfigError(f"{at('features', 'data')}: a [features] table embeds the patches of slides, but [data].mode "
                          "= 'features' trains on features that exist already. Fix: drop one of them.")
    sections = {stage: dict(raw.get(stage, {})) for stage in STAGES if stage != "synth"}
    if feature_stage:
        train_mode = sections["train"].setdefault("mode", "features")
        if train_mode != "features":
            raise ConfigError(f"{at('train', 'features')}: with a [features] table the head trains on features; "
                              f"[train].mode is {train_mode!r}. Fix: set mode = \"features\" (and an MLP head) or "
                              "drop [features].")
    train_mode = "features" if mode == "features" or feature_stage else "images"
    asked = sections["train"].get("mode", train_mode)
    if asked != train_mode:  # (checked here, not after tile and label, where train would find the other inputs)
        fix = ("add a [features] table (the encoder that embeds the patches), or drop [train].mode: a pipeline of "
               "slides without one trains on the patches' pixels" if train_mode == "images" else
               "drop [train].mode (or set it to \"features\"): this pipeline trains on feature files")
        raise ConfigError(f"{at('train')}: [train].mode is {asked!r}, but this pipeline gives the train stage "
                          f"{'patch images' if train_mode == 'images' else 'features'}. Fix: {fix}.")
    _validate_sections(sections, source, train_mode=train_mode, overrides=overrides)
    cutting = sorted(k for k in _HEATMAP_CUTTING_KEYS if sections.get("heatmap", {}).get(k) is not None)
    if train_mode == "images" and cutting:  # review CX: recorded, ran heatmap and evaluate again, changed nothing
        raise ConfigError(f"{at('heatmap')}: [heatmap] {', '.join(cutting)} {'chooses' if len(cutting) == 1 else 'choose'} "
                          "the patches of a slide cut on the fly, but a pipeline's heatmap predicts the patches of the stores that tile cut, so they "
                          f"would change nothing. Fix: set them in [tile] ({', '.join('tile.' + k for k in cutting)}), "
                          "which tiles the slides again, or drop them.")
    if generate and sets["train"].synth.seed == sets["test"].synth.seed:
        # slide i of a set is drawn from (seed, i): the same seed makes test slides that copy the training ones
        raise ConfigError(f"{at('synth')}: [synth.train] and [synth.test] have the same seed, "
                          f"{sets['test'].synth.seed} (a seed not given is 0), so the test slides would be copies of "
                          "the training slides and the model would be scored on slides it trained on. Fix: give "
                          "[synth.test] another seed (pipelines/demo.toml uses seed = 1000).")
    if mode == "features":
        _refuse_grid_without_validation(sections["train"].get("grid"), val_fraction, at("train", "data"), "bags")
    if check_paths:
        _refuse_missing_paths(given, base, at("data"), source)
        _refuse_missing_weights(sections["train"], at("train"))
    spec = PipelineSpec(name=name, source=source, out_dir=out, sets=sets, val_fraction=val_fraction,
                        split_seed=split_seed, sections=sections, mode=mode, feature_stage=feature_stage,
                        overrides=overrides, grid_workers=grid_workers)
    from wsi_milssl.pipeline.training import refuse_unusable_split  # it imports this module

    refuse_unusable_split(spec, read_lists=check_paths)
    return spec


def _moved_prepare_folder(own: Path, out_dir: str) -> Path | None:
    """``own / 'run'`` when ``own`` is a folder `wsi-milssl prepare` wrote (``cohort/prepare.json``) that was
    moved or copied since, so that the pipeline's out_dir (absolute, as prepare writes it) still names the
    original folder's run: a copy's run would replace the original's model and heatmaps, a moved folder's run
    would start again from nothing at the old place. None otherwise (an out_dir edited to another folder)."""
    try:
        recorded = json.loads((own / "cohort" / "prepare.json").read_text(encoding="utf-8")).get("pipeline")
    except (OSError, ValueError, AttributeError):
        return None
    written = Path(os.path.expanduser(out_dir))
    if not isinstance(recorded, str) or not written.is_absolute():
        return None
    original = Path(recorded).parent
    if written != original / "run" or original == own or (original.exists() and original.resolve() == own):
        return None
    return own / "run"


#: What each kind of [data] path must be (slides and features may be a folder or one file or list).
_PATH_KINDS = {"labels": "file (the slide labels CSV)", "annotations": "folder (of the slides' annotation files)"}


def _wrong_kind(key: str, path: Path) -> bool:
    kind = key.rsplit("_", 1)[1]
    return (kind == "labels" and path.is_dir()) or (kind == "annotations" and not path.is_dir())


def _refuse_missing_paths(given: dict[str, tuple[Any, Path]], base: Path, where: str, pipeline_file: Path) -> None:
    """One ConfigError starting with ``where`` that names each [data] path that does not exist, or is a folder
    where a file is wanted or the reverse (:data:`_PATH_KINDS`): its key, its value and the path it resolved
    to (a relative one against ``base``, the pipeline file's folder), so that a wrong path stops a run before
    any stage instead of when its stage is reached. A ready-made pipeline as shipped (``pipeline_file``), whose paths
    are placeholders, gets the fix of making one with real paths (review CS)."""
    missing = [f"[data].{key} = {value!r}: {path} does not exist" for key, (value, path) in given.items()
               if not path.exists()]
    missing += [f"[data].{key} = {value!r}: {path} is a {'folder' if path.is_dir() else 'file'}, not a "
                f"{_PATH_KINDS[key.rsplit('_', 1)[1]]}" for key, (value, path) in given.items()
                if path.exists() and _wrong_kind(key, path)]
    template = _ready_made(pipeline_file) if missing else None
    if template is not None:
        raise ConfigError(f"{where}: {'; '.join(missing)}. This is the ready-made pipeline {template!r} as shipped, "
                          f"whose [data] paths are placeholders. Fix: "
                          f"{_READY_MADE_FIXES[template].format(shlex.quote(str(pipeline_file)))}")
    if missing:
        raise ConfigError(f"{where}: {'; '.join(missing)} (relative [data] paths are resolved against the pipeline "
                          f"file's folder, {base}). Fix: give the path of an existing file or folder, absolute or "
                          f"relative to {base} (a pipeline file moved or copied without the files it names: move "
                          "them with it, or give absolute paths).")


#: How to make a pipeline with real paths from each ready-made one whose [data] are placeholders ({} = its path).
_READY_MADE_FIXES = {
    "camelyon16": "`wsi-milssl prepare camelyon16 ROOT --out DIR` finds the slides, labels and annotations below the "
                  "download ROOT and writes DIR/pipeline.toml with these settings and their paths; run that one.",
    "camelyon16-features": "`wsi-milssl prepare camelyon16 ROOT --out DIR --template {}` finds the slides, labels "
                           "and annotations below the download ROOT and writes DIR/pipeline.toml with these settings "
                           "and their paths; run that one.",
    "tcga-features": "copy it and point its [data] at your feature files and labels (its header says what each "
                     "holds), then run the copy.",
}


def _ready_made(path: Path) -> str | None:
    """The name of the ready-made pipeline (:data:`_READY_MADE_FIXES`) whose shipped bytes the file ``path`` holds
    (installed in the package, in a checkout's or the image's ``pipelines/``, or copied unchanged), else None."""
    from importlib.resources import files

    try:
        data = path.read_bytes()
        return next((name for name in _READY_MADE_FIXES
                     if (files("wsi_milssl") / "pipelines" / f"{name}.toml").read_bytes() == data), None)
    except OSError:
        return None


def _refuse_missing_weights(train: dict[str, Any], where: str) -> None:
    """ConfigError starting with ``where`` for a [train] weights_path (or a [train.grid] one) that names no file
    (resolved as training reads it: against the current folder): found only when train started, after the
    run folder of a finished training with other settings had been set aside."""
    grid = train.get("grid") if isinstance(train.get("grid"), dict) else {}
    paths = [train.get("weights_path"), *(grid.get("weights_path") or [])]
    missing = [p for p in paths if isinstance(p, str) and not Path(p).expanduser().is_file()]
    if missing:
        raise ConfigError(f"{where}: [train].weights_path {', '.join(map(repr, missing))}: no such file (a relative "
                          f"path is resolved against the current folder, {Path.cwd()}). Fix: give the path of the "
                          "weights file, or drop weights_path to train from scratch.")


def _unknown_data_keys(keys: Iterable[str], kinds: tuple[str, ...]) -> str:
    """"unknown [data] key(s) ...; valid keys are ... (did you mean ...?)" for the ``keys`` left in [data] that no
    form of [data] knows ("" when every one is known: a generated pipeline's keys for files it does not read);
    ``kinds``: the ``<set>_<kind>`` paths this form reads (none for generated slides)."""
    every = {"generate", "mode", "val_fraction", "split_seed",
             *(f"{set_name}_{kind}" for set_name in SETS for kind in ("slides", "labels", "annotations", "features"))}
    unknown = sorted(set(keys) - every) if not kinds else sorted(keys)
    if not unknown:
        return ""
    valid = sorted({"generate", "mode", "val_fraction", "split_seed",
                    *(f"{set_name}_{kind}" for set_name in SETS for kind in kinds)})
    of_other_form = [k for k in unknown if k in every]  # e.g. test_slides in a feature pipeline (review CB)
    misspelt = [k for k in unknown if k not in every]
    hint = did_you_mean(misspelt, every) if misspelt else ""
    other = (f" ({', '.join(of_other_form)}: not read by this form of [data], which reads {', '.join(kinds)})"
             if of_other_form else "")
    return f"unknown [data] key(s) {', '.join(unknown)}{hint}{other}; valid keys here are {', '.join(valid)}."


def _asks_for_generated_slides(raw: dict[str, Any]) -> bool:
    """Whether a pipeline file as read (before ``--set``) asks for generated slides: [data].generate = true,
    or [synth] tables without a [data].generate."""
    data = raw.get("data")
    if isinstance(data, dict) and "generate" in data:
        return data["generate"] is True
    return "synth" in raw


def _refuse_grid_without_validation(grid: Any, val_fraction: float, where: str, what: str) -> None:
    """ConfigError, when a feature-file pipeline is loaded, for a [train.grid] of two or more points without
    validation ``what`` (``[data].val_fraction = 0``) to choose one on: its split is known only when the train
    stage reads the files (which refuses one that holds out none with val_fraction > 0). A pipeline of slides is
    refused by :func:`wsi_milssl.pipeline.training.refuse_unusable_split` (at the end of :func:`load_pipeline`), from
    the split of its slide list and labels where they are read, so that one message names every fix needed
    (val_fraction > 0, and more training slides where any split would still hold out none, or one class)."""
    if not isinstance(grid, dict) or val_fraction > 0:
        return
    points = math.prod(len(values) for values in grid.values())
    if points > 1:
        raise ConfigError(f"{where}: a [train.grid] of {points} points needs validation {what} to choose one on, but "
                          "[data].val_fraction is 0. Fix: set [data].val_fraction > 0 (e.g. 0.25: training "
                          f"{what} held out, never the test set), or drop [train.grid].")


#: [heatmap] settings that choose the patches of a slide cut on the fly (`wsi-milssl heatmap` without stores): an
#: image pipeline's heatmap reads the stores, so they do not apply there.
_HEATMAP_CUTTING_KEYS = ("tissue", "min_tissue", "mask_mpp")


def _stage_classes() -> dict[str, type]:
    from wsi_milssl import config as cfg

    return {"tile": cfg.TileConfig, "label": cfg.LabelConfig, "features": cfg.FeaturesConfig,
            "train": cfg.TrainConfig, "heatmap": cfg.HeatmapConfig, "evaluate": cfg.EvaluateConfig}


def _without_none(value: Any) -> Any:
    """TOML has no null: a None setting is its default, so it is left out."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value


def resolved_pipeline(spec: PipelineSpec) -> dict[str, Any]:
    """The pipeline as it runs: [pipeline] with the absolute output folder, [data] with absolute
    paths, the generated sets' [synth.*] tables, and every stage table with all its settings
    (defaults filled in; ``[train.grid]`` kept). Loading it gives the same configs again."""
    data: dict[str, Any] = {}
    out: dict[str, Any] = {"pipeline": {"name": spec.name, "out_dir": str(Path(spec.out_dir).resolve()),
                                        "grid_workers": spec.grid_workers}, "data": data}
    generated = any(ds.synth is not None for ds in spec.sets.values())
    if generated:
        data["generate"] = True
        out["synth"] = {name: config_to_dict(ds.synth) for name, ds in spec.sets.items()}
    elif spec.mode == "features":
        data["mode"] = "features"
        for name, ds in spec.sets.items():  # absolute already (see load_pipeline); written as loaded so
            data[f"{name}_features"] = str(ds.features)  # that the stages' input fingerprints match
            data[f"{name}_labels"] = str(ds.labels)
    else:
        for name, ds in spec.sets.items():
            for key in ("slides", "labels", "annotations"):
                data[f"{name}_{key}"] = str(getattr(ds, key))
    data["val_fraction"] = spec.val_fraction
    data["split_seed"] = spec.split_seed
    for stage in _stage_classes():
        if stage == "features" and not spec.feature_stage:
            continue
        grid = spec.section(stage).get("grid")
        table = config_to_dict(stage_config(spec, stage))
        if grid is not None:
            table["grid"] = grid
        out[stage] = table
    return _without_none(out)


#: the last line of the header of :func:`write_resolved_pipeline`
_RESOLVED_LAST_LINE = "# Every stage table holds all its settings; `wsi-milssl run` accepts this file as it is."


def _header(path: Path) -> list[str]:
    """The comment lines that start the file at ``path`` ([] when it cannot be read)."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    return header


def write_resolved_pipeline(spec: PipelineSpec, path: str | os.PathLike) -> Path:
    """Write :func:`resolved_pipeline` as TOML (atomically), headed by where it came from: the pipeline file (absolute)
    and its ``--set`` overrides; a run started from this very file keeps the lines of where it came from first and
    adds its own overrides (``# then --set ...``)."""
    import tomli_w

    from wsi_milssl import __version__
    from wsi_milssl.atomic import atomic_write_text

    path = Path(path)
    source = Path(os.path.abspath(spec.source))
    header = []
    if source == Path(os.path.abspath(path)):
        for line in _header(path):
            if line == _RESOLVED_LAST_LINE:
                break
            header.append(line)
    if header:
        if spec.overrides:
            header.append("# then --set " + " --set ".join(spec.overrides))
    else:
        header = [f"# The pipeline as `wsi-milssl run` ran it (wsi-milssl {__version__}): {source}"]
        if spec.overrides:
            header.append("# with --set " + " --set ".join(spec.overrides))
    header.append(_RESOLVED_LAST_LINE)
    return atomic_write_text(Path(path), "\n".join(header) + "\n\n" + tomli_w.dumps(resolved_pipeline(spec)))


#: Keys of one stage that name, in another stage's table, what this stage calls otherwise, with this stage's name
#: for it and what it is (review EW: `[heatmap] workers` was sent to [tile], whose workers are another thing)
_SAME_SETTING = {
    "tile": {"num_workers": ("workers", "the slides tiled at once, `wsi-milssl tile --workers`")},
    **{stage: {"workers": ("num_workers", f"the reader processes, `wsi-milssl {stage} --workers`")}
       for stage in ("features", "train", "heatmap")},
    "evaluate": {"slide_mpp": ("mpp", "the slides' level-0 µm/px, `wsi-milssl evaluate --slide-mpp`")},
}


def _refuse_key_of_another_table(section: dict[str, Any], stage: str, classes: dict[str, type], where: str) -> None:
    """One error for keys of [stage] that are not its settings but another table's (``val_fraction`` in [train]
    belongs in [data]), naming that table (review BR: the error listed [train]'s 41 keys and no way on)."""
    import dataclasses

    own = {f.name for f in dataclasses.fields(classes[stage])}
    renamed = _SAME_SETTING.get(stage, {})
    meant = {key: renamed[key] for key in sorted(set(section) - own) if key in renamed}
    if meant:
        said = "; ".join(f"{key} is called {name} in [{stage}] ({what})" for key, (name, what) in meant.items())
        raise ConfigError(f"{where}: {said}. Fix: rename {'it' if len(meant) == 1 else 'them'}.")
    elsewhere = {}
    for key in sorted(set(section) - own):
        tables = ["data"] if key in ("val_fraction", "split_seed") else [
            other for other, cls in classes.items() if other != stage and key in {f.name for f in dataclasses.fields(cls)}]
        if tables:
            elsewhere[key] = tables
    if elsewhere:
        where_to = "; ".join(f"{key} is a setting of {' and '.join(f'[{t}]' for t in tables)}"
                             for key, tables in elsewhere.items())
        raise ConfigError(f"{where}: {where_to}, not of [{stage}]. Fix: move {'it' if len(elsewhere) == 1 else 'them'} "
                          "to that table.")


def _validate_sections(sections: dict[str, dict[str, Any]], source: Path, *, train_mode: str,
                       overrides: tuple[str, ...] = ()) -> None:
    """Build every stage's config once ([train].mode defaulting to ``train_mode``), so a wrong key or value
    fails before any stage runs; an error names the ``overrides`` of its table."""
    classes = _stage_classes()
    for stage, cls in classes.items():
        section = {k: v for k, v in sections.get(stage, {}).items() if k != "grid"}
        if stage == "train":
            section.setdefault("mode", train_mode)
        set_by = _set_by(overrides, stage)
        _refuse_key_of_another_table(section, stage, classes, f"{source} [{stage}]{set_by}")
        config_from_mapping(cls, section, source=f"{source} [{stage}]{set_by}")
        grid = sections.get(stage, {}).get("grid")
        if grid is not None:
            if stage != "train" or not isinstance(grid, dict):
                raise ConfigError(f"{source}{set_by}: only [train.grid] is supported (a table of lists).")
            for key, values in grid.items():
                if not isinstance(values, list) or not values:
                    raise ConfigError(
                        f"{source}{set_by}: [train.grid].{key} must be a non-empty list of values to try; got "
                        f"{values!r}. Fix: write {key} = [a, b, ...] (--set 'train.grid.{key}=[a, b]'), or set one "
                        f"value as [train].{key}.")
                if key in RUNTIME_ONLY_FIELDS:
                    raise ConfigError(
                        f"{source}{set_by}: [train.grid].{key} is a runtime setting (it changes how fast a run trains, "
                        f"not its model), so every point of the grid would train the same run. Fix: set it once as "
                        f"[train].{key}.")
                for k, value in enumerate(values):
                    # equal values (also equal numbers, 0.1 and 0.10, 25 and 25.0) are one training run
                    first = next((v for v in values[:k] if v == value), None)  # TOML has no null
                    if first is not None:
                        same = "" if repr(first) == repr(value) else f" ({first!r} and {value!r} are equal numbers)"
                        raise ConfigError(
                            f"{source}{set_by}: [train.grid].{key} lists {first!r} twice{same}; each value is one "
                            f"training run, so a repeat would train the same run again in the same folder. Fix: "
                            f"list each value of {key} once.")
                for value in values:
                    config_from_mapping(cls, {**section, key: value}, source=f"{source} [train.grid]{set_by}")
