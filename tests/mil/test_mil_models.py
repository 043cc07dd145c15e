"""The model registry: every registered model builds, maps a batch to 2 logits, and loads local weights."""

from __future__ import annotations

import pytest
import torch

from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.mil.models import MODELS, create_model, is_image_model, list_models, register_model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registered_models_give_two_logits(name):
    # 64 features: also a valid flattened 8 x 8 image for heads that reshape (e.g. digit-cnn)
    model = create_model(name, in_features=64)
    x = torch.randn(3, 3, 32, 32) if is_image_model(name) else torch.randn(3, 64)
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (3, 2) and torch.isfinite(out).all()


def test_registry_contents_and_errors():
    assert {"resnet18", "linear", "mlp"} <= set(list_models())
    with pytest.raises(ConfigError, match="unknown model 'vit'; registered models are"):
        create_model("vit")
    with pytest.raises(ConfigError, match="needs in_features"):
        create_model("mlp")


def test_register_a_new_model():
    @register_model("tiny-test-head")
    def tiny(*, in_features: int, **_):
        return torch.nn.Linear(in_features, 2)

    try:
        assert create_model("tiny-test-head", in_features=4)(torch.randn(2, 4)).shape == (2, 2)
    finally:
        MODELS.pop("tiny-test-head")


def test_resnet18_loads_local_imagenet_style_weights(tmp_path, caplog):
    from torchvision.models import resnet18

    donor = resnet18(weights=None, num_classes=1000)
    path = tmp_path / "imagenet_like.pt"
    torch.save(donor.state_dict(), path)
    model = create_model("resnet18", weights_path=str(path))
    assert torch.equal(model.conv1.weight, donor.conv1.weight)
    assert model.fc.out_features == 2
    assert "skipped 2 tensors" in caplog.text
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "wrong.pt")
    with pytest.raises(CheckpointError, match="weights do not fit the model"):
        create_model("resnet18", weights_path=str(tmp_path / "wrong.pt"))
    with pytest.raises(CheckpointError, match="weights file not found"):
        create_model("resnet18", weights_path=str(tmp_path / "missing.pt"))


def test_feature_head_standardises_with_its_buffers():
    model = create_model("linear", in_features=3)
    feats = torch.tensor([[1.0, 10.0, 5.0], [3.0, 30.0, 5.0]])
    model.standardize.set_stats(feats)
    assert torch.allclose(model.standardize(feats), torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0]]))
    assert set(model.state_dict()) >= {"standardize.mean", "standardize.std"}


def test_every_built_in_model_is_listed_without_importing_its_module_first():
    import subprocess
    import sys

    code = "from wsi_milssl.mil.models import list_models; print(' '.join(list_models()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert {"resnet18", "linear", "mlp", "digit-cnn"} <= set(out)


def test_the_settings_know_the_built_in_models_as_the_registry_does():
    """TrainConfig checks `model` against BUILTIN_MODELS without importing torch (review CH: every `run`, also one
    that found everything up to date, imported it); the registry must hold the same names and kinds."""
    import subprocess
    import sys

    from wsi_milssl.config.train import BUILTIN_MODELS, model_kinds
    from wsi_milssl.mil.models import is_image_model, list_models

    from wsi_milssl.mil.models import MODELS

    registered = {name: is_image_model(name) for name in list_models()}
    built_in = {n: k for n, k in registered.items() if MODELS[n].__module__.startswith("wsi_milssl.")}
    assert built_in == BUILTIN_MODELS  # a model added to the package must be added there too (review CP)
    assert model_kinds() == registered  # once the registry is imported, a model registered by the caller counts
    code = ("import sys\nfrom wsi_milssl.config import TrainConfig\nTrainConfig(mode='images')\n"
            "TrainConfig(mode='features', model='linear')\nprint('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_mil_package_gives_its_names_on_first_use_and_its_light_modules_need_no_torch():
    """An up-to-date image pipeline's `run` imported torch only to check its validation split with mil.scores
    (review CH): the package's names are imported on first use now."""
    import subprocess
    import sys

    import wsi_milssl.mil as mil

    for name in mil.__all__:
        assert getattr(mil, name) is not None and name in dir(mil)
    code = ("import sys\nimport wsi_milssl.mil.scores\nfrom wsi_milssl.pipeline.training import _selection_problem\n"
            "from wsi_milssl.config import TrainConfig\n"
            "print(_selection_problem([TrainConfig(mode='images')], ['a', 'b'], {'a': 1, 'b': 1})[0], "
            "'torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split() == ["bag_auc", "False"]
