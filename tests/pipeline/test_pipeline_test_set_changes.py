"""A training run folder is reused when only the test set's files changed (a fixed test annotation): label,
heatmap and evaluate run again, the model is not trained again. Training reads the training set's stores,
bag labels and instance labels only, and its run folder is started again (the old one renamed aside) when
one of those changed; a run folder recorded by an earlier version (``pipeline_run.json`` with the label
stage's stamp digest) is still reused."""

from __future__ import annotations

import csv
import json
import re
import shutil

import h5py
import numpy as np
import pytest
import torch

from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import ConfigError, WsiMilsslError
from wsi_milssl.mil.resnet import ResNet18
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.pipeline.digests import training_data
from wsi_milssl.pipeline.run_folders import RUN_MARKER
from wsi_milssl.synth import generate_slides

PIPELINE = """
[pipeline]
name = "test-set-changes"
[data]
train_slides = "cohort/train_slides.csv"
train_labels = "cohort/train_labels.csv"
train_annotations = "cohort/annotations/train"
test_slides = "cohort/test_slides.csv"
test_labels = "cohort/test_labels.csv"
test_annotations = "cohort/annotations/test"
val_fraction = 0.34
[tile]
magnification = 5.0  # a quarter of the patches of 10x: enough for every check here
patch_size_px = 32
entropy_threshold_bits = 4.0
min_tissue = 0.5
[train]
mode = "images"
model = "resnet18"
epochs = 1
batch_size = 32
mu_ramp_epochs = 1
select_metric = "bag_nll"  # defined on one validation slide
num_workers = 0
plots = false
[heatmap]
num_workers = 0
thumbnail_px = 64
[evaluate]
thumbnail_px = 64
"""

TRAIN, TEST = ["synth_000", "synth_001", "synth_003"], ["synth_002"]  # synth_001 and synth_002 are tumours


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slides")
    generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), folder)
    return folder


def _write_cohort(slides, root):
    """The pipeline file of a cohort as `prepare` writes one: slide lists, labels, and each set's
    annotations in its own folder (the slide lists name the slides in ``slides`` by absolute path)."""
    labels = dict(line.split(",") for line in (slides / "labels.csv").read_text().split()[1:])
    for set_name, stems in (("train", TRAIN), ("test", TEST)):
        (root / "cohort" / "annotations" / set_name).mkdir(parents=True)
        (root / "cohort" / f"{set_name}_slides.csv").write_text(
            "path\n" + "".join(f"{slides / stem}.tif\n" for stem in stems))
        (root / "cohort" / f"{set_name}_labels.csv").write_text(
            "slide,label\n" + "".join(f"{stem},{labels[stem]}\n" for stem in stems))
        for stem in stems:
            if (slides / f"{stem}.xml").is_file():
                shutil.copy(slides / f"{stem}.xml", root / "cohort" / "annotations" / set_name)
    (root / "p.toml").write_text(PIPELINE)
    return root / "p.toml"


@pytest.fixture()
def cohort(slides, tmp_path):
    """A cohort's pipeline file, nothing run yet."""
    return _write_cohort(slides, tmp_path)


@pytest.fixture(scope="module")
def finished(slides, tmp_path_factory):
    """A cohort whose pipeline ran to the end once (tile, label, a resnet18 trained, heatmap, evaluate)."""
    toml = _write_cohort(slides, tmp_path_factory.mktemp("finished"))
    assert set(_run(toml).values()) == {"ran"}
    return toml


@pytest.fixture()
def finished_cohort(finished, tmp_path):
    """A copy of the finished cohort (pipeline file, cohort folder and output folder; the paths in the pipeline
    file are relative to it, the slide lists name the shared slides) for a test to change and run again."""
    for name in ("cohort", "out"):
        shutil.copytree(finished.parent / name, tmp_path / name, symlinks=True, copy_function=shutil.copy2)
    shutil.copy2(finished, tmp_path / "p.toml")
    return tmp_path / "p.toml"


