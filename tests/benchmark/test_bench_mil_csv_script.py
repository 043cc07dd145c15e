"""benchmarks/bench_mil_csv.py run end to end on tiny generated MIL CSVs (3 x 2 folds, one epoch, one
learning rate): --from-json merges only runs of one seed and selection metric whose shared data sets come
from one data file under one protocol; ``mil-ssl`` is shown as the improved preset's row; every data set is
read and checked before any training; bad inputs are one line and exit 2; an output never replaces an input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from benchscripts import load_benchmark_script
from milcsv import make_mil_csv
from PIL import Image

TINY = ["--folds", "3", "--inner-folds", "2", "--epoch-grid", "1", "--lr-grid", "1e-3"]


@pytest.fixture(scope="module")
def script():
    return load_benchmark_script("bench_mil_csv")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """d5/ and d50/ each hold a musk1.csv (24 bags of 5 and 50 features); d5/ also a musk2.csv (12 bags)."""
    root = tmp_path_factory.mktemp("bench_mil_csv")
    (root / "d5").mkdir()
    (root / "d50").mkdir()
    make_mil_csv(root / "d5" / "musk1.csv", dim=5, n_bags=24)
    make_mil_csv(root / "d50" / "musk1.csv", dim=50, n_bags=24)
    make_mil_csv(root / "d5" / "musk2.csv", dim=5, n_bags=12, seed=3)
    return root


def _run(script, data: Path, out: Path, folder: str, *args: str) -> Path:
    assert script.main(["--data", str(data / folder), "--out", str(out), *args]) == 0
    return out.with_suffix(".json")


@pytest.fixture(scope="module")
def runs(script, data, tmp_path_factory) -> dict[str, Path]:
    """Saved runs: maxpool on d5's musk1 (a); abmil on d50's musk1 (other_file), on d5's musk1 with
    --select accuracy, --seed 1, without the --lr-grid override (other_grid) and as run a's protocol
    (same); abmil on d5's musk2 with 2 x 2 folds and no --lr-grid (musk2)."""
    out = tmp_path_factory.mktemp("runs")
    one = ["--datasets", "musk1"]
    return {
        "a": _run(script, data, out / "a.md", "d5", *one, "--methods", "maxpool", *TINY),
        "other_file": _run(script, data, out / "other_file.md", "d50", *one, "--methods", "abmil", *TINY),
        "select": _run(script, data, out / "select.md", "d5", *one, "--methods", "abmil", *TINY,
                       "--select", "accuracy"),
        "seed": _run(script, data, out / "seed.md", "d5", *one, "--methods", "abmil", *TINY, "--seed", "1"),
        "other_grid": _run(script, data, out / "other_grid.md", "d5", *one, "--methods", "abmil", *TINY[:-2]),
        "same": _run(script, data, out / "same.md", "d5", *one, "--methods", "abmil", *TINY),
        "musk2": _run(script, data, out / "musk2.md", "d5", "--datasets", "musk2", "--methods", "abmil",
                      "--folds", "2", "--inner-folds", "2", "--epoch-grid", "1"),
    }


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("other, message", [
    ("other_file", r"cannot merge .*other_file\.json into .*a\.json: musk1 differs in source_bytes .*n_features "
                   r"\(5 vs 50\); a data set's runs must share its file and protocol"),
    ("select", r"cannot merge .*select\.json into .*a\.json: the selection metric differs \(auc vs accuracy\)"),
    ("seed", r"cannot merge .*seed\.json into .*a\.json: the seed differs \(0 vs 1\)"),
    ("other_grid", r"musk1 differs in lr_grid \(\[0\.001\] vs None\)"),
])
def test_from_json_refuses_runs_of_another_file_or_protocol(script, runs, tmp_path, capsys, other, message):
    """Were merged into one table whose header states the first file's seed and selection metric, a MUSK1
    row of a 5-feature file beside one of a 50-feature file."""
    out = tmp_path / "m.md"
    assert script.main(["--from-json", str(runs["a"]), str(runs[other]), "--out", str(out)]) == 2
    assert re.search(message, _error(capsys))
    assert not out.exists() and not out.with_suffix(".json").exists()


