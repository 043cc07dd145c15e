"""Where a run's output folder is: ``out_dir`` / ``--out`` are held absolute, so the same run started from
another folder (or through its own ``OUT/resolved_pipeline.toml``) finds its stages up to date, and an output
folder of an earlier version, whose stamps and heatmap sidecars record paths relative to the folder its run
started in, stays up to date too (nothing is tiled, trained or predicted again after an upgrade). And
``OUT/resolved_pipeline.toml`` describes the run only once every stage has run with its settings."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tinypipeline import FEATURE_BAGS, GENERATED_SLIDES, feature_bags
from wsi_milssl.cli import main
from wsi_milssl.config import load_toml
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import RESOLVED_FILENAME, load_pipeline, run_pipeline
from wsi_milssl.pipeline import runner
from wsi_milssl.pipeline import stamps

FEATURES = """
[pipeline]
name = "feat"
out_dir = "feat_out"
""" + FEATURE_BAGS


@pytest.fixture()
def work(tmp_path, monkeypatch):
    """A folder with a feature pipeline (``p.toml``, its bags beside it), the current folder of the test."""
    folder = tmp_path / "work"
    feature_bags(folder / "bags" / "train", 8, 0)
    feature_bags(folder / "bags" / "test", 4, 1)
    (folder / "p.toml").write_text(FEATURES)
    monkeypatch.chdir(folder)
    return folder


def _statuses(spec) -> list[str]:
    return [o.status for o in run_pipeline(spec)]


def _as_an_earlier_version(out: Path, started_in: Path) -> None:
    """Rewrite ``out`` as earlier versions left it when run from ``started_in`` with a relative ``--out``: the
    stamps' outputs and the heatmap sidecars' checkpoint and store paths relative to ``started_in``."""
    def relative(path):
        return os.path.relpath(path, started_in) if path and Path(path).is_absolute() else path

    for stamp_file in (out / ".pipeline").glob("*.json"):
        stamp = json.loads(stamp_file.read_text())
        assert stamp.pop(stamps.OUTPUTS_BELOW) == "OUT"  # this version's: relative to OUT
        stamp["outputs"] = [relative(out / p) for p in stamp["outputs"]]
        assert stamp["outputs"] and not any(Path(p).is_absolute() for p in stamp["outputs"])
        stamp_file.write_text(json.dumps(stamp))
    for sidecar_file in [*(out / "heatmaps").rglob("*_probs.json"), *(out / "heatmaps").rglob("heatmap_config.json")]:
        sidecar = json.loads(sidecar_file.read_text())
        for key in ("checkpoint", "store_path"):
            if key in sidecar:
                sidecar[key] = relative(sidecar[key])
        sidecar_file.write_text(json.dumps(sidecar))


def test_a_relative_out_is_the_same_folder_from_anywhere(work, tmp_path, monkeypatch):
    assert main(["run", "p.toml", "--out", "out"]) == 0
    out = work / "out"
    stamp = json.loads((out / ".pipeline" / "train.json").read_text())
    assert stamp["outputs"] == ["model/best.pt", "model/last.pt"]  # relative to OUT, wherever OUT is
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # the pipeline's own resolved file, and the pipeline file with --out spelled from here
    assert _statuses(load_pipeline(out / RESOLVED_FILENAME)) == ["skipped", "skipped"]
    assert _statuses(load_pipeline(work / "p.toml", out_dir="../work/out")) == ["skipped", "skipped"]
    assert not (elsewhere / "out").exists()


def test_an_output_folder_of_an_earlier_version_stays_up_to_date(work, tmp_path, monkeypatch):
    assert main(["run", "p.toml"]) == 0  # [pipeline].out_dir = "feat_out", relative
    out = work / "feat_out"
    _as_an_earlier_version(out, work)
    # run again the same way from the same folder: nothing runs again after the upgrade
    assert _statuses(load_pipeline("p.toml")) == ["skipped", "skipped"]
    assert _statuses(load_pipeline("p.toml", out_dir="feat_out")) == ["skipped", "skipped"]
    # and from another folder, through the resolved pipeline (the outputs are found below its out_dir)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert _statuses(load_pipeline(out / RESOLVED_FILENAME)) == ["skipped", "skipped"]
    # a recorded output that is gone still makes its stage run
    (out / "evaluation" / "metrics.json").unlink()
    outcomes = run_pipeline(load_pipeline(out / RESOLVED_FILENAME))
    assert [(o.stage, o.status) for o in outcomes] == [("train", "skipped"), ("evaluate", "ran")]
    assert outcomes[1].reason == "output missing: feat_out/evaluation/metrics.json"


def test_relative_outputs_of_earlier_stamps_are_found_below_their_output_folder(tmp_path, monkeypatch):
    out = tmp_path / "runs" / "ci"
    (out / "model").mkdir(parents=True)
    (out / "model" / "best.pt").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    for recorded in ("runs/ci/model/best.pt", "ci/model/best.pt", "../ci/model/best.pt", "../../runs/ci/model/best.pt",
                     str(out / "model" / "best.pt")):
        assert stamps._output_exists(recorded, out), recorded
    for recorded in ("ci/model/last.pt", "other/model/best.pt", "model/best.pt/x", "ci/../ci/model/last.pt",
                     str(tmp_path / "model" / "best.pt")):
        assert not stamps._output_exists(recorded, out), recorded


def test_out_dir_expands_the_home_folder(work, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (work / "p.toml").write_text(FEATURES.replace('out_dir = "feat_out"', 'out_dir = "~/runs/feat"'))
    assert load_pipeline("p.toml").out_dir == tmp_path / "home" / "runs" / "feat"
    assert load_pipeline("p.toml", out_dir="~/x").out_dir == tmp_path / "home" / "x"
    assert load_pipeline("p.toml", out_dir="x").out_dir == work / "x"  # relative: to the current folder


def test_a_name_with_a_slash_is_refused_where_it_names_the_default_output_folder(work):
    """Review CX: `--set 'pipeline.name="../escape"'` ran into ../escape_out, outside the pipeline's folder."""
    no_out_dir = FEATURES.replace('out_dir = "feat_out"\n', "")
    (work / "p.toml").write_text(no_out_dir)
    assert load_pipeline("p.toml").out_dir == work / "feat_out"
    for name in ("../escape", "a/b", "a\\\\b"):
        with pytest.raises(ConfigError, match=r"\[pipeline\]\.name '.*' names the default output folder .*_out, which "
                                              r"would not lie directly in the folder `run` starts in\. Fix: a name "
                                              r"without"):
            load_pipeline("p.toml", overrides=[f'pipeline.name="{name}"'])
    # with an output folder of its own (or --out) the name is only a title
    assert load_pipeline("p.toml", out_dir="o", overrides=['pipeline.name="a/b"']).name == "a/b"
    (work / "p.toml").write_text(FEATURES.replace('name = "feat"', 'name = "CAMELYON16/10x"'))
    assert load_pipeline("p.toml").out_dir == work / "feat_out"
    assert not (work.parent / "escape_out").exists()