def _fix_annotation(xml) -> None:
    """A corrected annotation: its first polygon's first point moved by 20 px."""
    text = xml.read_text()
    fixed = re.sub(r'X="([0-9.]+)"', lambda m: f'X="{float(m.group(1)) + 20:.2f}"', text, count=1)
    assert fixed != text
    xml.write_text(fixed)


EMBEDDED = PIPELINE.split("[train]")[0] + """[features]
encoder = "resnet18"
weights = "random"
num_workers = 0
[train]
epochs = 1
mu_ramp_epochs = 1
select_metric = "bag_nll"
plots = false
"""

FEATURES = """
[pipeline]
name = "test-set-changes-features"
[data]
mode = "features"
train_features = "feats/train"
train_labels = "feats/train_labels.csv"
test_features = "feats/test"
test_labels = "feats/test_labels.csv"
val_fraction = 0.34
[train]
mode = "features"
model = "mlp"
epochs = 1
batch_size = 16
plots = false
"""


def _run(toml, until: str = "evaluate") -> dict[str, str]:
    outcomes = run_pipeline(load_pipeline(toml, out_dir=toml.parent / "out"), until=until)
    return {o.stage: o.status for o in outcomes}


def _aside(toml) -> list:
    return sorted((toml.parent / "out").glob("model.replaced-*"))


def test_a_fixed_test_annotation_reruns_label_and_evaluate_but_does_not_train_again(finished_cohort):
    cohort = finished_cohort
    out = cohort.parent / "out"
    model = out / "model"
    assert set(_run(cohort).values()) == {"skipped"}  # the copy of the finished run is up to date
    best, metrics, marker = ((model / name).read_bytes() for name in ("best.pt", "metrics.jsonl", RUN_MARKER))
    outputs = (out / "heatmaps" / "test" / "synth_002_probs.json", out / "evaluation" / "metrics.json")
    written = {path: path.stat().st_mtime_ns for path in outputs}

    _fix_annotation(cohort.parent / "cohort" / "annotations" / "test" / "synth_002.xml")
    assert _run(cohort) == {"tile": "skipped", "label": "ran", "train": "ran", "heatmap": "ran", "evaluate": "ran"}
    assert _aside(cohort) == []  # the run folder was reused: its finished run has nothing left to train
    assert (model / "best.pt").read_bytes() == best
    assert (model / "metrics.jsonl").read_bytes() == metrics
    assert (model / RUN_MARKER).read_bytes() == marker
    # the test slide's store holds its new instance labels: its heatmap and the report are made again
    assert all(path.stat().st_mtime_ns != mtime_ns for path, mtime_ns in written.items())
    assert set(_run(cohort).values()) == {"skipped"}


def test_what_training_reads_comes_from_the_training_set_alone(cohort):
    spec = load_pipeline(cohort, out_dir=cohort.parent / "out")
    before = training_data(spec)
    test_list = cohort.parent / "cohort" / "test_slides.csv"
    test_list.write_text(test_list.read_text() + f"{cohort.parent / 'other.tif'}\n")  # a test slide added
    _fix_annotation(cohort.parent / "cohort" / "annotations" / "test" / "synth_002.xml")
    assert training_data(spec) == before
    train_list = cohort.parent / "cohort" / "train_slides.csv"
    train_list.write_text(train_list.read_text().replace("synth_003", "synth_002"))  # another training slide
    assert training_data(spec) != before
    other_labels = load_pipeline(cohort, out_dir=cohort.parent / "out", overrides=["label.positive_fraction=0.5"])
    assert training_data(other_labels) != before


