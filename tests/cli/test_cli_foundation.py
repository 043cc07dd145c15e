"""The console script: --version, --help of every subcommand, synth, info and error exit codes."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from wsi_milssl import __version__
from wsi_milssl.cli import COMMANDS, build_parser, main


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wsi_milssl", *args], capture_output=True, text=True)


def test_version():
    result = _cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"wsi-milssl {__version__}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_with_default(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest in ("help",) or not action.option_strings:
            continue
        assert action.help, f"{command} {action.option_strings} has no help"
    text = sub.format_help()
    # defaults are shown, except None ("from --config or the settings' default", named in the help's brackets)
    shown = [a for a in sub._actions if a.option_strings and a.dest != "help" and a.default is not None
             and a.default is not argparse.SUPPRESS]
    assert ("(default:" in text) == bool(shown)
    assert "(default: None)" not in text


def test_info_shows_levels_mpp_and_10x_20x_plan(synth_slides, capsys):
    assert main(["info", str(synth_slides["normal"])]) == 0
    out = capsys.readouterr().out
    assert "4096 x 4096 px" in out
    assert "mpp:              0.2500 µm/px (from metadata)" in out
    assert "level 2:" in out
    assert "10x (1.000 µm/px): read level 2 (downsample 4.000), residual scale 1.000" in out
    assert "20x (0.500 µm/px): read level 1 (downsample 2.000), residual scale 1.000" in out


def test_info_on_bad_file_exits_1_with_one_clear_line(tmp_path):
    bad = tmp_path / "broken.svs"
    bad.write_bytes(b"\x00" * 100)
    result = _cli("info", str(bad))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "broken.svs" in lines[0]


def test_top_level_help_is_fast_and_each_command_builds_alone(capsys):
    import subprocess
    import sys

    code = ("import sys\nfrom wsi_milssl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'skimage' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "heatmap" in out and "train an instance classifier" in out
    assert out.strip().splitlines()[-1] == "False False"  # the list of commands imports neither
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: wsi-milssl {command}" in capsys.readouterr().out


def test_usage_error_exits_2():
    assert _cli("synth").returncode == 2
    assert _cli("no-such-command").returncode == 2


def test_synth_then_info_on_cli(tmp_path):
    out = tmp_path / "out"
    result = _cli("synth", str(out), "--slides", "2", "--seed", "1", "--size-px", "2048", "2048", "--mpp", "0.5")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.glob("*.tif")) == ["synth_000.tif", "synth_001.tif"]
    info = _cli("info", str(out / "synth_000.tif"))
    assert info.returncode == 0
    assert "mpp:              0.5000 µm/px" in info.stdout
    assert info.stdout.count("  level ") >= 3


@pytest.mark.parametrize("argv", [
    ["synth", ""], ["demo", " "], ["run", "p.toml", "--out", ""], ["tile", "s.tif", "--out", ""],
    ["label", "s.h5", "--out", ""], ["features", "s.h5", "--out", ""], ["train", "x.csv", "--out", ""],
    ["heatmap", "s.tif", "--model", "m.pt", "--out", ""], ["evaluate", "--predictions", "p", "--out", ""],
    ["prepare", "camelyon16", "root", "--out", ""]])
def test_an_empty_output_folder_is_a_usage_error_not_the_current_folder(argv, capsys):
    """Review CX, B6: `--out "$OUT"` with the variable unset wrote every output into the current folder."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "an empty path (an unset shell variable?); give the output folder" in capsys.readouterr().err


def test_synth_and_demo_take_their_folder_as_out_too(tmp_path, capsys):
    """Review EW, C11: every other command names its output folder --out; `synth --out DIR` and `demo --out DIR` were
    "unrecognized arguments". Either spelling works now, and two different folders are refused."""
    assert main(["synth", "--out", str(tmp_path / "s"), "--slides", "1", "--size-px", "1024", "1024"]) == 0
    assert (tmp_path / "s" / "synth_000.tif").is_file()
    for argv, message in ((["synth", "--slides", "1"], "OUT_DIR is required: the folder to write to (as OUT_DIR, "
                                                        "or --out OUT_DIR)."),
                          (["demo", str(tmp_path / "a"), "--out", str(tmp_path / "b")], "name two folders; give one.")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
