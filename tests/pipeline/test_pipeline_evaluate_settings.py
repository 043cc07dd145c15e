"""``run``'s evaluate stage reads the annotations as its label stage did: [label]'s tumour / non-tumour
groups and positive_fraction go to the evaluation unless [evaluate] sets other values (it used the
CAMELYON16 groups and its own 0.25 whatever [label] said)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline, write_resolved_pipeline
from wsi_milssl.pipeline.context import StageContext
from wsi_milssl.pipeline.runner import _evaluate

LABEL = """
[label]
tumor_groups = ["Metastasis"]
non_tumor_groups = ["Exclusion"]
positive_fraction = 0.5
"""


def _spec(tmp_path: Path, tables: str):
    path = tmp_path / "p.toml"
    path.write_text('[pipeline]\nname = "t"\n' + GENERATED_SLIDES + tables)
    return load_pipeline(path, out_dir=tmp_path / "out")


@pytest.fixture
def evaluated_with(monkeypatch):
    """Function (spec) -> the EvaluateConfig the pipeline's evaluate stage passes to evaluate_predictions."""
    import wsi_milssl.evaluation as evaluation

    seen = {}

    def fake(predictions_dir, **kwargs):
        seen.update(kwargs)
        return SimpleNamespace(metrics={})

    monkeypatch.setattr(evaluation, "evaluate_predictions", fake)

    def run(spec):
        _evaluate(StageContext(spec, None))
        return seen["config"]

    return run


def test_evaluate_takes_the_label_stage_s_groups_and_positive_fraction(tmp_path, evaluated_with):
    config = evaluated_with(_spec(tmp_path, LABEL))
    assert config.tumor_groups == ("Metastasis",) and config.non_tumor_groups == ("Exclusion",)
    assert config.positive_fraction == 0.5


def test_evaluate_s_own_settings_win(tmp_path, evaluated_with):
    config = evaluated_with(_spec(tmp_path, LABEL + '[evaluate]\npositive_fraction = 0.3\ntumor_groups = ["Tumor"]\n'))
    assert config.positive_fraction == 0.3 and config.tumor_groups == ("Tumor",)
    assert config.non_tumor_groups == ("Exclusion",)


def test_the_resolved_pipeline_evaluates_as_the_pipeline_it_came_from(tmp_path, evaluated_with):
    """resolved_pipeline.toml spells out [evaluate]'s defaults; they do not hide [label]'s values."""
    spec = _spec(tmp_path, LABEL)
    resolved = write_resolved_pipeline(spec, tmp_path / "resolved.toml")
    assert evaluated_with(load_pipeline(resolved)) == evaluated_with(spec)
    assert evaluated_with(load_pipeline(resolved)).tumor_groups == ("Metastasis",)


def test_a_label_setting_spelled_at_its_default_is_label_s_and_a_run_says_so(tmp_path, evaluated_with, caplog):
    """Review BR, A1: [evaluate] positive_fraction = 0.25 (the default, as the packaged templates spell it) takes
    [label]'s 0.5, as an absent one does: every pipeline prepare wrote relies on that (review BT: keeping the
    spelled value re-ran their evaluations with other metrics). A run now says so, naming the setting."""
    import logging

    from wsi_milssl.pipeline import run_pipeline

    spec = _spec(tmp_path, LABEL + '[evaluate]\npositive_fraction = 0.25\n')
    assert evaluated_with(spec).positive_fraction == 0.5
    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
        import wsi_milssl.pipeline.runner as runner

        def stop(*args, **kwargs):
            raise KeyboardInterrupt  # the warning comes before any stage

        original, runner._run_stages = runner._run_stages, stop
        try:
            run_pipeline(spec)
        finally:
            runner._run_stages = original
    assert "[evaluate] positive_fraction = 0.25 (the default) takes [label]'s 0.5" in caplog.text
    caplog.clear()
    assert evaluated_with(_spec(tmp_path, LABEL)).positive_fraction == 0.5


