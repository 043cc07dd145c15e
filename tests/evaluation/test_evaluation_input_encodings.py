"""evaluate's inputs: a byte-order mark is not part of a column name, a file that is not UTF-8 or holds an absurd
number is one clear error naming it (review findings), never a traceback or a numpy overflow warning."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import ConfigError, EvaluationError
from wsi_milssl.evaluation.froc import evaluation_mask, match_detections
from wsi_milssl.evaluation.inputs import (
    read_detections,
    read_patch_probs,
    read_probs_sidecar,
    read_scores,
    resolve_slides,
)

BOM = "\ufeff"


def test_a_slide_list_with_a_byte_order_mark_is_read(tmp_path):
    p = tmp_path / "s1.csv"
    p.write_text(f"{BOM}path,slide\nslides/a.tif,s1\n", encoding="utf-8")
    assert resolve_slides(p) == {"a": tmp_path / "slides" / "a.tif", "s1": tmp_path / "slides" / "a.tif"}


def test_a_slide_list_that_is_not_utf8_is_one_error_naming_it(tmp_path):
    p = tmp_path / "s1.csv"
    p.write_bytes(b"slide,path\ns1,caf\xe9.tif\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: not UTF-8 text \(byte 17\); a slide list must be "
                                          r"UTF-8 \(or ASCII\) text\. Fix: "):
        resolve_slides(p)


def test_scores_with_a_byte_order_mark_are_read_and_non_utf8_scores_are_one_error(tmp_path):
    p = tmp_path / "scores.csv"
    p.write_text(f"{BOM}slide,score\na,0.25\nb.tif,0.5\n", encoding="utf-8")
    assert read_scores(p) == {"a": 0.25, "b": 0.5}
    p.write_bytes(b"slide,score\na,0.25\n\xff,0.5\n")
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(p))}: not UTF-8 text \(byte 19\); the slide scores "
                                              r"must be UTF-8"):
        read_scores(p)
    p.write_text("slide,score\na,0.25\na,0.5\n")
    with pytest.raises(EvaluationError, match=r"line 3: slide 'a' is listed twice"):
        read_scores(p)
    p.write_text("x,y\n1,2\n")
    with pytest.raises(EvaluationError, match=r"header must contain 'slide,score'; got \['x', 'y'\]"):
        read_scores(p)


def test_patch_tables_and_sidecars_that_are_not_utf8_are_one_error(tmp_path):
    patches = tmp_path / "s_patches.csv"
    patches.write_bytes(b"x_lv0,y_lv0,prob\n0,0,0.5\n\x80,0,0.5\n")
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(patches))}: not UTF-8 text \(byte 25\); the patch "
                                              r"probabilities"):
        read_patch_probs(patches)
    patches.write_text(f"{BOM}x_lv0,y_lv0,prob\n0,0,0.5\n10,20,0.25\n", encoding="utf-8")
    coords, probs = read_patch_probs(patches)
    assert coords.tolist() == [[0, 0], [10, 20]] and probs.tolist() == [0.5, 0.25]
    sidecar = tmp_path / "s_probs.json"
    sidecar.write_bytes(b'{"patch_size_lv0": 256, "slide": "caf\xe9"}')
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(sidecar))}: not UTF-8 text \(byte 37\); the "
                                              r"probability-map sidecar"):
        read_probs_sidecar(sidecar)


@pytest.mark.parametrize("key, value", [("patch_size_lv0", "Infinity"), ("patch_size_lv0", "NaN"),
                                        ("patch_size_lv0", "1e400"), ("mpp", "Infinity"), ("mpp", "-0.5"),
                                        ("mpp", "0")])
def test_sidecar_numbers_must_be_finite_and_positive(tmp_path, key, value):
    sidecar = tmp_path / "s_probs.json"
    fields = {"patch_size_lv0": "256", "mpp": "0.5", key: value}
    sidecar.write_text("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}")
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(sidecar))}: '{key}' is .*a finite number > 0\)"):
        read_probs_sidecar(sidecar)


def test_a_sidecar_without_mpp_is_read(tmp_path):
    sidecar = tmp_path / "s_probs.json"
    for doc in ({"patch_size_lv0": 256}, {"patch_size_lv0": 256.5, "mpp": None}):
        sidecar.write_text(json.dumps(doc))
        assert read_probs_sidecar(sidecar) == doc


def test_a_coordinate_beyond_any_slide_is_one_error_naming_file_and_line(tmp_path):
    dets = tmp_path / "s_detections.csv"
    dets.write_text("0.5,12,34\n0.9,1e300,3456\n")
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(dets))}: line 2: x '1e300' lies beyond any slide"):
        read_detections(dets)
    dets.write_text("0.5,12,34\n0.9,100,-3e12\n")
    with pytest.raises(EvaluationError, match=r"line 2: y '-3e12' lies beyond any slide"):
        read_detections(dets)
    patches = tmp_path / "s_patches.csv"
    patches.write_text("x_lv0,y_lv0,prob\n0,1e300,0.5\n")
    with pytest.raises(EvaluationError, match=r"line 2: y_lv0 '1e300' lies beyond any slide"):
        read_patch_probs(patches)


def test_matching_a_far_away_point_gives_no_overflow_warning():
    tumour = np.zeros((64, 64), bool)
    tumour[2:52, 2:52] = True  # 50 level-5 px of 8 µm: a lesion, not an ITC
    mask = evaluation_mask(tumour, mpp=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        labels = mask.label_at(np.array([1e300, 128.0, -1e300]), np.array([3456.0, 128.0, np.float64(1e19)]))
        match = match_detections(np.array([0.9, 0.8]), np.array([1e300, 128.0]), np.array([3456.0, 128.0]),
                                 mask=mask, stem="s")
    assert labels.tolist() == [0, mask.label_at(np.array([128.0]), np.array([128.0]))[0], 0]
    assert labels[1] > 0 and match.n_outside_mask == 1 and list(match.outcome) == ["fp", "tp"]


def _evaluate(tmp_path, *extra):
    preds = tmp_path / "preds"
    preds.mkdir(exist_ok=True)
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nn1,0\n")
    (tmp_path / "annotations").mkdir(exist_ok=True)
    return main(["evaluate", "--predictions", str(preds), "--labels", str(labels), "--out", str(tmp_path / "out"),
                 "--annotations", str(tmp_path / "annotations"), *extra])


@pytest.mark.parametrize("case", ["slides_csv", "scores", "detections"])
def test_evaluate_cli_reports_bad_inputs_in_one_line(tmp_path, capsys, case):
    preds = tmp_path / "preds"
    preds.mkdir()
    (preds / "n1_detections.csv").write_text("0.9,1e300,3456\n" if case == "detections" else "0.9,10,20\n")
    if case == "scores":
        (preds / "scores.csv").write_bytes(b"slide,score\nn1,0.9\n\xe9,0.1\n")
    slides = tmp_path / "slides.csv"
    slides.write_bytes(b"slide,path\nn1,n\xe91.tif\n" if case == "slides_csv" else b"slide,path\n")
    code = _evaluate(tmp_path, "--slides", str(slides))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and err.count("error: ") == 1, err
    expected = {"slides_csv": f"{slides}: not UTF-8 text (byte 15)",
                "scores": f"{preds / 'scores.csv'}: not UTF-8 text (byte 19)",
                "detections": f"{preds / 'n1_detections.csv'}: line 1: x '1e300' lies beyond any slide"}[case]
    assert expected in err, err
