"""The digit-bag harness: same bags for every method, tables shaped like the paper's, reproducible by seed,
and the ``wsi-milssl benchmark bags`` command. Tiny bags and few epochs; the full tables are produced by
``benchmarks/bench_bags.py`` (and the slow test at the end)."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
from PIL import Image

from wsi_milssl.cli import main
from wsi_milssl.errors import ConfigError
from wsi_milssl.benchmark.bags import (
    ABLATION_ROWS,
    BagBenchConfig,
    acceptance,
    choose,
    digit_instance_set,
    format_markdown,
    mil_ssl_config,
    run_ablation,
    run_hard,
    run_methods,
    run_normal,
    run_tuned,
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
    """Untuned (no validation bags): one value per axis, last epoch scored."""
    return dict(epoch_grid=(2,), lrs=(1e-3,), encoders=("digit-cnn",), attention_dims=(64,), maxpool_weight_decays=(1e-4,),
                lams=(1.0,), val_fraction=0.0, bag_size=10, seeds=(0,), threads=1, mnist=digits_dir)


@pytest.fixture()
def tuned(digits_dir) -> dict:
    """A small equal-budget grid: lr x encoder x own axis (2 values) = 4 runs per method, 2 epoch counts."""
    return dict(epoch_grid=(1, 3), lrs=(1e-3,), encoders=("mlp", "digit-cnn"), lams=(1.0, 25.0),
                attention_dims=(16, 64), maxpool_weight_decays=(1e-4, 1e-3), val_fraction=0.25, bag_size=10,
                seeds=(0,), threads=1, mnist=digits_dir)


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_every_method_is_scored_on_the_same_bags_and_reproducible_by_seed(small_digits):
    config = BagBenchConfig(epoch_grid=(2,), lrs=(1e-3,), encoders=("digit-cnn",), lams=(1.0,), attention_dims=(64,),
                            maxpool_weight_decays=(1e-4,), val_fraction=0.0, threads=1)
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
    cfg = mil_ssl_config(BagBenchConfig(epoch_grid=(10, 30)), train, seed=4, lam=1.0)
    assert cfg.mode == "features" and cfg.model == "digit-cnn" and cfg.epochs == 30 and cfg.lr == 1e-3
    assert cfg.mu == pytest.approx(0.2) and cfg.mu_ramp_epochs == 15 and cfg.lam == 1.0 and cfg.seed == 4
    fixed = mil_ssl_config(BagBenchConfig(epoch_grid=(30,), mu=0.15, mu_ramp_epochs=5), train, seed=0, lam=25.0,
                           encoder="mlp", lr=3e-4, epochs=10)
    assert (fixed.mu, fixed.mu_ramp_epochs, fixed.model, fixed.lam, fixed.lr, fixed.epochs) == (0.15, 5, "mlp", 25.0,
                                                                                            3e-4, 10)
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
    assert v["margin"] == pytest.approx(v["mil_ssl"] - v["abmil_logit"]) and v["met"] == (v["margin"] >= 0)
    logit = summary[("ABMIL (raw attention logit)", "0.1")]["instance_auc"]["mean"]
    assert v["abmil_logit"] == logit
    assert json.loads(json.dumps(result))["protocol"] == "normal"


def test_hard_table_reports_three_test_sets_and_the_margin(fast):
    result = run_hard(BagBenchConfig(methods=("mil-ssl", "maxpool"), **fast))
    assert {r["test"] for r in result["rows"]} == {"test-normal", "test-pos0", "test-pos8"}
    text = format_markdown(result)
    assert "Table 4 analog" in text and "| Method | Test set | Instance-level AUC | Bag-level AUC |" in text
    acc = acceptance(result)
    assert set(acc["hard"]) == {"test-pos0", "test-pos8"}
    for t, v in acc["hard"].items():
        assert v["best_baseline"] == "Max-pooling MIL" and v["met"] == (v["mil_ssl"] >= 0.95)
        assert v["shortfall"] == pytest.approx(max(0.0, 0.95 - v["mil_ssl"]))
    assert acc["met"] == all(v["met"] for v in acc["hard"].values())
    assert "Acceptance (MIL-SSL instance AUC >= 0.95 on test-pos0 and on test-pos8)" in text


def test_ablation_rows_switch_soft_labels_constraints_and_adaptive_mu(fast):
    result = run_ablation(BagBenchConfig(ablation_ratio=0.2, **{**fast, "epoch_grid": (4,)}))
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
    with pytest.raises(ConfigError, match="seeds must not repeat a value"):
        BagBenchConfig(seeds=(1, 1))
    assert BagBenchConfig().resolved_bag_size() == 20
    assert BagBenchConfig(mnist="/data/mnist_5k.csv.gz").resolved_bag_size() == 100
    with pytest.raises(ConfigError, match="unequal tuning budgets"):
        BagBenchConfig(lams=(1.0, 5.0, 25.0))
    with pytest.raises(ConfigError, match="BagBenchConfig.lams"):  # beyond the solver's cap: refused before any run
        BagBenchConfig(lams=(1.0, 1e7))
    with pytest.raises(ConfigError, match="several candidates but val_fraction is 0"):
        BagBenchConfig(val_fraction=0.0, lams=(1.0,), attention_dims=(64,), maxpool_weight_decays=(1e-4,))
    # a method left out does not count: MIL-SSL alone may have any number of λ
    assert BagBenchConfig(methods=("mil-ssl",), lams=(1.0, 5.0, 25.0)).candidates("mil-ssl")[-1] == {
        "lr": 3e-4, "encoder": "mlp", "lam": 25.0}


def test_cli_prints_tables_and_writes_json(tmp_path, capsys, digits_dir):
    out = tmp_path / "hard.json"
    md = tmp_path / "hard.md"
    code = main(["benchmark", "bags", "--protocol", "hard", "--seeds", "0", "--epochs", "1", "2", "--bag-size", "10",
                 "--mnist", digits_dir, "--methods", "mil-ssl", "abmil", "--encoders", "mlp", "--lr", "1e-3",
                 "--lam", "1", "--attention-dims", "32", "--json", str(out), "--markdown", str(md),
                 "--plot", str(tmp_path / "hard.png")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Table 4 analog" in printed and "ABMIL (raw attention logit)" in printed
    assert "Settings chosen on validation bags" in printed
    data = json.loads(out.read_text())
    assert data["protocol"] == "hard" and data["config"]["epoch_grid"] == [1, 2] and len(data["rows"]) == 9
    assert {r["chosen"]["epochs"] for r in data["rows"]} <= {1, 2}
    assert md.read_text().startswith("Images: MNIST IDX")
    with Image.open(tmp_path / "hard.png") as png:
        assert png.format == "PNG" and png.width > 300


def test_the_help_example_of_the_ablation_is_accepted(capsys):
    """Review CD: `--ablation --val-fraction 0` (the help's own example) was refused, since the default grids held
    several candidates; the ablation trains the first value of each, untuned."""
    assert main(["benchmark", "bags", "--ablation", "--ablation-ratio", "0.05", "--val-fraction", "0", "--encoders",
                 "mlp", "--lr", "1e-3", "--show-bags"]) == 0
    assert "hold several candidates" not in capsys.readouterr().err


def test_the_ablation_gets_the_settings_it_is_given(monkeypatch, capsys, tmp_path):
    """Review CF: trimming every setting to its first value for --ablation (review CD's first fix) trained the first
    epoch count instead of the largest, and refused a plain `--ablation` (unequal tuning budgets)."""
    from wsi_milssl.benchmark import bags

    seen = []

    class Stop(Exception):
        pass

    def capture(config, progress=None):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(bags, "run_ablation", capture)
    monkeypatch.chdir(tmp_path)  # where the result file would go
    for argv in (["--epochs", "10", "20", "40"], ["--epochs", "10", "20", "40", "--val-fraction", "0"], []):
        with pytest.raises(Stop):
            main(["benchmark", "bags", "--ablation", *argv])
    assert [c.epoch_grid for c in seen[:2]] == [(10, 20, 40), (10, 20, 40)]
    assert seen[2].epoch_grid == BagBenchConfig().epoch_grid and seen[2].lams == BagBenchConfig().lams


def test_an_acceptance_line_without_the_methods_it_compares_says_so(fast):
    """Review CD: with --methods mil-ssl alone the normal protocol's acceptance line read "NOT met"."""
    result = run_normal(BagBenchConfig(methods=("mil-ssl",), ratios=(0.5,), **fast))
    assert acceptance(result)["met"] is None
    assert ("Acceptance (MIL-SSL instance AUC >= ABMIL's raw attention logit at every ratio): not assessed (needs "
            "MIL-SSL and ABMIL in --methods)") in format_markdown(result)


def test_cli_rejects_the_ablation_on_the_hard_protocol(capsys):
    assert main(["benchmark", "bags", "--ablation", "--protocol", "hard"]) == 2  # a usage error
    assert "--ablation runs on the normal protocol" in capsys.readouterr().err
    assert main(["benchmark", "bags", "--ablation", "--plot", "x.png"]) == 2
    assert "the ablation is one table" in capsys.readouterr().err


def test_cli_checks_its_outputs_before_the_run(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert main(["benchmark", "bags", "--json", str(tmp_path / "b.json"),
                 "--markdown", str(tmp_path / "a_file" / "b.md")]) == 1
    captured = capsys.readouterr()
    assert "a_file/b.md: cannot write this file" in captured.err and "Table" not in captured.out
    assert not (tmp_path / "b.json").exists()


def _pixels_near(png: bytes, hex_colour: str) -> int:
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    target = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb - target).sum(axis=2) < 30).sum())


