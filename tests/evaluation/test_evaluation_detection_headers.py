"""Detections CSV headers name the order of the columns (review AN, finding 1): a header 'x,y,prob' was
dropped and its rows still read as prob,x,y (prob 1500, y 0.9) without a word. Headers are now read by
their names, names not recognised are one error; scores outside [0, 1] are read with a warning (review AQ), unless
the file has no header and every y lies in [0, 1] (its columns swapped)."""

from __future__ import annotations

import re

import pytest

from wsi_milssl.errors import EvaluationError
from wsi_milssl.evaluation import read_detections


@pytest.mark.parametrize("header, row", [
    ("x,y,prob", "1500,2300,0.9"),
    ("X,Y,Probability", "1500,2300,0.9"),
    ("Y coordinate,Confidence,X coordinate", "2300,0.9,1500"),
    ("Confidence,X coordinate,Y coordinate", "0.9,1500,2300"),
    ("score, y_lv0, x_lv0", "0.9,2300,1500"),
    ("\ufeffp,x,y", "0.9,1500,2300"),
])
def test_a_header_gives_the_order_of_the_columns(tmp_path, header, row):
    path = tmp_path / "s.csv"
    path.write_text(f"{header}\n{row}\n", encoding="utf-8")
    dets = read_detections(path)
    assert dets.probs.tolist() == [0.9] and dets.x_lv0.tolist() == [1500] and dets.y_lv0.tolist() == [2300]


@pytest.mark.parametrize("header", ["a,b,c", "x,y,z", "prob,x,x", "prob,prob,y"])
def test_a_header_of_other_names_is_one_error_naming_file_and_header(tmp_path, header):
    path = tmp_path / "s.csv"
    path.write_text(f"{header}\n0.9,1500,2300\n")
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(path))}: line 1: header '{header}' does not name "
                                              r"the columns prob, x and y once each .*Fix: name the columns so"):
        read_detections(path)


@pytest.mark.parametrize("value", ["1500", "-0.1", "1.0001", "-3.5"])
def test_scores_outside_0_1_are_read_with_a_warning(tmp_path, value, caplog):
    """Other tools write logits or percentages; the FROC uses the scores' order only (review AQ: they were
    refused)."""
    path = tmp_path / "s_detections.csv"
    path.write_text(f"0.5,10,20\n{value},30,40\n")
    dets = read_detections(path)
    assert dets.probs.tolist() == [0.5, float(value)] and dets.y_lv0.tolist() == [20, 40]
    assert f"{path}: 1 detection score(s) outside [0, 1]" in caplog.text and "order only" in caplog.text


def test_headerless_columns_in_another_order_are_refused(tmp_path):
    """x,y,prob without a header reads x as the score and the probabilities as y: every y in [0, 1]."""
    path = tmp_path / "s_detections.csv"
    path.write_text("1500,2300,0.9\n800,400,0.2\n")
    with pytest.raises(EvaluationError, match=rf"^{re.escape(str(path))}: its scores reach 1500 \(about line 1\) "
                                              r"while every y lies in \[0, 1\]: the columns seem to be in another "
                                              r"order"):
        read_detections(path)
    path.write_text("x,y,prob\n1500,2300,0.9\n800,400,0.2\n")  # named: read as they say
    assert read_detections(path).probs.tolist() == [0.9, 0.2]


def test_probs_inside_0_1_warn_nothing(tmp_path, caplog):
    path = tmp_path / "s_detections.csv"
    path.write_text("0.9,1,0\n0.2,0,1\n")
    assert read_detections(path).probs.tolist() == [0.9, 0.2] and "outside" not in caplog.text


def test_probs_at_the_ends_of_0_1_are_read(tmp_path):
    path = tmp_path / "s_detections.csv"
    path.write_text("0,10,20\n1,30,40\n1e-7,5,5\n")
    assert read_detections(path).probs.tolist() == [0.0, 1.0, 1e-7]
