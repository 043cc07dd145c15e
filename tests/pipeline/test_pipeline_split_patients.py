"""``run``'s validation slides with a labels file that names each slide's patient (``slide,patient,label``, as
``prepare folder`` writes train_labels.csv for such a cohort): whole patients are held out, stratified by each
patient's highest label, so no patient has slides in both training and validation; a labels file without the
column splits exactly as before (review AO, follow-up)."""

from __future__ import annotations

import json

from wsi_milssl.cohorts import read_labels
from wsi_milssl.config import SynthConfig
from wsi_milssl.pipeline import load_pipeline, run_pipeline, split_train_val
from wsi_milssl.synth import generate_slides

# 6 slides of 3 patients: p1 two normal slides, p2 and p3 one tumour and one normal slide each
PATIENTS = {"synth_000": "p1", "synth_001": "p2", "synth_002": "p3", "synth_003": "p1", "synth_004": "p2",
            "synth_005": "p3"}

PIPELINE = """
[pipeline]
name = "patients"
[data]
train_slides = "slides"
train_labels = "train_labels.csv"
train_annotations = "slides"
test_slides = "test"
test_labels = "test/labels.csv"
test_annotations = "test"
val_fraction = 0.34
split_seed = {seed}
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
mu_ramp_epochs = 0
num_workers = 0
plots = false
select_metric = "bag_nll"
"""


def _labels(tmp_path) -> dict[str, str]:
    return {line.split(",")[0]: line.split(",")[1] for line in
            (tmp_path / "slides" / "labels.csv").read_text().splitlines()[1:]}


def test_pipeline_validation_holds_out_whole_patients(tmp_path):
    generate_slides(SynthConfig(n_slides=6, seed=0, width_px=2048, height_px=2048, tumor_slide_fraction=0.34),
                    tmp_path / "slides")
    generate_slides(SynthConfig(n_slides=1, seed=1000, width_px=2048, height_px=2048), tmp_path / "test")
    labels = _labels(tmp_path)
    assert {s: labels[s] for s in ("synth_000", "synth_003")} == {"synth_000": "0", "synth_003": "0"}
    assert sorted(labels[s] for s in PATIENTS) == ["0", "0", "0", "0", "1", "1"]
    assert {labels["synth_001"], labels["synth_004"]} == {"0", "1"} == {labels["synth_002"], labels["synth_005"]}
    (tmp_path / "train_labels.csv").write_text(
        "slide,patient,label\n" + "".join(f"{s},{PATIENTS[s]},{labels[s]}\n" for s in PATIENTS))
    # a seed whose slide-by-slide split put one patient's slides on both sides
    stems = sorted(PATIENTS)
    plain = read_labels(tmp_path / "train_labels.csv")
    # ... and whose patient split differs from seed 0's, so that the run is seen to use [data].split_seed (review EG:
    # a run ignoring it went unnoticed)
    seed = next(k for k in range(1, 50) if any(
        len({PATIENTS[s] for s in side} & {PATIENTS[s] for s in other}) > 0
        for side, other in [split_train_val(stems, plain, val_fraction=0.34, seed=k)])
        and split_train_val(stems, plain, val_fraction=0.34, seed=k, groups=PATIENTS)
        != split_train_val(stems, plain, val_fraction=0.34, seed=0, groups=PATIENTS))
    (tmp_path / "p.toml").write_text(PIPELINE.format(seed=seed))
    run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=tmp_path / "out"), until="train")
    data = json.loads((tmp_path / "out" / "model" / "config.json").read_text())["data"]
    val = sorted(p.rsplit("/", 1)[-1].removesuffix(".h5") for p in data["val_inputs"] or [])
    train = sorted(p.rsplit("/", 1)[-1].removesuffix(".h5") for p in data["inputs"])
    assert val and sorted(val + train) == stems
    assert not {PATIENTS[s] for s in val} & {PATIENTS[s] for s in train}, (train, val)
    # val_fraction 0.34 of each class of patients: one of the two tumour patients (p1 is normal, alone in its class)
    assert {PATIENTS[s] for s in val} in ({"p2"}, {"p3"})
    assert val == split_train_val(stems, plain, val_fraction=0.34, seed=seed, groups=PATIENTS)[1]


def test_split_with_groups_keeps_patients_together_and_without_stays_as_it_was():
    stems = [f"s{i:02d}" for i in range(20)]
    labels = {s: int(i % 3 == 0) for i, s in enumerate(stems)}
    # without patients: the split of earlier versions, slide by slide (same seed, same slides)
    assert split_train_val(stems, labels, val_fraction=0.25, seed=3) == (
        ["s00", "s01", "s02", "s03", "s05", "s06", "s07", "s08", "s09", "s10", "s11", "s13", "s16", "s17", "s18"],
        ["s04", "s12", "s14", "s15", "s19"])
    assert split_train_val(stems, labels, val_fraction=0.25, seed=3, groups={}) == \
        split_train_val(stems, labels, val_fraction=0.25, seed=3)
    groups = {s: f"P{i // 4}" for i, s in enumerate(stems)}  # 5 patients of 4 slides, each with a tumour slide
    groups["s19"] = ""  # an empty patient cell: a patient of its own
    for seed in range(10):
        train, val = split_train_val(stems, labels, val_fraction=0.25, seed=seed, groups=groups)
        assert sorted(train + val) == stems and val
        assert not {groups[s] for s in val if groups[s]} & {groups[s] for s in train if groups[s]}