def test_digit_bags_png_keeps_a_colour_per_method_and_shows_every_value():
    from wsi_milssl.benchmark.plots import digit_bags_figure, digit_bags_png

    def row(method, scoring, label, primary, ratio, seed, auc):
        return {"method": method, "scoring": scoring, "label": label, "bag_label": method, "primary": primary,
                "ratio": ratio, "test": "test", "seed": seed, "instance_auc": auc, "bag_auc": auc}

    rows = [row("mil-ssl", "probability", "MIL-SSL", True, r, s, 0.9 + 0.01 * s) for r in (0.1, 0.5) for s in (0, 1)]
    rows += [row("abmil", "attention", "ABMIL (softmax)", False, r, s, 0.6) for r in (0.1, 0.5) for s in (0, 1)]
    rows += [row("abmil", "attention_logit", "ABMIL (logit)", True, r, s, 0.05) for r in (0.1, 0.5) for s in (0, 1)]
    png = digit_bags_png({"protocol": "normal", "rows": rows})
    assert _pixels_near(png, "#1f77b4") > 50 and _pixels_near(png, "#ff7f0e") > 50  # C0 MIL-SSL, C1 ABMIL
    assert _pixels_near(png, "#2ca02c") == 0  # no third method
    # ABMIL's logit series at 0.05 is inside the axes: the shared y axis reaches below chance level for it
    figure = digit_bags_figure({"protocol": "normal", "rows": rows})
    bottom, top = figure.axes[0].get_ylim()
    assert bottom < 0.05 and top == pytest.approx(1.03) and figure.axes[1].get_ylim() == (bottom, top)
    ticks = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert ticks == ["10%", "50%"]
    hard = [{**r, "test": f"test-{r['ratio']}", "ratio": None} for r in rows]
    assert _pixels_near(digit_bags_png({"protocol": "hard", "rows": hard}), "#1f77b4") > 20
    with pytest.raises(ConfigError, match="no rows"):
        digit_bags_png({"protocol": "normal", "rows": []})
    with pytest.raises(ConfigError, match="normal or hard protocol"):
        digit_bags_png({"protocol": "ablation", "rows": rows})


