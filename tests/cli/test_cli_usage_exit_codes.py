"""A wrong command line is a usage error, exit code 2 as argparse's own, whichever part of the command finds it
(review CX: these exited 1, as a failed run does); a run that fails on its data exits 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_milssl.cli import main


@pytest.mark.parametrize("argv, message", [
    (["prepare", "folder", "--slides", "s", "--labels", "l.csv", "--out", "o", "--test-fraction", "0"],
     "error: --test-fraction must satisfy 0 < F < 1; got 0.0."),
    (["prepare", "folder", "--slides", "s", "--labels", "l.csv", "--out", "o", "--val-fraction", "1"],
     "error: --val-fraction must satisfy 0 <= F < 1; got 1.0."),
    (["prepare", "camelyon16", "root", "--out", "o", "--val-fraction", "nan"],
     "error: --val-fraction must satisfy 0 <= F < 1; got nan."),
    (["prepare", "folder", "--slides", "s", "--labels", "l.csv", "--out", "o", "--name", " "],
     "error: --name must not be empty (or blank); leave it out for the --out folder's name."),
    (["train"], "error: no inputs; pass patch stores"),
    # review EW, C9: --val took the inputs given after it
    (["train", "--val", "v.h5", "a.h5", "--out", "o"], "(--val took v.h5 a.h5: it takes every path after it, so put "
                                                      "the training inputs before --val)"),
    (["demo", "d", "--until", "nosuch"], "argument --until: invalid choice: 'nosuch'"),
    (["demo", "d", "--until", "features"], "argument --until: invalid choice: 'features'"),  # not a demo stage
])
def test_a_wrong_option_exits_2_and_names_the_option(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert _exit_code(argv) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # checked before anything is read or written


def test_a_fraction_in_range_passes_the_check(tmp_path, monkeypatch, capsys):
    """Refused for its data (no such folder: exit 1), not for its fractions."""
    monkeypatch.chdir(tmp_path)
    code = main(["prepare", "folder", "--slides", "s", "--labels", "l.csv", "--out", "o", "--test-fraction", "0.5",
                 "--val-fraction", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "fraction" not in err, err


def _exit_code(argv: list[str]) -> int:
    """The exit code of ``wsi-milssl ARGV``: main's, or argparse's own exit."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("set_value, message", [
    ("train.epochs=0", "with --set train.epochs=0: TrainConfig.epochs must satisfy 1 <= value; got 0."),
    ("train.epochs", "error: --set 'train.epochs': expected TABLE.KEY=VALUE"),
    ("nosuch.x=1", "error: --set 'nosuch.x=1': unknown table [nosuch]"),
])
def test_a_wrong_set_value_of_run_exits_2_and_a_wrong_file_1(tmp_path, monkeypatch, capsys, set_value, message):
    from wsi_milssl.cli.demo import demo_pipeline_file

    monkeypatch.chdir(tmp_path)
    good = demo_pipeline_file().read_text()
    Path("p.toml").write_text(good)
    assert main(["run", "p.toml", "--out", "out", "--set", set_value]) == 2
    assert message in capsys.readouterr().err
    # the same --set on a file that is itself wrong: the file's error, a failed run's exit code
    Path("p.toml").write_text(good.replace("epochs = 6", "epochs = -1"))
    assert main(["run", "p.toml", "--out", "out", "--set", set_value]) == 1
    assert capsys.readouterr().err.count("error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.toml"]
