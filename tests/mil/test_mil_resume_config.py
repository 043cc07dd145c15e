"""`train --resume RUN` with a damaged or wrong RUN/config.json gives one error naming config.json."""

from __future__ import annotations

import json
import shutil

import pytest

from wsi_milssl.cli import main


@pytest.fixture(scope="module")
def run_dir(mil_csv, tmp_path_factory):
    run = tmp_path_factory.mktemp("resume") / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return run


def _resume(run, tmp_path, capsys, config_text):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "config.json").write_text(config_text)
    capsys.readouterr()
    code = main(["train", "--resume", str(copy), "--epochs", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1
    return err, copy / "config.json"


def _edited(run, **changes):
    saved = json.loads((run / "config.json").read_text())
    for key, value in changes.items():
        if key == "data":
            saved["data"].update(value)
        else:
            saved[key] = value
    return json.dumps(saved)


@pytest.mark.parametrize("text", ["{", "\xff\xfe", "[1, 2]", '{"data": 3}'])
def test_damaged_config_json(run_dir, tmp_path, capsys, text):
    err, path = _resume(run_dir, tmp_path, capsys, text)
    assert f"error: {path}: " in err
    assert "Fix: restore it from the run's last.pt" in err


def test_wrong_value_names_config_json(run_dir, tmp_path, capsys):
    err, path = _resume(run_dir, tmp_path, capsys, _edited(run_dir, mu="high"))
    assert f"error: {path}: TrainConfig.mu must be " in err and "got 'high'" in err
    assert "Fix: correct that value in config.json" in err and "options:" not in err
    # review CZ: one fix, the resume's (a value's own fix is for settings given now)
    err, path = _resume(run_dir, tmp_path / "b", capsys, _edited(run_dir, batch_size=1, model="resnet18",
                                                                  mode="images"))
    assert err.count("Fix:") == 1, err


def test_a_run_saved_with_a_lam_above_todays_cap_is_not_resumable(run_dir, tmp_path, capsys):
    """revT W3: λ > 1e6 was allowed before the cap (5fb5fb9). Resuming such a run said "correct that value in
    config.json", which then failed as "cannot resume with different settings (lam: 1e8 -> 1e6)": the
    checkpoint keeps the run's λ. Now the error says the run cannot be resumed on this version and to
    start a new run."""
    import torch

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    ckpt = torch.load(copy / "last.pt", weights_only=True)
    ckpt["config"]["lam"] = 1e8  # as a run of an earlier version saved it
    torch.save(ckpt, copy / "last.pt")
    (copy / "config.json").write_text(_edited(run_dir, lam=1e8))
    capsys.readouterr()
    assert main(["train", "--resume", str(copy), "--epochs", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {copy / 'config.json'}: this run was saved with λ (lam) = 1e+08, above the "
                          "1e+06 that this version allows"), err
    assert "so it cannot be resumed on this version. Fix: start a new run without --resume, with a λ of at most " \
           "1e+06" in err
    assert "correct that value" not in err and "Traceback" not in err
    # what the old fix led to: the checkpoint's λ is the run's
    (copy / "config.json").write_text(_edited(run_dir, lam=1e6))
    assert main(["train", "--resume", str(copy), "--epochs", "2"]) == 1
    assert "cannot resume with different settings or data (lam: 100000000.0 -> 1000000.0)" in capsys.readouterr().err


def test_wrong_data_entry(run_dir, tmp_path, capsys):
    err, path = _resume(run_dir, tmp_path, capsys, _edited(run_dir, data={"inputs": [3]}))
    assert f"error: {path}: 'data' does not list the run's inputs as paths" in err


def test_intact_config_resumes(run_dir, tmp_path, capsys):
    copy = tmp_path / "ok"
    shutil.copytree(run_dir, copy)
    assert main(["train", "--resume", str(copy), "--epochs", "2"]) == 0


def test_feature_settings_an_earlier_version_did_not_record_are_not_compared_on_resume(tmp_path):
    """Random encoder weights were recorded as '' (not recorded) before they read 'random': a run saved
    then resumes; weights it did record are still compared."""
    from wsi_milssl.errors import CheckpointError
    from wsi_milssl.mil.run_folder import _check_resume_config

    def cfg(sha: str) -> dict:
        return {"store_settings": {"kind": "features", "feature_settings": {
            "encoder": "resnet50_trunc", "encoder_weights_sha256": sha, "input_size_px": 224}}}

    _check_resume_config(cfg(""), cfg("random"), tmp_path / "last.pt")
    _check_resume_config(cfg("ab12"), cfg("ab12"), tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match="cannot resume with different settings"):
        _check_resume_config(cfg("ab12"), cfg("random"), tmp_path / "last.pt")
    changed = cfg("")
    changed["store_settings"]["feature_settings"]["input_size_px"] = 256
    with pytest.raises(CheckpointError, match="input_size_px"):
        _check_resume_config(cfg(""), changed, tmp_path / "last.pt")


def test_a_resume_names_changed_validation_data_before_the_metric_it_cannot_compute(mil_csv, mil_csv_val, tmp_path,
                                                                                    capsys):
    """revY 5: after the validation labels changed (every bag now negative), a resume said '... Fix:
    --select-metric bag_nll', then refused that with 'select_metric changed; validation data changed'.
    The comparison with the saved run comes first now, so the first error names the real cause."""
    val = tmp_path / "val.csv"
    shutil.copy(mil_csv_val, val)
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--val", str(val), "--out", str(run), "--epochs", "1", "--threads", "1",
                 "--no-plots"]) == 0
    val.write_text("".join("0" + line[1:] for line in val.read_text().splitlines(keepends=True)))  # all negative
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--epochs", "2"]) == 1
    err = capsys.readouterr().err
    assert f"error: {run / 'last.pt'}: cannot resume with different settings or data (the validation data changed " \
           "since the run was saved" in err, err
    assert "--select-metric bag_nll" not in err and "Traceback" not in err


def test_a_run_that_recorded_no_op_head_settings_resumes(mil_csv, tmp_path):
    """Review CZ: an earlier version recorded `--dropout 0.2` given to a linear head (no effect); refusing it left
    such runs unresumable (the fix to edit config.json then failed the resume's own comparison)."""
    import torch

    copy = tmp_path / "run"
    assert main(["train", str(mil_csv), "--model", "linear", "--out", str(copy), "--epochs", "1", "--threads", "1",
                 "--no-plots"]) == 0
    (copy / "config.json").write_text(_edited(copy, dropout=0.2, hidden_dims=[64]))
    ckpt = torch.load(copy / "last.pt", weights_only=True)
    ckpt["config"] = {**ckpt["config"], "dropout": 0.2, "hidden_dims": [64]}
    torch.save(ckpt, copy / "last.pt")
    assert main(["train", "--resume", str(copy), "--epochs", "2", "--threads", "1", "--no-plots"]) == 0
    assert torch.load(copy / "last.pt", weights_only=True)["epoch"] == 2
