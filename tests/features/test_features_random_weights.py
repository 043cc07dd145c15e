"""Features of ``--weights random`` are another encoder than features of a weights file (review R1): a head
trained on the one is not run on the other (heatmap --features), not validated on the other (train --val),
and a features-mode pipeline refuses test features of the other before training. ``random`` is one fixed,
seeded initialisation, so two random-weight runs of one encoder are the same encoder; files of earlier
versions (which record ``encoder_weights_sha256`` = '' for random weights) still load and are told apart."""

from __future__ import annotations

import csv
import shutil

import pytest
import torch
from torchvision.models import resnet18 as tv_resnet18

from feature_fixtures import TILE
from wsi_milssl.cli import main
from wsi_milssl.config import FeaturesConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.features import extract_features
from wsi_milssl.features.schema import read_feature_file, settings_differences
from wsi_milssl.pipeline import load_pipeline, run_pipeline


@pytest.fixture(scope="module")
def feature_sets(tmp_path_factory, synth_slides):
    """The session's two slides embedded by one resnet18 with random weights (twice: two runs) and with a
    weights file, and copies of them under other names (held-out slides) with the weights file:
    {"random", "random_again", "real", "real_val"} -> folder, "labels" -> the labels of all."""
    out = tmp_path_factory.mktemp("random_weights")
    held_out = []
    for name, slide in (("v_tumor", synth_slides["tumor"]), ("v_normal", synth_slides["normal"])):
        held_out.append(out / "val_slides" / f"{name}.tif")
        held_out[-1].parent.mkdir(exist_ok=True)
        shutil.copy(slide, held_out[-1])
    (out / "labels.csv").write_text(f"slide,label\n{synth_slides['tumor'].stem},1\n{synth_slides['normal'].stem},0\n"
                                    "v_tumor,1\nv_normal,0\n")
    torch.manual_seed(1)
    weights = out / "resnet18.pth"
    torch.save(tv_resnet18(weights=None).state_dict(), weights)
    slides = [synth_slides["tumor"], synth_slides["normal"]]
    folders = {"labels": out / "labels.csv"}
    for name, source, inputs in (("random", "random", slides), ("random_again", "random", slides),
                                 ("real", str(weights), slides), ("real_val", str(weights), held_out)):
        config = FeaturesConfig(encoder="resnet18", weights=source, num_workers=0, batch_size=64, amp="off")
        assert extract_features(inputs, out / name, config, tile=TILE).ok
        folders[name] = out / name
    return folders


def _train(features, labels, out, val=None) -> int:
    args = ["train", str(features), "--labels", str(labels), "--out", str(out), "--epochs", "1", "--threads", "1",
            "--no-plots"]
    return main(args + (["--val", str(val)] if val is not None else []))


def _heatmap_errors(features, model, out) -> dict[str, str]:
    main(["heatmap", "--features", str(features), "--model", str(model), "--out", str(out), "--threads", "1"])
    return {r["slide"]: r["error"] for r in csv.DictReader((out / "heatmap_status.csv").open())}


def test_the_feature_files_tell_random_weights_from_a_weights_file(feature_sets):
    random = read_feature_file(feature_sets["random"] / "synth_000.h5")
    real = read_feature_file(feature_sets["real"] / "synth_000.h5")
    assert random.attrs["encoder_weights_sha256"] == ""  # as written since version 1: still read
    assert random.feature_settings["encoder_weights_sha256"] == "random"
    assert settings_differences(random.feature_settings, real.feature_settings) == [
        f"encoder_weights_sha256 random vs {real.encoder_weights_sha256[:12]}"]
    again = read_feature_file(feature_sets["random_again"] / "synth_000.h5")
    assert settings_differences(random.feature_settings, again.feature_settings) == []  # one seeded encoder


def test_a_head_of_random_weight_features_is_not_run_on_features_of_a_weights_file(feature_sets, synth_dir,
                                                                                    tmp_path):
    labels = synth_dir / "labels.csv"
    assert _train(feature_sets["random"], labels, tmp_path / "random_head") == 0
    errors = _heatmap_errors(feature_sets["real"], tmp_path / "random_head", tmp_path / "maps_real")
    assert set(errors) == {"synth_000", "synth_001"}
    for error in errors.values():  # was "ok" for both slides, no warning (review R1)
        assert "features made with other settings than those the head" in error
        assert "encoder_weights_sha256" in error and "vs random" in error
    # the reverse: a head of the weights file's features on random-weight features
    assert _train(feature_sets["real"], labels, tmp_path / "real_head") == 0
    errors = _heatmap_errors(feature_sets["random"], tmp_path / "real_head", tmp_path / "maps_random")
    assert all("encoder_weights_sha256 random vs" in e for e in errors.values()), errors
    # another run with random weights is the same (seeded) encoder: the head runs on it
    errors = _heatmap_errors(feature_sets["random_again"], tmp_path / "random_head", tmp_path / "maps_again")
    assert errors == {"synth_000": "", "synth_001": ""}


def test_train_refuses_validation_features_of_the_other_weights(feature_sets, tmp_path, capsys):
    rc = _train(feature_sets["random"], feature_sets["labels"], tmp_path / "run", val=feature_sets["real_val"])
    err = capsys.readouterr().err
    assert rc != 0 and not (tmp_path / "run" / "last.pt").exists()
    assert "the validation features" in err and "encoder_weights_sha256 random vs" in err


def test_a_features_pipeline_refuses_test_features_of_the_other_weights_before_training(feature_sets, tmp_path):
    labels = feature_sets["labels"]
    toml = tmp_path / "f.toml"
    # the test features are of other slides (review DB: features of the training slides are refused as such)
    toml.write_text(f'[pipeline]\nname = "f"\n[data]\nmode = "features"\ntrain_features = "{feature_sets["random"]}"\n'
                    f'train_labels = "{labels}"\ntest_features = "{feature_sets["real_val"]}"\n'
                    f'test_labels = "{labels}"\nval_fraction = 0\n[train]\nmode = "features"\nmodel = "mlp"\n'
                    'epochs = 1\nplots = false\n')
    spec = load_pipeline(toml, out_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match=r"were made otherwise than the training features .*: "
                                          r"encoder_weights_sha256 \w+ vs random"):
        run_pipeline(spec)
    assert not (tmp_path / "out" / "model").exists()  # refused before training


def test_a_head_saved_before_random_weights_were_told_apart_is_compared_by_the_settings_hash():
    """A head trained on random-weight features by an earlier version recorded no weights: its settings hash
    (which covers the weights) tells it from features of a weights file; the same settings match."""
    common = {"encoder": "resnet18", "encoder_kwargs": "{}", "feature_dtype": "float32", "input_size_px": 224,
              "amp": "off", "target_mpp": 2.0, "patch_size_px": 32}
    old_head = {**common, "settings_hash": "h_random"}
    real = {**common, "settings_hash": "h_real", "encoder_weights_sha256": "b" * 64}
    assert settings_differences(real, old_head) == ["settings_hash h_real vs h_random"]
    random_now = {**common, "settings_hash": "h_random", "encoder_weights_sha256": "random"}
    assert settings_differences(random_now, old_head) == []
    # a hash that differs in the precision alone is not a difference (float16 files may be mixed)
    assert settings_differences({**random_now, "settings_hash": "h16", "feature_dtype": "float16"}, old_head) == []