def test_the_resolved_pipeline_is_written_when_every_stage_has_run_with_its_settings(work, monkeypatch):
    resolved = work / "feat_out" / RESOLVED_FILENAME
    assert main(["run", "p.toml", "--until", "train"]) == 0
    assert not resolved.exists()  # evaluate has not run
    assert main(["run", "p.toml"]) == 0
    assert load_toml(resolved)["train"]["epochs"] == 3
    # --until with a setting of a later stage, and nothing that runs: the file stays as it was
    assert main(["run", "p.toml", "--until", "train", "--set", "evaluate.thumbnail_px=64"]) == 0
    assert load_toml(resolved)["train"]["epochs"] == 3
    # a stage runs with other settings, and the run stops before the last stage: no file describes the folder
    assert main(["run", "p.toml", "--until", "train", "--set", "train.epochs=2"]) == 0
    assert not resolved.exists()
    assert main(["run", "p.toml", "--set", "train.epochs=2"]) == 0
    assert load_toml(resolved)["train"]["epochs"] == 2

    def interrupted(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(runner._FEATURE_RUNNERS, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(load_pipeline("p.toml", overrides=["train.epochs=4"]))
    assert not resolved.exists()  # epochs = 2 no longer describes the model, epochs = 4 not the evaluation


TINY = """
[pipeline]
name = "tiny"
out_dir = "tiny_out"
""" + GENERATED_SLIDES + """[train]
epochs = 1
batch_size = 32
num_workers = 0
[heatmap]
num_workers = 0
thumbnail_px = 128
[evaluate]
thumbnail_px = 128
"""


def test_a_generated_pipeline_run_from_another_folder_is_up_to_date(tmp_path, monkeypatch):
    """The reported case: `run base.toml --out ci`, then `run W/ci/resolved_pipeline.toml` from elsewhere made
    new slides, tiled, trained and predicted again; and an earlier version's folder of it stays up to date."""
    work, elsewhere = tmp_path / "w", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "base.toml").write_text(TINY)
    monkeypatch.chdir(work)
    assert main(["run", "base.toml", "--out", "ci"]) == 0
    out = work / "ci"
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != RESOLVED_FILENAME}
    sidecar = json.loads(next((out / "heatmaps" / "test").glob("*_probs.json")).read_text())
    assert Path(sidecar["checkpoint"]).is_absolute() and Path(sidecar["store_path"]).is_absolute()
    monkeypatch.chdir(elsewhere)
    assert _statuses(load_pipeline(out / RESOLVED_FILENAME)) == ["skipped"] * 6
    _as_an_earlier_version(out, work)
    monkeypatch.chdir(work)
    assert _statuses(load_pipeline("base.toml", out_dir="ci")) == ["skipped"] * 6
    monkeypatch.chdir(elsewhere)
    assert _statuses(load_pipeline(out / RESOLVED_FILENAME)) == ["skipped"] * 6
    changed = [p for p, mtime in files.items() if p.suffix != ".json" and p.stat().st_mtime_ns != mtime]
    assert not changed  # no slide made, tiled or predicted again


