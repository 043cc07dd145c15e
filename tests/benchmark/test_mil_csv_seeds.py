"""benchmarks/mil_csv_seeds.py: the per-seed table of saved bench_mil_csv runs and the differences to a
reference method, on hand-made run dicts."""

from __future__ import annotations

import json
import re

import pytest
from benchscripts import load_benchmark_script

from wsi_milssl.errors import ConfigError


def _module():
    return load_benchmark_script("mil_csv_seeds")


def _run(seed: int, values: dict[str, dict[str, tuple[float, float]]]) -> dict:
    return {"meta": {"seed": seed}, "datasets": {
        ds: {"methods": {m: {"summary": {"accuracy": {"mean": acc}, "auc": {"mean": auc}}}
                         for m, (acc, auc) in methods.items()}}
        for ds, methods in values.items()}}


def test_seed_table_means_and_differences_to_the_reference(tmp_path):
    mod = _module()
    runs = [_run(0, {"musk1": {"a": (0.80, 0.90), "ref": (0.90, 0.95)}}),
            _run(1, {"musk1": {"a": (0.90, 0.92), "ref": (0.85, 0.91)}, "fox": {"a": (0.6, 0.7)}})]
    for i, r in enumerate(runs):
        (tmp_path / f"s{i}.json").write_text(json.dumps(r))
    out = tmp_path / "seeds.md"
    mod.main([str(tmp_path / "s0.json"), str(tmp_path / "s1.json"), "--reference", "ref", "--out", str(out)])
    lines = out.read_text().splitlines()
    row_a = next(line for line in lines if line.startswith("| musk1 | a |"))
    assert "0.800 / 0.900 | 0.900 / 0.920 | 0.850 / 0.910 |" in row_a
    assert row_a.endswith("-0.025 / -0.020 (2 seeds) |")  # ((0.80-0.90) + (0.90-0.85)) / 2
    row_ref = next(line for line in lines if line.startswith("| musk1 | ref |"))
    assert row_ref.endswith("— |")
    row_fox = next(line for line in lines if line.startswith("| fox | a |"))
    assert "| — | 0.600 / 0.700 |" in row_fox and row_fox.endswith("— |")  # no reference run for fox


def test_a_seed_given_twice_is_an_error():
    mod = _module()
    run = _run(3, {"musk1": {"a": (0.8, 0.9)}})
    with pytest.raises(ConfigError, match="musk1 / a / seed 3 is in run 1 and run 2"):
        mod.collect([run, run])


