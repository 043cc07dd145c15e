"""SLIDES arguments: files, folders and CSV lists become slide paths; bad input is a usage error."""

from __future__ import annotations

import re

import pytest

from wsi_milssl.errors import ConfigError
from wsi_milssl.tiling import find_slides


def test_folder_csv_and_files(synth_dir, tmp_path):
    from_folder = find_slides([synth_dir])
    assert [p.name for p in from_folder] == ["synth_000.tif", "synth_001.tif"]
    # labels.csv names slides without a suffix; they are found beside the CSV
    assert find_slides([synth_dir / "labels.csv"]) == from_folder
    listing = tmp_path / "list.csv"
    listing.write_text(f"slide,label\n{synth_dir / 'synth_001.tif'},0\n")
    assert find_slides([listing, synth_dir / "synth_001.tif"]) == [synth_dir / "synth_001.tif"]


def test_bad_inputs(synth_dir, tmp_path):
    with pytest.raises(ConfigError, match="no such slide file or folder"):
        find_slides([tmp_path / "nope"])
    with pytest.raises(ConfigError, match="no slide files in this folder"):
        find_slides([tmp_path])
    bad = tmp_path / "bad.csv"
    bad.write_text("file\nx.tif\n")
    with pytest.raises(ConfigError, match=r"bad\.csv: no 'slide' or 'path' column \(columns: file\)"):
        find_slides([bad])
    missing = tmp_path / "missing.csv"
    missing.write_text("slide\nghost\n")
    with pytest.raises(ConfigError, match=r"1 slide\(s\) not found: ghost"):
        find_slides([missing])
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "synth_000.svs").write_text("another slide with the same stem")
    with pytest.raises(ConfigError, match="have the same name 'synth_000', so their stores would collide"):
        find_slides([synth_dir, twin])


def test_bare_names_in_a_csv_find_slides_whatever_the_case_of_their_suffix(synth_dir, tmp_path):
    """The reviewer's list: a bare name finds its slide beside the CSV with the suffix in any case
    (UPPER -> UPPER.TIF), a name with dots its .tif (x.ome -> x.ome.tif), and a name in another case its
    slide (stems are compared case-insensitively); a slide with another suffix (.h5) is not a slide."""
    import shutil

    files = ["UPPER.TIF", "x.ome.tif", "plain.tiff", "Tumor_001.TIFF", "sp ace.tif"]
    for name in files:
        shutil.copy(synth_dir / "synth_000.tif", tmp_path / name)
    (tmp_path / "store.h5").write_text("not a slide")
    listing = tmp_path / "l.csv"
    listing.write_text("slide\nUPPER\nx.ome\nplain\ntumor_001\nsp ace\n")
    assert find_slides([listing]) == [tmp_path / name for name in files]
    listing.write_text("slide\nstore\n")
    with pytest.raises(ConfigError, match=r"1 slide\(s\) not found: store"):
        find_slides([listing])


def test_a_prepared_list_with_a_deleted_slide_names_prepare_as_the_fix(synth_dir, tmp_path):
    """A slide list `wsi-milssl prepare` wrote (prepare.json beside it) whose slide was deleted since: the fix
    is to run prepare again (its command is quoted), not to edit paths in a file prepare owns."""
    import json

    cohort = tmp_path / "cohort"
    cohort.mkdir()
    listing = cohort / "train_slides.csv"
    listing.write_text(f"slide,path\nsynth_000,{synth_dir / 'synth_000.tif'}\ngone,{tmp_path / 'gone.tif'}\n")
    with pytest.raises(ConfigError, match=r"not found: .*gone\.tif\. Fix: give paths"):
        find_slides([listing])
    (cohort / "prepare.json").write_text(json.dumps({"command": "wsi-milssl prepare camelyon16 /data/c16 --out p"}))
    with pytest.raises(ConfigError) as err:
        find_slides([listing])
    assert str(err.value).endswith(f"Fix: this list was written by `wsi-milssl prepare` ({cohort / 'prepare.json'}), "
                                   "and its slides were moved or deleted since: put them back, or run prepare again: "
                                   "wsi-milssl prepare camelyon16 /data/c16 --out p.")


def test_one_file_under_two_slide_names_is_refused(synth_dir, tmp_path):
    """Review BG: a link beside its target was deduplicated by resolved path without a word, the slide tiled under
    the name that sorts first (a_alias) and the real name, with its label and annotations, left out."""
    import shutil

    folder = tmp_path / "slides"
    shutil.copytree(synth_dir, folder)
    (folder / "a_alias.tif").symlink_to(folder / "synth_001.tif")
    alias, real = re.escape(str(folder / "a_alias.tif")), re.escape(str(folder / "synth_001.tif"))
    with pytest.raises(ConfigError, match=(
            rf"^1 slide file\(s\) are listed under two names \(links\): {alias} and "
            rf"{real}: one would be tiled under the first name .* Fix: keep one name per slide")):
        find_slides([folder])
    # the same name twice (the folder and one of its files, or a link of the same name elsewhere) is one slide
    other = tmp_path / "links"
    other.mkdir()
    (other / "synth_000.tif").symlink_to(folder / "synth_000.tif")
    assert find_slides([folder / "synth_000.tif", other / "synth_000.tif"]) == [folder / "synth_000.tif"]


def test_a_link_whose_target_is_gone_is_listed_and_fails_naming_its_target(synth_dir, tmp_path):
    """A link in a slide folder to a file on a mount that is down was skipped without a word (tile counted the
    other slides only): it is listed, and opening it says what it points to."""
    import shutil

    from wsi_milssl.errors import SlideReadError
    from wsi_milssl.slide import SlideReader

    folder = tmp_path / "slides"
    shutil.copytree(synth_dir, folder)
    (folder / "gone.tif").symlink_to(tmp_path / "unmounted" / "gone.tif")
    slides = find_slides([folder])
    assert [p.name for p in slides] == ["gone.tif", "synth_000.tif", "synth_001.tif"]
    target = re.escape(str(tmp_path / "unmounted" / "gone.tif"))
    with pytest.raises(SlideReadError, match=rf"gone\.tif: a link to {target}, which "
                                             r"does not exist\. Fix: mount or restore"):
        SlideReader(slides[0])


def test_a_loop_of_links_fails_those_slides_alone(synth_dir, tmp_path):
    """Review BI: two links that point at each other stopped `run`, `tile`, `heatmap --slides` with a traceback
    (Path.resolve raises on a loop): they are listed, and tiling fails them alone, naming the loop."""
    import shutil

    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import tile_slides

    folder = tmp_path / "slides"
    shutil.copytree(synth_dir, folder)
    (folder / "a.tif").symlink_to("b.tif")
    (folder / "b.tif").symlink_to("a.tif")
    slides = find_slides([folder])
    assert [p.name for p in slides] == ["a.tif", "b.tif", "synth_000.tif", "synth_001.tif"]
    run = tile_slides(slides, tmp_path / "stores", TileConfig(magnification=20, patch_size_px=256,
                                                                 entropy_threshold_bits=4.0))
    assert [(r.slide, r.status) for r in run.results] == [("a", "failed"), ("b", "failed"), ("synth_000", "ok"),
                                                          ("synth_001", "ok")]
    assert run.results[0].error.endswith("a.tif: a link to b.tif in a loop of links that never reaches a file. Fix: "
                                         "point the link at the slide file, or remove it.")
