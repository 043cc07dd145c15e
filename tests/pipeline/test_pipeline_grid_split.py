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
    with pytest.raises(ConfigError) as info:  # by load_pipeline, as run loads it (review AO, finding 3)
        load_pipeline(two_training_slides, out_dir=tmp_path / "out", check_paths=True,
                      overrides=["train.grid.mu=[0.1, 0.2]", f"data.val_fraction={val_fraction}"])
    message = str(info.value)
    assert "a [train.grid] of 2 points needs validation slides to choose one on" in message
    assert CAUSE.format(what="slide") in message
    assert "set [data].val_fraction > 0" not in message  # it is > 0: that fix cannot work
    assert "Fix: add training slides" in message and "drop [train.grid]" in message
    assert not (tmp_path / "out" / "stores").exists()  # tile never ran


def test_a_grid_on_too_few_generated_slides_is_refused_before_synth(tmp_path):
    toml = tmp_path / "gen.toml"
    toml.write_text('[pipeline]\nname = "gen"\n[data]\ngenerate = true\nval_fraction = 0.5\n'
                    "[synth.train]\nn_slides = 2\nseed = 0\nwidth_px = 2048\nheight_px = 2048\n"
                    "[synth.test]\nn_slides = 1\nseed = 1000\nwidth_px = 2048\nheight_px = 2048\n"
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
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline"):
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
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline"):
        run_pipeline(spec, until="train")
    warnings = [r.getMessage() for r in caplog.records if "no validation" in r.getMessage()]
    assert len(warnings) == 1 and CAUSE.format(what="bag") in warnings[0]
    # val_fraction = 0 asks for no validation: nothing to warn about
    caplog.clear()
    spec = load_pipeline(tmp_path / "feat.toml", out_dir=tmp_path / "out0", overrides=["data.val_fraction=0"])
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.pipeline"):
        run_pipeline(spec, until="train")
    assert not [r for r in caplog.records if "no validation" in r.getMessage()]


GENERATED = ('[pipeline]\nname = "gen"\n[data]\ngenerate = true\nval_fraction = {val_fraction}\n'
             "[synth.train]\nn_slides = {n_slides}\nseed = 0\nwidth_px = 2048\nheight_px = 2048\n"
             "[synth.test]\nn_slides = 1\nseed = 1000\nwidth_px = 2048\nheight_px = 2048\n{grid}")
GRID = "[train.grid]\nmu = [0.1, 0.2]\n"
#: 3 generated training slides: synth_000 normal, synth_001 and synth_002 tumour; any val_fraction > 0 holds out
#: synth_001 alone (a class goes into validation only with at least 2 training slides)
ONE_CLASS = "val_fraction = 0.5 holds out synth_001: the one validation slide (bag) is tumour (label 1)"


def _generated(tmp_path, *, n_slides: int, val_fraction: str, grid: bool = True):
    toml = tmp_path / "gen.toml"
    toml.write_text(GENERATED.format(n_slides=n_slides, val_fraction=val_fraction, grid=GRID if grid else ""))
    return toml


def _refused_before_synth(toml, tmp_path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out", overrides=list(overrides)))
    assert not (tmp_path / "out" / "slides").exists()  # synth never ran
    return str(info.value)


def test_a_grid_whose_validation_slides_are_of_one_class_is_refused_before_synth(tmp_path):
    """select_metric = "bag_auc" (the default) needs validation slides of both classes: with 2 tumour and 1
    normal training slide every split holds out one tumour slide, and each grid point would fail in train."""
    toml = _generated(tmp_path, n_slides=3, val_fraction="0.5")
    message = _refused_before_synth(toml, tmp_path)
    assert "a [train.grid] of 2 points is chosen on the validation slides by select_metric \"bag_auc\"" in message
    assert ONE_CLASS in message and "bag AUC cannot be computed" in message
    assert "here: 2 tumour, 1 normal" in message
    assert 'select_metric = "bag_nll"' in message and "add training slides" in message
    assert "drop [train.grid]" not in message  # a single run on this split fails as well
    # the fixes it names work: bag_nll is defined with one class; 4 training slides give both classes
    assert run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out", overrides=["train.select_metric=bag_nll"]),
                        until="synth")[0].status == "ran"
    toml = _generated(tmp_path, n_slides=4, val_fraction="0.5")
    assert run_pipeline(load_pipeline(toml, out_dir=tmp_path / "out4"), until="synth")[0].status == "ran"


def test_instance_auc_is_left_to_train(tmp_path):
    """Instance labels are known only after the label stage: a grid chosen by instance_auc is not refused up
    front on its slide labels."""
    toml = _generated(tmp_path, n_slides=3, val_fraction="0.5")
    spec = load_pipeline(toml, out_dir=tmp_path / "out", overrides=["train.select_metric=instance_auc"])
    assert run_pipeline(spec, until="synth")[0].status == "ran"


def test_a_single_run_whose_validation_slides_are_of_one_class_is_refused_before_synth(tmp_path):
    """A single run on the same split would certainly fail in train (no epoch can be chosen for best.pt)."""
    toml = _generated(tmp_path, n_slides=3, val_fraction="0.5", grid=False)
    message = _refused_before_synth(toml, tmp_path)
    assert "select_metric \"bag_auc\" chooses best.pt on the validation slides, so train would fail" in message
    assert ONE_CLASS in message and "here: 2 tumour, 1 normal" in message
    assert 'select_metric = "bag_nll"' in message and "set [data].val_fraction = 0" in message
    # the fix it names works: no validation slides, the run keeps last.pt (one warning)
    spec = load_pipeline(toml, out_dir=tmp_path / "out", overrides=["data.val_fraction=0"])
    assert run_pipeline(spec, until="synth")[0].status == "ran"


def test_a_grid_with_val_fraction_0_names_every_fix_needed(two_training_slides, tmp_path):
    """val_fraction = 0 with a grid: the message names val_fraction > 0 and, when any val_fraction > 0 would
    hold out no validation slide (1 tumour, 1 normal), more training slides as well, not one fix at a time."""
    with pytest.raises(ConfigError) as info:  # by load_pipeline, as run loads it (review AO, finding 3)
        load_pipeline(two_training_slides, out_dir=tmp_path / "out", check_paths=True,
                      overrides=["train.grid.mu=[0.1, 0.2]", "data.val_fraction=0"])
    message = str(info.value)
    assert "few.toml [train] with --set train.grid.mu=[0.1, 0.2] --set data.val_fraction=0: " in message
    assert "[data].val_fraction is 0, and any val_fraction > 0 would hold out none" in message
    assert CAUSE.format(what="slide") in message
    assert "Fix: set [data].val_fraction > 0 (e.g. 0.25" in message and "and add training slides" in message
    assert not (tmp_path / "out" / "stores").exists()


def test_a_grid_with_val_fraction_0_and_a_one_class_split_names_both_fixes(tmp_path):
    message = _refused_before_synth(_generated(tmp_path, n_slides=3, val_fraction="0"), tmp_path)
    assert "[data].val_fraction is 0, and val_fraction = 0.25 would hold out synth_001: the one validation slide " \
           "(bag) is tumour (label 1): bag AUC cannot be computed" in message
    assert "as with any val_fraction > 0" in message and "here: 2 tumour, 1 normal" in message
    assert "Fix: set [data].val_fraction > 0 (e.g. 0.25" in message
    assert 'select_metric = "bag_nll"' in message and "add training slides" in message


def test_a_grid_with_val_fraction_0_and_enough_slides_names_only_val_fraction(tmp_path):
    toml = _generated(tmp_path, n_slides=4, val_fraction="0")
    message = _refused_before_synth(toml, tmp_path)
    assert "[data].val_fraction is 0. Fix: set [data].val_fraction > 0 (e.g. 0.25" in message
    assert "add training slides" not in message
    spec = load_pipeline(toml, out_dir=tmp_path / "out", overrides=["data.val_fraction=0.25"])
    assert run_pipeline(spec, until="synth")[0].status == "ran"


def test_a_grid_with_val_fraction_0_and_an_unreadable_labels_file_is_still_refused(two_training_slides, tmp_path):
    (tmp_path / "cohort" / "train_labels.csv").unlink()
    with pytest.raises(ConfigError) as info:  # by load_pipeline (review AO, finding 3)
        load_pipeline(two_training_slides, out_dir=tmp_path / "out",
                      overrides=["train.grid.mu=[0.1, 0.2]", "data.val_fraction=0"])
    assert "[data].val_fraction is 0. Fix: set [data].val_fraction > 0" in str(info.value)
    assert not (tmp_path / "out" / "stores").exists()


def test_a_feature_grid_with_val_fraction_0_is_refused_when_loaded(tmp_path):
    """Feature files are split by the train stage: the load-time refusal stays for them."""
    with pytest.raises(ConfigError, match=r"val_fraction is 0\. Fix: set \[data\]\.val_fraction > 0"):
        load_pipeline(_two_bags(tmp_path), out_dir=tmp_path / "out",
                      overrides=["train.grid.mu=[0.1, 0.3]", "data.val_fraction=0"])
