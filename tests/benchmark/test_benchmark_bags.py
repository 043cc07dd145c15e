"""The digit-bag harness: same bags for every method, tables shaped like the paper's, reproducible by seed,
and the ``wsi-milssl benchmark bags`` command. Tiny bags and few epochs; the full tables are produced by
``benchmarks/bench_bags.py`` (and the slow test at the end)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import ConfigError
from wsi_milssl.benchmark.bags import (
    ABLATION_ROWS,
    BagBenchConfig,
    acceptance,
    digit_instance_set,
    format_markdown,
    mil_ssl_config,
    run_ablation,
    run_hard,
    run_methods,
    run_normal,
    summarise,
)
from wsi_milssl.benchmark.digits import DigitImages, load_digit_images, normal_protocol

N_IMAGES = 700  # a subset of scikit-learn's 1,797 digits keeps these tests fast


@pytest.fixture(scope="module")
def small_digits() -> DigitImages:
    d = load_digit_images()
    return DigitImages(images=d.images[:N_IMAGES], labels=d.labels[:N_IMAGES], source="subset")


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory, small_digits) -> str:
    """The subset as an IDX image/label pair (8x8 uint8), read through the MNIST path of the harness."""
    folder = tmp_path_factory.mktemp("idx")
    images = np.round(small_digits.images * 255).astype(np.uint8)
    labels = small_digits.labels.astype(np.uint8)
    for name, arr in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels)):
        header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
        (folder / name).write_bytes(header + arr.tobytes())
    return str(folder)


@pytest.fixture()
def fast(digits_dir) -> dict:
    return dict(epochs=2, bag_size=10, seeds=(0,), threads=1, mnist_dir=digits_dir)


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_every_method_is_scored_on_the_same_bags_and_reproducible_by_seed(small_digits):
    config = BagBenchConfig(epochs=2, threads=1)
    train, test = normal_protocol(small_digits, ratio=0.2, bag_size=10, seed=0)
    rows = run_methods(config, train, {"test": test}, seed=0)
    labels = [r["label"] for r in rows]
    assert labels == ["MIL-SSL", "ABMIL (softmax attention)", "ABMIL (raw attention logit)",
                      "Gated ABMIL (softmax attention)", "Gated ABMIL (raw attention logit)", "Max-pooling MIL"]
    for r in rows:
        assert 0.0 <= r["instance_auc"] <= 1.0 and 0.0 <= r["bag_auc"] <= 1.0
    assert rows[1]["bag_auc"] == rows[2]["bag_auc"]  # ABMIL's two scorings share one model
    assert _strip(run_methods(config, train, {"test": test}, seed=0)) == _strip(rows)
    other = run_methods(config, train, {"test": test}, seed=1, methods=("mil-ssl", "abmil"))
    assert [r["instance_auc"] for r in other] != [r["instance_auc"] for r in rows[:3]]  # the seed matters


def test_mil_ssl_config_uses_the_construction_ratio_and_half_the_epochs_as_ramp(small_digits):
    train, _ = normal_protocol(small_digits, ratio=0.2, bag_size=10, seed=0)
    cfg = mil_ssl_config(BagBenchConfig(epochs=30), train, seed=4, lam=1.0)
    assert cfg.mode == "features" and cfg.model == "digit-cnn"
    assert cfg.mu == pytest.approx(0.2) and cfg.mu_ramp_epochs == 15 and cfg.lam == 1.0 and cfg.seed == 4
    fixed = mil_ssl_config(BagBenchConfig(epochs=30, mu=0.15, mu_ramp_epochs=5, encoder="mlp"), train, seed=0, lam=25.0)
    assert (fixed.mu, fixed.mu_ramp_epochs, fixed.model, fixed.lam) == (0.15, 5, "mlp", 25.0)
    s = digit_instance_set(train)
    assert s.kind == "features" and s.in_features == 64 and s.n_bags == train.n_bags


def test_normal_tables_have_the_paper_shape(fast):
    result = run_normal(BagBenchConfig(ratios=(0.1, 0.5), methods=("mil-ssl", "abmil"), **fast))
    text = format_markdown(result)
    for piece in ("Table 1 analog", "Table 2 analog", "Table 3 analog", "| Method | 10% | 50% |",
                  "ABMIL (raw attention logit)", "positives per positive bag (realised ratio)", "| bags (train : test)"):
        assert piece in text, piece
    summary = summarise(result)
    assert summary[("MIL-SSL", "0.1")]["instance_auc"]["n"] == 1
    assert result["source"].startswith("MNIST IDX") and result["bag_size"] == 10
    acc = acceptance(result)
    assert set(acc["normal"]) == {"0.1", "0.5"}
    v = acc["normal"]["0.1"]
    assert v["margin"] == pytest.approx(v["mil_ssl"] - v["best_abmil"]) and v["met"] == (v["margin"] > 0)
    assert json.loads(json.dumps(result))["protocol"] == "normal"


def test_hard_table_reports_three_test_sets_and_the_margin(fast):
    result = run_hard(BagBenchConfig(methods=("mil-ssl", "maxpool"), **fast))
    assert {r["test"] for r in result["rows"]} == {"test-normal", "test-pos0", "test-pos8"}
    text = format_markdown(result)
    assert "Table 4 analog" in text and "| Method | Test set | Instance-level AUC | Bag-level AUC |" in text
    acc = acceptance(result)["hard"]
    assert acc["harder_test"] in ("test-pos0", "test-pos8") and acc["best_baseline"] == "Max-pooling MIL"


def test_ablation_rows_switch_soft_labels_constraints_and_adaptive_mu(fast):
    result = run_ablation(BagBenchConfig(ablation_ratio=0.2, **{**fast, "epochs": 4}))
    rows = result["rows"]
    assert [(r["soft"], r["constraint"], r["adaptive_mu"]) for r in rows] == list(ABLATION_ROWS)
    # without the constraints the pseudo labels of positive bags collapse toward all-negative
    assert rows[0]["pseudo_label_mean"] < 0.05
    assert rows[3]["pseudo_label_mean"] > 0.1
    text = format_markdown(result)
    assert "Table 8 analog" in text and text.count("| ✓ | ✓ | ✓ |") == 1
    assert "Order as in the paper" in text


def test_config_is_validated_with_the_field_name():
    with pytest.raises(ConfigError, match="BagBenchConfig.methods must be one of"):
        BagBenchConfig(methods=("dsmil",))
    with pytest.raises(ConfigError, match="BagBenchConfig.ratios"):
        BagBenchConfig(ratios=(0.0,))
    with pytest.raises(ConfigError, match="must not repeat a seed"):
        BagBenchConfig(seeds=(1, 1))
    assert BagBenchConfig().resolved_bag_size() == 20
    assert BagBenchConfig(mnist_dir="/data/mnist").resolved_bag_size() == 100


def test_cli_prints_tables_and_writes_json(tmp_path, capsys, digits_dir):
    out = tmp_path / "hard.json"
    md = tmp_path / "hard.md"
    code = main(["benchmark", "bags", "--protocol", "hard", "--seeds", "0", "--epochs", "1", "--bag-size", "10",
                 "--mnist", digits_dir, "--methods", "mil-ssl", "abmil", "--json", str(out), "--markdown", str(md)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Table 4 analog" in printed and "ABMIL (raw attention logit)" in printed
    data = json.loads(out.read_text())
    assert data["protocol"] == "hard" and data["config"]["epochs"] == 1 and len(data["rows"]) == 9
    assert md.read_text().startswith("Images: MNIST IDX")


def test_cli_rejects_the_ablation_on_the_hard_protocol(capsys):
    assert main(["benchmark", "bags", "--ablation", "--protocol", "hard"]) == 1
    assert "--ablation runs on the normal protocol" in capsys.readouterr().err


@pytest.mark.slow
def test_mil_ssl_beats_abmil_on_instances_at_a_high_ratio():
    """Default settings at 70 %: bag classifiers need only a few 9s; MIL-SSL learns them all."""
    result = run_normal(BagBenchConfig(ratios=(0.7,), seeds=(0, 1), methods=("mil-ssl", "abmil")))
    acc = acceptance(result)["normal"]["0.7"]
    assert acc["met"] and acc["mil_ssl"] > 0.95, acc
    assert np.isfinite(acc["margin"])


def test_ratios_with_the_same_bags_are_trained_once(fast):
    result = run_normal(BagBenchConfig(ratios=(0.05, 0.1, 0.08), methods=("abmil",), **fast))
    # at bag size 10: 5 % -> 1 positive (= 10 %), 8 % -> 1 positive: one training run for all three
    assert result["same_bags"] == {"0.1": "0.05", "0.08": "0.05"}
    by_ratio = {r["ratio"]: r["instance_auc"] for r in result["rows"] if r["scoring"] == "attention"}
    assert by_ratio[0.05] == by_ratio[0.1] == by_ratio[0.08]
    assert "5% and 10% and 8% all give 1 positive(s) per positive bag" in format_markdown(result)
