"""Weights files as they come: older torchvision files without BatchNorm's ``num_batches_tracked`` load,
weights holding NaN are refused, a folder is named as a folder; an encoder giving NaN features writes
no feature file."""

from __future__ import annotations

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
