"""``evaluate`` never scores what it should refuse: tumour polygons in other annotation groups (QuPath
"Metastasis"), slides whose latest heatmap run failed (or found them empty) but whose earlier files are
still there, and a folder whose slides were predicted by different heatmap runs; and its settings are
checked (no infinite margin, a slide MPP in the range of every other stage)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from wsi_milssl.annotations import PolygonAnnotation, read_annotations, write_annotations
from wsi_milssl.cli import main
from wsi_milssl.config import EvaluateConfig
from wsi_milssl.errors import ConfigError, EvaluationError
from wsi_milssl.evaluation import evaluate_predictions


def _evaluate(pred_dir: Path, synth_dir: Path, annotations_dir: Path, out: Path, **config):
    return evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                annotations_dir=annotations_dir, slides=synth_dir,
                                config=EvaluateConfig(**config))


def _copy(pred_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    return copy


# -- annotation groups ---------------------------------------------------------------------------

@pytest.fixture
def metastasis_annotations(known_annotation, tmp_path) -> Path:
    """The known annotation as a QuPath GeoJSON whose polygons are classified "Metastasis"."""
    folder = tmp_path / "qupath"
    folder.mkdir()
    polygons = [PolygonAnnotation(a.name, "Metastasis", a.coords_lv0)
                for a in read_annotations(known_annotation.path).polygons]
    write_annotations(polygons, folder / f"{known_annotation.stem}.geojson", format="geojson")
    return folder


def test_tumour_polygons_in_another_group_are_refused_not_dropped(synth_dir, predictions, metastasis_annotations,
                                                                   known_annotation, tmp_path):
    """They were dropped with a warning: the slide had no lesion, its true positives counted as false
    positives and the metrics were written (FROC n/a, exit 0)."""
    with pytest.raises(EvaluationError) as exc:
        _evaluate(predictions[0], synth_dir, metastasis_annotations, tmp_path / "out")
    message = str(exc.value)
    assert f"{known_annotation.stem}.geojson: slide {known_annotation.stem!r} is labelled tumour" in message
    assert "group(s) 'Metastasis', which are neither tumour nor non-tumour" in message
    assert "Fix: name the tumour group(s) with --tumor-groups" in message
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_evaluate_takes_the_tumour_groups_as_label_does(synth_dir, predictions, metastasis_annotations,
                                                        annotations_dir, tmp_path, capsys):
    reference = _evaluate(predictions[0], synth_dir, annotations_dir, tmp_path / "ref").metrics
    out = tmp_path / "out"
    args = ["evaluate", "--predictions", str(predictions[0]), "--annotations", str(metastasis_annotations),
            "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)]
    assert main(args) == 1
    assert "--tumor-groups" in capsys.readouterr().err
    assert main(args + ["--tumor-groups", "Metastasis,Tumor", "--non-tumor-groups", "Exclusion"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_lesions"] == reference["n_lesions"] == 1
    assert metrics["froc"] == reference["froc"] and metrics["instance_auc"] == reference["instance_auc"]
    config = json.loads((out / "config.json").read_text())
    assert config["tumor_groups"] == ["Metastasis", "Tumor"] and config["non_tumor_groups"] == ["Exclusion"]


def test_evaluate_group_defaults_and_checks_are_label_s():
    from wsi_milssl.config import LabelConfig

    assert EvaluateConfig().tumor_groups == LabelConfig().tumor_groups
    assert EvaluateConfig().non_tumor_groups == LabelConfig().non_tumor_groups
    assert EvaluateConfig(tumor_groups=["Metastasis"]).tumor_groups == ("Metastasis",)  # TOML gives lists
    with pytest.raises(ConfigError, match=r"group\(s\) tumor are in both tumor_groups and non_tumor_groups"):
        EvaluateConfig(tumor_groups=("Tumor",), non_tumor_groups=("tumor",))
    with pytest.raises(ConfigError, match=r"EvaluateConfig.tumor_groups must name at least one group"):
        EvaluateConfig(tumor_groups=())


# -- the heatmap stage's latest run failed --------------------------------------------------------

def _status(folder: Path, rows: dict[str, str]) -> None:
    (folder / "heatmap_status.csv").write_text(
        "slide,status,n_patches,score,seconds,error\n"
        + "".join(f"{stem},{status},0,,0.1,{'SlideReadError: cannot read' if status == 'failed' else ''}\n"
                  for stem, status in rows.items()))


def test_a_slide_whose_latest_heatmap_run_failed_is_refused_whatever_files_it_has(synth_dir, annotations_dir,
                                                                                  predictions, tmp_path):
    """The check covered only slides without a detection file: an earlier run's files were scored."""
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _status(copy, {info["tumor"]: "ok", info["normal"]: "failed"})
    with pytest.raises(EvaluationError) as exc:
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    message = str(exc.value)
    assert f"the heatmap stage failed on labelled slides {info['normal']} (SlideReadError: cannot read)" in message
    assert f"the files of {info['normal']} in the folder are an earlier run's, not the latest" in message
    assert "Fix: mend and re-run the heatmap stage for them" in message
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_a_slide_the_latest_heatmap_run_found_empty_is_not_scored_on_older_files(synth_dir, annotations_dir,
                                                                                 predictions, tmp_path):
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _status(copy, {info["tumor"]: "empty", info["normal"]: "ok"})
    with pytest.raises(EvaluationError, match=rf"found no tissue patch on slides {info['tumor']}, but prediction "
                                              r"files of an earlier run"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")


def test_slides_the_heatmap_stage_finished_are_evaluated(synth_dir, annotations_dir, predictions, tmp_path):
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _status(copy, {info["tumor"]: "ok", info["normal"]: "ok", "not_labelled": "failed"})
    assert _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out").metrics["froc"] == pytest.approx(5 / 6)


# -- one heatmap run ------------------------------------------------------------------------------

def _sidecars(folder: Path, info: dict, **per_slide: dict) -> None:
    """Add the run records the heatmap stage writes (checkpoint, fingerprint, settings) to both sidecars;
    ``per_slide``: {"tumor" | "normal": {key: value}} changes (None removes the key)."""
    run = {"checkpoint": "/runs/a/best.pt", "fingerprint": "aaaaaaaaaaaaaaaa", "model_name": "resnet18",
           "bag_pooling": "max", "detection_threshold": 0.5, "nms_radius_um": 100.0, "tumor_threshold": 0.5,
           "source": "store"}
    for which in ("tumor", "normal"):
        path = folder / f"{info[which]}_probs.json"
        data = {**json.loads(path.read_text()), **run, **per_slide.get(which, {})}
        path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def test_slides_of_two_heatmap_runs_are_not_evaluated_as_one(synth_dir, annotations_dir, predictions, tmp_path):
    """A partial re-run with another checkpoint left slides of both side by side; they were mixed silently
    and the report showed only the last run's settings."""
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _sidecars(copy, info, normal={"checkpoint": "/runs/b/best.pt", "fingerprint": "bbbbbbbbbbbbbbbb"})
    with pytest.raises(EvaluationError) as exc:
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    message = str(exc.value)
    assert "its slides were predicted by 2 different heatmap runs" in message
    assert f"slides {info['tumor']} by checkpoint /runs/a/best.pt, fingerprint aaaaaaaaaaaaaaaa" in message
    assert f"slides {info['normal']} by checkpoint /runs/b/best.pt, fingerprint bbbbbbbbbbbbbbbb" in message
    assert "Fix: run the heatmap stage again with --overwrite on the whole set of slides" in message
    assert not (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.parametrize("normal", [
    {"detection_threshold": 0.9},  # feature heads record no fingerprint: the settings are compared
    {"checkpoint": "/runs/b/best.pt"},
])
def test_slides_without_fingerprints_are_compared_on_checkpoint_and_settings(synth_dir, annotations_dir, predictions,
                                                                              tmp_path, normal):
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _sidecars(copy, info, tumor={"fingerprint": None, "source": "features"},
              normal={"fingerprint": None, "source": "features", **normal})
    with pytest.raises(EvaluationError, match="2 different heatmap runs"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")


def test_a_slide_without_the_fingerprint_of_the_others_is_refused(synth_dir, annotations_dir, predictions, tmp_path):
    """A slide whose files a killed run left half-written has a sidecar without a fingerprint."""
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _sidecars(copy, info, normal={"fingerprint": None})
    with pytest.raises(EvaluationError, match=rf"slides {info['normal']} by checkpoint /runs/a/best.pt, no "
                                              r"fingerprint: made by a feature head or an earlier version"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")


@pytest.mark.parametrize("tumor, normal", [
    ({}, {"source": "slide"}),  # one run (a resumed one: the fingerprint leaves runtime settings out)
    ({"fingerprint": None, "source": "features"}, {"fingerprint": None, "source": "features"}),  # a feature head
])
def test_slides_of_one_heatmap_run_are_evaluated(synth_dir, annotations_dir, predictions, tmp_path, tumor, normal):
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _sidecars(copy, info, tumor=tumor, normal=normal)
    (copy / "heatmap_config.json").write_text(json.dumps({"checkpoint": "/runs/a/best.pt",
                                                         "fingerprint": tumor.get("fingerprint", "aaaaaaaaaaaaaaaa")}))
    result = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert result.metrics["froc"] == pytest.approx(5 / 6)
    report = (tmp_path / "out" / "report.html").read_text()
    assert "/runs/a/best.pt" in report and "describes a later heatmap run" not in report


def test_the_report_does_not_show_a_later_run_s_settings_as_the_slides(synth_dir, annotations_dir, predictions,
                                                                       tmp_path):
    """heatmap_config.json is rewritten by every run, also one on other slides than those evaluated."""
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    _sidecars(copy, info)
    (copy / "heatmap_config.json").write_text(json.dumps({"checkpoint": "/runs/later/best.pt",
                                                         "fingerprint": "cccccccccccccccc"}))
    _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    report = (tmp_path / "out" / "report.html").read_text()
    assert "heatmap_config.json describes a later heatmap run (checkpoint /runs/later/best.pt)" in report
    assert "cccccccccccccccc" not in report and "aaaaaaaaaaaaaaaa" in report


# -- settings --------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value, field", [
    ("--margin-um", "inf", "margin_um"), ("--margin-um", "1e300", "margin_um"),
    ("--itc-major-axis-um", "inf", "itc_major_axis_um"), ("--slide-mpp", "1e-9", "mpp"),
    ("--slide-mpp", "1000", "mpp"),
])
def test_evaluate_refuses_settings_out_of_range_in_one_line(synth_dir, annotations_dir, predictions, tmp_path,
                                                            capsys, option, value, field):
    """--margin-um inf was an OverflowError traceback; --slide-mpp 1e-9 made every region an ITC."""
    out = tmp_path / "out"
    code = main(["evaluate", "--predictions", str(predictions[0]), "--annotations", str(annotations_dir),
                 "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out),
                 option, value])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: {option}: EvaluateConfig.{field} must satisfy ")
    assert not out.exists()


def test_evaluate_config_ranges():
    with pytest.raises(ConfigError, match=r"EvaluateConfig.margin_um must satisfy 0.0 <= value <= 100000.0; got inf"):
        EvaluateConfig(margin_um=float("inf"))
    with pytest.raises(ConfigError, match=r"EvaluateConfig.mpp must satisfy 0.01 <= value <= 100.0; got 1e-09"):
        EvaluateConfig(mpp=1e-9)
    assert EvaluateConfig(mpp=0.01, margin_um=0.0, itc_major_axis_um=100_000.0).mpp == 0.01


def test_a_patch_table_cut_short_is_refused_where_its_sidecar_records_the_count(synth_dir, annotations_dir,
                                                                                  predictions, tmp_path):
    """Review BW: a `<stem>_patches.csv` cut short (its last rows lost, the last probability cut to "0.4") was
    evaluated as it was: another instance AUC, exit 0."""
    pred_dir, info = predictions
    copy = _copy(pred_dir, tmp_path)
    table = copy / f"{info['normal']}_patches.csv"
    n_rows = len(table.read_text().splitlines()) - 1
    _sidecars(copy, info, normal={"n_patches": n_rows}, tumor={"n_patches": None})
    assert _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out").metrics["instance_auc"] is not None
    table.write_bytes(table.read_bytes()[:-100])  # the last rows, and part of the one before them
    left = len(table.read_text().splitlines()) - 1
    assert left < n_rows
    with pytest.raises(EvaluationError, match=(
            rf"{re.escape(str(table))}: holds {left} patch rows, but .*_probs\.json records {n_rows} "
            r"patches: the table was cut short or changed after the heatmap stage wrote it\. Fix: run the heatmap "
            r"stage again for this slide")):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out2")
