"""prepare checks the validation split of the pipeline it writes (review AR, finding 2): the README said so, but
``prepare folder`` with 4 slides and the 16-point grid template wrote a pipeline that ``run`` then refused
(a grid needs validation slides of both classes). The split is now checked from the slides and labels prepare
holds, and prepare's notes say that run will refuse the pipeline until it is edited, and why."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from prepare_trees import distinct_copy

from wsi_milssl.cohorts import prepare_folder
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline


def _cohort(root: Path, synth_slides: dict[str, Path], n_per_class: int) -> Path:
    root.mkdir()
    lines = ["slide,label"]
    for k in range(2 * n_per_class):
        label = int(k < n_per_class)
        source = synth_slides["tumor" if label else "normal"]
        distinct_copy(source, root / f"s{k}.tif")
        if label:
            (root / f"s{k}.xml").write_bytes(source.with_suffix(".xml").read_bytes())
        lines.append(f"s{k},{label}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root / "labels.csv"


def test_a_grid_that_would_get_no_validation_slides_is_named_in_a_note(tmp_path, synth_slides):
    labels = _cohort(tmp_path / "slides", synth_slides, 2)
    prepared = prepare_folder(tmp_path / "slides", labels, tmp_path / "prep", test_fraction=0.5)
    (note,) = [n for n in prepared.notes if "will refuse" in n]
    assert note.startswith(f"`wsi-milssl run` will refuse this pipeline until it is edited: {prepared.pipeline_toml} "
                           "[train]: a [train.grid] of 16 points needs validation slides")
    assert "drop [train.grid]" in note
    header = prepared.pipeline_toml.read_text().splitlines()[2]  # it said "Run it as it is" (review BF)
    assert header.startswith("# found by prepare (cohort/). Edit it first (cohort/prepare.json's notes say why `run` "
                             "refuses it as it is), then:  wsi-milssl run ")
    with pytest.raises(ConfigError, match=r"needs validation slides"):
        load_pipeline(prepared.pipeline_toml, check_paths=True)


def test_enough_slides_prepare_as_before(tmp_path, synth_slides):
    labels = _cohort(tmp_path / "slides", synth_slides, 6)
    prepared = prepare_folder(tmp_path / "slides", labels, tmp_path / "prep", test_fraction=0.25)
    assert len(prepared.sets["train"].slides) == 8 and not [n for n in prepared.notes if "will refuse" in n]
    assert "Run it as it is:  wsi-milssl run" in prepared.pipeline_toml.read_text().splitlines()[2]
    load_pipeline(prepared.pipeline_toml, check_paths=True)


def test_the_kept_pipeline_and_the_new_one_are_checked_each_for_itself(tmp_path, synth_slides, capsys):
    """Review BI: with an edited pipeline.toml kept, the header of pipeline.new.toml was chosen by checking the kept
    file: fixed by hand (grid dropped), it made the new file say "Run it as it is", and run refused that."""
    import re

    from wsi_milssl.cli import main

    labels = _cohort(tmp_path / "slides", synth_slides, 2)
    first = prepare_folder(tmp_path / "slides", labels, tmp_path / "prep", test_fraction=0.5)
    assert not first.ready
    toml = first.pipeline_toml
    toml.write_text(re.sub(r"(?ms)^\[train\.grid\].*?^\n", "", toml.read_text()))  # the note's fix
    load_pipeline(toml, check_paths=True)
    argv = ["prepare", "folder", "--slides", str(tmp_path / "slides"), "--labels", str(labels),
            "--out", str(tmp_path / "prep"), "--test-fraction", "0.5"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    new = tmp_path / "prep" / "pipeline.new.toml"
    assert "Edit it first" in new.read_text().splitlines()[2]
    assert (f"note: `wsi-milssl run` will refuse this pipeline until it is edited: {new} [train]: a [train.grid]"
            in printed)
    assert printed.rstrip().endswith(f"next: wsi-milssl run {shlex.quote(str(toml))}")  # the kept one, run accepts it
    with pytest.raises(ConfigError, match=r"needs validation slides"):
        load_pipeline(new, check_paths=True)
    toml.write_text(toml.read_text() + "\n[train.grid]\nlr = [0.1, 0.01]\n")  # kept, and refused again
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"note: `wsi-milssl run` will refuse the kept pipeline until it is edited: {toml} [train]" in printed
    assert printed.rstrip().endswith(f"next: edit {toml} (the notes above say why `run` refuses it as it is), then: "
                                     f"wsi-milssl run {shlex.quote(str(toml))}")
