"""Review ED: two things the MIL CSV reader did without a word. Features were parsed straight to float32, so a
column far from 0 for its spread lost its differences (1e9 added to every MUSK1 feature left about 6 distinct
values per column of 73); and a bag whose rows disagree on the label became positive (the first column read as
instance labels), which a file meant to hold bag labels reads the same way."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from wsi_milssl.errors import ConfigError
from wsi_milssl.mil import read_mil_csv


def _write(path, rows):
    path.write_text("".join(",".join(str(v) for v in r) + "\n" for r in rows))
    return path


def test_features_far_from_zero_for_their_spread_are_warned_about_and_read_exactly_below(tmp_path, caplog):
    rng = np.random.default_rng(0)
    rows = [[i % 2, f"b{i // 2}", *rng.normal(size=3).round(6)] for i in range(20)]
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.mil.data"):
        plain = read_mil_csv(_write(tmp_path / "plain.csv", rows))
    assert caplog.text == ""
    np.testing.assert_allclose(plain.features, np.array([r[2:] for r in rows], np.float32))
    far = [[r[0], r[1], r[2] + 1e9, *r[3:]] for r in rows]
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.mil.data"):
        read_mil_csv(_write(tmp_path / "far.csv", far))
    assert ("far.csv: float32, which the models read, moves the values of 1 feature column(s) by more than 1 % of "
            "their spread, as they lie far from 0 for it (column 1: mean 1e+09") in caplog.text
    assert "Fix: centre the features (subtract each column's mean) before writing the CSV." in caplog.text
    caplog.clear()
    # review EH: columns float32 keeps (1e5 plus rare 0/1 values, exactly; N(2e4, 1), to 0.1 %) are not named
    kept = [[r[0], r[1], 1e5 + (i == 3), 2e4 + r[3], r[4]] for i, r in enumerate(rows)]
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.mil.data"):
        read_mil_csv(_write(tmp_path / "kept.csv", kept))
    assert caplog.text == ""


def test_a_bag_whose_rows_disagree_is_positive_and_said_so(tmp_path, caplog):
    rows = [[0, "a", 0.1], [1, "a", 0.9], [0, "b", 0.2], [0, "b", 0.3]]
    with caplog.at_level(logging.INFO, logger="wsi_milssl.mil.data"):
        bags = read_mil_csv(_write(tmp_path / "mixed.csv", rows))
    assert bags.bag_labels.tolist() == [1, 0] and bags.instance_labels.tolist() == [0, 1, 0, 0]
    assert ("mixed.csv: 1 bag(s) hold rows labelled 0 and rows labelled 1 (a): the first column is read as instance "
            "labels (kept for evaluation only), and each bag is positive when any of its rows is 1.") in caplog.text


def test_a_trailing_comma_on_every_row_is_read_and_another_separator_names_the_first_line(tmp_path):
    """Review ED, C6: a trailing comma on every row (as many exporters write) failed with "could not convert
    string to float: ''"; a semicolon-separated file's first row was taken for a header, so the error named line 2."""
    rows = [["label", "bag", "f1", ""], [0, "a", 0.1, ""], [1, "b", 0.9, ""]]
    bags = read_mil_csv(_write(tmp_path / "trailing.csv", rows))
    assert bags.features.shape == (2, 1) and bags.bag_labels.tolist() == [0, 1]
    (tmp_path / "semi.csv").write_text("0;a;0.1\n1;b;0.9\n")
    with pytest.raises(ConfigError, match=r"semi\.csv: rows need label,bag_id and at least one feature; got 1 "
                                          r"columns \(line 1\)\. The values look separated by semicolons"):
        read_mil_csv(tmp_path / "semi.csv")


def test_a_header_without_the_rows_trailing_comma_is_read_and_mixed_label_kinds_are_warned_about(tmp_path, caplog):
    """Review EH, C3-C4: a header without a trailing comma over rows with one failed on ''; bags repeating the bag
    label beside bags of instance labels made every row of the former a positive instance without a word."""
    path = tmp_path / "hdr.csv"
    path.write_text("label,bag,f1\n0,a,0.1,\n1,b,0.9,\n")
    assert read_mil_csv(path).features.shape == (2, 1)
    rows = [[1, "p1", 0.9], [1, "p1", 0.8], [0, "p2", 0.1], [1, "p2", 0.7], [0, "n", 0.2]]
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.mil.data"):
        read_mil_csv(_write(tmp_path / "kinds.csv", rows))
    assert ("kinds.csv: 1 positive bag(s) hold rows labelled 0 and 1 positive bag(s) of several rows hold only rows "
            "labelled 1 (p1)") in caplog.text