@pytest.mark.slow
def test_mil_ssl_beats_abmil_on_instances_at_a_high_ratio():
    """Default settings at 70 %: bag classifiers need only a few 9s; MIL-SSL learns them all."""
    result = run_normal(BagBenchConfig(ratios=(0.7,), seeds=(0, 1), methods=("mil-ssl", "abmil"), encoders=("digit-cnn",),
                                       lrs=(1e-3,), epoch_grid=(50, 100)))
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


# ----------------------------------------------------------------------------------------------
# Tuning on validation bags with an equal budget
# ----------------------------------------------------------------------------------------------

def _tuned_bags(small_digits, seed=0):
    from wsi_milssl.benchmark.digits import normal_bags

    return normal_bags(small_digits, ratio=0.2, bag_size=10, seed=seed, val_fraction=0.25)


def test_validation_bags_come_from_training_images_only(small_digits):
    bags = _tuned_bags(small_digits)
    assert set(bags) == {"train", "val", "test"}
    used = {k: set(b.image_index.tolist()) for k, b in bags.items()}
    assert not used["val"] & used["train"] and not used["val"] & used["test"] and not used["train"] & used["test"]
    # the test bags are those of the untuned protocol: tuning does not change what is scored
    _, test = normal_protocol(small_digits, ratio=0.2, bag_size=10, seed=0)
    assert np.array_equal(test.image_index, bags["test"].image_index)