def test_a_changed_training_annotation_or_training_label_trains_again(finished_cohort):
    cohort = finished_cohort
    model = cohort.parent / "out" / "model"
    first = (model / "best.pt").read_bytes()

    _fix_annotation(cohort.parent / "cohort" / "annotations" / "train" / "synth_001.xml")
    assert _run(cohort, until="train") == {"tile": "skipped", "label": "ran", "train": "ran"}
    (aside,) = _aside(cohort)
    assert (aside / "best.pt").read_bytes() == first  # kept, renamed aside; the new run trained from epoch 1
    assert [json.loads(line)["epoch"] for line in (model / "metrics.jsonl").read_text().splitlines()] == [1]

    labels = cohort.parent / "cohort" / "train_labels.csv"  # two labels swapped: the split stays the same
    labels.write_text(labels.read_text().replace("synth_001,1", "synth_001,0").replace("synth_003,0", "synth_003,1"))
    assert _run(cohort, until="train") == {"tile": "skipped", "label": "ran", "train": "ran"}
    assert len(_aside(cohort)) == 2


def test_a_run_folder_recorded_by_an_earlier_version_is_reused(finished_cohort):
    cohort = finished_cohort
    out = cohort.parent / "out"
    marker = json.loads((out / "model" / RUN_MARKER).read_text())
    best = (out / "model" / "best.pt").read_bytes()
    # pipeline_run.json as earlier versions wrote it: the label stage's stamp digest and the external
    # inputs of the train stage (none in an image pipeline) in place of what the training set comes from
    earlier = {k: marker[k] for k in ("kind", "settings", "split")}
    earlier.update(upstream=json.loads((out / ".pipeline" / "label.json").read_text())["digest"], external=[])
    (out / "model" / RUN_MARKER).write_text(json.dumps(earlier, sort_keys=True))
    (out / ".pipeline" / "train.json").unlink()  # the train stage runs again (as after an interruption)

    assert _run(cohort, until="train") == {"tile": "skipped", "label": "skipped", "train": "ran"}
    assert _aside(cohort) == []
    assert (out / "model" / "best.pt").read_bytes() == best
    assert json.loads((out / "model" / RUN_MARKER).read_text()) == marker  # recorded again in this version's form


def test_with_a_features_table_a_fixed_test_annotation_does_not_train_again(cohort):
    cohort.write_text(EMBEDDED)
    model = cohort.parent / "out" / "model"
    _run(cohort, until="train")
    best = (model / "best.pt").read_bytes()
    features = sorted((cohort.parent / "out" / "features").glob("*/*.h5"))
    made = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in features}
    assert len(made) == 4
    _fix_annotation(cohort.parent / "cohort" / "annotations" / "test" / "synth_002.xml")
    assert _run(cohort, until="train") == {"tile": "skipped", "label": "ran", "features": "ran", "train": "ran"}
    assert _aside(cohort) == [] and (model / "best.pt").read_bytes() == best
    # the stores are the same (labelled again): every feature file is kept, none embedded again (the
    # stage made every file again on each run)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in features if p.stem != "synth_002"} == {
        p: v for p, v in made.items() if p.stem != "synth_002"}
    test_file = cohort.parent / "out" / "features" / "test" / "synth_002.h5"
    assert test_file.stat().st_ino == made[test_file][0]  # its labels, if they changed, are updated in place

    _fix_annotation(cohort.parent / "cohort" / "annotations" / "train" / "synth_001.xml")
    assert _run(cohort, until="train") == {"tile": "skipped", "label": "ran", "features": "ran", "train": "ran"}
    assert len(_aside(cohort)) == 1


