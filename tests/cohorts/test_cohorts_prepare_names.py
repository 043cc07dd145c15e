"""``prepare folder``: labelled slides that are not there are reported (a warning and a note), a
symlinked slide keeps its link's name, and decomposed (NFD, as macOS writes them) file names match
composed (NFC) names in the labels file."""

from __future__ import annotations

import json
import logging
import os
import unicodedata
from pathlib import Path

import pytest

from wsi_milssl.cohorts import prepare_folder, read_labels, stem_key
from wsi_milssl.errors import LabelsError
from wsi_milssl.tiling import find_slides, slide_stem

EMPTY_GEOJSON = '{"type": "FeatureCollection", "features": []}'


def _touch(path: Path, text: str | None = None) -> Path:
    """``path`` holding ``text``; by default a placeholder slide: not empty (prepare refuses an empty slide file,
    review EC B3) and distinct from every other (identical slide files are one slide)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"placeholder slide {path}" if text is None else text)
    return path


def _cohort(root: Path, names: dict[str, int]) -> Path:
    """Placeholder slides (prepare never opens them) and an annotation beside each tumour slide."""
    for name, label in names.items():
        _touch(root / f"{name}.tif")
        if label:
            _touch(root / f"{name}.geojson", EMPTY_GEOJSON)
    return root


BASE = {"n1": 0, "n2": 0, "n3": 0, "t1": 1, "t2": 1, "t3": 1}


def test_labelled_slides_that_are_not_there_are_a_warning_and_a_note(tmp_path, caplog):
    slides = _cohort(tmp_path / "slides", BASE)
    labels = _touch(tmp_path / "labels.csv", "".join(f"{s},{v}\n" for s, v in BASE.items())
                    + "ghost,1\nphantom,0\n")
    with caplog.at_level(logging.WARNING):
        result = prepare_folder(slides, labels, tmp_path / "out")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    note = next(n for n in result.notes if "not below" in n)
    assert note.startswith(f"2 labelled slide(s) of {labels} are not below {slides}, so they are left out: ")
    assert "ghost" in note and "phantom" in note
    assert note in warnings
    assert note in json.loads(result.summary_json.read_text())["notes"]
    assert sum(len(s.slides) for s in result.sets.values()) == 6


def test_a_symlinked_slide_keeps_the_name_of_its_link(tmp_path):
    elsewhere = _touch(tmp_path / "storage" / "synth_006.tif")
    slides = _cohort(tmp_path / "slides", {k: v for k, v in BASE.items() if k != "t3"})
    (slides / "lt.tif").symlink_to(elsewhere)
    _touch(slides / "lt.geojson", EMPTY_GEOJSON)
    labels = _touch(tmp_path / "labels.csv", "".join(f"{s},{v}\n" for s, v in BASE.items() if s != "t3")
                    + "lt,1\n")
    result = prepare_folder(slides, labels, tmp_path / "out", test_fraction=0.25, seed=0)
    where = next(s for s in result.sets.values() if "lt" in s.slides)
    assert where.labels["lt"] == 1
    # the slide list names the link (the tile stage names the store after the path it reads)
    listed = [p for p in find_slides([where.slides_csv]) if p.name == "lt.tif"]
    assert listed == [slides.absolute() / "lt.tif"] and slide_stem(listed[0]) == "lt"
    assert not any("synth_006" in p.name for p in find_slides([where.slides_csv]))


def test_decomposed_file_names_match_composed_labels(tmp_path):
    nfc, nfd = unicodedata.normalize("NFC", "café_3"), unicodedata.normalize("NFD", "café_3")
    assert nfc != nfd and stem_key(nfd + ".tif") == stem_key(nfc) == stem_key(nfc.upper())
    names = {**BASE, nfd: 1}
    slides = _cohort(tmp_path / "slides", {k: v for k, v in names.items() if k != nfd})
    _touch(slides / f"{nfd}.tif")
    _touch(tmp_path / "ann" / f"{nfc}.geojson", EMPTY_GEOJSON)  # the annotation in the composed form
    for s, v in BASE.items():
        if v:
            _touch(tmp_path / "ann" / f"{s}.geojson", EMPTY_GEOJSON)
    labels = _touch(tmp_path / "labels.csv", "".join(f"{s},{v}\n" for s, v in BASE.items()) + f"{nfc},1\n")
    assert nfd in read_labels(labels)
    result = prepare_folder(slides, labels, tmp_path / "out", annotations_dir=tmp_path / "ann")
    where = next(s for s in result.sets.values() if nfd in s.slides)
    assert where.labels[nfd] == 1 and nfd in where.annotations
    # the only note: the empty annotations of the tumour test slides hold no tumour area
    assert [n.split(" (")[0] for n in result.notes] == ["1 tumour test slide(s) have an annotation without a tumour "
                                                        "area"]


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_one_slide_file_under_two_names_is_refused(tmp_path, link):
    slides = _cohort(tmp_path / "slides", BASE)
    if link == "symbolic":  # would count twice, and could be train and test
        (slides / "t1_copy.tif").symlink_to(slides / "t1.tif")
    else:
        os.link(slides / "t1.tif", slides / "t1_copy.tif")
    labels = _touch(tmp_path / "labels.csv", "".join(f"{s},{v}\n" for s, v in BASE.items()) + "t1_copy,1\n")
    with pytest.raises(LabelsError, match=r"1 slide file\(s\) are reached under more than one name \(links\).*t1"):
        prepare_folder(slides, labels, tmp_path / "out", test_fraction=0.5, seed=1)
    # across a given test set too
    (slides / "t1_copy.tif").unlink()
    test = _cohort(tmp_path / "test", {"n9": 0, "t9": 1})
    (test / "t1_again.tif").symlink_to(slides / "t1.tif")
    test_labels = _touch(tmp_path / "test_labels.csv", "n9,0\nt9,1\nt1_again,1\n")
    _touch(test / "t1_again.geojson", EMPTY_GEOJSON)
    labels.write_text("".join(f"{s},{v}\n" for s, v in BASE.items()))
    with pytest.raises(LabelsError, match=r"in both the training and the test set under other names \(links\)"):
        prepare_folder(slides, labels, tmp_path / "out", test_slides_dir=test, test_labels_csv=test_labels)


def test_a_prepare_again_that_moves_slides_across_the_split_says_so(tmp_path, caplog):
    slides = _cohort(tmp_path / "slides", BASE)
    labels = _touch(tmp_path / "labels.csv", "".join(f"{s},{v}\n" for s, v in BASE.items()))
    first = prepare_folder(slides, labels, tmp_path / "out", test_fraction=0.34, seed=0)
    assert not any("test set differs" in n for n in first.notes)
    again = prepare_folder(slides, labels, tmp_path / "out", test_fraction=0.34, seed=0)  # the same split
    assert not any("test set differs" in n for n in again.notes)
    _cohort(slides, {"n4": 0, "t4": 1, "t5": 1})  # slides added: the seeded split moves
    labels.write_text(labels.read_text() + "n4,0\nt4,1\nt5,1\n")
    with caplog.at_level(logging.WARNING):
        moved = prepare_folder(slides, labels, tmp_path / "out", test_fraction=0.34, seed=0)
    note = next(n for n in moved.notes if "test set differs" in n)
    assert "has seen test slides" in note and note in [r.getMessage() for r in caplog.records]


def test_a_generating_template_gives_a_pipeline_of_the_cohort(tmp_path):
    from importlib.resources import files

    from wsi_milssl.pipeline import load_pipeline

    slides = _cohort(tmp_path / "slides", BASE)
    labels = _touch(tmp_path / "labels.csv", "".join(f"{s},{v}\n" for s, v in BASE.items()))
    demo = Path(str(files("wsi_milssl") / "pipelines" / "demo.toml"))  # holds [synth.train] and [synth.test]
    result = prepare_folder(slides, labels, tmp_path / "out", template=demo)
    spec = load_pipeline(result.pipeline_toml)
    assert all(ds.synth is None for ds in spec.sets.values())
    assert "[synth" not in result.pipeline_toml.read_text()
