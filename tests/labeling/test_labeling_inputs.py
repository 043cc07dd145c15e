"""labels.csv parsing and the evaluation-mask file format."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from wsi_milssl.errors import AnnotationError, LabelsError
from wsi_milssl.labeling import eval_mask_paths, read_eval_mask, read_slide_labels, write_eval_mask


def test_labels_csv_with_header_and_words(tmp_path):
    path = tmp_path / "labels.csv"
    path.write_text("label,slide,comment\n1,tumor_001.tif,x\n0,normal_001,\nTumour,b.svs,\n\n")
    assert read_slide_labels(path) == {"tumor_001": 1, "normal_001": 0, "b": 1}


def test_camelyon16_reference_csv_without_header(tmp_path):
    path = tmp_path / "reference.csv"
    path.write_text("Test_001,Tumor,Macro,Primary\nTest_002,Normal\nTest_003,normal\n")
    assert read_slide_labels(path) == {"Test_001": 1, "Test_002": 0, "Test_003": 0}


def test_bad_labels_name_file_and_line(tmp_path):
    path = tmp_path / "labels.csv"
    path.write_text("slide,label\na,1\nb,maybe\n")
    with pytest.raises(LabelsError, match=r"labels\.csv: line 3: label 'maybe' of slide 'b' is not 0/1"):
        read_slide_labels(path)
    path.write_text("slide,label\na,1\na,0\n")
    with pytest.raises(LabelsError, match=r"lines 2 and 3 give slide 'a' different labels \(1 and 0\)"):
        read_slide_labels(path)
    path.write_text("name,class\na,1\n")
    with pytest.raises(LabelsError, match=r"line 1: 'name,class' is neither a header with a name column"):
        read_slide_labels(path)
    with pytest.raises(LabelsError, match="slide-labels file not found"):
        read_slide_labels(tmp_path / "missing.csv")


def test_eval_mask_round_trip_and_sidecar(tmp_path):
    rng = np.random.default_rng(0)
    mask = rng.random((40, 70)) > 0.7
    png = write_eval_mask(mask, tmp_path, "s1", downsample=32, dimensions_lv0=(70 * 32 - 5, 40 * 32),
                          meta={"mpp": 0.25, "slide_label": 1})
    assert png == eval_mask_paths(tmp_path, "s1")[0]
    back, meta = read_eval_mask(png)
    np.testing.assert_array_equal(back, mask)
    assert meta["shape"] == [40, 70] and meta["level"] == 5 and meta["mask_mpp"] == 8.0
    assert meta["tumor_pixels"] == int(mask.sum()) and meta["slide_label"] == 1
    assert np.array(Image.open(png)).max() == 255
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match=r"expected \(40, 70\)"):
        write_eval_mask(mask[:-1], tmp_path, "s2", downsample=32, dimensions_lv0=(70 * 32, 40 * 32))


def test_eval_mask_incomplete_or_mismatched(tmp_path):
    mask = np.zeros((4, 4), bool)
    png = write_eval_mask(mask, tmp_path, "s", downsample=3, dimensions_lv0=(12, 12))
    _, meta = read_eval_mask(png)
    assert meta["level"] is None  # 3 is no power of two
    sidecar = eval_mask_paths(tmp_path, "s")[1]
    data = json.loads(sidecar.read_text())
    data["shape"] = [5, 4]
    sidecar.write_text(json.dumps(data))
    with pytest.raises(AnnotationError, match=r"image is 4x4 but its sidecar says 4x5"):
        read_eval_mask(png)
    sidecar.unlink()
    with pytest.raises(AnnotationError, match=r"mask sidecar not found \(incomplete mask\?\)"):
        read_eval_mask(png)