def test_every_method_gets_the_same_budget_and_rows_report_their_choice(small_digits, tuned):
    config = BagBenchConfig(**{k: v for k, v in tuned.items() if k != "mnist"})
    rows = run_tuned(config, _tuned_bags(small_digits), seed=0)
    assert {r["candidates"] for r in rows} == {4}  # 1 lr x 2 encoders x 2 values of the method's own axis
    by = {r["label"]: r for r in rows}
    assert set(by["MIL-SSL"]["chosen"]) == {"lr", "encoder", "lam", "epochs"}
    assert set(by["ABMIL (raw attention logit)"]["chosen"]) == {"lr", "encoder", "attention_dim", "epochs"}
    assert set(by["Max-pooling MIL"]["chosen"]) == {"lr", "encoder", "weight_decay", "epochs"}
    for r in rows:
        assert r["chosen"]["epochs"] in (1, 3) and r["test"] == "test"
        assert r["primary"] == (r["scoring"] in ("probability", "attention_logit", "instance_prob"))


def test_the_choice_never_reads_the_test_bags(small_digits, tuned):
    """Shuffling the test bags' instance and bag labels changes the test scores, never the choice."""
    import dataclasses

    config = BagBenchConfig(**{k: v for k, v in tuned.items() if k != "mnist"})
    bags = _tuned_bags(small_digits)
    rng = np.random.default_rng(0)
    scrambled = dataclasses.replace(bags["test"], instance_labels=rng.permutation(bags["test"].instance_labels),
                                    bag_labels=rng.permutation(bags["test"].bag_labels))
    a = run_tuned(config, bags, seed=0, methods=("mil-ssl", "abmil"))
    b = run_tuned(config, {**bags, "test": scrambled}, seed=0, methods=("mil-ssl", "abmil"))
    assert [r["chosen"] for r in a] == [r["chosen"] for r in b]
    assert [r["val_instance_auc"] for r in a] == [r["val_instance_auc"] for r in b]
    assert [r["instance_auc"] for r in a] != [r["instance_auc"] for r in b]


def test_choose_takes_the_best_validation_score_and_keeps_the_earlier_on_ties():
    def run(val_aucs, test_auc=0.5):
        return {"scores": {e: {"val": {"instance_auc": {"s": v}, "bag_auc": 0.5, "bag_nll": 0.7},
                               "test": {"instance_auc": {"s": test_auc}, "bag_auc": 1.0, "bag_nll": 0.1}}
                           for e, v in val_aucs.items()}}

    runs = [({"c": 0}, run({5: 0.80, 10: 0.90}, test_auc=1.0)), ({"c": 1}, run({5: 0.95, 10: 0.90})),
            ({"c": 2}, run({5: 0.95, 10: 0.70}))]
    assert choose(runs, "s", "instance_auc") == (1, 5)
    runs[2][1]["scores"][5]["val"]["bag_auc"] = 0.9  # bag AUC breaks an instance-AUC tie
    assert choose(runs, "s", "instance_auc") == (2, 5)
    assert choose(runs, "s", "bag_auc") == (2, 5)