def test_from_json_joins_runs_of_one_protocol_and_data_sets_of_their_own(script, runs, tmp_path, capsys):
    out = tmp_path / "m.md"
    assert script.main(["--from-json", str(runs["a"]), str(runs["same"]), str(runs["musk2"]),
                        "--out", str(out)]) == 0
    merged = json.loads(out.with_suffix(".json").read_text())
    assert set(merged["datasets"]["musk1"]["methods"]) == {"maxpool", "abmil"}
    text = out.read_text()
    assert "| MUSK1 | 3 x 2 |" in text and "| MUSK2 | 2 x 2 |" in text  # each data set's own protocol
    # a file of an earlier version lacks the file's size and SHA-256 (and the protocol): it matches anything
    old = json.loads(runs["same"].read_text())
    for key in ("source_bytes", "source_sha256", "benchmark"):
        del old["datasets"]["musk1"][key]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert script.main(["--from-json", str(runs["a"]), str(tmp_path / "old.json"), "--out", str(out)]) == 0


def test_an_earlier_versions_file_first_does_not_let_two_other_files_merge(script, runs, tmp_path, capsys):
    """A key a run lacks matches anything, but was matched only against the first file: with a file of an
    earlier version first (no size, SHA-256, counts or protocol), runs of a 5-feature and a 50-feature file
    merged into one row, while the same two alone were refused. Every file is compared with every earlier
    one now, and the merged file records what the later ones did, for a later merge."""
    old = json.loads(runs["a"].read_text())
    for key in ("source_bytes", "source_sha256", "n_bags", "n_positive_bags", "n_instances", "n_features",
                "benchmark"):
        del old["datasets"]["musk1"][key]
    (tmp_path / "old.json").write_text(json.dumps(old))
    out = tmp_path / "m.md"
    for first in ([], [str(tmp_path / "old.json")]):
        assert script.main(["--from-json", *first, str(runs["same"]), str(runs["other_file"]),
                            "--out", str(out)]) == 2
        assert re.search(r"cannot merge .*other_file\.json into .*same\.json: musk1 differs in source_bytes .*"
                         r"n_features \(5 vs 50\)", _error(capsys))
        assert not out.exists()
    assert script.main(["--from-json", str(tmp_path / "old.json"), str(runs["same"]), "--out", str(out)]) == 0
    same = json.loads(runs["same"].read_text())["datasets"]["musk1"]
    merged = json.loads(out.with_suffix(".json").read_text())["datasets"]["musk1"]
    assert (merged["source_sha256"], merged["n_features"]) == (same["source_sha256"], 5)
    assert merged["benchmark"]["folds"] == 3
    assert script.main(["--from-json", str(out.with_suffix(".json")), str(runs["other_file"]),
                        "--out", str(tmp_path / "m2.md")]) == 2
    assert re.search(r"cannot merge .*other_file\.json into .*m\.json: musk1 differs in source_bytes", _error(capsys))


def test_mil_ssl_is_the_improved_presets_row(script, data, tmp_path, capsys):
    """``--methods mil-ssl`` ran as "mil-ssl (improved)" while the table looked for "mil-ssl": every cell
    was "—", and alone it made the PNG raise "nothing to plot" after the first data set."""
    out = tmp_path / "s.md"
    assert script.main(["--data", str(data / "d5"), "--datasets", "musk1", "musk2", "--methods", "mil-ssl",
                        *TINY, "--out", str(out)]) == 0
    assert "mil-ssl is run as mil-ssl-improved" in capsys.readouterr().out
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["meta"]["methods"] == ["mil-ssl-improved"] and set(result["datasets"]) == {"musk1", "musk2"}
    rows = [line for line in out.read_text().split("## Bag AUC")[0].splitlines() if line.startswith("| MUSK")]
    assert len(rows) == 2 and all("—" not in row.split(" | ", 2)[2] for row in rows), rows
    with Image.open(out.with_suffix(".png")) as png:
        assert png.format == "PNG"
    assert script.main(["--data", str(data / "d5"), "--methods", "mil-ssl", "mil-ssl-improved", "--out",
                        str(tmp_path / "twice.md")]) == 2
    assert "'mil-ssl' is 'mil-ssl-improved' (the improved preset), and both are listed" in _error(capsys)


