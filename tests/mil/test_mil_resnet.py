"""wsi_milssl.mil.resnet builds torchvision's ResNet18: same keys, same initialisation, same outputs."""

from __future__ import annotations

import subprocess
import sys

import torch
from torchvision.models import resnet18 as tv_resnet18

from wsi_milssl.mil.resnet import ResNet18


def test_same_state_dict_keys_shapes_and_initialisation_for_a_seed():
    torch.manual_seed(3)
    ours = ResNet18(num_classes=2).state_dict()
    torch.manual_seed(3)
    theirs = tv_resnet18(weights=None, num_classes=2).state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_same_outputs_with_the_same_weights_in_eval_and_train_mode():
    torch.manual_seed(0)
    theirs = tv_resnet18(weights=None, num_classes=1000)
    for m in theirs.modules():  # non-trivial BatchNorm statistics
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    ours = ResNet18(num_classes=1000)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    for train in (False, True):
        ours.train(train)
        theirs.train(train)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_building_the_model_does_not_import_torchvision():
    code = ("import sys; from wsi_milssl.mil.models import create_model; create_model('resnet18'); "
            "print('torchvision' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