def test_an_epoch_snapshot_equals_a_run_of_that_many_epochs(small_digits, tuned):
    """Epoch counts are scored as snapshots of one run; each equals a separate shorter run."""
    from wsi_milssl.benchmark.bags import train_and_score

    config = BagBenchConfig(**{k: v for k, v in tuned.items() if k != "mnist"})
    bags = _tuned_bags(small_digits)
    train = digit_instance_set(bags["train"])
    evals = {"val": digit_instance_set(bags["val"])}
    for method, settings in (("mil-ssl", {"lr": 1e-3, "encoder": "mlp", "lam": 1.0}),
                             ("gated-abmil", {"lr": 1e-3, "encoder": "mlp", "attention_dim": 16})):
        kw = dict(seed=0, settings=settings, bag_size=10, mu=0.2)
        long = train_and_score(config, method, train, evals, eval_at=(1, 3), **kw)
        short = train_and_score(config, method, train, evals, eval_at=(1,), **kw)
        assert set(long["scores"]) == {1, 3}
        assert long["scores"][1] == short["scores"][1], method
        assert long["scores"][1] != long["scores"][3]


def test_tuned_tables_show_choices_and_bag_auc_of_the_primary_scoring(tuned):
    result = run_normal(BagBenchConfig(ratios=(0.2,), methods=("mil-ssl", "abmil"), **tuned))
    text = format_markdown(result)
    assert "every method tuned with the same budget on validation bags" in text
    assert "| bags (train : validation : test) |" in text
    assert "Settings chosen on validation bags" in text and "- MIL-SSL: lr 0.001 x1; encoder " in text
    logit = next(r for r in result["rows"] if r["scoring"] == "attention_logit")
    table3 = text.split("Table 3 analog")[1].split("Acceptance")[0]
    assert f"| ABMIL | {logit['bag_auc']:.4f}" in table3.replace("**", "")


def test_bench_script_merges_runs_of_other_seeds(fast):
    """benchmarks/bench_bags.py --from-json pools the rows of runs made with other seeds (same settings)."""
    from benchscripts import load_benchmark_script

    bench = load_benchmark_script("bench_bags")
    cfg = dict(fast, methods=("abmil",), ratios=(0.2,))
    a = run_normal(BagBenchConfig(**cfg))
    b = run_normal(BagBenchConfig(**{**cfg, "seeds": (1,)}))
    merged = bench._merge(a, b)
    assert merged["config"]["seeds"] == [0, 1] and len(merged["rows"]) == len(a["rows"]) * 2
    assert summarise(merged)[("ABMIL (softmax attention)", "0.2")]["instance_auc"]["n"] == 2
    with pytest.raises(ConfigError, match="seeds repeat"):
        bench._merge(a, a)


def test_bench_script_writes_table_json_and_a_figure_per_protocol(fast, tmp_path):
    from benchscripts import load_benchmark_script

    bench = load_benchmark_script("bench_bags")
    normal = run_normal(BagBenchConfig(**dict(fast, methods=("abmil",), ratios=(0.2,))))
    bench._write_all(tmp_path / "bags.md", {"machine": "test", "normal": normal})
    assert "## Normal bags" in (tmp_path / "bags.md").read_text()
    assert json.loads((tmp_path / "bags.json").read_text())["normal"]["rows"] == normal["rows"]
    with Image.open(tmp_path / "bags_normal.png") as png:
        assert png.format == "PNG"
    assert not (tmp_path / "bags_hard.png").exists()
    assert not list(tmp_path.glob(".*.tmp"))
