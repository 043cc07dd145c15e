"""`train --weights` and `train --resume`: the run records the weights file as an absolute path, and a
resume neither loads nor needs it (last.pt holds the whole model), so it runs from another folder and
after the file moved, for runs that recorded the path as typed too (earlier versions)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from wsi_milssl.cli import main


@pytest.fixture(scope="module")
def head_weights(mil_csv, tmp_path_factory):
    """A trained head's last.pt (a checkpoint holds its weights under 'model'), which a new run starts from."""
    run = tmp_path_factory.mktemp("resume_weights") / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return run / "last.pt"


def _start(mil_csv, tmp_path, monkeypatch, head_weights):
    """A run started in ``tmp_path`` with ``--weights w_head.pt`` typed relative."""
    shutil.copy(head_weights, tmp_path / "w_head.pt")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(mil_csv), "--out", "fW", "--epochs", "1", "--threads", "1", "--no-plots",
                 "--weights", "w_head.pt"]) == 0
    return tmp_path / "fW"


def test_a_new_run_records_the_weights_file_as_an_absolute_path(mil_csv, tmp_path, monkeypatch, head_weights):
    run = _start(mil_csv, tmp_path, monkeypatch, head_weights)
    absolute = str((tmp_path / "w_head.pt").resolve())
    assert json.loads((run / "config.json").read_text())["weights_path"] == absolute
    assert torch.load(run / "last.pt", weights_only=True)["config"]["weights_path"] == absolute


def test_a_resume_from_another_folder_or_after_the_weights_moved_needs_no_weights(mil_csv, tmp_path, monkeypatch,
                                                                                  head_weights, capsys):
    """It said 'w_head.pt: weights file not found; check --weights.' (the initial weights were loaded again
    before last.pt replaced them)."""
    run = _start(mil_csv, tmp_path, monkeypatch, head_weights)
    (tmp_path / "w_head.pt").rename(tmp_path / "w_head_moved.pt")
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    capsys.readouterr()
    assert main(["train", "--resume", "../fW", "--epochs", "2", "--threads", "1"]) == 0, capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "fW", "--epochs", "3", "--threads", "1"]) == 0, capsys.readouterr().err
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def _as_an_earlier_version_recorded(run, weights_path: str) -> None:
    """Rewrite the run's records with ``weights_path`` as typed (earlier versions kept it so)."""
    cfg = json.loads((run / "config.json").read_text())
    cfg["weights_path"] = weights_path
    (run / "config.json").write_text(json.dumps(cfg))
    ckpt = torch.load(run / "last.pt", weights_only=True)
    ckpt["config"]["weights_path"] = weights_path
    torch.save(ckpt, run / "last.pt")


def test_a_run_that_recorded_a_relative_weights_path_resumes(mil_csv, tmp_path, monkeypatch, head_weights, capsys):
    """From another folder it said 'w_head.pt: weights file not found'; with --weights ../w_head.pt, 'cannot
    resume ... (weights_path: 'w_head.pt' -> '../w_head.pt')', the same file spelt otherwise."""
    run = _start(mil_csv, tmp_path, monkeypatch, head_weights)
    _as_an_earlier_version_recorded(run, "w_head.pt")
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    capsys.readouterr()
    assert main(["train", "--resume", "../fW", "--epochs", "2", "--threads", "1"]) == 0, capsys.readouterr().err
    assert main(["train", "--resume", "../fW", "--epochs", "3", "--threads", "1", "--weights", "../w_head.pt"]) == 0, \
        capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "fW", "--epochs", "4", "--threads", "1", "--weights",
                 str(tmp_path / "w_head.pt")]) == 0, capsys.readouterr().err
    (tmp_path / "w_head.pt").rename(tmp_path / "w_head_moved.pt")
    assert main(["train", "--resume", "fW", "--epochs", "5", "--threads", "1"]) == 0, capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["weights_path"] == "w_head.pt"  # the run's own record


def test_a_resume_with_other_weights_is_refused(mil_csv, tmp_path, monkeypatch, head_weights, capsys):
    """A file of other weights (both found) is not the run's start: one error naming weights_path."""
    _start(mil_csv, tmp_path, monkeypatch, head_weights)
    state = torch.load(head_weights, weights_only=True)["model"]
    torch.save({k: v + 1 for k, v in state.items()}, tmp_path / "w_other.pt")
    capsys.readouterr()
    assert main(["train", "--resume", "fW", "--epochs", "2", "--weights", "w_other.pt"]) == 1
    err = capsys.readouterr().err
    assert "error: fW/last.pt: cannot resume with different settings or data (weights_path: " in err, err
    assert "Traceback" not in err
