"""`run` after an edit of a test slide's annotation file draws that slide's heatmap overlay again and does not
predict it again (review AJ, finding 1: the label stage rewrites the slide's store, and the heatmap stage took
the store's new size and modification time for new patches: hours of GPU on CAMELYON16 for a new outline)."""

from __future__ import annotations

import logging
import shutil

from wsi_milssl.config import SynthConfig
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.synth import generate_slides

PIPELINE = """
[pipeline]
name = "relabelled-test-slide"
[data]
train_slides = "cohort/train_slides.csv"
train_labels = "cohort/train_labels.csv"
train_annotations = "cohort/annotations/train"
test_slides = "cohort/test_slides.csv"
test_labels = "cohort/test_labels.csv"
test_annotations = "cohort/annotations/test"
val_fraction = 0.34
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


def test_an_edited_test_annotation_redraws_its_heatmap_without_predicting(tmp_path, caplog):
    slides = tmp_path / "slides"
    generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), slides)
    labels = dict(line.split(",") for line in (slides / "labels.csv").read_text().split()[1:])
    for set_name, stems in (("train", TRAIN), ("test", TEST)):
        (tmp_path / "cohort" / "annotations" / set_name).mkdir(parents=True)
        (tmp_path / "cohort" / f"{set_name}_slides.csv").write_text(
            "path\n" + "".join(f"{slides / stem}.tif\n" for stem in stems))
        (tmp_path / "cohort" / f"{set_name}_labels.csv").write_text(
            "slide,label\n" + "".join(f"{stem},{labels[stem]}\n" for stem in stems))
        for stem in stems:
            if (slides / f"{stem}.xml").is_file():
                shutil.copy(slides / f"{stem}.xml", tmp_path / "cohort" / "annotations" / set_name)
    toml = tmp_path / "p.toml"
    toml.write_text(PIPELINE)
    out = tmp_path / "out"

    def run() -> dict[str, str]:
        return {o.stage: o.status for o in run_pipeline(load_pipeline(toml, out_dir=out))}

    assert set(run().values()) == {"ran"}
    store = out / "stores" / "test" / "synth_002.h5"
    assert store.is_file()
    stat = store.stat()
    with open(tmp_path / "cohort" / "annotations" / "test" / "synth_002.xml", "a", encoding="utf-8") as fh:
        fh.write("<!-- c -->\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="wsi_milssl"):
        outcome = run()
    assert outcome["label"] == "ran" and outcome["heatmap"] == "ran"
    assert (store.stat().st_size, store.stat().st_mtime_ns) != (stat.st_size, stat.st_mtime_ns)  # relabelled
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("synth_002:")]
    assert not [m for m in messages if "predicting it again" in m], messages
    assert [m for m in messages if "another annotation file to outline" in m], messages
    assert set(run().values()) == {"skipped"}
