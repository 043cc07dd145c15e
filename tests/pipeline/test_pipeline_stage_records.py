"""What makes a stage of `run` run again beyond its settings: a run stopped inside a stage (its stamp must
not stay valid while the stage rewrote its files), new encoder weights behind the same weights path, and
the checks of the feature-mode evaluation and of `--force`."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.errors import ConfigError
from wsi_milssl.mil.resnet import ResNet18
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.evaluation.bags import check_test_features as _check_test_features

TINY = """
[pipeline]
name = "stage-records"
""" + GENERATED_SLIDES + """[features]
encoder = "resnet18"
weights = "WEIGHTS"
num_workers = 0
[train]
epochs = 1
mu_ramp_epochs = 1
plots = false
"""


def _weights(path, seed: int) -> None:
    torch.manual_seed(seed)
    torch.save(ResNet18(num_classes=1).state_dict(), path)


def _feature_attrs(out, key: str) -> dict:
    found = {}
    for p in sorted((out / "features").glob("*/*.h5")):
        with h5py.File(p, "r") as fh:
            value = fh.attrs[key]
        found[f"{p.parent.name}/{p.stem}"] = value.decode() if isinstance(value, bytes) else str(value)
    return found


@pytest.fixture()
def tiny(tmp_path):
    _weights(tmp_path / "w.pth", 1)
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY.replace("WEIGHTS", str(tmp_path / "w.pth")))
    return toml


def _outcomes(toml, *overrides, until="features") -> dict[str, tuple[str, str]]:
    spec = load_pipeline(toml, out_dir=toml.parent / "out", overrides=overrides)
    return {o.stage: (o.status, o.reason) for o in run_pipeline(spec, until=until)}


def test_a_stage_stopped_inside_runs_again_even_with_the_settings_of_its_stamp(tiny, monkeypatch):
    import wsi_milssl.features as features

    out = tiny.parent / "out"
    _outcomes(tiny)
    assert set(_feature_attrs(out, "feature_dtype").values()) == {"float32"}
    real = features.extract_features
    calls = []

    def stopped_after_the_first_set(*args, **kwargs):  # a kill while the test set is being embedded
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "extract_features", stopped_after_the_first_set)
    with pytest.raises(KeyboardInterrupt):
        _outcomes(tiny, 'features.dtype="float16"')
    monkeypatch.setattr(features, "extract_features", real)
    assert set(_feature_attrs(out, "feature_dtype").values()) == {"float32", "float16"}  # a mix on disk
    # back to the settings of the stamp: the stage did not finish, so it runs and the files agree again
    status, reason = _outcomes(tiny)["features"]
    assert (status, reason) == ("ran", "its last run did not finish (stopped inside the stage)")
    assert set(_feature_attrs(out, "feature_dtype").values()) == {"float32"}
    assert _outcomes(tiny)["features"] == ("skipped", "")


def test_new_encoder_weights_behind_the_same_path_embed_again(tiny):
    out = tiny.parent / "out"
    _outcomes(tiny)
    before = _feature_attrs(out, "encoder_weights_sha256")
    _weights(tiny.parent / "w.pth", 2)
    status, reason = _outcomes(tiny)["features"]
    assert status == "ran" and "w.pth" in reason
    after = _feature_attrs(out, "encoder_weights_sha256")
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in after)


def test_force_of_a_stage_the_pipeline_does_not_have_is_refused(tiny):
    features_mode = tiny.parent / "f.toml"
    features_mode.write_text('[pipeline]\nname = "f"\n[data]\nmode = "features"\ntrain_features = "a"\n'
                             'train_labels = "a.csv"\ntest_features = "b"\ntest_labels = "b.csv"\n')
    with pytest.raises(ConfigError, match=r"--force features: not a stage of this pipeline \(its stages: train, "
                                          r"evaluate\)"):
        run_pipeline(load_pipeline(features_mode, out_dir=tiny.parent / "o2"), force=["features"])


class _Features:
    def __init__(self, width: int, settings: dict) -> None:
        self.features = np.zeros((3, width), np.float32)
        self.settings = settings
        self.source = "feats/test"

    def __len__(self) -> int:
        return 3


def test_feature_mode_evaluation_refuses_test_features_the_head_was_not_trained_on():
    saved = {"in_features": 8, "store_settings": {"feature_encoder": "resnet18",
                                                  "feature_encoder_weights_sha256": "a" * 64}}
    same = {"feature_encoder": "resnet18", "feature_encoder_weights_sha256": "a" * 64}
    _check_test_features(_Features(8, same), saved, "best.pt")
    with pytest.raises(ConfigError, match=r"have 16 values per patch, but the head best.pt was trained on 8"):
        _check_test_features(_Features(16, same), saved, "best.pt")
    with pytest.raises(ConfigError, match=r"are of resnet18 .*but the head best.pt was trained on features of"):
        _check_test_features(_Features(8, {**same, "feature_encoder_weights_sha256": "b" * 64}), saved, "best.pt")


def test_feature_mode_evaluation_refuses_test_features_of_another_resolution():
    made = {"feature_encoder": "resnet18", "feature_encoder_weights_sha256": "a" * 64}
    trained = {"in_features": 8, "store_settings": {**made, "feature_settings": {"encoder": "resnet18",
                                                                                  "target_mpp": 1.0}}}
    _check_test_features(_Features(8, {**made, "feature_settings": {"encoder": "resnet18", "target_mpp": 1.0}}),
                         trained, "best.pt")
    with pytest.raises(ConfigError, match=r"other settings than the features the head best.pt was trained on "
                                          r"\(target_mpp 2 vs 1 µm/px\)"):
        _check_test_features(_Features(8, {**made, "feature_settings": {"encoder": "resnet18", "target_mpp": 2.0}}),
                             trained, "best.pt")


def test_force_of_a_stage_after_until_is_refused(tiny):
    spec = load_pipeline(tiny, out_dir=tiny.parent / "out")
    with pytest.raises(ConfigError, match=r"--force train: after --until tile, so it would not run"):
        run_pipeline(spec, until="tile", force=["train"])


def test_feature_mode_test_features_made_otherwise_are_refused_before_training(tmp_path):
    """They were found at evaluate, after the whole training (review)."""
    from wsi_milssl.features import write_feature_file

    rng = np.random.default_rng(0)
    for set_name, target_mpp in (("train", 1.0), ("test", 2.0)):
        for i in range(4):
            coords = np.stack([np.arange(6) * 512, np.zeros(6, np.int64)], axis=1)
            write_feature_file(tmp_path / "feats" / set_name / f"{set_name}{i}.h5",
                               features=rng.normal(size=(6, 8)).astype(np.float32), coords=coords,
                               attrs={"slide_stem": f"{set_name}{i}", "encoder": "resnet18", "mpp": 0.25,
                                      "target_mpp": target_mpp, "patch_size_px": 256},
                               coords_attrs={"patch_size": 256}, features_attrs={"encoder": "resnet18"})
        (tmp_path / "feats" / f"{set_name}.csv").write_text(
            "slide,label\n" + "".join(f"{set_name}{i},{i % 2}\n" for i in range(4)))
    toml = tmp_path / "f.toml"
    toml.write_text('[pipeline]\nname = "f"\n[data]\nmode = "features"\ntrain_features = "feats/train"\n'
                    'train_labels = "feats/train.csv"\ntest_features = "feats/test"\ntest_labels = "feats/test.csv"\n'
                    'val_fraction = 0.25\n[train]\nmode = "features"\nmodel = "mlp"\nepochs = 1\nplots = false\n')
    spec = load_pipeline(toml, out_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match=r"the test features .*test0.h5\) were made otherwise than the training "
                                          r"features .*train0.h5\): target_mpp 2 vs 1 µm/px"):
        run_pipeline(spec)
    assert not (tmp_path / "out" / "model").exists()  # refused before training
    assert [o.stage for o in run_pipeline(spec, until="train")] == ["train"]  # training alone still runs
