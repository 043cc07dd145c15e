"""Review EC: a pipeline whose training slides are all of one label ran tile and label on every slide (hours on
CAMELYON16) before the train stage refused it ("no negative bag"). The pipeline is refused when it is loaded,
before any stage, naming the fix."""

from __future__ import annotations

import csv
import re

import pytest

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline

from test_pipeline_grid_validation_at_load import _camelyon16


@pytest.mark.parametrize("label, named", [(1, "tumour (label 1)"), (0, "normal (label 0)")])
def test_training_slides_of_one_label_are_refused_before_any_stage(tmp_path, capsys, label, named):
    out = tmp_path / "prepared"
    toml = prepare_camelyon16(_camelyon16(tmp_path / "CAMELYON16"), out).pipeline_toml
    labels = load_pipeline(toml, out_dir=out / "run").sets["train"].labels
    with open(labels, newline="") as fh:
        rows = list(csv.DictReader(fh))
    with open(labels, "w", newline="") as fh:  # a hand edit: every training slide given one label
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "label": str(label)} for r in rows)
    with pytest.raises(ConfigError, match=re.escape(f"the {len(rows)} training slide(s) are all {named}")):
        load_pipeline(toml, out_dir=out / "run", check_paths=True)
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(["run", str(toml)]) == 1
    err = capsys.readouterr().err
    assert "so the train stage would stop after every slide is tiled and labelled. Fix: add training slides" in err
    assert sorted(p for p in tmp_path.rglob("*")) == before  # no stage ran: nothing written


def test_a_generated_training_set_of_one_label_names_the_synth_settings(tmp_path):
    """Review EI, B1: slides cannot be added to a generated set; the fix names [synth.train]'s settings."""
    from importlib.resources import files

    with pytest.raises(ConfigError, match=r"are all normal \(label 0\), .* Fix: set \[synth\.train\] n_slides and "
                                          r"tumor_slide_fraction so that round"):
        load_pipeline(files("wsi_milssl") / "pipelines" / "demo.toml", out_dir=tmp_path / "out",
                      overrides=["synth.train.n_slides=1"])
