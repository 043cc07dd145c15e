"""Review BR: settings written where they do not belong get an error that shows the way: a misspelt key names
the close one, a key of another table names that table, a misspelt [data] key of a generated pipeline is
unknown (it read "not used with generated data"), a negative split seed is refused at load (it was numpy's
traceback), and a file that starts with a UTF-8 byte-order mark loads."""

from __future__ import annotations

import re

import pytest

from tinypipeline import GENERATED_SLIDES
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import load_pipeline


def _load(tmp_path, text: str, **kwargs):
    path = tmp_path / "p.toml"
    path.write_text('[pipeline]\nname = "t"\n' + text)
    return load_pipeline(path, out_dir=tmp_path / "out", **kwargs)


@pytest.mark.parametrize("extra, message", [
    ("[train]\nepoch = 3\n", r"\[train\]: unknown key\(s\) epoch for TrainConfig \(did you mean epochs\?\); valid keys"),
    ("[train]\nval_fraction = 0.3\n", r"\[train\]: val_fraction is a setting of \[data\], not of \[train\]\. "
                                      r"Fix: move it to that table\."),
    ("[heatmap]\npatch_size_px = 64\n", r"\[heatmap\]: patch_size_px is a setting of \[tile\]"),
    ("[evaluate]\ncolourmap = 'magma'\n", r"unknown key\(s\) colourmap for EvaluateConfig; valid keys"),
    # review EW, B1: the command-line option's name in a table that calls it otherwise was sent to another table
    ("[heatmap]\nworkers = 2\n", r"\[heatmap\]: workers is called num_workers in \[heatmap\] \(the reader "
                                  r"processes, `wsi-milssl heatmap --workers`\)\. Fix: rename it\.$"),
    ("[features]\nworkers = 2\n", r"\[features\]: workers is called num_workers in \[features\]"),
    ("[evaluate]\nslide_mpp = 0.25\n", r"\[evaluate\]: slide_mpp is called mpp in \[evaluate\]"),
])
def test_a_key_in_the_wrong_place_names_where_it_belongs(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, GENERATED_SLIDES + extra)


def test_a_misspelt_data_key_of_a_generated_pipeline_is_unknown(tmp_path):
    text = GENERATED_SLIDES.replace("[data]\n", "[data]\nval_fracton = 0.3\n", 1)
    assert "val_fracton" in text
    with pytest.raises(ConfigError, match=r"unknown \[data\] key\(s\) val_fracton \(did you mean val_fraction\?\); "
                                          r"valid keys here are generate, mode, split_seed, val_fraction\."):
        _load(tmp_path, text)
    with pytest.raises(ConfigError, match=r"\[data\] keys train_slides are not used with generated data"):
        _load(tmp_path, GENERATED_SLIDES.replace("[data]\n", "[data]\ntrain_slides = 'x'\n", 1))


def test_a_negative_split_seed_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"\[data\]\.split_seed must satisfy 0 <= value; got -1"):
        _load(tmp_path, GENERATED_SLIDES, overrides=["data.split_seed=-1"])


@pytest.mark.parametrize("content", [b"", b"\n  \n# settings lost\n"])
def test_an_empty_pipeline_file_is_said_to_be_empty(tmp_path, content):
    """Review BW: a file emptied by a failed copy read "[data] is missing train_slides, train_labels, ..."."""
    path = tmp_path / "p.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError,
                       match=rf"^{re.escape(str(path))}: the pipeline file is empty \(no table or setting\)\. Fix: "):
        load_pipeline(path, out_dir=tmp_path / "out")


def test_slide_keys_in_a_feature_pipeline_are_named_as_keys_of_the_other_form(tmp_path):
    """Review CB: they were "unknown ... (did you mean test_slides for test_slides?)"."""
    text = ('[data]\nmode = "features"\ntrain_features = "f"\ntrain_labels = "l.csv"\ntest_features = "g"\n'
            'test_labels = "m.csv"\ntest_slides = "s"\ntest_annotaions = "a"\n')
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    message = str(err.value)
    assert "did you mean test_slides" not in message and "(did you mean test_annotations?)" in message
    assert "(test_slides: not read by this form of [data], which reads features, labels)" in message, message


def test_a_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + ('[pipeline]\nname = "bom"\n' + GENERATED_SLIDES).encode())
    assert load_pipeline(path, out_dir=tmp_path / "out").name == "bom"


def test_an_image_pipeline_without_patch_pixels_is_refused_before_any_stage(tmp_path):
    """Review BR, B4: `--set tile.pixels="none"` tiled every store again without pixels, then train refused. A run
    that stops before train may keep coordinates only."""
    from wsi_milssl.pipeline import run_pipeline

    spec = _load(tmp_path, GENERATED_SLIDES, overrides=['tile.pixels="none"'])
    with pytest.raises(ConfigError, match=r'with --set tile.pixels="none": \[tile\] pixels = "none" keeps the '
                                          r'patches\' coordinates only, but the train stage trains on their pixels'):
        run_pipeline(spec)
    assert not (tmp_path / "out" / "slides").exists()  # nothing generated or tiled first
    assert [o.stage for o in run_pipeline(spec, until="synth")] == ["synth"]


def test_tiles_own_name_for_its_workers_is_named_for_a_set_override(tmp_path):
    with pytest.raises(ConfigError, match=r"\[tile\] with --set tile\.num_workers=2: num_workers is called workers in "
                                          r"\[tile\] \(the slides tiled at once, `wsi-milssl tile --workers`\)"):
        _load(tmp_path, GENERATED_SLIDES, overrides=["tile.num_workers=2"])
