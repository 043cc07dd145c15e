"""benchmarks/mil_csv_seeds.py: the per-seed table of saved bench_mil_csv runs and the differences to a
reference method, on hand-made run dicts."""

from __future__ import annotations

import json

import pytest
from benchscripts import load_benchmark_script


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
    with pytest.raises(SystemExit, match="musk1 / a / seed 3"):
        mod.collect([run, run])


def test_methods_filter_and_order_the_rows(tmp_path, capsys):
    mod = _module()
    run = _run(0, {"musk1": {"a": (0.8, 0.9), "b": (0.7, 0.8), "ref": (0.9, 0.95)}})
    (tmp_path / "s0.json").write_text(json.dumps(run))
    mod.main([str(tmp_path / "s0.json"), "--reference", "ref", "--methods", "ref", "a"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| musk1 |")]
    assert [r.split(" | ")[1] for r in rows] == ["ref", "a"]
