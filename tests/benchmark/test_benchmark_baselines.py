"""ABMIL, gated ABMIL and max-pooling MIL baselines, and the shared digit CNN."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from wsi_milssl.errors import ConfigError
from wsi_milssl.mil import create_model, read_mil_csv
from wsi_milssl.benchmark.baselines import (
    AttentionMIL,
    BaselineConfig,
    DigitCNN,
    MLPEncoder,
    build_baseline,
    fit_baseline,
    pad_bags,
    predict_baseline,
)
from wsi_milssl.mil.data import InstanceSet


def _ragged_set() -> InstanceSet:
    rng = np.random.default_rng(0)
    bag_ids = np.array([1, 0, 2, 1, 0, 1, 2, 2, 2], dtype=np.int64)  # sizes 2, 3, 4, interleaved
    return InstanceSet(kind="features", bag_ids=bag_ids, bag_names=["a", "b", "c"],
                       bag_labels=np.array([0, 1, 1]), features=rng.normal(size=(9, 5)).astype(np.float32))


def test_pad_bags_places_every_instance_once_with_a_mask():
    s = _ragged_set()
    x, mask, slot = pad_bags(s)
    assert x.shape == (3, 4, 5) and mask.sum().item() == 9
    assert mask.sum(1).tolist() == [2, 3, 4]
    for i in range(9):
        assert torch.equal(x[s.bag_ids[i], slot[i]], torch.from_numpy(s.features[i]))
    assert float(x[~mask].abs().sum()) == 0.0


@pytest.mark.parametrize("method", ["abmil", "gated-abmil", "maxpool"])
def test_padding_does_not_change_bag_scores(method):
    s = _ragged_set()
    torch.manual_seed(0)
    model = build_baseline(method, 5, hidden_dims=(8,)).eval()
    together = predict_baseline(model, s)
    alone = predict_baseline(model, s.subset_bags([0]))  # bag "a" without padding
    assert together["bag_scores"][0] == pytest.approx(alone["bag_scores"][0], abs=1e-6)
    for name, scores in together["instance_scores"].items():
        mine = scores[s.bag_ids == 0]
        assert np.allclose(np.sort(mine), np.sort(alone["instance_scores"][name]), atol=1e-6), name


def test_abmil_reports_softmax_attention_and_raw_logit():
    s = _ragged_set()
    torch.manual_seed(1)
    model = build_baseline("abmil", 5, hidden_dims=(8,))
    assert isinstance(model, AttentionMIL)
    pred = predict_baseline(model, s)
    att, logit = pred["instance_scores"]["attention"], pred["instance_scores"]["attention_logit"]
    assert np.allclose(np.bincount(s.bag_ids, weights=att), 1.0)
    for b in range(3):  # the softmax of the raw logits within each bag is the attention
        m = s.bag_ids == b
        assert np.allclose(np.exp(logit[m]) / np.exp(logit[m]).sum(), att[m])
    assert set(predict_baseline(build_baseline("maxpool", 5), s)["instance_scores"]) == {"instance_prob"}


@pytest.mark.parametrize("method", ["abmil", "gated-abmil", "maxpool"])
def test_baselines_learn_a_separable_mil_problem_and_are_reproducible(method, mil_csv, mil_csv_val):
    train, val = read_mil_csv(mil_csv), read_mil_csv(mil_csv_val)
    cfg = BaselineConfig(method=method, encoder="mlp", hidden_dims=(32, 16), epochs=40, bags_per_batch=4, seed=3,
                         threads=1)
    model = fit_baseline(train, config=cfg)
    pred = predict_baseline(model, val)
    assert roc_auc_score(val.bag_labels, pred["bag_scores"]) > 0.9
    best = max(roc_auc_score(val.instance_labels, v) for v in pred["instance_scores"].values())
    assert best > 0.75
    again = fit_baseline(train, config=cfg)
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_baseline_needs_both_bag_classes(mil_csv):
    s = read_mil_csv(mil_csv)
    only_pos = s.subset_bags(np.flatnonzero(s.bag_labels == 1))
    with pytest.raises(ConfigError, match="need positive and negative bags"):
        fit_baseline(only_pos, config=BaselineConfig(epochs=1))


def test_baseline_config_is_validated():
    with pytest.raises(ConfigError, match="BaselineConfig.method must be one of"):
        BaselineConfig(method="transmil")
    with pytest.raises(ConfigError, match="BaselineConfig.encoder must be one of"):
        BaselineConfig(encoder="resnet18")
    with pytest.raises(ConfigError, match="hidden_dims needs at least one layer"):
        BaselineConfig(hidden_dims=())


def test_digit_cnn_is_registered_and_shares_its_encoder_with_the_baselines():
    model = create_model("digit-cnn", in_features=64)
    assert isinstance(model, DigitCNN)
    assert model(torch.rand(5, 64)).shape == (5, 2)
    assert create_model("digit-cnn", in_features=784)(torch.rand(2, 784)).shape == (2, 2)
    base = build_baseline("abmil", 64, encoder="digit-cnn")
    assert type(base.encoder) is type(model.encoder)
    assert base.encoder(torch.rand(3, 7, 64)).shape == (3, 7, 64)
    with pytest.raises(ConfigError, match="square images"):
        create_model("digit-cnn", in_features=63)
    mlp = build_baseline("maxpool", 10, encoder="mlp", hidden_dims=(16, 4))
    assert isinstance(mlp.encoder, MLPEncoder) and mlp.encoder.out_features == 4


def test_random_shift_moves_each_image_by_at_most_the_shift_with_zero_fill():
    from wsi_milssl.benchmark.baselines import random_shift

    torch.manual_seed(0)
    img = torch.zeros(400, 1, 6, 6)
    img[:, 0, 2, 3] = 1.0  # one bright pixel away from the border
    out = random_shift(img, 1)
    assert out.shape == img.shape and out.sum() == 400  # every pixel kept, nothing invented
    rows, cols = torch.nonzero(out[:, 0] == 1.0)[:, 1], torch.nonzero(out[:, 0] == 1.0)[:, 2]
    offsets = {(int(r) - 2, int(c) - 3) for r, c in zip(rows, cols)}
    assert offsets == {(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)}  # all nine, none larger
    edge = torch.zeros(50, 1, 4, 4)
    edge[:, 0, 0, :] = 1.0  # a top row: a shift up drops it, zeros come in
    moved = random_shift(edge, 1)
    assert set(moved.sum(dim=(1, 2, 3)).tolist()) <= {0.0, 3.0, 4.0}


def test_digit_cnn_shift_shifts_while_training_only():
    from wsi_milssl.benchmark.baselines import DigitCNNEncoder, build_encoder

    shifted = create_model("digit-cnn-shift", in_features=64)
    plain = create_model("digit-cnn", in_features=64)
    assert isinstance(shifted, DigitCNN) and shifted.encoder.shift_px == 1 and plain.encoder.shift_px == 0
    plain.load_state_dict(shifted.state_dict())  # same weights: the shift is not a parameter
    x = torch.rand(32, 64)
    shifted.eval(), plain.eval()
    assert torch.equal(shifted(x), plain(x))
    shifted.train(), plain.train()
    torch.manual_seed(0)
    assert not torch.allclose(shifted(x), plain(x))
    assert build_encoder("digit-cnn-shift", 784).shift_px == 1
    assert build_baseline("abmil", 64, encoder="digit-cnn-shift").encoder.shift_px == 1
    assert BaselineConfig(encoder="digit-cnn-shift").encoder == "digit-cnn-shift"
    with pytest.raises(ConfigError, match="shift_px"):
        DigitCNNEncoder(64, shift_px=-1)
