"""wsi_milssl.features.resnet builds torchvision's ResNet50, and its trunk is CLAM's resnet50_trunc:
same keys, same initialisation, same outputs."""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models import resnet50 as tv_resnet50

from wsi_milssl.features.resnet import ResNet50


def _random_statistics(model: nn.Module) -> None:
    for m in model.modules():  # non-trivial BatchNorm statistics and affine parameters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)


def test_same_state_dict_keys_shapes_and_initialisation_for_a_seed():
    torch.manual_seed(5)
    ours = ResNet50(num_classes=3).state_dict()
    torch.manual_seed(5)
    theirs = tv_resnet50(weights=None, num_classes=3).state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_full_network_gives_torchvisions_outputs():
    torch.manual_seed(0)
    theirs = tv_resnet50(weights=None).eval()
    _random_statistics(theirs)
    ours = ResNet50().eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_trunk_is_torchvision_up_to_layer3_average_pooled():
    torch.manual_seed(1)
    full = tv_resnet50(weights=None).eval()
    _random_statistics(full)
    trunk = ResNet50(trunk=True).eval()
    want_keys = [k for k in full.state_dict() if not k.startswith(("layer4.", "fc."))]
    assert list(trunk.state_dict()) == want_keys
    trunk.load_state_dict({k: full.state_dict()[k] for k in want_keys}, strict=True)
    reference = nn.Sequential(full.conv1, full.bn1, full.relu, full.maxpool, full.layer1, full.layer2, full.layer3,
                              nn.AdaptiveAvgPool2d(1), nn.Flatten())
    x = torch.randn(3, 3, 96, 80)  # any input size: adaptive pooling
    with torch.no_grad():
        got = trunk(x)
        torch.testing.assert_close(got, reference(x), rtol=0, atol=0)
    assert got.shape == (3, 1024) and trunk.out_features == 1024
