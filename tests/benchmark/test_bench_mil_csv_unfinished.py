"""benchmarks/bench_mil_csv.py and mil_csv_seeds.py run as commands (subprocesses) on tiny generated MIL
CSVs: a run killed after its first of two data sets leaves a table whose first line says INCOMPLETE, a
JSON that records the data sets requested and done, and a PNG with a banner; --from-json warns naming such
a file (and the merge with the missing data set is complete again), mil_csv_seeds.py refuses it; the
committed JSON (of an earlier version, no such record) still re-renders byte for byte; a subset run, or
--from-json, without --out is refused instead of replacing benchmarks/results/; --data defaults to mil_csv
and a missing file names --data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchscripts import BENCHMARKS, kill_when, one_error_line
from milcsv import make_mil_csv
from PIL import Image

RESULTS = BENCHMARKS / "results"
TINY = ["--methods", "maxpool", "--folds", "3", "--inner-folds", "2", "--lr-grid", "1e-3", "--threads", "1"]


def _script(name: str, *args: str, cwd: Path, check_rc: int | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "MIL_CSV_DIR"})
    if check_rc is not None:
        assert done.returncode == check_rc, done.stderr
    return done


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The outputs of a run of musk1 (12 bags, seconds) then musk2 (150 bags, ~8 s), killed as soon as the
    first data set's files appear: k.md, k.json, k.png; the data in d/."""
    root = tmp_path_factory.mktemp("killed")
    (root / "d").mkdir()
    make_mil_csv(root / "d" / "musk1.csv", dim=5, n_bags=12)
    make_mil_csv(root / "d" / "musk2.csv", dim=5, n_bags=150, seed=3)
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "bench_mil_csv.py"), "--data", "d", "--datasets",
                             "musk1", "musk2", *TINY, "--epoch-grid", "1", "20", "--out", "k.md"], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    kill_when(proc, lambda: (root / "k.png").exists(), timeout_s=60)
    assert (root / "k.png").exists(), proc.stderr.read().decode()
    return root


def test_a_killed_run_says_it_is_incomplete_in_table_json_and_png(killed):
    text = (killed / "k.md").read_text()
    assert text.splitlines()[0].startswith("INCOMPLETE: 1 of 2 data sets done (musk1); missing musk2"), text[:300]
    meta = json.loads((killed / "k.json").read_text())["meta"]
    assert meta["datasets_requested"] == ["musk1", "musk2"] and meta["datasets_done"] == ["musk1"]
    with Image.open(killed / "k.png") as png:
        top = png.convert("RGB").getpixel((2, 2))
    assert top[0] > 150 and top[1] < 60, top  # the red banner


def test_from_json_warns_naming_an_unfinished_run_and_completes_with_the_missing_data_set(killed):
    """k.json merged with a run of the missing data set: a warning naming k.json, and a complete table."""
    _script("bench_mil_csv", "--data", "d", "--datasets", "musk2", *TINY, "--epoch-grid", "1", "20",
            "--out", "rest.md", cwd=killed, check_rc=0)
    done = _script("bench_mil_csv", "--from-json", "k.json", "rest.json", "--out", "re/all.md", cwd=killed, check_rc=0)
    assert "warning: k.json: its run did not finish (1 of 2 data sets done; missing musk2)" in done.stderr
    text = (killed / "re" / "all.md").read_text()
    assert not text.startswith("INCOMPLETE") and "| MUSK2 |" in text and "| MUSK1 |" in text
    assert json.loads((killed / "re" / "all.json").read_text())["meta"]["datasets_done"] == ["musk1", "musk2"]


def test_from_json_of_an_unfinished_run_alone_is_marked_incomplete(killed):
    done = _script("bench_mil_csv", "--from-json", "k.json", "--out", "re1/one.md", cwd=killed, check_rc=0)
    assert "warning: k.json: its run did not finish" in done.stderr
    assert (killed / "re1" / "one.md").read_text().startswith("INCOMPLETE: 1 of 2 data sets done (musk1)")


def test_seed_table_refuses_an_unfinished_run(killed):
    done = _script("mil_csv_seeds", "k.json", cwd=killed)
    err = one_error_line(done)
    assert err.startswith("error: k.json: its run did not finish (1 of 2 data sets done; missing musk2)"), err


@pytest.mark.parametrize("args, option", [
    (["--datasets", "musk1"], "--datasets"),
    (["--folds", "3"], "--folds"),
    (["--methods", "abmil"], "--methods"),
    (["--from-json", str(RESULTS / "mil_csv.json")], "--from-json"),
])
def test_a_subset_run_without_out_is_refused_not_written_over_the_results(tmp_path, args, option):
    before = {p: p.stat().st_mtime_ns for p in RESULTS.glob("mil_csv.*")}
    err = one_error_line(_script("bench_mil_csv", "--data", str(tmp_path), *args, cwd=tmp_path))
    assert err.startswith(f"error: {option}: not the full default run") and "give --out FILE.md" in err, err
    assert {p: p.stat().st_mtime_ns for p in RESULTS.glob("mil_csv.*")} == before


def test_data_defaults_to_mil_csv_and_a_missing_file_names_data(tmp_path):
    helped = _script("bench_mil_csv", "--help", cwd=tmp_path, check_rc=0).stdout
    assert "(default: mil_csv)" in " ".join(helped.split()) and "/work/data16" not in helped
    err = one_error_line(_script("bench_mil_csv", "--datasets", "musk1", "--out", "x.md", cwd=tmp_path))
    assert err.startswith("error: mil_csv/musk1.csv: MIL CSV not found (--data mil_csv") and "give --data" in err


def test_out_naming_a_json_is_refused(tmp_path):
    err = one_error_line(_script("bench_mil_csv", "--from-json", str(RESULTS / "mil_csv.json"), "--out", "x.json",
                                  cwd=tmp_path))
    assert "--out x.json: the markdown table, not its JSON" in err


def test_committed_results_of_an_earlier_version_re_render_byte_for_byte(tmp_path):
    _script("bench_mil_csv", "--from-json", str(RESULTS / "mil_csv.json"), "--out", "m.md", cwd=tmp_path, check_rc=0)
    assert (tmp_path / "m.md").read_bytes() == (RESULTS / "mil_csv.md").read_bytes()
    assert (tmp_path / "m.json").read_bytes() == (RESULTS / "mil_csv.json").read_bytes()


def test_a_run_killed_before_its_first_data_set_leaves_no_earlier_run_looking_like_its_own(tmp_path):
    """Review EI, A1: files were written only when a data set finished, so a run killed during its first left an
    earlier run's table, JSON and PNG at --out, looking finished."""
    (tmp_path / "d").mkdir()
    make_mil_csv(tmp_path / "d" / "musk2.csv", dim=5, n_bags=150, seed=3)
    (tmp_path / "k.md").write_text("# an earlier run's table\n")
    (tmp_path / "k.png").write_bytes(b"an earlier run's figure")
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "bench_mil_csv.py"), "--data", "d", "--datasets",
                             "musk2", *TINY, "--epoch-grid", "1", "20", "--out", "k.md"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    kill_when(proc, lambda: (tmp_path / "k.md").read_text().startswith("INCOMPLETE"), timeout_s=60)
    assert (tmp_path / "k.md").read_text().startswith("INCOMPLETE: 0 of 1 data sets done (none)")
    assert json.loads((tmp_path / "k.json").read_text())["meta"]["datasets_done"] == []
    assert not (tmp_path / "k.png").exists()
