"""Detections CSV headers name the order of the columns (review AN, finding 1): a header 'x,y,prob' was
dropped and its rows still read as prob,x,y (prob 1500, y 0.9) without a word. Headers are now read by
their names, names not recognised are one error, and a prob outside [0, 1] is refused."""

from __future__ import annotations

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
    with pytest.raises(EvaluationError, match=rf"^{path}: line 1: header '{header}' does not name the columns prob, x "
                                              r"and y once each .*Fix: name the columns so"):
        read_detections(path)


@pytest.mark.parametrize("value", ["1500", "-0.1", "1.0001"])
def test_a_prob_outside_0_1_is_refused_naming_file_and_line(tmp_path, value):
    path = tmp_path / "s_detections.csv"
    path.write_text(f"0.5,10,20\n{value},30,40\n")
    with pytest.raises(EvaluationError, match=rf"^{path}: line 2: prob '{value}' lies outside \[0, 1\]\. Fix:"):
        read_detections(path)


def test_probs_at_the_ends_of_0_1_are_read(tmp_path):
    path = tmp_path / "s_detections.csv"
    path.write_text("0,10,20\n1,30,40\n1e-7,5,5\n")
    assert read_detections(path).probs.tolist() == [0.0, 1.0, 1e-7]