def test_a_label_group_that_evaluate_carves_out_is_one_error(tmp_path, evaluated_with):
    spec = _spec(tmp_path, LABEL + '[evaluate]\nnon_tumor_groups = ["Metastasis"]\n')
    with pytest.raises(ConfigError, match=r"p.toml \[evaluate\] with \[label\]'s positive_fraction, tumor_groups: "
                                          r".*group\(s\) metastasis are in both tumor_groups and non_tumor_groups"):
        evaluated_with(spec)


def test_heatmap_outlines_take_the_label_stage_s_groups(tmp_path):
    """The overlays outlined the annotations with CAMELYON16's groups whatever [label] said (a QuPath
    'Metastasis' cohort got no outline); [heatmap]'s own groups win."""
    from wsi_milssl.pipeline.digests import with_label_settings

    config = with_label_settings(_spec(tmp_path, LABEL), "heatmap")
    assert config.tumor_groups == ("Metastasis",) and config.non_tumor_groups == ("Exclusion",)
    own = with_label_settings(_spec(tmp_path, LABEL + '[heatmap]\ntumor_groups = ["Tumor"]\n'), "heatmap")
    assert own.tumor_groups == ("Tumor",) and own.non_tumor_groups == ("Exclusion",)
    assert with_label_settings(_spec(tmp_path, ""), "heatmap").tumor_groups == ("_0", "_1", "Tumor")


def test_heatmap_outlines_are_read_with_the_configured_groups(tmp_path):
    import json

    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference.stage import _read_outlines

    square = [[[0, 0], [400, 0], [400, 400], [0, 400], [0, 0]]]
    (tmp_path / "s1.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": square},
         "properties": {"objectType": "annotation", "classification": {"name": "Metastasis"}}}]}))
    default = _read_outlines("s1", tmp_path, (1000, 1000), HeatmapConfig())
    assert default is None or default.is_empty
    region = _read_outlines("s1", tmp_path, (1000, 1000), HeatmapConfig(tumor_groups=("Metastasis",)))
    assert region.area == pytest.approx(400 * 400)
    with pytest.raises(ConfigError, match="are in both tumor_groups and non_tumor_groups"):
        HeatmapConfig(tumor_groups=("A",), non_tumor_groups=("a",))


def test_default_outline_groups_keep_the_heatmap_fingerprint_of_earlier_versions():
    """A heatmap folder made before the groups were a setting is still finished for the same settings;
    other groups make its overlays again."""
    import hashlib
    import json

    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.config.base import config_to_dict
    from wsi_milssl.inference.stage import _RUNTIME_FIELDS, _fingerprint

    import torch

    model = SimpleNamespace(checkpoint_path=None, tiling=SimpleNamespace(to_dict=lambda: {"patch": 32}), pooling="max",
                            runtime=SimpleNamespace(device=torch.device("cpu"), amp_dtype=torch.bfloat16))
    earlier = {k: v for k, v in config_to_dict(HeatmapConfig()).items()
               if k not in _RUNTIME_FIELDS and k not in ("tumor_groups", "non_tumor_groups")}
    blob = json.dumps({"heatmap": earlier, "tiling": {"patch": 32}, "pooling": "max"}, sort_keys=True).encode()
    assert _fingerprint(HeatmapConfig(), model) == hashlib.sha256(blob).hexdigest()[:16]
    assert _fingerprint(HeatmapConfig(tumor_groups=("Metastasis",)), model) != _fingerprint(HeatmapConfig(), model)
    # at the device's default precision (amp = "auto": bfloat16 on the CPU) the precision is left out, as earlier
    # versions left it out; another (float32) counts (ad3d804)
    model.runtime.amp_dtype = None
    assert _fingerprint(HeatmapConfig(), model) != hashlib.sha256(blob).hexdigest()[:16]


