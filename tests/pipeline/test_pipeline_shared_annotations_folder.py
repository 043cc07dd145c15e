"""Review AU, finding 5: a pipeline with one annotations folder for both sets ([data] train_annotations =
test_annotations, which the README allows) warned on every label run that the training slides' annotation
files "match no store" (the test set's label step saw them). The label step now passes the other set's slides
along, so only a file of no slide of either set is reported."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

from tinypipeline import LISTED_COHORT
from wsi_milssl.config import SynthConfig
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.synth import generate_slides

PIPELINE = """
[pipeline]
name = "shared-annotations"
""" + LISTED_COHORT


def test_one_annotations_folder_for_both_sets_reports_only_files_of_no_slide(tmp_path, caplog):
    root = tmp_path / "cohort"
    generate_slides(SynthConfig(n_slides=4, seed=0, width_px=2048, height_px=2048), root / "slides")
    with open(root / "slides" / "labels.csv", newline="") as fh:
        labels = {row["slide"]: row["label"] for row in csv.DictReader(fh)}
    sets = {"train": ["synth_000", "synth_001", "synth_002"], "test": ["synth_003"]}
    for set_name, stems in sets.items():
        (root / f"{set_name}_slides.csv").write_text("path\n" + "".join(f"slides/{s}.tif\n" for s in stems))
        (root / f"{set_name}_labels.csv").write_text("slide,label\n" + "".join(f"{s},{labels[s]}\n" for s in stems))
    train_xml = sorted(p.name for p in (root / "slides").glob("*.xml"))
    assert train_xml and all(Path(n).stem in sets["train"] for n in train_xml)  # the test set's slide: none
    (root / "slides" / "stray.xml").write_text(next((root / "slides").glob("*.xml")).read_text())
    (tmp_path / "p.toml").write_text(PIPELINE.format(root=root))
    with caplog.at_level(logging.WARNING):
        outcomes = run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=tmp_path / "out"), until="label")
    assert [o.status for o in outcomes][-1] == "ran"
    warned = [r.getMessage() for r in caplog.records if "match no store" in r.getMessage()]
    # each set's step names the stray file (no slide of either set), neither names the training annotations
    assert len(warned) == 2 and all("1 annotation file(s)" in w and "stray.xml" in w for w in warned), warned
    assert not any(name in w for w in warned for name in train_xml), warned


def test_bad_slides_of_both_sets_are_named_at_once_with_both_fixes(tmp_path):
    """Review BS, C5: `run` stopped at the first set with a failed slide (the test set's bad slide was found only
    by the next run, after the training set was tiled again) and offered only to download it again."""
    import pytest

    from wsi_milssl.errors import WsiMilsslError

    root = tmp_path / "cohort"
    generate_slides(SynthConfig(n_slides=2, seed=0, width_px=2048, height_px=2048), root / "slides")
    for name in ("bad_train", "bad_test"):
        (root / "slides" / f"{name}.tif").write_bytes(f"not a slide: {name}".encode())
    sets = {"train": ["synth_000", "bad_train"], "test": ["synth_001", "bad_test"]}
    for set_name, stems in sets.items():
        (root / f"{set_name}_slides.csv").write_text("path\n" + "".join(f"slides/{s}.tif\n" for s in stems))
        (root / f"{set_name}_labels.csv").write_text("slide,label\n" + "".join(f"{s},0\n" for s in stems))
    (tmp_path / "p.toml").write_text(PIPELINE.format(root=root))
    with pytest.raises(WsiMilsslError, match=r"tile: 1 slide\(s\) of the train set failed .*bad_train.* \| 1 slide\(s\) "
                                             r"of the test set failed .*bad_test.*To go on, mend or replace those "
                                             r"slide files, or leave them out of their set"):
        run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=tmp_path / "out"), until="tile")
    assert (tmp_path / "out" / "stores" / "test" / "synth_001.h5").is_file()


def test_every_slide_stage_names_its_status_file_when_slides_fail(tmp_path):
    """Review BQ: label's error named no status file and heatmap's named its folder; one wording for all now."""
    from types import SimpleNamespace

    from wsi_milssl.pipeline.runner import _failed

    # each slide's error keeps its own "Fix: ..." without its last period (review BW: "again.. Fix:")
    failed = [SimpleNamespace(stem="a", slide="a", error="broken. Fix: mend a."),
              SimpleNamespace(stem="b", slide="b", error="x")]
    status = tmp_path / "labels" / "train" / "label_status.csv"
    assert _failed(failed, status, set_name="train", what="store(s)", name=lambda r: r.stem) == \
        f"2 store(s) of the train set failed (see {status}): a: broken. Fix: mend a; b: x"
