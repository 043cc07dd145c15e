"""Review DW, C6: a shard read a folder record that is not a JSON object (``[1]``) as "tiled with other settings",
listing every setting as ``None -> value``; label and heatmap read such a record as none. Tile does so too now, and
writes its own record over it."""

from __future__ import annotations

import json

import pytest

from wsi_milssl.cli import main

ARGS = ["--magnification", "20", "--patch-size", "256", "--entropy-threshold", "4", "--threads", "1"]


@pytest.mark.parametrize("record", ["[1]", "{}", '{"settings": 3}'])
def test_a_record_without_settings_is_read_as_none_and_replaced(four_slides, tmp_path, capsys, record):
    """Review EB, C3: an object without settings (``{}``) still listed every setting as None."""
    slides, _ = four_slides
    out = tmp_path / "out"
    out.mkdir()
    (out / "tile_config.json").write_text(record + "\n")
    assert main(["tile", str(slides), "--out", str(out), *ARGS, "--shard", "1/3"]) == 0, capsys.readouterr().err
    assert isinstance(json.loads((out / "tile_config.json").read_text()), dict)
    (out / "tile_config.json").write_text("[1")  # damaged: one error naming the file, as before
    assert main(["tile", str(slides), "--out", str(out), *ARGS, "--shard", "2/3"]) == 2  # as label and heatmap refuse it
    assert f"{out / 'tile_config.json'}: cannot read the settings of this folder" in capsys.readouterr().err