@pytest.mark.parametrize("shared", [False, True], ids=["own-labels", "one-labels-csv"])
def test_in_feature_mode_a_changed_test_label_does_not_train_again(tmp_path, shared):
    """Also with one labels CSV for both sets: training counts its own bags' rows, not the whole file."""
    rng = np.random.default_rng(0)
    for set_name, n_bags in (("train", 6), ("test", 4)):
        (tmp_path / "feats" / set_name).mkdir(parents=True)
        for i in range(n_bags):
            with h5py.File(tmp_path / "feats" / set_name / f"{set_name}{i}.h5", "w") as fh:
                fh["features"] = rng.normal(size=(12, 8)).astype(np.float32) + i % 2
        (tmp_path / "feats" / f"{set_name}_labels.csv").write_text(
            "slide,label\n" + "".join(f"{set_name}{i},{i % 2}\n" for i in range(n_bags)))
    toml = tmp_path / "feat.toml"
    text = FEATURES
    labels = tmp_path / "feats" / "test_labels.csv"
    train_labels = tmp_path / "feats" / "train_labels.csv"
    if shared:
        both = tmp_path / "feats" / "labels.csv"
        both.write_text((tmp_path / "feats" / "train_labels.csv").read_text() + labels.read_text().split("\n", 1)[1])
        text = text.replace("feats/train_labels.csv", "feats/labels.csv").replace("feats/test_labels.csv",
                                                                                  "feats/labels.csv")
        labels = train_labels = both
    toml.write_text(text)
    model = tmp_path / "out" / "model"
    _run(toml)
    metrics = (model / "metrics.jsonl").read_bytes()
    labels.write_text(labels.read_text().replace("test0,0", "test0,1"))
    assert _run(toml) == {"train": "ran", "evaluate": "ran"}
    assert _aside(toml) == [] and (model / "metrics.jsonl").read_bytes() == metrics
    train_labels.write_text(train_labels.read_text().replace("train0,0", "train0,1"))  # a training bag's label
    _run(toml)
    assert len(_aside(toml)) == 1


def test_with_one_annotations_folder_for_both_sets_a_fixed_test_annotation_does_not_train_again(finished_cohort):
    """Training reads its own slides' rows and annotation files, not the whole folder or CSV that a
    pipeline may share between the sets."""
    cohort = finished_cohort  # its first run below runs again into the finished run's folder, one folder now
    shared = cohort.parent / "cohort" / "annotations" / "test"
    for xml in (cohort.parent / "cohort" / "annotations" / "train").iterdir():
        shutil.copy(xml, shared)
    cohort.write_text(cohort.read_text().replace('train_annotations = "cohort/annotations/train"',
                                                 'train_annotations = "cohort/annotations/test"'))
    _run(cohort, until="train")
    _fix_annotation(shared / "synth_002.xml")  # the test slide's
    assert _run(cohort, until="train") == {"tile": "skipped", "label": "ran", "train": "ran"}
    assert _aside(cohort) == []
    _fix_annotation(shared / "synth_001.xml")  # a training slide's
    assert _run(cohort, until="train") == {"tile": "skipped", "label": "ran", "train": "ran"}
    assert len(_aside(cohort)) == 1


def test_new_encoder_weights_behind_the_same_path_train_again(cohort):
    """The training feature files are embedded again with the new weights: the head trained on the old
    ones is not reused (its resume used to fail on every later run, naming no fix)."""
    weights = cohort.parent / "enc.pt"

    def write_weights(seed: int) -> None:
        torch.manual_seed(seed)
        torch.save(ResNet18(num_classes=1).state_dict(), weights)

    write_weights(1)
    cohort.write_text(EMBEDDED.replace('weights = "random"', f'weights = "{weights}"'))
    _run(cohort, until="train")
    write_weights(2)
    _fix_annotation(cohort.parent / "cohort" / "annotations" / "test" / "synth_002.xml")
    assert _run(cohort, until="train") == {"tile": "skipped", "label": "ran", "features": "ran", "train": "ran"}
    assert len(_aside(cohort)) == 1
    assert set(_run(cohort, until="train").values()) == {"skipped"}