@pytest.mark.parametrize("datasets, args, message", [
    (["musk1", "elephant"], [], r"elephant\.csv: MIL CSV not found"),
    (["musk1", "musk2"], ["--folds", "8"], r"musk2\.csv: only 6 negative bags for 8 outer folds"),
])
def test_every_data_set_is_checked_before_any_training(script, data, tmp_path, capsys, datasets, args, message):
    """MUSK1 was trained (and its table, JSON and PNG written, looking finished) before a missing or too
    small later data set stopped the run with a traceback."""
    out = tmp_path / "e.md"
    folds = args or ["--folds", "3"]
    assert script.main(["--data", str(data / "d5"), "--datasets", *datasets, "--methods", "maxpool", *TINY[2:],
                        "--inner-folds", "2", *folds, "--out", str(out)]) == 2
    assert re.search(message, _error(capsys))
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_are_one_line_and_exit_2(script, data, runs, tmp_path, capsys):
    cut = tmp_path / "cut.json"
    cut.write_text(runs["a"].read_text()[:100])
    cli = tmp_path / "cli.json"
    cli.write_text(json.dumps(json.loads(runs["a"].read_text())["datasets"]["musk1"]))  # the CLI's layout
    out = str(tmp_path / "x.md")
    cases = [(["--from-json", str(cut), "--out", out], "cut.json: not complete JSON"),
             (["--from-json", str(cli), "--out", out], "cli.json: a result of `wsi-milssl benchmark mil-csv --json`"),
             (["--from-json", str(tmp_path / "gone.json"), "--out", out], "gone.json: not found"),
             (["--data", str(data / "d5"), "--methods", "foo", "--out", out], "unknown benchmark method 'foo'"),
             (["--data", str(data / "d5"), "--folds", "1", "--out", out], "error: --folds must satisfy 2 <= value")]
    for argv, message in cases:
        assert script.main(argv) == 2, argv
        assert message in _error(capsys)
    assert not (tmp_path / "x.md").exists()


def test_outputs_never_replace_an_input(script, runs, tmp_path, capsys):
    """``--from-json r1c.json r2.json --out r1c.md`` wrote the merged JSON over its input r1c.json."""
    r1c = tmp_path / "r1c.json"
    r1c.write_bytes(runs["a"].read_bytes())
    assert script.main(["--from-json", str(r1c), str(runs["same"]), "--out", str(tmp_path / "r1c.md")]) == 2
    assert "--out (its .json) names the same file as the input --from-json" in _error(capsys)
    assert r1c.read_bytes() == runs["a"].read_bytes() and not (tmp_path / "r1c.md").exists()


def test_a_grid_override_no_method_searches_does_not_part_two_runs(script, data, runs, tmp_path, capsys):
    """--ramp-grid replaces the paper preset's T grid alone: a run of ABMIL given it (as the development
    table's first runs were) is ABMIL's run all the same, and merges with a run without it; an --lr-grid
    that a method searches still parts them (test above)."""
    ramp = _run(script, data, tmp_path / "ramp.md", "d5", "--datasets", "musk1", "--methods", "abmil", *TINY,
                "--ramp-grid", "5")
    out = tmp_path / "m.md"
    assert script.main(["--from-json", str(runs["a"]), str(ramp), "--out", str(out)]) == 0, capsys.readouterr().err
    assert set(json.loads(out.with_suffix(".json").read_text())["datasets"]["musk1"]["methods"]) == {"maxpool", "abmil"}
