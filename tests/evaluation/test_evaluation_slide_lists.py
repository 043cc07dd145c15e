"""``evaluate --slides LIST.csv`` reads slide lists by the rule ``tile`` reads them with: a list with only a
``slide`` column (pipelines/camelyon16.toml's "a CSV with a `slide` column") was refused at the last stage of a
run ("a slide list needs a 'path' (or 'slide_path') column; got 'slide'")."""

from __future__ import annotations

import json

import pytest

from wsi_milssl.cli import main
from wsi_milssl.evaluation.inputs import resolve_slides
from wsi_milssl.tiling import find_slides


def _linked_slides(synth_dir, folder):
    """``folder`` holding links to the generated slides (the session's synth_dir is left as it is)."""
    folder.mkdir(parents=True)
    for slide in sorted(synth_dir.glob("*.tif")):
        (folder / slide.name).symlink_to(slide)
    return folder


def _evaluate(tmp_path, slides, predictions, annotations_dir, synth_dir, name):
    out = tmp_path / name
    rc = main(["evaluate", "--predictions", str(predictions[0]), "--annotations", str(annotations_dir),
               "--slides", str(slides), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)])
    assert rc == 0
    return json.loads((out / "metrics.json").read_text())


def test_a_list_with_only_a_slide_column_of_names_is_evaluated(synth_dir, annotations_dir, predictions, tmp_path):
    slides = _linked_slides(synth_dir, tmp_path / "slides")
    listing = slides / "test_slides.csv"
    listing.write_text("slide\n" + "".join(f"{p.stem}\n" for p in sorted(slides.glob("*.tif"))))
    assert sorted(resolve_slides(listing).values()) == find_slides([listing]) == sorted(slides.glob("*.tif"))

    metrics = _evaluate(tmp_path, listing, predictions, annotations_dir, synth_dir, "by_list")
    assert metrics["froc"] == pytest.approx(5 / 6)
    assert metrics == _evaluate(tmp_path, slides, predictions, annotations_dir, synth_dir, "by_folder")


def test_a_slide_column_of_paths_with_a_home_folder_and_a_byte_order_mark(synth_dir, tmp_path, monkeypatch):
    slides = _linked_slides(synth_dir, tmp_path / "home" / "slides")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    listing = tmp_path / "list.csv"
    listing.write_text("\ufeff slide \n" + "".join(f"~/slides/{p.name}\n" for p in sorted(slides.glob("*.tif"))),
                       encoding="utf-8")
    found = find_slides([listing])
    assert found == sorted(slides.glob("*.tif"))
    assert resolve_slides(listing) == {p.stem: p for p in found}
