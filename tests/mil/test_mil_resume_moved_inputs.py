"""`train --resume` of a run whose inputs moved said to resume from the folder the run was started in
(review AK, finding 5), but runs record absolute paths now: only putting the inputs back, or a new run,
helps. Runs that recorded paths as typed (earlier versions) keep that advice."""

from __future__ import annotations

import json
import shutil
import os

import h5py
import numpy as np

from wsi_milssl.cli import main

BASE = ["--epochs", "1", "--threads", "1", "--workers", "0", "--no-plots"]


def _run(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    folder = tmp_path / "ftr"
    folder.mkdir()
    for i in range(4):
        feats = np.random.default_rng(i).normal(size=(6, 8)).astype(np.float32)
        with h5py.File(folder / f"s{i}.h5", "w") as f:
            f.create_dataset("features", data=feats + 3.0 * (i % 2))
            f.create_dataset("coords", data=np.stack([np.arange(6) * 256, np.zeros(6, np.int64)], 1))
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"s{i},{i % 2}\n" for i in range(4)))
    assert main(["train", str(folder), "--labels", str(labels), "--out", str(tmp_path / "run"), *BASE]) == 0
    return folder


def test_resume_after_the_inputs_moved_says_to_put_them_back(tmp_path, capsys):
    folder = _run(tmp_path)
    folder.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "--epochs", "2"]) != 0
    err = capsys.readouterr().err
    assert f"the run's inputs {folder} are not found; the run recorded them as absolute paths" in err
    assert "Fix: put the inputs back at those paths, or start a new run" in err
    assert "from the folder the run was started in" not in err


def test_a_run_that_recorded_paths_as_typed_keeps_the_old_advice(tmp_path, capsys, monkeypatch):
    _run(tmp_path)
    cfg = tmp_path / "run" / "config.json"
    saved = json.loads(cfg.read_text())
    saved["data"]["inputs"] = ["ftr"]  # as an earlier version recorded `train ftr ...` typed in tmp_path
    cfg.write_text(json.dumps(saved))
    monkeypatch.chdir(tmp_path / "run")
    capsys.readouterr()
    assert main(["train", "--resume", ".", "--epochs", "2"]) != 0
    err = capsys.readouterr().err
    assert f"the run's inputs ftr are not found from {os.getcwd()}" in err
    assert "Fix: run `train --resume` from the folder the run was started in" in err


def test_resume_of_a_run_moved_together_with_its_inputs_reads_them_where_they_are(tmp_path, capsys, caplog):
    """Review DD: a pipeline's OUT moved (its model beside its stores) was up to date for `run`, but `train --resume
    OUT/model` stopped: "put the inputs back, or start a new run", which throws the training away."""
    _run(tmp_path / "before")
    (tmp_path / "before").rename(tmp_path / "after")
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "after" / "run"), "--epochs", "2"]) == 0
    assert (f"the run's inputs recorded below {tmp_path / 'before'} are read from below {tmp_path / 'after'}, "
            "where the run folder is now (moved with it)") in caplog.text
    saved = json.loads((tmp_path / "after" / "run" / "config.json").read_text())["data"]
    assert saved["inputs"] == [str(tmp_path / "after" / "ftr")] and saved["labels"] == str(tmp_path / "after" /
                                                                                          "labels.csv")
    # one input left behind (not moved with the run): the error, as before
    (tmp_path / "after" / "ftr").rename(tmp_path / "elsewhere")
    assert main(["train", "--resume", str(tmp_path / "after" / "run"), "--epochs", "3"]) != 0
    assert "are not found; the run recorded them as absolute paths" in capsys.readouterr().err


def test_inputs_gone_beside_other_data_of_the_same_layout_are_not_adopted(tmp_path, capsys):
    """Review DT: a run whose inputs were deleted (a scratch folder wiped) read another data set of the same layout
    beside it, saying it had moved with the run; the run folder itself did not move."""
    data = _run(tmp_path / "scratch")
    shutil.rmtree(data)
    shutil.copytree(_run(tmp_path / "other"), tmp_path / "ftr")  # other data where the old rule looked: tmp/ftr
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "scratch" / "run"), "--epochs", "2"]) != 0
    err = capsys.readouterr().err
    assert "are not found; the run recorded them as absolute paths" in err and "moved with it" not in err


