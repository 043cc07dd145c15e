"""``wsi-milssl run`` after a cohort's split changed (as when ``prepare folder`` is run again after a slide
was added): the stores (and feature files) of slides that moved to the other set stay in
``OUT/stores/<set>/`` (``OUT/features/<set>/``), but label, features, train and heatmap use only those of
the slides now in each set, with one warning per folder; likewise the heatmap files of a slide that left
the test set stay in ``OUT/heatmaps/test/``, but ``scores.csv`` and the evaluate stage hold only the test set's
slides now."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest

from wsi_milssl.config import SynthConfig
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.synth import generate_slides

# tiled at 5x (the other pipeline tests: 10x): a quarter of the patches; these tests are about which slides' files
# the stages read, not how many patches they hold
PIPELINE = """
[pipeline]
name = "moved"
[data]
train_slides = "cohort/train_slides.csv"
train_labels = "cohort/train_labels.csv"
train_annotations = "slides"
test_slides = "cohort/test_slides.csv"
test_labels = "cohort/test_labels.csv"
test_annotations = "slides"
val_fraction = 0.0
[tile]
magnification = 5.0
patch_size_px = 32
entropy_threshold_bits = 4.0
min_tissue = 0.5
[train]
mode = "images"
model = "resnet18"
epochs = 1
batch_size = 32
mu_ramp_epochs = 1
num_workers = 0
plots = false
[heatmap]
num_workers = 0
thumbnail_px = 64
[evaluate]
thumbnail_px = 64
"""


def _split(root, labels: dict[str, str], *, train: list[str], test: list[str]) -> None:
    """The cohort's slide lists and label files for this split (what `prepare folder` writes)."""
    for set_name, stems in (("train", train), ("test", test)):
        paths = "".join(f"{root / 'slides' / stem}.tif\n" for stem in stems)
        (root / "cohort" / f"{set_name}_slides.csv").write_text("path\n" + paths)
        rows = "".join(f"{stem},{labels[stem]}\n" for stem in stems)
        (root / "cohort" / f"{set_name}_labels.csv").write_text("slide,label\n" + rows)


def _slides_in(path) -> list[str]:
    with open(path, newline="") as fh:
        return sorted(row["slide"] for row in csv.DictReader(fh))


def _ignored(folder: Path, set_name: str, stem: str, what: str = "store") -> str:
    return (f"{folder}: ignored 1 {what}(s) of slides no longer in the {set_name} set ({stem}); they are kept, "
            "remove them if they are not needed")


@pytest.fixture()
def moved(tmp_path, caplog):
    """run(pipeline text, until): runs it on the first split up to ``until``, moves synth_002 from the
    training set to the test set and synth_003 the other way, runs it to the end; returns the outcomes."""
    generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), tmp_path / "slides")
    with open(tmp_path / "slides" / "labels.csv", newline="") as fh:
        labels = {row["slide"]: row["label"] for row in csv.DictReader(fh)}
    assert labels == {"synth_000": "0", "synth_001": "1", "synth_002": "1", "synth_003": "0"}
    (tmp_path / "cohort").mkdir()

    def run(text: str, until: str):
        (tmp_path / "moved.toml").write_text(text)
        _split(tmp_path, labels, train=["synth_000", "synth_001", "synth_002"], test=["synth_003"])
        run_pipeline(load_pipeline(tmp_path / "moved.toml", out_dir=tmp_path / "out"), until=until)
        _split(tmp_path, labels, train=["synth_000", "synth_001", "synth_003"], test=["synth_002"])
        with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline"):
            return run_pipeline(load_pipeline(tmp_path / "moved.toml", out_dir=tmp_path / "out"))
    return run


def _warnings(caplog) -> list[str]:
    return sorted(r.getMessage() for r in caplog.records if "no longer in the" in r.getMessage())


def test_stores_of_slides_that_moved_to_the_other_set_are_ignored_and_kept(moved, tmp_path, caplog):
    outcomes = moved(PIPELINE, "tile")
    out = tmp_path / "out"
    assert [(o.stage, o.status) for o in outcomes] == [
        (s, "ran") for s in ("tile", "label", "train", "heatmap", "evaluate")]
    lists = [str(tmp_path / "cohort" / f"{set_name}_slides.csv") for set_name in ("train", "test")]
    assert outcomes[0].reason == f"input changed: {lists[0]}, {lists[1]}"  # the line says which lists changed
    stores = out / "stores"
    # nothing is deleted: the stores of the moved slides stay where the first split put them
    assert sorted(p.name for p in (stores / "train").glob("*.h5")) == [
        "synth_000.h5", "synth_001.h5", "synth_002.h5", "synth_003.h5"]
    assert sorted(p.name for p in (stores / "test").glob("*.h5")) == ["synth_002.h5", "synth_003.h5"]
    # ... but no stage reads them
    assert _slides_in(out / "labels" / "train" / "label_status.csv") == ["synth_000", "synth_001", "synth_003"]
    assert _slides_in(out / "labels" / "test" / "label_status.csv") == ["synth_002"]
    assert _slides_in(out / "heatmaps" / "test" / "scores.csv") == ["synth_002"]
    assert _warnings(caplog) == [_ignored(stores / "test", "test", "synth_003"),
                                 _ignored(stores / "train", "train", "synth_002")]


