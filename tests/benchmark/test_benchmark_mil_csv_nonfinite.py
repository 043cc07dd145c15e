"""A NaN or infinite score anywhere in benchmark mil-csv's nested cross-validation (an instance or a bag, an
inner-fold or a whole-split model, the training split or the test fold, any method) is one ConfigError naming
the data set, the method and the fold, with the fix: never a metric on the finite rest (review B1; the AUC
kept the finite scores alone and the accuracy counted a NaN as negative)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from milcsv import make_mil_csv
from wsi_milssl.benchmark import mil_csv as mc
from wsi_milssl.benchmark import stacked
from wsi_milssl.config.train import BenchmarkConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.mil import read_mil_csv

BENCH = BenchmarkConfig(folds=3, inner_folds=2, seed=0, threads=1)
FIX = r"Fix: lower the learning rate"


def _tiny(name: str) -> mc.MethodSpec:
    """``name`` with its grid cut to one point, small layers and 3 epochs."""
    spec = mc.METHODS[name]
    fixed = dict(spec.fixed)
    fixed["hidden_dims"] = (8,) if spec.kind == "mil-ssl" else (8, 4)
    return dataclasses.replace(spec, grid=tuple((k, v[:1]) for k, v in spec.grid), fixed=tuple(fixed.items()),
                               epoch_grid=(3,))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_mil_csv(tmp_path_factory.mktemp("nonfinite") / "toy.csv", n_bags=18)


@pytest.fixture(scope="module")
def extreme(tmp_path_factory):
    """The toy problem with one instance of bag b000 at 3e38 in every feature (float32 holds it): a model
    scoring it on a test fold gives NaN."""
    path = make_mil_csv(tmp_path_factory.mktemp("extreme") / "extreme.csv", n_bags=18)
    rows = path.read_text().splitlines()
    label, bag, *values = rows[0].split(",")
    rows[0] = ",".join([label, bag] + ["3e38"] * len(values))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_nan_instance_scores_of_a_test_bag_are_refused_not_pooled_away(extreme):
    """No stand-in: mil-ssl's test-fold probabilities of the extreme instance are NaN (the training scores are
    finite); top-half pooling dropped them and the fold reported an AUC of 1.0."""
    spec = _tiny("mil-ssl-improved")
    with pytest.raises(ConfigError) as err:
        mc.nested_cross_validation(read_mil_csv(extreme), bench=BENCH, methods=[spec])
    message = str(err.value)
    assert message.startswith(f"{extreme}: method mil-ssl-improved, outer fold 3/3: ")
    assert "instance scores are NaN or infinite" in message and "of bag b000" in message
    assert FIX in message and "check the data set's features" in message


def test_a_diverged_baseline_names_the_data_set_method_and_fold(extreme):
    """The stacked trainer's own check of the training scores, now with the data set, method and fold."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(extreme))}: method abmil, outer fold \d/3: .*diverged.*"
                                          "lower the learning rate or check the features for extreme values"):
        mc.nested_cross_validation(read_mil_csv(extreme), bench=BENCH, methods=[_tiny("abmil")])


def _nan_at(monkeypatch, fit_name: str, where: str, *, model: int, bag: int = 0, call: int = 0) -> None:
    """Make ``stacked.<fit_name>`` return a NaN score of model ``model`` for bag (or instance) ``bag`` of
    the ``where`` set ("train" or "test") at every epoch, in its ``call``-th call (0: the first fold)."""
    real = getattr(stacked, fit_name)
    calls = []

    def fit(data, **kwargs):
        out = real(data, **kwargs)
        if len(calls) == call:
            for scores in out[where].values():
                scores[model, bag] = np.nan
        calls.append(1)
        return out

    monkeypatch.setattr(stacked, fit_name, fit)


def test_a_nan_inner_fold_score_is_refused(toy, monkeypatch):
    """Inner model 1 (of fold 0) scores a bag it was held out from as NaN: the OOF AUC that picks the setting
    kept the finite scores alone."""
    data = read_mil_csv(toy)
    train_bags, _ = mc._stratified(data.bag_labels, BENCH.folds, BENCH.seed)[0]
    tr_labels = data.bag_labels[train_bags]
    held_out = mc._stratified(tr_labels, BENCH.inner_folds, BENCH.seed + 1)[1][1]
    _nan_at(monkeypatch, "fit_stacked_baseline", "train", model=1, bag=int(held_out[0]))
    with pytest.raises(ConfigError) as err:
        mc.nested_cross_validation(data, bench=BENCH, methods=[_tiny("maxpool")])
    message = str(err.value)
    assert message.startswith(f"{toy}: method maxpool, outer fold 1/3: ")
    assert "bag scores are NaN or infinite" in message and "inner fold 2/2 model" in message
    assert "held out from it" in message and FIX in message


@pytest.mark.parametrize("name", ["abmil", "mil-ssl-improved-no-ensemble"])
def test_a_nan_test_score_of_the_whole_split_model_is_refused(toy, monkeypatch, name):
    """The outer test fold's score of the model trained on the whole split (2 = after the 2 inner models),
    in the second outer fold: was counted as a negative bag by the accuracy and left out of the AUC."""
    spec = _tiny(name)
    fit = "fit_stacked_milssl" if spec.kind == "mil-ssl" else "fit_stacked_baseline"
    _nan_at(monkeypatch, fit, "test", model=2, call=1)
    with pytest.raises(ConfigError) as err:
        mc.nested_cross_validation(read_mil_csv(toy), bench=BENCH, methods=[spec])
    message = str(err.value)
    assert message.startswith(f"{toy}: method {name}, outer fold 2/3: ")
    assert "NaN or infinite" in message and "model trained on the whole training split" in message
    assert "test-fold" in message and FIX in message


def test_a_nan_calibrated_ensemble_score_is_refused(toy, monkeypatch):
    real = mc.calibrated_ensemble

    def calibrated(*args, **kwargs):
        scores = real(*args, **kwargs)
        scores[-1] = np.inf
        return scores

    monkeypatch.setattr(mc, "calibrated_ensemble", calibrated)
    with pytest.raises(ConfigError) as err:
        mc.nested_cross_validation(read_mil_csv(toy), bench=BENCH, methods=[_tiny("abmil-ensemble-calibrated")])
    message = str(err.value)
    assert message.startswith(f"{toy}: method abmil-ensemble-calibrated, outer fold 1/3: ")
    assert "1 of 6 test-fold bag scores" in message and FIX in message


def test_finite_scores_still_give_every_fold(toy):
    out = mc.nested_cross_validation(read_mil_csv(toy), bench=BENCH, methods=[_tiny("abmil")])
    assert [r["fold"] for r in out["methods"]["abmil"]["folds"]] == [0, 1, 2]
