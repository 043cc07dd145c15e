"""benchmarks/bench_bags.py run as a command (subprocess) on scikit-learn's 8x8 digits with a tiny untuned
grid: a run killed after the first of two protocols leaves a markdown whose first line says INCOMPLETE, a
JSON that records the protocols requested and done, and no figure of an earlier run for the protocol not
done; --from-json warns naming such a file, and gives one error line naming a missing, cut-off or foreign
JSON (exit 2, nothing written); --out X.json and a subset run (or --from-json) without --out are refused
instead of replacing benchmarks/results/; the committed bags.json re-renders byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchscripts import BENCHMARKS, kill_when, one_error_line

RESULTS = BENCHMARKS / "results"
SCRIPT = str(BENCHMARKS / "bench_bags.py")
TINY = ["--seeds", "0", "--epochs", "3", "--lr", "1e-3", "--encoders", "mlp", "--lams", "1", "--attention-dims",
        "16", "--maxpool-weight-decays", "1e-4", "--val-fraction", "0", "--bag-size", "10", "--workers", "0"]


def _script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """k.md, k.json, k_hard.png of a run of the hard then the normal protocol, killed as soon as the hard
    protocol's figure appears; k_normal.png was there before, as if from an earlier run."""
    root = tmp_path_factory.mktemp("killed_bags")
    (root / "k_normal.png").write_bytes(b"an earlier run's figure")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--only", "hard", "normal", *TINY, "--out", "k.md"], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    kill_when(proc, lambda: (root / "k_hard.png").exists(), timeout_s=90)
    assert (root / "k_hard.png").exists()
    return root


def test_a_killed_run_says_it_is_incomplete_and_leaves_no_earlier_figure(killed):
    text = (killed / "k.md").read_text()
    assert text.splitlines()[0].startswith("INCOMPLETE: 1 of 2 protocols done (hard); missing normal"), text[:300]
    saved = json.loads((killed / "k.json").read_text())
    assert saved["protocols_requested"] == ["hard", "normal"] and saved["protocols_done"] == ["hard"]
    assert "normal" not in saved
    assert not (killed / "k_normal.png").exists()  # the earlier run's figure is not left beside this table


def test_from_json_warns_naming_an_unfinished_run(killed):
    done = _script("--from-json", "k.json", "--out", "re.md", cwd=killed)
    assert done.returncode == 0, done.stderr
    assert "warning: k.json: its run did not finish (1 of 2 protocols done; missing normal)" in done.stderr
    assert (killed / "re.md").read_text().startswith("INCOMPLETE: 1 of 2 protocols done (hard)")


@pytest.mark.parametrize("make, message", [
    (None, r"not found; give the \.json that benchmarks/bench_bags\.py wrote"),
    (lambda p: p.write_bytes((RESULTS / "bags.json").read_bytes()[:5000]), r"not complete JSON \(Unterminated"),
    (lambda p: p.write_text(json.dumps({"protocol": "normal", "config": {}, "rows": [], "counts": {}})),
     r"a result of `wsi-milssl benchmark bags --json` \(one protocol\)"),
    (lambda p: p.write_bytes((RESULTS / "mil_csv.json").read_bytes()), r"not a saved run of benchmarks/bench_bags\.py"),
])
def test_from_json_names_a_missing_cut_or_foreign_file_in_one_line(tmp_path, make, message):
    import re

    given = tmp_path / "given.json"
    if make:
        make(given)
    err = one_error_line(_script("--from-json", str(given), "--out", "out/b.md", cwd=tmp_path))
    assert err.startswith(f"error: {given}: ") and re.search(message, err), err
    assert not (tmp_path / "out" / "b.md").exists() and not (tmp_path / "out" / "b.json").exists()


@pytest.mark.parametrize("args, option", [
    ([], "a default run"),  # review EI: no single run makes the committed table (two runs, merged)
    (["--only", "hard"], "--only"),
    (["--seeds", "0"], "--seeds"),
    (["--from-json", str(RESULTS / "bags.json")], "--from-json"),
])
def test_a_run_without_out_is_refused_not_written_over_the_results(tmp_path, args, option):
    before = {p: p.stat().st_mtime_ns for p in RESULTS.glob("bags*")}
    err = one_error_line(_script(*args, cwd=tmp_path))
    assert err.startswith("error: --out is required: the committed ") and "give --out FILE.md" in err, err
    assert {p: p.stat().st_mtime_ns for p in RESULTS.glob("bags*")} == before


def test_out_naming_a_json_is_refused(tmp_path):
    err = one_error_line(_script("--from-json", str(RESULTS / "bags.json"), "--out", "x.json", cwd=tmp_path))
    assert "--out x.json: the markdown table, not its JSON" in err
    assert not (tmp_path / "x.json").exists()


def test_help_shows_defaults_and_says_which_option_writes_the_ablation(tmp_path):
    done = _script("--help", cwd=tmp_path)
    text = " ".join(done.stdout.split())
    assert done.returncode == 0 and "(default: ['normal', 'hard'])" in text
    assert "the ablation (table 8) is written only when asked for, with ``--only normal hard ablation" in text


def test_committed_results_of_an_earlier_version_re_render_byte_for_byte(tmp_path):
    done = _script("--from-json", str(RESULTS / "bags.json"), "--out", "b.md", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("bags.md", "bags.json", "bags_normal.png", "bags_hard.png"):
        assert (tmp_path / name.replace("bags", "b")).read_bytes() == (RESULTS / name).read_bytes(), name


def test_a_run_killed_before_its_first_protocol_leaves_no_earlier_run_looking_like_its_own(tmp_path):
    """Review EI, A1: files were written only when a protocol finished, so a run killed during its first left an
    earlier run's table, JSON and figures at --out, looking finished."""
    (tmp_path / "k.md").write_text("# an earlier run's table\n")
    (tmp_path / "k_hard.png").write_bytes(b"an earlier run's figure")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--only", "hard", *TINY, "--out", "k.md"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    kill_when(proc, lambda: (tmp_path / "k.md").read_text().startswith("INCOMPLETE"), timeout_s=90)
    text = (tmp_path / "k.md").read_text()
    assert text.startswith("INCOMPLETE: 0 of 1 protocols done (none)"), text
    assert json.loads((tmp_path / "k.json").read_text())["protocols_done"] == []
    assert not (tmp_path / "k_hard.png").exists()
