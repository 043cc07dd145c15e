"""Weights files as they come: older torchvision files without BatchNorm's ``num_batches_tracked`` load,
weights holding NaN are refused, a folder is named as a folder; an encoder giving NaN features writes
no feature file. Files that cannot be loaded safely (pickled objects, TorchScript, text, empty) are one
error line each; stacked wrapper prefixes are stripped; a checkpoint of several models names them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torchvision.models import resnet18 as tv_resnet18

from wsi_milssl.config import FeaturesConfig
from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.features import create_encoder, extract_features


def test_a_file_without_num_batches_tracked_loads_as_torch_would(tmp_path):
    """torchvision's older files (e.g. resnet50-19c8e357.pth) lack the counters; load_state_dict takes them."""
    torch.manual_seed(3)
    full = tv_resnet18(weights=None)
    state = {k: v for k, v in full.state_dict().items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "legacy.pth"
    torch.save(state, path)
    enc = create_encoder("resnet18", weights=str(path))
    x = torch.randn(2, 3, 64, 64)
    full.fc = nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(enc.module(x), full.eval()(x))


def test_weights_holding_nan_are_refused_naming_the_tensor(tmp_path):
    state = tv_resnet18(weights=None).state_dict()
    state["layer2.0.conv1.weight"][0, 0, 0, 0] = float("nan")
    path = tmp_path / "diverged.pth"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"diverged.pth: 1 tensors of these weights hold NaN or infinity "
                                              r"\(layer2.0.conv1.weight\)"):
        create_encoder("resnet18", weights=str(path))


def test_a_folder_given_as_weights_is_named_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=rf"{tmp_path.name}: is a folder, not a weights file .*Fix: pass the weights file"):
        create_encoder("resnet18", weights=str(tmp_path))


def test_an_encoder_giving_nan_features_writes_no_file(tmp_path, stores_copy):
    enc = create_encoder("resnet18", weights="random")
    with torch.no_grad():
        enc.module.conv1.weight.fill_(float("nan"))
    config = FeaturesConfig(encoder="resnet18", weights="random", amp="off", num_workers=1, batch_size=24)
    run = extract_features([stores_copy], tmp_path / "feats", config, encoder=enc)
    assert not run.ok and {r.status for r in run.results} == {"failed"}
    assert "the encoder 'resnet18' (weights random) gave NaN or infinite features" in run.results[0].error
    assert not list((tmp_path / "feats").glob("*.h5"))


class _Payload:
    """Unpickling this calls print: a file holding it must not be loaded."""

    def __reduce__(self):
        return (print, ("PWNED",))


def test_files_that_cannot_be_loaded_safely_are_one_line_each(tmp_path, stores_copy, capfd, recwarn):
    """They got torch's ~6-line message with escape codes advising weights_only=False (or add_safe_globals),
    'cannot load ... (101)' for a text file and '()' for an empty one; a TorchScript archive first warned
    that torch was 'dispatching to torch.jit.load'."""
    from wsi_milssl.cli import main

    model = tv_resnet18(weights=None)
    torch.save({"state_dict": model.state_dict(), "x": _Payload()}, tmp_path / "w_evil.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        torch.jit.script(model.eval()).save(str(tmp_path / "w_ts.pt"))
    (tmp_path / "w_text.pt").write_text("not weights\n")
    (tmp_path / "w_empty.pt").write_bytes(b"")
    cases = {"w_evil.pt": r"holds pickled Python objects, not only tensors.*e\.g\. print: not loaded, for safety",
             "w_ts.pt": r"is a TorchScript archive \(torch.jit.save\): not loaded",
             "w_text.pt": r"is not a PyTorch file",
             "w_empty.pt": r"is empty \(0 bytes"}
    for name, what in cases.items():
        with pytest.raises(CheckpointError, match=rf"{name}: {what}.*Fix: save the weights alone with "
                                                  r"torch.save\(model.state_dict\(\), path\)"):
            create_encoder("resnet18", weights=str(tmp_path / name))
        rc = main(["features", str(stores_copy), "--out", str(tmp_path / f"f_{name}"), "--encoder", "resnet18",
                   "--weights", str(tmp_path / name)])
        out, err = capfd.readouterr()
        assert rc == 1 and name in err and "PWNED" not in out + err
        assert len(err.strip().splitlines()) == 1, err
        assert "\x1b" not in err and "weights_only=False" not in err and "add_safe_globals" not in err
        assert "Warning" not in err
    assert not [w for w in recwarn if "TorchScript" in str(w.message)]


def test_stacked_wrapper_prefixes_are_stripped(tmp_path):
    """'module.model.' (and 'module.backbone.') were not: each prefix alone raised no matching names."""
    torch.manual_seed(4)
    state = tv_resnet18(weights=None).state_dict()
    for prefix in ("module.model.", "module.backbone.", "module."):
        path = tmp_path / "w.pth"
        torch.save({prefix + k: v for k, v in state.items()}, path)
        enc = create_encoder("resnet18", weights=str(path))
        assert torch.equal(enc.module.layer4[1].conv2.weight, state["layer4.1.conv2.weight"]), prefix


def test_a_checkpoint_of_several_models_names_them_and_how_to_pick_one(tmp_path):
    """A DINO-style checkpoint got 'expected a state dict (a mapping of names to tensors); got dict'."""
    state = tv_resnet18(weights=None).state_dict()
    path = tmp_path / "w_dino.pt"
    torch.save({"teacher": {"backbone." + k: v for k, v in state.items()}, "student": state, "epoch": 1}, path)
    with pytest.raises(CheckpointError, match=r"w_dino.pt: is not a state dict: 3 of its 3 entries are not tensors "
                                              r"\(teacher: state dict of \d+ tensors, student: state dict of \d+ "
                                              r"tensors, epoch: int\)\. Fix: save the state dict wanted alone"):
        create_encoder("resnet18", weights=str(path))