def _mtimes(folder: Path) -> dict[Path, int]:
    return {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_a_moved_output_folder_is_up_to_date_and_a_copy_checks_its_own_files(tmp_path, monkeypatch, caplog):
    """`mv N1 N2` of the folder holding the pipeline and its OUT: nothing runs again (stamps record outputs relative
    to OUT, a slide's heatmap the files by name, size and time); `cp -a N2 N3` with files deleted in N3: the stages
    of those files run again (N2's files of the same names do not count)."""
    n1, n2, n3 = tmp_path / "N1", tmp_path / "N2", tmp_path / "N3"
    n1.mkdir()
    (n1 / "base.toml").write_text(TINY)
    monkeypatch.chdir(n1)
    assert main(["run", "base.toml"]) == 0
    monkeypatch.chdir(tmp_path)
    n1.rename(n2)
    monkeypatch.chdir(n2)
    before = _mtimes(n2 / "tiny_out")
    assert _statuses(load_pipeline("base.toml")) == ["skipped"] * 6
    # the heatmap stage run again (its stamp gone) keeps each slide's maps: same slide and store, moved
    (n2 / "tiny_out" / ".pipeline" / "heatmap.json").unlink()
    caplog.clear()
    outcomes = run_pipeline(load_pipeline("base.toml"))
    assert [o.status for o in outcomes] == ["skipped"] * 4 + ["ran", "ran"]
    assert "not found" not in caplog.text and "not drawn" not in caplog.text  # the slides are found where they are now
    after = _mtimes(n2 / "tiny_out")
    assert [p for p in before if p.suffix == ".npy" and after[p] != before[p]] == []
    shutil.copytree(n2, n3, copy_function=shutil.copy2, symlinks=True)
    (n3 / "tiny_out" / "model" / "best.pt").unlink()
    for npy in (n3 / "tiny_out" / "heatmaps" / "test").glob("*_probs.npy"):
        npy.unlink()
    monkeypatch.chdir(n3)
    outcomes = run_pipeline(load_pipeline("base.toml"))
    assert [(o.stage, o.status) for o in outcomes][:4] == [(s, "skipped") for s in ("synth", "tile", "label")] + [
        ("train", "ran")]
    assert outcomes[3].reason == f"output missing: {n3 / 'tiny_out' / 'model' / 'best.pt'}"
    assert (n3 / "tiny_out" / "model" / "best.pt").is_file()
    assert len(list((n3 / "tiny_out" / "heatmaps" / "test").glob("*_probs.npy"))) == 2
    assert _mtimes(n2 / "tiny_out") == after  # the folder copied from is left alone


def test_a_run_started_from_its_resolved_pipeline_keeps_that_file(work, monkeypatch):
    """`run OUT/resolved_pipeline.toml --set ... --until STAGE` ran a stage and removed the file it was started
    from ("config file not found" on the next run)."""
    assert main(["run", "p.toml"]) == 0
    resolved = work / "feat_out" / RESOLVED_FILENAME
    text = resolved.read_text()
    assert main(["run", str(resolved), "--set", "train.epochs=2", "--until", "train"]) == 0
    assert resolved.read_text() == text  # kept as it was: the settings of the last complete run
    outcomes = run_pipeline(load_pipeline(resolved))
    assert [(o.stage, o.status) for o in outcomes] == [("train", "ran"), ("evaluate", "ran")]  # epochs = 3 again
    assert load_toml(resolved)["train"]["epochs"] == 3


def test_an_earlier_versions_folder_made_with_out_dot_or_dot_dot_is_up_to_date(work, tmp_path, monkeypatch):
    """Earlier versions recorded `model/best.pt` for `--out .` and `../model/best.pt` for `--out ..`: found below
    OUT from any folder, as other relative stamps are."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # --out . from the pipeline's folder
    assert main(["run", "p.toml", "--out", "."]) == 0
    _as_an_earlier_version(work, work)
    assert json.loads((work / ".pipeline" / "train.json").read_text())["outputs"] == ["model/best.pt", "model/last.pt"]
    monkeypatch.chdir(elsewhere)
    assert _statuses(load_pipeline(work / RESOLVED_FILENAME)) == ["skipped", "skipped"]
    # --out .. from a folder inside it
    out = tmp_path / "up"
    (out / "sub").mkdir(parents=True)
    (out / "p.toml").write_text((work / "p.toml").read_text().replace('"bags/', f'"{work}/bags/'))
    monkeypatch.chdir(out / "sub")
    assert main(["run", "../p.toml", "--out", ".."]) == 0
    _as_an_earlier_version(out, out / "sub")
    assert json.loads((out / ".pipeline" / "train.json").read_text())["outputs"] == ["../model/best.pt",
                                                                                     "../model/last.pt"]
    monkeypatch.chdir(elsewhere)
    assert _statuses(load_pipeline(out / RESOLVED_FILENAME)) == ["skipped", "skipped"]
    # a file of the recorded name beside the current folder does not count for one missing below OUT
    (out / "model" / "best.pt").unlink()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "best.pt").write_bytes(b"x")
    outcomes = run_pipeline(load_pipeline(out / RESOLVED_FILENAME))
    assert [(o.stage, o.status) for o in outcomes] == [("train", "ran"), ("evaluate", "ran")]


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_moved_or_copied_output_folder_runs_through_its_own_resolved_pipeline(work, tmp_path):
    """The resolved file records out_dir as an absolute path: run from a moved folder it made the run again
    where the folder used to be, and from a copy it called the original up to date (a copy without best.pt
    kept none) and re-ran stages in the original. A run's own resolved file now runs in the folder it is in."""
    assert main(["run", "p.toml", "--out", "out"]) == 0
    moved = tmp_path / "moved"
    shutil.move(str(work / "out"), moved)
    assert _statuses(load_pipeline(moved / RESOLVED_FILENAME)) == ["skipped", "skipped"]
    assert not (work / "out").exists()
    copy = tmp_path / "copy"
    shutil.copytree(moved, copy)
    (copy / "model" / "best.pt").unlink()
    before = _listing(moved)
    assert _statuses(load_pipeline(copy / RESOLVED_FILENAME)) == ["ran", "ran"]
    assert (copy / "model" / "best.pt").is_file() and _listing(moved) == before
    # with --out, the folder given is the run's, as for any pipeline file
    assert load_pipeline(copy / RESOLVED_FILENAME, out_dir=moved).out_dir == moved.resolve()


def test_a_copy_of_an_earlier_versions_folder_with_absolute_stamps_checks_its_own_files(work, tmp_path):
    """Earlier versions recorded the outputs of a run with an absolute --out as absolute paths: a copy of
    such a folder without best.pt was called up to date from the original's files. Those paths now count
    only inside the folder the stamp is in (in place, the folder stays up to date)."""
    out = work / "abs_out"
    assert main(["run", "p.toml", "--out", str(out)]) == 0
    for stamp_file in (out / ".pipeline").glob("*.json"):
        stamp = json.loads(stamp_file.read_text())
        assert stamp.pop(stamps.OUTPUTS_BELOW) == "OUT"
        stamp["outputs"] = [str(out / p) for p in stamp["outputs"]]
        stamp_file.write_text(json.dumps(stamp))
    assert _statuses(load_pipeline("p.toml", out_dir=out)) == ["skipped", "skipped"]
    copy = tmp_path / "abs_copy"
    shutil.copytree(out, copy)
    (copy / "model" / "best.pt").unlink()
    outcomes = run_pipeline(load_pipeline("p.toml", out_dir=copy))
    assert [o.status for o in outcomes] == ["ran", "ran"]
    assert outcomes[0].reason.startswith("output missing") and (copy / "model" / "best.pt").is_file()
