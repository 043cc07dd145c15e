"""Preparing again keeps a pipeline.toml edited since prepare wrote it, or not written by prepare, and writes the
new pipeline beside it (review AO, finding 3)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from prepare_trees import gigadb_tree

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.pipeline import load_pipeline


def _record(out: Path) -> dict:
    return json.loads((out / "cohort" / "prepare.json").read_text())


def test_an_edited_pipeline_is_kept_and_the_new_one_written_beside_it(tmp_path, caplog, synth_slides):
    """Preparing again (the download grew) replaced pipeline.toml and its hand edits without a word."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    out = tmp_path / "prep"
    first = prepare_camelyon16(root, out)
    toml = out / "pipeline.toml"
    assert first.pipeline_toml == toml and not (out / "pipeline.new.toml").exists()
    edited = toml.read_text().replace("\nepochs = 50\n", "\nepochs = 5\n")
    assert edited != toml.read_text()
    toml.write_text(edited)

    again = prepare_camelyon16(root, out)
    assert toml.read_text() == edited  # the edits are kept
    new = out / "pipeline.new.toml"
    assert "\nepochs = 50\n" in new.read_text()
    assert again.pipeline_toml == toml  # the edited pipeline reads the lists written now: run it
    note = [n for n in again.notes if "was edited since prepare wrote it" in n]
    assert len(note) == 1 and str(new) in note[0] and f"mv {shlex.quote(str(new))} {shlex.quote(str(toml))}" in note[0]
    assert note[0] in caplog.text
    assert load_pipeline(new).out_dir == (out / "run").resolve()

    # taken (moved over pipeline.toml): it is prepare's again, rewritten without a word next time
    new.replace(toml)
    third = prepare_camelyon16(root, out)
    assert not any("pipeline" in n and "kept" in n for n in third.notes)
    assert not new.exists() and "\nepochs = 50\n" in toml.read_text()
    # taken by a copy: pipeline.toml is prepare's again, and prepare's unchanged pipeline.new.toml goes
    toml.write_text(edited)
    prepare_camelyon16(root, out)
    assert new.exists() and toml.read_text() == edited
    toml.write_text(new.read_text())
    fourth = prepare_camelyon16(root, out)
    assert not new.exists() and fourth.pipeline_toml == toml and "\nepochs = 50\n" in toml.read_text()


def test_a_pipeline_toml_prepare_did_not_write_is_kept(tmp_path, capsys, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    out = tmp_path / "myproj"
    out.mkdir()
    mine = '# my own tuned pipeline\n[pipeline]\nname = "mine"\n'
    (out / "pipeline.toml").write_text(mine)
    assert main(["prepare", "camelyon16", str(root), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "pipeline.toml").read_text() == mine
    new = out / "pipeline.new.toml"
    assert load_pipeline(new).out_dir == (out / "run").resolve()
    assert f"next: wsi-milssl run {shlex.quote(str(new))}" in printed  # the cohort's pipeline is the new one
    take = f"mv {shlex.quote(str(new))} {shlex.quote(str(out / 'pipeline.toml'))}"
    assert "was not written by prepare" in printed and take in printed
    record = _record(out)
    assert record["pipeline_new"] == str(new.resolve()) and record["pipeline_sha256"] is None
