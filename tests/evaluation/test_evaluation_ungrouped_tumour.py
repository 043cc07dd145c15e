"""Review DX, B1: ASAP writes ``PartOfGroup="None"`` for a polygon in no group, and "None" counts as non-tumour
by default (some CAMELYON16 files carve regions out of tumour so). A tumour slide outlined without groups then had
no lesion: its true hits counted as false positives (FROC 0.833 where 1.0 was right) and the label stage gave it
no tumour patch, each with one warning alone. Both refuse it now, naming the group and the fix; the groups given
as tumour read it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.annotations import PolygonAnnotation, read_annotations, write_asap_xml
from wsi_milssl.cli import main
from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import evaluate_predictions


@pytest.fixture()
def ungrouped(known_annotation, tmp_path) -> Path:
    """The known annotation's polygons in ASAP's group "None" (drawn in ASAP without a group)."""
    folder = tmp_path / "ungrouped"
    folder.mkdir()
    polygons = [PolygonAnnotation(a.name, "None", a.coords_lv0) for a in read_annotations(known_annotation.path).polygons]
    write_asap_xml(polygons, folder / f"{known_annotation.stem}.xml", groups=["None"])
    assert 'PartOfGroup="None"' in (folder / f"{known_annotation.stem}.xml").read_text()
    return folder


def test_evaluate_refuses_a_tumour_slide_outlined_in_no_group_and_reads_it_with_none_as_tumour(
        synth_dir, predictions, ungrouped, annotations_dir, known_annotation, tmp_path, capsys):
    with pytest.raises(EvaluationError) as exc:
        evaluate_predictions(predictions[0], labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                             annotations_dir=ungrouped, slides=synth_dir)
    n = len(read_annotations(known_annotation.path).polygons)
    assert str(exc.value).startswith(
        f"{ungrouped / known_annotation.stem}.xml: slide {known_annotation.stem!r} is labelled tumour but none of its "
        f"polygons is in a tumour group (_0, _1, Tumor); {n} of them {'is' if n == 1 else 'are'} in group 'None', "
        "which ASAP writes for a polygon in no group and which counts as non-tumour (carved out of tumour) by "
        "default, so the slide would have no lesion"), exc.value
    assert not (tmp_path / "out" / "metrics.json").exists()
    reference = evaluate_predictions(predictions[0], labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "ref",
                                     annotations_dir=annotations_dir, slides=synth_dir).metrics
    out = tmp_path / "as_tumour"
    assert main(["evaluate", "--predictions", str(predictions[0]), "--annotations", str(ungrouped), "--slides",
                 str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out), "--tumor-groups",
                 "_0,_1,Tumor,None", "--non-tumor-groups", "_2,Exclusion"]) == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_lesions"] == reference["n_lesions"] == 1 and metrics["froc"] == reference["froc"]


def test_regions_carved_out_alone_in_another_non_tumour_group_are_still_allowed_with_a_warning(
        synth_dir, predictions, known_annotation, tmp_path, caplog):
    folder = tmp_path / "carved"
    folder.mkdir()
    square = np.asarray([(0, 0), (500, 0), (500, 500), (0, 500)], float)
    write_asap_xml([PolygonAnnotation("Annotation 0", "_2", square)], folder / f"{known_annotation.stem}.xml",
                   groups=["_2"])
    result = evaluate_predictions(predictions[0], labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "out",
                                  annotations_dir=folder, slides=synth_dir)
    assert result.metrics["n_lesions"] == 0
    assert "has no tumour polygon" in caplog.text


def test_label_refuses_the_slide_alone(four_slides, tmp_path):
    from wsi_milssl.config import TileConfig
    from wsi_milssl.labeling import label_stores
    from wsi_milssl.tiling import find_slides, tile_slides

    slides, annotations = four_slides
    stores = tmp_path / "stores"
    assert tile_slides(find_slides([slides]), stores, TileConfig(magnification=20, patch_size_px=256, threads=1)).ok
    ann = tmp_path / "ann"
    ann.mkdir()
    for k in (0, 2):
        polygons = read_annotations(annotations / f"slide_{k}.xml").polygons
        group = "None" if k == 2 else polygons[0].group
        write_asap_xml([PolygonAnnotation(a.name, group, a.coords_lv0) for a in polygons], ann / f"slide_{k}.xml",
                       groups=sorted({group}))
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nslide_0,1\nslide_1,0\nslide_2,1\nslide_3,0\n")
    report = label_stores(stores, annotations_dir=ann, labels_csv=labels, out_dir=tmp_path / "out")
    assert report.n_failed == 1
    with open(tmp_path / "out" / "label_status.csv", newline="") as fh:
        rows = {r["slide"]: r for r in csv.DictReader(fh)}
    assert rows["slide_2"]["status"] == "failed" and rows["slide_0"]["status"] == "ok"
    assert "of them are in group 'None', which ASAP writes for a polygon in no group" in rows["slide_2"]["error"]