def test_a_test_slide_renamed_in_letter_case_is_evaluated_under_its_new_name(finished_cohort, slides):
    """Its heatmap files under the old name stay and are ignored (they were a 'two files of one slide'
    error on every later run)."""
    cohort = finished_cohort
    out = cohort.parent / "out"
    renamed = cohort.parent / "Synth_002.tif"
    shutil.copy(slides / "synth_002.tif", renamed)
    root = cohort.parent / "cohort"
    (root / "test_slides.csv").write_text(f"path\n{renamed}\n")
    (root / "test_labels.csv").write_text((root / "test_labels.csv").read_text().replace("synth_002", "Synth_002"))
    (root / "annotations" / "test" / "synth_002.xml").rename(root / "annotations" / "test" / "Synth_002.xml")
    assert _run(cohort)["evaluate"] == "ran"
    with open(out / "evaluation" / "per_slide.csv", newline="") as fh:
        assert [row["slide"] for row in csv.DictReader(fh)] == ["Synth_002"]
    assert (out / "heatmaps" / "test" / "synth_002_detections.csv").is_file()


def test_a_slide_in_both_sets_is_refused_before_any_stage(cohort, slides):
    listed = cohort.parent / "cohort" / "test_slides.csv"
    listed.write_text(listed.read_text() + f"{slides / 'synth_000.tif'}\n")  # a training slide
    with pytest.raises(ConfigError, match=r"1 slide\(s\) are in both the training and the test set \(.*synth_000"
                                          r"\.tif\).*Fix: remove them from the test set or from the training set"):
        _run(cohort)
    assert not (cohort.parent / "out" / "stores").exists()


def _blank_slide(path):
    """A pyramidal slide without tissue (every tile is background)."""
    from wsi_milssl.synth.pyramid import write_pyramidal_tiff

    write_pyramidal_tiff(path, lambda x0, y0, x1, y1: np.full((y1 - y0, x1 - x0, 3), 245, np.uint8),
                         width=2048, height=2048, mpp=0.25)
    return path


@pytest.mark.parametrize("text", [PIPELINE, EMBEDDED], ids=["images", "features"])
def test_a_test_slide_without_tissue_counts_as_empty_and_leaves_with_the_list(request, text):
    """A no-tissue test slide failed the heatmap stage of an image pipeline (and the features stage) on every
    run; taken off the test list, it was still evaluated with score 0 from the heatmap status file."""
    # the image pipeline starts from a copy of the finished run (the blank slide makes every stage run again)
    cohort = request.getfixturevalue("finished_cohort" if text is PIPELINE else "cohort")
    cohort.write_text(text)
    root = cohort.parent / "cohort"
    blank = _blank_slide(cohort.parent / "blank.tif")
    (root / "test_slides.csv").write_text((root / "test_slides.csv").read_text() + f"{blank}\n")
    (root / "test_labels.csv").write_text((root / "test_labels.csv").read_text() + "blank,0\n")
    assert set(_run(cohort).values()) == {"ran"}
    metrics = json.loads((cohort.parent / "out" / "evaluation" / "metrics.json").read_text())
    assert metrics["n_slides"] == 2 and metrics["n_normal_slides"] == 1  # blank counts, with no detection
    (root / "test_slides.csv").write_text((root / "test_slides.csv").read_text().replace(f"{blank}\n", ""))
    _run(cohort)
    metrics = json.loads((cohort.parent / "out" / "evaluation" / "metrics.json").read_text())
    assert metrics["n_slides"] == 1 and metrics["not_evaluated"] == []


def test_a_store_deleted_under_a_stamp_of_an_earlier_version_is_made_again(cohort):
    out = cohort.parent / "out"
    _run(cohort, until="tile")
    stamp = json.loads((out / ".pipeline" / "tile.json").read_text())
    stamp["outputs"] = [p for p in stamp["outputs"] if p.endswith(".csv")]  # as earlier versions recorded it
    (out / ".pipeline" / "tile.json").write_text(json.dumps(stamp))
    (out / "stores" / "train" / "synth_000.h5").unlink()
    outcomes = run_pipeline(load_pipeline(cohort, out_dir=out), until="tile")
    missing = out / "stores" / "train" / "synth_000.h5"
    assert [(o.status, o.reason) for o in outcomes] == [("ran", f"output missing: {missing}")]
    assert (out / "stores" / "train" / "synth_000.h5").is_file()


