"""Pipeline files (``pipelines/*.toml``): which data, and each stage's settings.

A pipeline file has one table per stage, whose keys are the fields of that stage's config
dataclass, plus ``[pipeline]`` and ``[data]``::

    [pipeline]
    name = "demo"
    out_dir = "demo_out"            # where every artifact goes (``wsi-milssl run --out`` overrides)

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

Relative data paths are resolved against the pipeline file's folder; a generated set lives in
``OUT/slides/<set>`` and serves as its own labels and annotations folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wsi_milssl.config import SynthConfig, config_from_mapping, load_toml
from wsi_milssl.errors import ConfigError

__all__ = ["PipelineSpec", "DataSet", "load_pipeline", "STAGES", "SETS"]

STAGES = ("synth", "tile", "label", "features", "train", "heatmap", "evaluate")
SETS = ("train", "test")
_TOP_LEVEL = {"pipeline", "data", *STAGES}


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

    def section(self, stage: str) -> dict[str, Any]:
        """The raw table of ``stage`` (empty when absent)."""
        return dict(self.sections.get(stage, {}))


def _path(base: Path, value: Any, key: str, source: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{source}: [data].{key} must be a path string; got {value!r}.")
    p = Path(os.path.expanduser(value))
    return p if p.is_absolute() else (base / p)


def load_pipeline(path: str | os.PathLike, *, out_dir: str | os.PathLike | None = None) -> PipelineSpec:
    """Read and validate a pipeline file; every stage table is checked against its config class."""
    source = Path(path)
    raw = load_toml(source)
    unknown = sorted(set(raw) - _TOP_LEVEL)
    if unknown:
        raise ConfigError(
            f"{source}: unknown table(s) {', '.join(unknown)}; valid tables are {', '.join(sorted(_TOP_LEVEL))}."
        )
    meta = raw.get("pipeline", {})
    name = str(meta.get("name", source.stem))
    out = Path(out_dir) if out_dir is not None else Path(meta.get("out_dir", f"{name}_out"))
    data = dict(raw.get("data", {}))
    base = source.resolve().parent
    mode = str(data.pop("mode", "images"))
    if mode not in ("images", "features"):
        raise ConfigError(f"{source}: [data].mode must be 'images' or 'features'; got {mode!r}.")
    generate = bool(data.pop("generate", "synth" in raw)) and mode == "images"
    val_fraction = float(data.pop("val_fraction", 0.25))
    split_seed = int(data.pop("split_seed", 0))
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"{source}: [data].val_fraction must satisfy 0 <= value < 1; got {val_fraction!r}.")

    sets: dict[str, DataSet] = {}
    if generate:
        synth = raw.get("synth", {})
        for set_name in SETS:
            if set_name not in synth:
                raise ConfigError(f"{source}: a generated pipeline needs a [synth.{set_name}] table.")
            cfg = config_from_mapping(SynthConfig, synth[set_name], source=f"{source} [synth.{set_name}]")
            folder = out / "slides" / set_name
            sets[set_name] = DataSet(set_name, folder, folder / "labels.csv", folder, cfg)
        if data:
            raise ConfigError(f"{source}: [data] keys {', '.join(sorted(data))} are not used with generated data.")
    elif mode == "features":
        for set_name in SETS:
            keys = {k: f"{set_name}_{k}" for k in ("features", "labels")}
            missing = [v for v in keys.values() if v not in data]
            if missing:
                raise ConfigError(f"{source}: [data] is missing {', '.join(missing)} (features mode).")
            features, labels = (_path(base, data.pop(keys[k]), keys[k], source) for k in ("features", "labels"))
            sets[set_name] = DataSet(set_name, None, labels, None, None, features)
        if data:
            raise ConfigError(f"{source}: unknown [data] key(s) {', '.join(sorted(data))}.")
    else:
        for set_name in SETS:
            keys = {k: f"{set_name}_{k}" for k in ("slides", "labels", "annotations")}
            missing = [v for v in keys.values() if v not in data]
            if missing:
                raise ConfigError(f"{source}: [data] is missing {', '.join(missing)}.")
            sets[set_name] = DataSet(
                set_name, *(_path(base, data.pop(keys[k]), keys[k], source) for k in ("slides", "labels", "annotations"))
            )
        if data:
            raise ConfigError(f"{source}: unknown [data] key(s) {', '.join(sorted(data))}.")

    feature_stage = "features" in raw
    if feature_stage and mode == "features":
        raise ConfigError(f"{source}: a [features] table embeds the patches of slides, but [data].mode = 'features' "
                          "trains on features that exist already. Fix: drop one of them.")
    sections = {stage: dict(raw.get(stage, {})) for stage in STAGES if stage != "synth"}
    if feature_stage:
        train_mode = sections["train"].setdefault("mode", "features")
        if train_mode != "features":
            raise ConfigError(f"{source}: with a [features] table the head trains on features; [train].mode is "
                              f"{train_mode!r}. Fix: set mode = \"features\" (and an MLP head) or drop [features].")
    _validate_sections(sections, source)
    return PipelineSpec(name=name, source=source, out_dir=out, sets=sets, val_fraction=val_fraction,
                        split_seed=split_seed, sections=sections, mode=mode, feature_stage=feature_stage)


def _validate_sections(sections: dict[str, dict[str, Any]], source: Path) -> None:
    """Build every stage's config once, so a wrong key or value fails before any stage runs."""
    from wsi_milssl import config as cfg

    classes = {"tile": cfg.TileConfig, "label": cfg.LabelConfig, "features": cfg.FeaturesConfig,
               "train": cfg.TrainConfig, "heatmap": cfg.HeatmapConfig, "evaluate": cfg.EvaluateConfig}
    for stage, cls in classes.items():
        section = {k: v for k, v in sections.get(stage, {}).items() if k != "grid"}
        config_from_mapping(cls, section, source=f"{source} [{stage}]")
        grid = sections.get(stage, {}).get("grid")
        if grid is not None:
            if stage != "train" or not isinstance(grid, dict):
                raise ConfigError(f"{source}: only [train.grid] is supported (a table of lists).")
            for key, values in grid.items():
                for value in values if isinstance(values, list) else [values]:
                    config_from_mapping(cls, {**section, key: value}, source=f"{source} [train.grid]")