def test_methods_filter_and_order_the_rows(tmp_path, capsys):
    mod = _module()
    run = _run(0, {"musk1": {"a": (0.8, 0.9), "b": (0.7, 0.8), "ref": (0.9, 0.95)}})
    (tmp_path / "s0.json").write_text(json.dumps(run))
    mod.main([str(tmp_path / "s0.json"), "--reference", "ref", "--methods", "ref", "a"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| musk1 |")]
    assert [r.split(" | ")[1] for r in rows] == ["ref", "a"]


def _with_data(run: dict, **recorded) -> dict:
    """``run`` with every data set's result recording ``recorded`` (counts at the top, the protocol under
    "benchmark")."""
    bench = {k: recorded.pop(k) for k in ("folds", "inner_folds", "seed", "select_metric") if k in recorded}
    for res in run["datasets"].values():
        res.update(recorded)
        res["benchmark"] = bench
    return run


@pytest.mark.parametrize("change, message", [
    ({"n_features": 50},
     r"s0\.json and \S*s1\.json differ in more than the seed: musk1 differs in n_features \(5 vs 50\)"),
    ({"folds": 5}, r"musk1 differs in folds \(10 vs 5\)"),
    ({"inner_folds": 2}, r"musk1 differs in inner_folds \(3 vs 2\)"),
])
def test_runs_of_another_file_or_protocol_are_refused(tmp_path, capsys, change, message):
    """Were averaged as seeds of one run: a 5-feature and a 50-feature file, 10 and 5 outer folds."""
    mod = _module()
    base = {"n_features": 5, "n_bags": 40, "folds": 10, "inner_folds": 3}
    (tmp_path / "s0.json").write_text(json.dumps(_with_data(_run(0, {"musk1": {"a": (0.8, 0.9)}}), **base)))
    (tmp_path / "s1.json").write_text(json.dumps(_with_data(_run(1, {"musk1": {"a": (0.7, 0.8)}}),
                                                            **{**base, "seed": 1, **change})))
    assert mod.main([str(tmp_path / "s0.json"), str(tmp_path / "s1.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


def test_a_run_without_the_data_files_record_first_does_not_let_two_other_files_through(tmp_path, capsys):
    """A key a run lacks matches anything, but was matched only against the first run: an earlier version's
    run (no size, SHA-256 or counts) first let seeds of two different data files be averaged, while the
    same two alone were refused. Each run is compared with every earlier one now."""
    mod = _module()
    (tmp_path / "old.json").write_text(json.dumps(_run(0, {"musk1": {"a": (0.8, 0.9)}})))
    for seed, size, sha in ((1, 100, "b" * 64), (2, 200, "c" * 64)):
        run = _with_data(_run(seed, {"musk1": {"a": (0.7, 0.8)}}), source_bytes=size, source_sha256=sha)
        (tmp_path / f"s{seed}.json").write_text(json.dumps(run))
    for first in ([], [str(tmp_path / "old.json")]):
        assert mod.main([*first, str(tmp_path / "s1.json"), str(tmp_path / "s2.json")]) == 2
        err = capsys.readouterr().err
        assert re.search(r"s1\.json and \S*s2\.json differ in more than the seed: musk1 differs in source_bytes "
                         r"\(100 vs 200\), source_sha256 \(bbbbbbbbbbbb\.\.\. vs cccccccccccc\.\.\.\)", err), err
    assert mod.main([str(tmp_path / "old.json"), str(tmp_path / "s1.json")]) == 0


def test_the_reference_subtracts_when_its_row_is_not_shown(tmp_path, capsys):
    """--methods a with the reference ref left out filtered ref's runs out before rendering: the
    "mean − ref" column was all "—" without a word."""
    mod = _module()
    runs = [_run(0, {"musk1": {"a": (0.80, 0.90), "ref": (0.90, 0.95)}}),
            _run(1, {"musk1": {"a": (0.90, 0.92), "ref": (0.85, 0.91)}})]
    for i, r in enumerate(runs):
        (tmp_path / f"s{i}.json").write_text(json.dumps(r))
    assert mod.main([str(tmp_path / "s0.json"), str(tmp_path / "s1.json"), "--reference", "ref",
                     "--methods", "a"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| musk1 |")]
    assert len(rows) == 1 and rows[0].startswith("| musk1 | a |")
    assert rows[0].endswith("| -0.025 / -0.020 (2 seeds) |")


def test_another_selection_metric_is_refused_and_the_seed_alone_may_differ(tmp_path, capsys):
    mod = _module()
    runs = [_with_data(_run(s, {"musk1": {"a": (0.8, 0.9)}}), n_features=5, folds=5, seed=s) for s in (0, 1)]
    runs[1]["meta"]["select"], runs[0]["meta"]["select"] = "accuracy", "auc"
    with pytest.raises(ConfigError, match=r"run 1 and run 2 differ in the selection metric \(auc vs accuracy\)"):
        mod.collect(runs)
    runs[1]["meta"]["select"] = "auc"
    table = mod.collect(runs)
    # the text names the runs' own fold count (it said "the 10 outer folds" whatever the runs had)
    assert "each the mean over the 5 outer folds of one nested run" in mod.render(table, None, mod.fold_counts(runs))


def test_unknown_methods_and_other_layouts_are_one_clear_error(tmp_path, capsys):
    """--methods foo printed an empty table; the JSON of `wsi-milssl benchmark mil-csv --json` was a KeyError."""
    mod = _module()
    (tmp_path / "s0.json").write_text(json.dumps(_run(0, {"musk1": {"a": (0.8, 0.9)}})))
    assert mod.main([str(tmp_path / "s0.json"), "--methods", "a", "foo"]) == 2
    assert "foo: in none of the runs (their methods: a)" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "s0.json"), "--reference", "abmil"]) == 2
    assert "abmil: in none of the runs" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "s0.json")]) == 0  # the default reference, abmil, only where the runs hold it
    assert "mean −" not in capsys.readouterr().out
    (tmp_path / "cli.json").write_text(json.dumps({"source": "x.csv", "benchmark": {}, "methods": {}}))
    assert mod.main([str(tmp_path / "cli.json")]) == 2
    assert "cli.json: a result of `wsi-milssl benchmark mil-csv --json`" in capsys.readouterr().err
