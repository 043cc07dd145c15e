"""A checkpoint with the right format tag but missing or mistyped parts gives one CheckpointError naming the
file and saying it is incomplete, from load_model and from `heatmap`."""

from __future__ import annotations

import pytest
import torch

from wsi_milssl.cli import main
from wsi_milssl.errors import CheckpointError
from wsi_milssl.mil import load_model


@pytest.fixture(scope="module")
def checkpoint(mil_csv, tmp_path_factory):
    run = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return run / "last.pt"


def _damaged(checkpoint, tmp_path, **changes):
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    for key, value in changes.items():
        if value is None:
            del ckpt[key]
        else:
            ckpt[key] = value
    path = tmp_path / "bad.pt"
    torch.save(ckpt, path)
    return path


CASES = [
    ({"model_name": None}, r"'model_name' is missing"),
    ({"model": None}, r"'model' \(the weights\) is missing"),
    ({"config": "mu=0.2"}, r"'config' is a str, not a dict"),
    ({"model_kwargs": [1, 2]}, r"'model_kwargs' is a list, not a dict"),
    ({"model": {"weight": 3}}, r"'model' is a dict, not a state dict of tensors"),
    ({"model_name": 7}, r"'model_name' is 7, not a model name"),
    ({"model_kwargs": {"no_such_argument": 1}}, r"cannot build model 'mlp' with the saved model_kwargs"),
    # torch refuses the size with a RuntimeError
    ({"model_kwargs": {"num_classes": 2, "in_features": 8, "hidden_dims": [-5], "dropout": 0.5}},
     r"cannot build model 'mlp' with the saved model_kwargs .*\(.*negative dimension -5.*\)\."),
]


@pytest.mark.parametrize("changes, message", CASES, ids=[next(iter(c[0])) + str(i) for i, c in enumerate(CASES)])
def test_incomplete_checkpoint(checkpoint, tmp_path, changes, message):
    path = _damaged(checkpoint, tmp_path, **changes)
    with pytest.raises(CheckpointError, match=rf"bad\.pt: {message}.*The checkpoint is incomplete or was not "
                                              r"written by this version's `wsi-milssl train`\. Fix: re-run training"):
        load_model(path)


def test_complete_checkpoint_loads(checkpoint):
    model, config = load_model(checkpoint)
    assert config["model_name"] == "mlp" and not model.training


@pytest.mark.parametrize("changes", [{"model_name": None}, {"model": None}, {"config": "x"},
                                     {"model_kwargs": {"num_classes": 2, "in_features": 8, "hidden_dims": [-5]}}])
def test_heatmap_gives_one_error_line(checkpoint, tmp_path, synth_slides, capsys, changes):
    path = _damaged(checkpoint, tmp_path, **changes)
    capsys.readouterr()
    code = main(["heatmap", str(synth_slides["tumor"]), "--model", str(path), "--out", str(tmp_path / "hm")])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert f"error: {path}: " in err and "The checkpoint is incomplete" in err


def test_resume_from_an_incomplete_last_pt_says_how_to_resume(checkpoint, tmp_path, capsys):
    """`train --resume RUN` with a last.pt missing a resume part: the fix is about the run, not about passing
    another checkpoint (RUN_DIR/best.pt cannot be resumed from)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(checkpoint.parent, run)
    ckpt = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    del ckpt["optimizer"]
    torch.save(ckpt, run / "last.pt")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--epochs", "2"]) != 0
    err = capsys.readouterr().err
    assert f"{run / 'last.pt'}: 'optimizer' is missing. The checkpoint is incomplete" in err
    assert "so the run cannot be resumed from it" in err
    assert "put the run's complete last.pt back, or train again without --resume into a new --out" in err
    assert "RUN_DIR/best.pt" not in err