@pytest.mark.parametrize("text", [PIPELINE, EMBEDDED], ids=["images", "features"])
def test_a_test_slide_found_empty_on_a_later_run_is_not_scored_on_its_earlier_predictions(request, slides, text):
    """The slide file was replaced by one without tissue: its earlier heatmap files and scores.csv row are
    removed, so evaluate counts it with no detection (it used to score the old predictions again)."""
    cohort = request.getfixturevalue("finished_cohort" if text is PIPELINE else "cohort")  # images: from a copy
    cohort.write_text(text)
    copy = cohort.parent / "synth_002.tif"
    shutil.copy(slides / "synth_002.tif", copy)
    (cohort.parent / "cohort" / "test_slides.csv").write_text(f"path\n{copy}\n")
    _run(cohort)
    heatmaps = cohort.parent / "out" / "heatmaps" / "test"
    assert (heatmaps / "synth_002_detections.csv").is_file()
    copy.unlink()
    _blank_slide(copy)
    _run(cohort)
    assert (heatmaps / "synth_002_detections.csv").read_bytes() == b""  # no detection: an empty file
    assert not list(heatmaps.glob("synth_002_probs*"))
    assert "synth_002" not in (heatmaps / "scores.csv").read_text()
    metrics = json.loads((cohort.parent / "out" / "evaluation" / "metrics.json").read_text())
    assert (metrics["n_slides"], metrics["n_detections"], metrics["n_lesions_detected"]) == (1, 0, 0)


def test_a_missing_slide_file_in_both_lists_is_reported_missing_not_shared(cohort):
    gone = cohort.parent / "gone.tif"
    for set_name in ("train", "test"):
        listed = cohort.parent / "cohort" / f"{set_name}_slides.csv"
        listed.write_text(listed.read_text() + f"{gone}\n")
    with pytest.raises(WsiMilsslError) as caught:
        _run(cohort)
    assert "gone.tif" in str(caught.value) and "both the training and the test set" not in str(caught.value)


def test_the_stage_summaries_count_slides_without_a_patch(finished_cohort):
    """Review BK: `[train] 240 training / 60 validation slides` when 209 / 55 were trained and validated on (the
    rest had no patch and were left out), and the tile and heatmap lines never said that slides were empty."""
    import re

    from wsi_milssl.synth.pyramid import write_pyramidal_tiff

    root = finished_cohort.parent / "cohort"
    for name, set_name, grey in (("blank_a", "train", 245), ("blank_b", "test", 246)):  # two files: other bytes
        blank = finished_cohort.parent / f"{name}.tif"
        write_pyramidal_tiff(blank, lambda x0, y0, x1, y1, g=grey: np.full((y1 - y0, x1 - x0, 3), g, np.uint8),
                             width=2048, height=2048, mpp=0.25)
        (root / f"{set_name}_slides.csv").write_text((root / f"{set_name}_slides.csv").read_text() + f"{blank}\n")
        (root / f"{set_name}_labels.csv").write_text((root / f"{set_name}_labels.csv").read_text() + f"{name},0\n")
    outcomes = {o.stage: o.summary for o in run_pipeline(load_pipeline(finished_cohort,
                                                                       out_dir=finished_cohort.parent / "out"))}
    assert re.match(r"^train: \d+ patches from 4 slides \(3 kept, 1 without a patch\); test: \d+ patches from 2 "
                    r"slides \(1 kept, 1 without a patch\)$", outcomes["tile"]), outcomes["tile"]
    trained = re.match(r"^(\d) training / (\d) validation slides \(1 without a patch left out\), best epoch",
                       outcomes["train"])
    assert trained and int(trained[1]) + int(trained[2]) == 3, outcomes["train"]
    assert re.match(r"^2 slides \(1 without a patch\), \d+ patches$", outcomes["heatmap"]), outcomes["heatmap"]