def test_a_copy_resumed_then_its_original_deleted_and_a_symlinked_folder_still_resume(tmp_path, capsys):
    """Review DU: every resume recorded the copy's folder while its inputs stayed the original's, so the original
    deleted later was not found; and a folder reached through a symlink never matched its resolved inputs."""
    _run(tmp_path / "orig")
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    assert main(["train", "--resume", str(tmp_path / "copy" / "run"), "--epochs", "2"]) == 0  # reads orig's inputs
    shutil.rmtree(tmp_path / "orig")
    assert main(["train", "--resume", str(tmp_path / "copy" / "run"), "--epochs", "3"]) == 0
    saved = json.loads((tmp_path / "copy" / "run" / "config.json").read_text())["data"]
    assert saved["inputs"] == [str(tmp_path / "copy" / "ftr")] and saved["run_dir"] == str(tmp_path / "copy" / "run")
    # a folder reached through a link: the run recorded resolved paths; the storage moved, the link follows it
    (tmp_path / "storage").mkdir()
    shutil.move(str(tmp_path / "copy"), str(tmp_path / "storage" / "a"))
    (tmp_path / "link").symlink_to(tmp_path / "storage" / "a")
    assert main(["train", "--resume", str(tmp_path / "link" / "run"), "--epochs", "4"]) == 0
    capsys.readouterr()


def test_a_run_folder_that_is_a_link_moves_with_the_folder_that_holds_the_link(tmp_path, capsys, caplog):
    """Review DW, B1: with the run folder itself a link to scratch space, the run's place was recorded as the
    scratch folder, so a project moved with its inputs (the link going along) was never taken for a move, and the
    resume said to put the inputs back."""
    (tmp_path / "scratch_run").mkdir()
    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "run").symlink_to(tmp_path / "scratch_run")
    _run(tmp_path / "before")
    saved = json.loads((tmp_path / "before" / "run" / "config.json").read_text())["data"]
    assert saved["run_dir"] == str(tmp_path / "before" / "run")
    (tmp_path / "before").rename(tmp_path / "after")
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "after" / "run"), "--epochs", "2"]) == 0
    assert (f"the run's inputs recorded below {tmp_path / 'before'} are read from below {tmp_path / 'after'}, "
            "where the run folder is now (moved with it)") in caplog.text


def test_a_linked_run_folder_given_as_dot_from_inside_it_is_where_its_link_is(tmp_path, monkeypatch):
    """Review EB, B3: "." from inside a run folder that is a link resolved to the link's target, so the moved
    project was not found from there; the shell's $PWD keeps the link."""
    from wsi_milssl.paths import folder_place

    (tmp_path / "scratch").mkdir()
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "run").symlink_to(tmp_path / "scratch")
    monkeypatch.chdir(tmp_path / "project" / "run")
    monkeypatch.setenv("PWD", str(tmp_path / "project" / "run"))  # as `cd project/run` sets it
    assert folder_place(".") == folder_place("./") == tmp_path / "project" / "run"
    # review EH: ".." goes where the system takes it, the real folder's parent, not the link's
    assert folder_place("../x") == tmp_path / "x"
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)  # review EI: ".." after a link is the link target's parent
    (tmp_path / "project" / "lnk").symlink_to(tmp_path / "elsewhere" / "deep")
    monkeypatch.chdir(tmp_path / "project")
    monkeypatch.setenv("PWD", str(tmp_path / "project"))
    assert folder_place("lnk/../run") == tmp_path / "elsewhere" / "run"
    assert folder_place("lnk/..") == tmp_path / "elsewhere"
    monkeypatch.chdir(tmp_path / "project" / "run")
    monkeypatch.setenv("PWD", str(tmp_path / "elsewhere"))  # a stale $PWD is not taken
    assert folder_place(".") == tmp_path / "scratch"
