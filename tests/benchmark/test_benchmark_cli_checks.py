"""The benchmark commands refuse, before any work, outputs that name an input or each other; the fold-count
error says what fixes it; a bad --hard-ratio is reported under its own name. Tiny generated files only."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.benchmark import mil_csv as mc
from wsi_milssl.cli import main
from wsi_milssl.errors import ConfigError

TINY = ["--folds", "2", "--inner-folds", "2", "--methods", "maxpool", "--epoch-grid", "1"]


def _mil_csv(path: Path, labels: list[int]) -> Path:
    rng = np.random.default_rng(0)
    rows = [f"{y},bag{b},{rng.normal(y):.3f},{rng.normal():.3f}" for b, y in enumerate(labels) for _ in range(2)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("outputs, message", [
    (["--json", "{in}"], "--json names the same file as the input FILE"),
    (["--json", "r.json", "--markdown", "{in}"], "--markdown names the same file as the input FILE"),
    (["--json", "r.json", "--markdown", "sub/../r.json"], "--markdown names the same file as --json"),
    (["--json", "r.json", "--plot", "link.csv"], "--plot names the same file as the input FILE"),
])
def test_mil_csv_refuses_an_output_on_an_input_or_another_output(tmp_path, monkeypatch, capsys, outputs, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    data = _mil_csv(tmp_path / "bags.csv", [0, 1] * 4)
    (tmp_path / "link.csv").symlink_to(data)
    before = data.read_bytes()
    args = [a.replace("{in}", "bags.csv") for a in outputs]
    assert main(["benchmark", "mil-csv", "bags.csv", *args, *TINY]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("error:") == 1 and "bags" not in captured.out
    assert data.read_bytes() == before and not (tmp_path / "r.json").exists()


def test_bags_refuses_an_output_on_the_mnist_file_or_another_output(tmp_path, capsys):
    mnist = tmp_path / "mnist.csv"
    mnist.write_text("not read\n")
    assert main(["benchmark", "bags", "--mnist", str(mnist), "--markdown", str(mnist)]) == 1
    assert "--markdown names the same file as the input --mnist" in capsys.readouterr().err
    assert mnist.read_text() == "not read\n"
    out = tmp_path / "r.json"
    assert main(["benchmark", "bags", "--mnist", str(mnist), "--json", str(out), "--plot", str(out)]) == 1
    assert "--plot names the same file as --json" in capsys.readouterr().err and not out.exists()


def test_bags_reports_a_bad_hard_ratio_under_its_own_name(capsys):
    assert main(["benchmark", "bags", "--hard-ratio", "-1"]) == 2  # a usage error
    err = capsys.readouterr().err
    assert "--hard-ratio" in err and "--ratios" not in err
    assert main(["benchmark", "bags", "--ablation-ratio", "1.5"]) == 2
    assert "--ablation-ratio" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lr", "0"], "error: --lr must satisfy 0.0 < value; got 0.0."),
    (["--bag-size", "1"], "error: --bag-size must satisfy 2 <= value; got 1."),
    (["--hard-ratio", "-1"], "error: --hard-ratio must satisfy"),
])
def test_bags_names_a_bad_value_by_its_option(capsys, argv, message):
    """Review CD: "BagBenchConfig.lrs must satisfy ...", a field name the command line does not show."""
    assert main(["benchmark", "bags", *argv, "--show-bags"]) == 2  # a usage error
    err = capsys.readouterr().err
    assert message in err and "BagBenchConfig." not in err


@pytest.mark.parametrize("labels, folds, inner, message", [
    ([0] * 8, 2, 2, r"one\.csv: all 8 bags are negative; the benchmark needs bags of both classes"),
    ([0] * 6 + [1] * 2, 2, 2, r"only 2 positive bag\(s\); nested cross-validation needs at least 3 bags of each"),
    ([0, 1] * 4, 5, 2, r"only 4 negative bags for 5 outer folds \(each fold needs one\); use --folds 4 or fewer"),
    ([0, 1] * 6, 2, 4, r"keeps as few as 3 of the 6 negative bags, too few for 4 inner folds; use --inner-folds 3"),
    ([0, 1] * 3, 2, 2, r"keeps as few as 1 of the 3 negative bags.*use more outer folds \(--folds 3"),
])
def test_the_fold_count_error_says_what_fixes_it(tmp_path, capsys, labels, folds, inner, message):
    path = _mil_csv(tmp_path / "one.csv", labels)
    args = ["--folds", str(folds), "--inner-folds", str(inner), "--methods", "maxpool", "--epoch-grid", "1",
            "--json", str(tmp_path / "r.json")]
    assert main(["benchmark", "mil-csv", str(path), *args]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert re.search(message, err), err
    assert not (tmp_path / "r.json").exists()


def test_fold_counts_that_fit_pass():
    mc._check_fold_counts(np.array([0, 1] * 3), 3, 2)  # 3 per class: 3 outer folds leave 2 to train on
    with pytest.raises(ConfigError, match="use more outer folds"):
        mc._check_fold_counts(np.array([0, 1] * 3), 2, 2)


def test_a_bad_setting_is_named_by_its_option(tmp_path, capsys):
    """Said "BenchmarkConfig.folds must satisfy ..." for --folds 1."""
    path = _mil_csv(tmp_path / "one.csv", [0, 1] * 4)
    for option, value in (("--folds", "1"), ("--inner-folds", "1"), ("--repeats", "0")):
        assert main(["benchmark", "mil-csv", str(path), *TINY, option, value, "--json", str(tmp_path / "r.json")]) == 2
        err = capsys.readouterr().err
        assert f"error: {option} must satisfy" in err and "BenchmarkConfig" not in err
    assert main(["benchmark", "mil-csv", str(path), "--methods", "mil-ssl", "mil-ssl-improved"]) == 2
    assert "'mil-ssl' is 'mil-ssl-improved' (the improved preset), and both are listed" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_repeated_folds_are_printed_with_their_repeat(tmp_path, capsys):
    """--repeats 2 printed "fold 1", "fold 2" twice, with nothing to tell the repeats apart."""
    path = _mil_csv(tmp_path / "one.csv", [0, 1] * 4)
    assert main(["benchmark", "mil-csv", str(path), *TINY, "--repeats", "2", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0].strip() for line in out.splitlines() if " fold " in line] == [
        "maxpool repeat 1 fold  1", "maxpool repeat 1 fold  2", "maxpool repeat 2 fold  1", "maxpool repeat 2 fold  2"]


def test_bags_refuses_a_setting_the_digits_cannot_fill_before_any_training(tmp_path, capsys, monkeypatch):
    """Trained every job of the 5 % ratio, then found that the 70 % ratio "cannot fill one positive bag" and
    wrote nothing."""
    from wsi_milssl.benchmark import bags

    trained = []
    real = bags.train_and_score
    monkeypatch.setattr(bags, "train_and_score", lambda *a, **k: trained.append(1) or real(*a, **k))
    out = tmp_path / "by.json"
    assert main(["benchmark", "bags", "--encoders", "mlp", "--hidden-dims", "8", "--epochs", "1", "--lr", "1e-3",
                 "--lam", "25", "--attention-dims", "8", "--maxpool-weight-decays", "1e-4", "--threads", "1",
                 "--seeds", "0", "--bag-size", "60", "--ratios", "0.05", "0.7", "--json", str(out)]) == 1
    assert trained == [] and not out.exists()
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert re.search(r"seed 0: normal-70%-val: .* cannot fill one positive bag .* Nothing was trained", err), err


def test_a_grid_value_given_twice_is_one_candidate(tmp_path, capsys):
    """Review CD: `--epoch-grid 1 1 1` showed a grid of 3 (and trained the same model three times)."""
    import json

    path = _mil_csv(tmp_path / "one.csv", [0, 1] * 4)
    argv = ["benchmark", "mil-csv", str(path), "--folds", "2", "--inner-folds", "2", "--methods", "maxpool", "maxpool"]
    assert main([*argv, "--epoch-grid", "1", "1", "1", "--json", str(tmp_path / "r.json")]) == 0
    once = json.loads((tmp_path / "r.json").read_text())
    assert main([*argv[:-1], "--epoch-grid", "1", "--json", str(tmp_path / "s.json")]) == 0
    single = json.loads((tmp_path / "s.json").read_text())
    assert once["benchmark"]["epoch_grid"] == single["benchmark"]["epoch_grid"] == [1]
    assert once["benchmark"]["methods"] == ["maxpool"] and list(once["methods"]) == ["maxpool"]
    assert once["methods"]["maxpool"]["spec"]["grid_size"] == single["methods"]["maxpool"]["spec"]["grid_size"] == 8
