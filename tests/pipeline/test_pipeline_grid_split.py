"""A [train.grid] whose train/validation split has no validation slides: ``split_train_val`` holds out a slide
of a class only when the class has at least 2 training slides, so with one tumour and one normal training
slide no ``[data].val_fraction`` gives any. The run is refused before any stage runs (the split is known
from the slide list and labels), naming that cause and a fix that works; a single run (no grid, or a
one-point grid) trains on, with one warning that it keeps last.pt."""

from __future__ import annotations

import csv
import logging

import h5py
import numpy as np
import pytest

from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.synth import generate_slides

PIPELINE = """
[pipeline]
name = "few"
[data]
train_slides = "cohort/train_slides.csv"
train_labels = "cohort/train_labels.csv"
train_annotations = "slides"
test_slides = "cohort/test_slides.csv"
test_labels = "cohort/test_labels.csv"
test_annotations = "slides"
val_fraction = 0.2
[tile]
magnification = 10.0
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
"""

FEATURES = """
[pipeline]
name = "feat"
[data]
mode = "features"
train_features = "feats/train"
train_labels = "feats/train_labels.csv"
test_features = "feats/test"
test_labels = "feats/test_labels.csv"
val_fraction = 0.5
[train]
mode = "features"
model = "mlp"
epochs = 2
batch_size = 16
plots = false
"""

CAUSE = ("split_train_val puts a {what} of a class into validation only when the class has at least 2 training "
         "{what}s; here: 1 tumour, 1 normal")


@pytest.fixture()
def two_training_slides(tmp_path):
    """The pipeline file of a cohort with one tumour and one normal training slide (and two test slides)."""
    generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), tmp_path / "slides")
    with open(tmp_path / "slides" / "labels.csv", newline="") as fh:
        labels = {row["slide"]: row["label"] for row in csv.DictReader(fh)}
    assert labels == {"synth_000": "0", "synth_001": "1", "synth_002": "1", "synth_003": "0"}
    (tmp_path / "cohort").mkdir()
    for set_name, stems in (("train", ["synth_000", "synth_001"]), ("test", ["synth_002", "synth_003"])):
        (tmp_path / "cohort" / f"{set_name}_slides.csv").write_text(
            "path\n" + "".join(f"{tmp_path / 'slides' / stem}.tif\n" for stem in stems))
        (tmp_path / "cohort" / f"{set_name}_labels.csv").write_text(
            "slide,label\n" + "".join(f"{stem},{labels[stem]}\n" for stem in stems))
    toml = tmp_path / "few.toml"
    toml.write_text(PIPELINE)
    return toml


@pytest.mark.parametrize("val_fraction", ["0.2", "0.5"])
def test_a_grid_whose_split_has_no_validation_slides_is_refused_before_any_stage(two_training_slides, tmp_path,
                                                                                val_fraction):
    spec = load_pipeline(two_training_slides, out_dir=tmp_path / "out",
                         overrides=["train.grid.mu=[0.1, 0.2]", f"data.val_fraction={val_fraction}"])
    ran = []
    with pytest.raises(ConfigError) as info:
        run_pipeline(spec, on_stage=ran.append)
    message = str(info.value)
    assert "a [train.grid] of 2 points needs validation slides to choose one on" in message
    assert CAUSE.format(what="slide") in message
    assert "set [data].val_fraction > 0" not in message  # it is > 0: that fix cannot work
    assert "Fix: add training slides" in message and "drop [train.grid]" in message
    assert ran == [] and not (tmp_path / "out" / "stores").exists()  # tile never ran


def test_a_grid_on_too_few_generated_slides_is_refused_before_synth(tmp_path):
    toml = tmp_path / "gen.toml"
    toml.write_text('[pipeline]\nname = "gen"\n[data]\ngenerate = true\nval_fraction = 0.5\n'
                    "[synth.train]\nn_slides = 2\nseed = 0\n[synth.test]\nn_slides = 1\nseed = 1000\n"
                    "[train.grid]\nmu = [0.1, 0.2]\n")
    with pytest.raises(ConfigError) as info:
        run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out"))
    assert CAUSE.format(what="slide") in str(info.value)
    assert not (tmp_path / "out" / "slides").exists()  # synth never ran
    # with 4 generated training slides (2 of each class) the grid has validation slides: nothing refused here
    toml.write_text(toml.read_text().replace("n_slides = 2", "n_slides = 4"))
    assert run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out"), until="synth")[0].status == "ran"


def test_a_single_run_without_validation_slides_warns_that_it_keeps_last_pt(two_training_slides, tmp_path, caplog):
    spec = load_pipeline(two_training_slides, out_dir=tmp_path / "out", overrides=["train.grid.mu=[0.1]"])
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline.runner"):
        outcomes = run_pipeline(spec, until="train")
    assert outcomes[-1].summary.startswith("2 training / 0 validation slides")
    warnings = [r.getMessage() for r in caplog.records if "no validation" in r.getMessage()]
    assert len(warnings) == 1
    assert "[data].val_fraction = 0.2 gave no validation slides" in warnings[0]
    assert CAUSE.format(what="slide") in warnings[0] and "last.pt" in warnings[0]
    assert (tmp_path / "out" / "model" / "last.pt").is_file() and not (tmp_path / "out" / "model" / "best.pt").exists()


def _feature_files(folder, labels: dict[str, int], seed: int) -> None:
    """One feature file of 12 instances per bag (a tumour bag's first 4 shifted), and its labels CSV."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for name, label in labels.items():
        inst = np.zeros(12, dtype=np.uint8)
        inst[:4] = label
        with h5py.File(folder / f"{name}.h5", "w") as fh:
            fh["features"] = rng.normal(size=(12, 8)).astype(np.float32) + inst[:, None] * 1.5
            fh["instance_label"] = inst
    (folder.parent / f"{folder.name}_labels.csv").write_text(
        "slide,label\n" + "".join(f"{k},{v}\n" for k, v in labels.items()))


def _two_bags(tmp_path):
    """A feature pipeline with one tumour and one normal training bag."""
    _feature_files(tmp_path / "feats" / "train", {"tr0": 0, "tr1": 1}, 0)
    _feature_files(tmp_path / "feats" / "test", {"te0": 0, "te1": 1}, 1)
    toml = tmp_path / "feat.toml"
    toml.write_text(FEATURES)
    return toml


def test_a_feature_grid_without_validation_bags_names_the_cause(tmp_path):
    spec = load_pipeline(_two_bags(tmp_path), out_dir=tmp_path / "out",
                         overrides=["train.grid.mu=[0.1, 0.3]"])
    with pytest.raises(ConfigError) as info:
        run_pipeline(spec)
    message = str(info.value)
    assert CAUSE.format(what="bag") in message and "set [data].val_fraction > 0" not in message
    assert not (tmp_path / "out" / "model" / "grid").exists()


def test_a_single_feature_run_without_validation_bags_warns(tmp_path, caplog):
    spec = load_pipeline(_two_bags(tmp_path), out_dir=tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline.runner"):
        run_pipeline(spec, until="train")
    warnings = [r.getMessage() for r in caplog.records if "no validation" in r.getMessage()]
    assert len(warnings) == 1 and CAUSE.format(what="bag") in warnings[0]
    # val_fraction = 0 asks for no validation: nothing to warn about
    caplog.clear()
    spec = load_pipeline(tmp_path / "feat.toml", out_dir=tmp_path / "out0", overrides=["data.val_fraction=0"])
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline.runner"):
        run_pipeline(spec, until="train")
    assert not [r for r in caplog.records if "no validation" in r.getMessage()]
