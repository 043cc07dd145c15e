"""A pipeline file with a value or table of the wrong type gives one ConfigError naming the file, the key
and the expected type; `run` on a folder or a file that is not UTF-8 gives one `error:` line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline

DEMO = (Path(__file__).resolve().parents[2] / "pipelines" / "demo.toml").read_text()


def _replace(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


CASES = [
    ("val_fraction = 0.25", "val_fraction = \"abc\"", r"\[data\]\.val_fraction must be int or float; got 'abc' \(str\)"),
    ("val_fraction = 0.25", "val_fraction = 1.0", r"\[data\]\.val_fraction must satisfy 0\.0 <= value < 1\.0; got 1\.0"),
    ("val_fraction = 0.25", "val_fraction = true", r"\[data\]\.val_fraction must be int or float; got True"),
    ("split_seed = 0", "split_seed = \"x\"", r"\[data\]\.split_seed must be int; got 'x' \(str\)"),
    ("split_seed = 0", "split_seed = 1.7", r"\[data\]\.split_seed must be int; got 1\.7 \(float\)"),
    ("generate = true", "generate = \"false\"", r"\[data\]\.generate must be bool; got 'false' \(str\)"),
    ("name = \"demo\"", "name = {a=1}", r"\[pipeline\]\.name must be str; got \{'a': 1\} \(dict\)"),
    ("out_dir = \"demo_out\"", "out_dir = 5", r"\[pipeline\]\.out_dir must be str; got 5 \(int\)"),
]


@pytest.mark.parametrize("old, new, message", CASES, ids=[c[1].split("\n")[0] for c in CASES])
def test_wrong_types_name_file_key_and_type(tmp_path, old, new, message):
    path = tmp_path / "bad.toml"
    path.write_text(_replace(DEMO, old, new))
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": " + message):
        load_pipeline(path)


TABLE_CASES = [
    ("pipeline = 3\n", "pipeline"),
    ("tile = 3\n", "tile"),
    ("data = 3\n", "data"),
    ("synth = 3\n", "synth"),
    ("synth = {train = 3}\n", "synth.train"),
    ("[synth]\ntrain = 3\n", "synth.train"),
]


@pytest.mark.parametrize("text, table", TABLE_CASES)
def test_tables_that_are_values_are_refused(tmp_path, text, table):
    path = tmp_path / "bad.toml"
    path.write_text(text + "[train]\nepochs = 1\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {table} must be a table ([{table}] with key = value "
                                                    "lines below it); got 3 (int).")):
        load_pipeline(path)


def test_demo_pipeline_still_loads(tmp_path):
    path = tmp_path / "demo.toml"
    path.write_text(DEMO)
    spec = load_pipeline(path)
    assert (spec.name, spec.val_fraction, spec.split_seed) == ("demo", 0.25, 0)
    assert spec.out_dir == Path("demo_out").resolve()  # relative to the folder the run starts in
    path.write_text(_replace(DEMO, "val_fraction = 0.25", "val_fraction = 0"))
    assert load_pipeline(path, out_dir=tmp_path / "o").val_fraction == 0.0


def _run(args, capsys):
    code = main(["run", *args])
    return code, capsys.readouterr().err


def test_run_on_a_folder_or_non_utf8_file_gives_one_error_line(tmp_path, capsys):
    folder = tmp_path / "slides"
    folder.mkdir()
    code, err = _run([str(folder), "--out", str(tmp_path / "x")], capsys)
    assert code != 0 and "Traceback" not in err
    assert f"error: {folder}: is a folder, not a config file; give the path of a TOML file" in err
    bad = tmp_path / "utf16.toml"
    bad.write_bytes(b"\xff\xfe[\x00p\x00]\x00")
    code, err = _run([str(bad), "--out", str(tmp_path / "x")], capsys)
    assert code != 0 and "Traceback" not in err
    assert f"error: {bad}: not UTF-8 text (byte 0 cannot be decoded), so not a TOML file" in err
    assert not (tmp_path / "x").exists()


def test_an_unknown_synth_set_is_refused(tmp_path):
    """A third generated set ([synth.validation]) used to be ignored without a word."""
    path = tmp_path / "extra.toml"
    path.write_text(DEMO + "\n[synth.validation]\nn_slides = 2\n")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + r": unknown table\(s\) \[synth\.validation\]; a "
                                          r"generated pipeline has the sets \[synth\.train\], \[synth\.test\]\."):
        load_pipeline(path)


@pytest.mark.parametrize("key", ["outdir = \"x\"", "epochs = 5"])
def test_an_unknown_pipeline_key_is_refused(tmp_path, key):
    """A misspelt [pipeline] key used to be ignored (`outdir` ran into the default folder)."""
    path = tmp_path / "extra.toml"
    path.write_text(_replace(DEMO, "name = \"demo\"", "name = \"demo\"\n" + key))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: unknown [pipeline] key(s) {key.split()[0]}; valid keys "
                                                    "are grid_workers, name, out_dir")):
        load_pipeline(path)


def test_synth_tables_without_generated_data_are_refused(tmp_path):
    """[synth.*] tables with generate = false (or a features pipeline) used to be ignored without a word."""
    path = tmp_path / "off.toml"
    path.write_text(_replace(DEMO, "generate = true", "generate = false"))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: [synth.train] and [synth.test] describe generated "
                                                    "slides, but [data].generate = false, so they would be ignored. "
                                                    "Fix: drop the [synth] tables, or set [data].generate = true")):
        load_pipeline(path)
    path.write_text(_replace(DEMO, "generate = true", "mode = \"features\""))
    with pytest.raises(ConfigError, match=re.escape("but [data].mode = 'features' trains on features that exist")):
        load_pipeline(path)
    path.write_text(DEMO)
    with pytest.raises(ConfigError, match=re.escape(f"{path} with --set data.generate=false: [synth.train]")):
        load_pipeline(path, overrides=["data.generate=false"])
