"""``wsi-milssl run`` says in one line why a stage runs again: its first run, the settings that changed
(by the names ``--set`` gives them), the stage it reads from, an output that is missing, ``--force``, an
earlier stage that ran; a stamp of an earlier version (no details recorded) is still accepted, and when it
no longer matches the line says since when."""

from __future__ import annotations

import json
import re

from wsi_milssl.cli import main
from wsi_milssl.pipeline import load_pipeline, run_pipeline

PIPELINE = """
[pipeline]
name = "reasons"
[data]
generate = true
[synth.train]
n_slides = 2
seed = 0
width_px = 2048
height_px = 2048
[synth.test]
n_slides = 1
seed = 1000
width_px = 2048
height_px = 2048
[tile]
magnification = 10.0
patch_size_px = 32
pixels = "none"
"""


def test_a_stage_that_runs_again_says_why(tmp_path, capsys):
    toml = tmp_path / "reasons.toml"
    toml.write_text(PIPELINE)
    out = tmp_path / "out"

    def run(*overrides: str, force=()) -> list[tuple[str, str, str]]:
        spec = load_pipeline(toml, out_dir=out, overrides=list(overrides))
        return [(o.stage, o.status, o.reason) for o in run_pipeline(spec, until="tile", force=force)]

    assert run() == [("synth", "ran", "first run (no stamp)"), ("tile", "ran", "first run (no stamp)")]
    assert run() == [("synth", "skipped", ""), ("tile", "skipped", "")]
    # the command's line for the stage names the setting
    assert main(["run", str(toml), "--out", str(out), "--until", "tile", "--set", "tile.patch_size_px=64"]) == 0
    printed = capsys.readouterr().out
    assert "[synth] skipped (up to date)" in printed
    assert re.search(r"^\[tile\] [0-9.]+ s \(settings changed: tile\.patch_size_px\): ", printed, re.M), printed
    size, seed = "tile.patch_size_px=64", ("synth.train.seed=7", "synth.test.n_slides=2")
    (out / "stores" / "test" / "tile_status.csv").unlink()
    assert run(size) == [("synth", "skipped", ""),
                         ("tile", "ran", f"output missing: {out / 'stores' / 'test' / 'tile_status.csv'}")]
    assert run(size, *seed) == [("synth", "ran", "settings changed: synth.test.n_slides, synth.train.seed"),
                                ("tile", "ran", "input changed: the synth stage's settings or inputs")]
    assert run(size, *seed, force=["synth"]) == [("synth", "ran", "forced (--force synth)"),
                                                 ("tile", "ran", "forced (--force synth)")]
    (out / "slides" / "train" / "labels.csv").unlink()
    assert run(size, *seed) == [("synth", "ran", f"output missing: {out / 'slides' / 'train' / 'labels.csv'}"),
                                ("tile", "ran", "the synth stage ran before it")]

    # a stamp as earlier versions wrote it (digest and outputs only) is accepted as it was ...
    stamp_path = out / ".pipeline" / "tile.json"
    stamp = json.loads(stamp_path.read_text())
    assert {"settings", "inputs"} <= set(stamp)
    stamp_path.write_text(json.dumps({k: stamp[k] for k in ("stage", "digest", "outputs")}))
    assert run(size, *seed) == [("synth", "skipped", ""), ("tile", "skipped", "")]
    # ... and once it no longer matches, says since when (it records no details)
    (outcome,) = [o for o in run(*seed) if o[0] == "tile"]
    assert re.fullmatch(r"settings or inputs changed since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(a stamp of an "
                        r"earlier version, which records no details\)", outcome[2]), outcome


def test_a_file_taken_off_the_inputs_is_not_called_gone_while_it_is_on_disk(tmp_path):
    from wsi_milssl.pipeline.stamps import _changes

    kept, deleted = tmp_path / "a.tif", tmp_path / "b.tif"
    kept.write_bytes(b"x")
    old = {"upstream": {"tile": "d1"}, "external": [[str(kept), 1, 2], [str(deleted), 1, 2]]}
    new = {"upstream": {"tile": "d2"}, "external": []}
    assert _changes({}, {}, old, new) == [
        f"input changed: the tile stage's settings or inputs, {kept} (no longer an input), {deleted} (gone)"]


def test_a_damaged_stamp_runs_its_stage_again_saying_so(tmp_path):
    """Review BW: a stamp with a byte that is not UTF-8, or JSON that is not an object, was a traceback."""
    toml = tmp_path / "reasons.toml"
    toml.write_text(PIPELINE)
    out = tmp_path / "out"

    def run() -> list[tuple[str, str, str]]:
        return [(o.stage, o.status, o.reason)
                for o in run_pipeline(load_pipeline(toml, out_dir=out), until="tile")]

    run()
    stamp_path = out / ".pipeline" / "tile.json"
    good = stamp_path.read_bytes()
    for damaged in (good[:40] + b"\xff\xfe" + good[42:], b"[1, 2]", b"", good[: len(good) // 2]):
        stamp_path.write_bytes(damaged)
        assert run() == [("synth", "skipped", ""), ("tile", "ran", f"{stamp_path} cannot be read")], damaged
        assert run() == [("synth", "skipped", ""), ("tile", "skipped", "")]  # the stage wrote a good stamp