def test_the_evaluate_stamp_counts_the_label_settings_it_takes(tmp_path):
    """A pipeline evaluated by an earlier version with CAMELYON16's groups although [label] named others
    evaluates again; one with [label]'s defaults keeps its digest."""
    from wsi_milssl.pipeline.digests import stage_settings

    taken = {"tumor_groups": ["Metastasis"], "non_tumor_groups": ["Exclusion"], "positive_fraction": 0.5}
    section = stage_settings(_spec(tmp_path, LABEL), "evaluate")["section"]
    assert {k: section[k] for k in taken} == taken
    # as the stamps of the earlier form recorded it: the settings that differ from their defaults
    assert stage_settings(_spec(tmp_path, ""), "evaluate", form="changed") == {"section": {}}
    assert stage_settings(_spec(tmp_path, LABEL), "evaluate", form="changed") == {"section": taken}


def test_a_group_clash_with_label_is_refused_before_any_stage_runs(tmp_path):
    from wsi_milssl.pipeline import run_pipeline

    spec = _spec(tmp_path, LABEL + '[evaluate]\nnon_tumor_groups = ["Metastasis"]\n')
    with pytest.raises(ConfigError, match=r"\[evaluate\] with \[label\]'s"):
        run_pipeline(spec)
    assert not (tmp_path / "out" / "slides").exists()  # nothing was generated, tiled or trained first


def test_a_group_clash_with_the_default_non_tumour_groups_says_so():
    from wsi_milssl.config import EvaluateConfig

    with pytest.raises(ConfigError, match=r"non_tumor_groups are the default ones, _2, Exclusion, None: set them too"):
        EvaluateConfig(tumor_groups=("_2",))


def test_evaluate_measures_at_the_tile_stage_s_slide_mpp(tmp_path, evaluated_with):
    """[tile] slide_mpp cuts the slides at that µm/px: the evaluation measures their lesions at it (it took the
    slide's metadata); [evaluate]'s own mpp wins (and evaluate refuses one that the heatmaps contradict). The
    evaluate stamp counts it: an evaluation made at the metadata's µm/px runs again."""
    from wsi_milssl.pipeline.digests import stage_settings

    assert evaluated_with(_spec(tmp_path, "slide_mpp = 0.5\n")).mpp == 0.5  # a key of GENERATED_SLIDES' [tile]
    assert evaluated_with(_spec(tmp_path, "slide_mpp = 0.5\n[evaluate]\nmpp = 0.3\n")).mpp == 0.3
    assert evaluated_with(_spec(tmp_path, "")).mpp is None
    assert stage_settings(_spec(tmp_path, "slide_mpp = 0.5\n"), "evaluate")["section"]["mpp"] == 0.5
    assert stage_settings(_spec(tmp_path, ""), "evaluate")["section"]["mpp"] is None
    assert stage_settings(_spec(tmp_path, "slide_mpp = 0.5\n"), "evaluate", form="changed") == {"section": {"mpp": 0.5}}


def test_a_pipeline_with_a_slide_mpp_evaluates_every_slide_at_it(tmp_path):
    """`run` with [tile] slide_mpp = 0.5 on slides whose metadata says 0.25: per_slide.csv had 0.25 for the
    tumour slide (its FROC mask measured at the metadata's µm/px) and 0.5 for the normal one."""
    import csv
    import json

    from wsi_milssl.pipeline import run_pipeline

    spec = _spec(tmp_path, "slide_mpp = 0.5\n" + """[train]
mode = "images"
model = "resnet18"
epochs = 1
batch_size = 32
mu = 0.2
mu_ramp_epochs = 1
num_workers = 0
[heatmap]
num_workers = 0
thumbnail_px = 128
[evaluate]
thumbnail_px = 64
""")
    run_pipeline(spec)
    out = tmp_path / "out"
    with open(out / "evaluation" / "per_slide.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["label"] for r in rows} == {"0", "1"}
    assert [float(r["mpp"]) for r in rows] == [0.5] * len(rows)
    sidecars = sorted((out / "heatmaps" / "test").glob("*_probs.json"))
    assert len(sidecars) == len(rows) and all(json.loads(p.read_text())["mpp"] == 0.5 for p in sidecars)
