"""Deleted heatmap files of a finished slide (the overlay, the viewer files, the detections) are written again
by the next ``heatmap`` run, drawn from the slide's saved probabilities without the model (review AS, finding 9:
they were never written again, as the completeness check knew only the map, sidecar, patch table and
detections)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsi_milssl.cli import main

DELETED = ("heatmap.png", "patches.geojson", "probs.ome.tif", "lesions.xml", "lesions.geojson", "probs.tif",
           "detections.csv")


@pytest.fixture(scope="module")
def two_slides(tmp_path_factory, slide_writer) -> list[Path]:
    folder = tmp_path_factory.mktemp("deleted")
    a = slide_writer(folder / "a.tif", width=1536, height=1536, tissue_box=(256, 256, 1280, 1280),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=1536, height=1536, tissue_box=(0, 256, 1536, 1280),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return [a, b]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith(("a_", "b_"))}


@pytest.mark.parametrize("deleted", [DELETED, ("heatmap.png",)], ids=["seven", "overlay"])
def test_deleted_files_are_drawn_again_without_predicting(tmp_path, two_slides, checkpoint_factory, predicted,
                                                          deleted, caplog):
    out = tmp_path / "hm"
    args = ["heatmap", *map(str, two_slides), "--model", str(checkpoint_factory()), "--out", str(out),
            "--thumbnail-px", "96", "--batch-size", "32", "--workers", "0"]
    assert main(args) == 0
    before = _files(out)
    assert len(before) == 20  # ten files a slide
    for kind in deleted:
        (out / f"a_{kind}").unlink()

    predicted.clear()
    caplog.set_level("INFO", logger="wsi_milssl.inference.stage")
    assert main(args) == 0
    assert predicted == []  # the model did not run
    assert _files(out) == before  # every file back, as it was
    said = [m for m in caplog.messages if m.startswith("a: predicted with this checkpoint and settings, its file(s) ")]
    assert len(said) == 1 and all(f"a_{kind}" in said[0] for kind in deleted), caplog.messages

    predicted.clear()  # and then the folder is complete: nothing drawn again
    caplog.clear()
    assert main(args) == 0
    assert predicted == [] and not [m for m in caplog.messages if "drawing it again" in m]


def test_a_slide_without_its_saved_probabilities_is_predicted_again(tmp_path, two_slides, checkpoint_factory,
                                                                    predicted):
    out = tmp_path / "hm"
    args = ["heatmap", *map(str, two_slides), "--model", str(checkpoint_factory()), "--out", str(out),
            "--thumbnail-px", "96", "--batch-size", "32", "--workers", "0"]
    assert main(args) == 0
    before = _files(out)
    (out / "b_patches.csv").unlink()  # the patch table is part of the prediction: nothing to draw from
    predicted.clear()
    assert main(args) == 0
    assert predicted == ["b"]
    assert _files(out) == before
