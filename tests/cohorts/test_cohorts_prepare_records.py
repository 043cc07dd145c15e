"""prepare.json records absolute paths, the links among their folders resolved, for a relative or a linked --out:
run tells a copied or moved prepare folder from the original by them (review AO, finding 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prepare_trees import gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.pipeline import load_pipeline


def _record(out: Path) -> dict:
    return json.loads((out / "cohort" / "prepare.json").read_text())


def test_a_relative_out_is_recorded_absolute_so_a_copied_folder_runs_in_itself(tmp_path, monkeypatch, synth_slides):
    """prepare.json recorded 'pipeline' as typed (prep/pipeline.toml), so run could not tell that a copy of the
    folder is a copy, and the copy's run replaced the original's (its out_dir names the original's run)."""
    gigadb_tree(tmp_path / "C16", synth_slides)
    monkeypatch.chdir(tmp_path)
    prepare_camelyon16(Path("C16"), Path("prep"))
    record = _record(tmp_path / "prep")
    real = tmp_path.resolve()
    assert record["pipeline"] == str(real / "prep" / "pipeline.toml")
    assert record["sets"]["train"]["slides_csv"] == str(real / "prep" / "cohort" / "train_slides.csv")
    assert record["sets"]["test"]["annotations"] == str(real / "prep" / "cohort" / "annotations" / "test")
    assert record["reference"] == str(real / "C16" / "testing" / "reference.csv")
    assert record["sets"]["test"]["annotation_sources"] == {
        "Test_001": str(real / "C16" / "testing" / "lesion_annotations" / "Test_001.xml")}
    shutil.copytree(tmp_path / "prep", tmp_path / "copy")
    monkeypatch.chdir(tmp_path / "C16")  # from anywhere
    assert load_pipeline(tmp_path / "copy" / "pipeline.toml").out_dir == real / "copy" / "run"
    assert load_pipeline(tmp_path / "prep" / "pipeline.toml").out_dir == real / "prep" / "run"


def test_an_out_reached_through_a_link_is_recorded_where_it_lies(tmp_path, synth_slides):
    """--out a link to a folder: the pipeline's out_dir is the folder's (resolved), prepare.json named the link,
    and a copy of the folder ran into the original's run."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    (tmp_path / "disk" / "prep").mkdir(parents=True)
    (tmp_path / "prep").symlink_to(tmp_path / "disk" / "prep")
    prepare_camelyon16(root, tmp_path / "prep")
    real = (tmp_path / "disk" / "prep").resolve()
    assert _record(real)["pipeline"] == str(real / "pipeline.toml")
    shutil.copytree(real, tmp_path / "copy")
    assert load_pipeline(tmp_path / "copy" / "pipeline.toml").out_dir == (tmp_path / "copy" / "run").resolve()