def test_feature_files_of_slides_that_moved_are_ignored_and_kept(moved, tmp_path, caplog):
    features = PIPELINE.split("[train]")[0] + """[features]
encoder = "resnet18"
weights = "random"
num_workers = 0
[train]
epochs = 1
mu_ramp_epochs = 1
plots = false
[heatmap]
thumbnail_px = 64
[evaluate]
thumbnail_px = 64
"""
    outcomes = moved(features, "features")  # the first split's feature files are made too
    out = tmp_path / "out"
    assert [(o.stage, o.status) for o in outcomes] == [
        (s, "ran") for s in ("tile", "label", "features", "train", "heatmap", "evaluate")]
    assert sorted(p.name for p in (out / "features" / "train").glob("*.h5")) == [
        "synth_000.h5", "synth_001.h5", "synth_002.h5", "synth_003.h5"]
    assert sorted(p.name for p in (out / "features" / "test").glob("*.h5")) == ["synth_002.h5", "synth_003.h5"]
    trained_on = json.loads((out / "model" / "config.json").read_text())["data"]["inputs"]
    assert sorted(Path(p).name for p in trained_on) == ["synth_000.h5", "synth_001.h5", "synth_003.h5"]
    assert _slides_in(out / "heatmaps" / "test" / "scores.csv") == ["synth_002"]
    assert _warnings(caplog) == [
        _ignored(out / "features" / "test", "test", "synth_003", "feature file"),
        _ignored(out / "features" / "train", "train", "synth_002", "feature file"),
        _ignored(out / "stores" / "test", "test", "synth_003"),
        _ignored(out / "stores" / "train", "train", "synth_002")]


def test_heatmap_files_of_a_slide_that_left_the_test_set_are_ignored_by_evaluate_and_kept(moved, tmp_path, caplog):
    outcomes = moved(PIPELINE, "evaluate")  # the first split's heatmaps (synth_003) and report are made too
    out = tmp_path / "out"
    assert [(o.stage, o.status) for o in outcomes] == [
        (s, "ran") for s in ("tile", "label", "train", "heatmap", "evaluate")]
    heatmaps = out / "heatmaps" / "test"
    # synth_003's files stay in the heatmap folder ...
    for name in ("synth_003_detections.csv", "synth_003_patches.csv", "synth_003_probs.json", "synth_003_probs.npy"):
        assert (heatmaps / name).is_file(), name
    # ... but neither scores.csv nor the report count it
    assert _slides_in(heatmaps / "scores.csv") == ["synth_002"]
    assert _slides_in(out / "evaluation" / "per_slide.csv") == ["synth_002"]
    metrics = json.loads((out / "evaluation" / "metrics.json").read_text())
    assert (metrics["n_slides"], metrics["n_tumor_slides"], metrics["n_normal_slides"]) == (1, 1, 0)
    assert metrics["not_evaluated"] == []
    assert "synth_003" not in (out / "evaluation" / "report.html").read_text()
    assert _warnings(caplog) == [_ignored(heatmaps, "test", "synth_003", "heatmap output"),
                                 _ignored(out / "stores" / "test", "test", "synth_003"),
                                 _ignored(out / "stores" / "train", "train", "synth_002")]


@pytest.fixture()
def cohort(tmp_path):
    """Four generated slides, synth_000-002 for training and synth_003 for testing; returns the labels."""
    generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), tmp_path / "slides")
    with open(tmp_path / "slides" / "labels.csv", newline="") as fh:
        labels = {row["slide"]: row["label"] for row in csv.DictReader(fh)}
    (tmp_path / "cohort").mkdir()
    _split(tmp_path, labels, train=["synth_000", "synth_001", "synth_002"], test=["synth_003"])
    (tmp_path / "moved.toml").write_text(PIPELINE)
    return labels


def _trained_on(out: Path) -> list[str]:
    return sorted(Path(p).name for p in json.loads((out / "model" / "config.json").read_text())["data"]["inputs"])


