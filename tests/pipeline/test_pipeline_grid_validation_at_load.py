"""prepare --val-fraction 0 with the default template (a 16-point [train.grid]) wrote a pipeline that `run`
refused at once ("a [train.grid] of 16 points needs validation slides"), because that check was made by
run_pipeline, not by load_pipeline, which prepare uses to check the file it writes (review AO, finding 3). The
check moved into load_pipeline: prepare refuses the combination with the same message and writes nothing, and
run still refuses it before any stage (from the split of the slide list and labels, with check_paths)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.cohorts.prepare import default_template
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline

XML = "<ASAP_Annotations><Annotations /></ASAP_Annotations>\n"
NEEDS = ("[train]: a [train.grid] of 16 points needs validation slides to choose one on, but [data].val_fraction "
         "is 0. Fix: set [data].val_fraction > 0 (e.g. 0.25: training slides held out, never the test set), or drop "
         "[train.grid].")

SLIDES = """
[pipeline]
name = "grid"
[data]
train_slides = "nothing/train_slides.csv"
train_labels = "nothing/train_labels.csv"
train_annotations = "nothing"
test_slides = "nothing/test_slides.csv"
test_labels = "nothing/test_labels.csv"
test_annotations = "nothing"
val_fraction = 0
[train.grid]
mu = [0.1, 0.2]
"""


def _touch(path: Path, text: str | None = None) -> Path:
    """``path`` holding ``text``; by default a placeholder slide: not empty (prepare refuses an empty slide file,
    review EC B3) and distinct from every other (identical slide files are one slide)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"placeholder slide {path}" if text is None else text)
    return path


def _camelyon16(root: Path) -> Path:
    """A CAMELYON16 download of placeholder files (prepare matches names and never opens a slide)."""
    for name in ("normal/normal_001.tif", "normal/normal_002.tif", "tumor/tumor_001.tif", "tumor/tumor_002.tif"):
        _touch(root / "training" / name)
    with zipfile.ZipFile(root / "training" / "lesion_annotations.zip", "w") as archive:
        archive.writestr("lesion_annotations/tumor_001.xml", XML)
        archive.writestr("lesion_annotations/tumor_002.xml", XML)
    _touch(root / "testing" / "images" / "test_001.tif")
    _touch(root / "testing" / "images" / "test_002.tif")
    _touch(root / "testing" / "lesion_annotations" / "test_001.xml", XML)
    _touch(root / "testing" / "reference.csv", "Test_001,Tumor,Macro,Yes\nTest_002,Normal,,\n")
    return root


def test_load_pipeline_refuses_a_grid_with_val_fraction_0_without_reading_the_lists(tmp_path):
    toml = _touch(tmp_path / "grid.toml", SLIDES)
    with pytest.raises(ConfigError) as info:
        load_pipeline(toml, out_dir=tmp_path / "out")
    assert str(info.value) == f"{toml} " + NEEDS.replace("16 points", "2 points")
    load_pipeline(toml, out_dir=tmp_path / "out", overrides=["data.val_fraction=0.25"])  # lists not read: accepted


def test_prepare_refuses_val_fraction_0_with_the_default_grid_and_writes_nothing(tmp_path):
    root = _camelyon16(tmp_path / "CAMELYON16")
    out = tmp_path / "prepared"
    with pytest.raises(ConfigError) as info:
        prepare_camelyon16(root, out, val_fraction=0)
    assert str(info.value) == (f"{out / 'pipeline.toml'} {NEEDS} (in the pipeline written from {default_template()}; nothing "
                               "was written)")
    assert not out.exists()
    assert prepare_camelyon16(root, out, val_fraction=0.5).pipeline_toml.is_file()


def test_run_refuses_a_prepared_pipeline_edited_to_val_fraction_0_before_any_stage(tmp_path, capsys):
    out = tmp_path / "prepared"
    toml = prepare_camelyon16(_camelyon16(tmp_path / "CAMELYON16"), out, val_fraction=0.5).pipeline_toml
    assert main(["run", str(toml), "--set", "data.val_fraction=0"]) == 2  # a usage error
    err = capsys.readouterr().err
    # from the split of the prepared lists: 2 tumour and 2 normal training slides, enough for validation
    assert f"{toml} [train] with --set data.val_fraction=0: a [train.grid] of 16 points needs validation slides" in err
    assert "Fix: set [data].val_fraction > 0 (e.g. 0.25" in err
    assert not (out / "run").exists()