def test_stores_of_an_earlier_format_are_ignored_not_trained_on(cohort, tmp_path, caplog):
    """An earlier run's Zarr stores beside the current HDF5 ones (same slides): the HDF5 stores of the
    tile stage's format are read; a sorted listing used to let the stale .zarr store replace the .h5 one."""
    pipe, out = tmp_path / "moved.toml", tmp_path / "out"
    run_pipeline(load_pipeline(pipe, out_dir=out, overrides=["tile.format=zarr", "tile.patch_size_px=48"]),
                 until="tile")
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline"):
        run_pipeline(load_pipeline(pipe, out_dir=out), until="train")
    assert _trained_on(out) == ["synth_000.h5", "synth_001.h5", "synth_002.h5"]
    assert json.loads((out / "model" / "config.json").read_text())["patch_size_px"] == 32
    assert (out / "stores" / "train" / "synth_000.zarr").exists()  # kept
    assert any("ignored 3 store(s) in another format than [tile] format = 'h5'" in r.getMessage()
               for r in caplog.records)


def test_the_store_of_a_slide_renamed_in_letter_case_is_not_the_renamed_slides(cohort, tmp_path, caplog):
    pipe, out = tmp_path / "moved.toml", tmp_path / "out"
    run_pipeline(load_pipeline(pipe, out_dir=out), until="tile")
    (tmp_path / "slides" / "synth_000.tif").rename(tmp_path / "slides" / "Synth_000.tif")
    (tmp_path / "slides" / "synth_000.xml").unlink(missing_ok=True)
    cohort["Synth_000"] = cohort.pop("synth_000")
    _split(tmp_path, cohort, train=["Synth_000", "synth_001", "synth_002"], test=["synth_003"])
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline"):
        run_pipeline(load_pipeline(pipe, out_dir=out), until="train")
    assert _trained_on(out) == ["Synth_000.h5", "synth_001.h5", "synth_002.h5"]
    assert _ignored(out / "stores" / "train", "train", "synth_000") in _warnings(caplog)


def test_a_deleted_store_or_heatmap_file_makes_its_stage_run_again(cohort, tmp_path, caplog):
    """The tile and heatmap stamps record every slide's files: a store deleted after a run used to leave
    the tile stage 'up to date' and train silently trained without that slide."""
    pipe, out = tmp_path / "moved.toml", tmp_path / "out"
    run_pipeline(load_pipeline(pipe, out_dir=out))
    (out / "stores" / "train" / "synth_001.h5").unlink()
    (out / "heatmaps" / "test" / "synth_003_detections.csv").unlink()
    outcomes = run_pipeline(load_pipeline(pipe, out_dir=out))
    assert (outcomes[0].stage, outcomes[0].status) == ("tile", "ran")
    assert outcomes[0].reason == f"output missing: {out / 'stores' / 'train' / 'synth_001.h5'}"
    assert (out / "stores" / "train" / "synth_001.h5").is_file()
    assert _trained_on(out) == ["synth_000.h5", "synth_001.h5", "synth_002.h5"]
    # review CY: without validation slides the line said "best epoch None"
    assert "3 training / 0 validation slides, no validation slides to choose a best epoch" in next(
        o.summary for o in outcomes if o.stage == "train")
    assert (out / "heatmaps" / "test" / "synth_003_detections.csv").is_file()
    (out / "heatmaps" / "test" / "synth_003_patches.csv").unlink()
    outcomes = run_pipeline(load_pipeline(pipe, out_dir=out))
    ran = [(o.stage, o.reason) for o in outcomes if o.status == "ran"]
    assert ran[0] == ("heatmap", f"output missing: {out / 'heatmaps' / 'test' / 'synth_003_patches.csv'}")
    assert (out / "heatmaps" / "test" / "synth_003_patches.csv").is_file()
    summary = next(o.summary for o in outcomes if o.stage == "heatmap")
    assert summary.startswith("1 slides, ") and summary.endswith(" patches")  # predicted again
    # a drawing-only change: the summary says the slide was drawn again, not predicted (it read as predicted)
    outcomes = run_pipeline(load_pipeline(pipe, out_dir=out, overrides=["heatmap.colormap=magma"]))
    summary = next(o.summary for o in outcomes if o.stage == "heatmap")
    assert summary.startswith("1 slides (1 drawn again), ") and summary.endswith(" patches")
    # a Mac's '._X' copies in the heatmap folder are no slide's: no warning about a slide outside the test set
    (out / "heatmaps" / "test" / "._synth_009_detections.csv").write_bytes(b"\x00\x05\x16\x07")
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline"):
        outcomes = run_pipeline(load_pipeline(pipe, out_dir=out, overrides=["heatmap.colormap=magma"]),
                                force=["evaluate"])
    assert [o.stage for o in outcomes if o.status == "ran"] == ["evaluate"]
    assert _warnings(caplog) == []
