"""Review findings on the readers: a junk first line of a detections file is not a header, a numbered
first row of a MIL CSV read as a header is said, a BOM in a digit CSV, and an output inside a folder of
MNIST input files."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from wsi_milssl.artifacts import read_detections
from wsi_milssl.errors import ConfigError, EvaluationError


@pytest.mark.parametrize("first", ["Traceback (most recent call last)", "<html><body>x</body></html>", "p;x;y"])
def test_a_junk_first_line_of_detections_is_an_error_not_a_header(tmp_path, first):
    path = tmp_path / "s_detections.csv"
    path.write_text(first + "\n")
    with pytest.raises(EvaluationError, match="line 1: expected 3 values"):
        read_detections(path)


def test_a_three_column_header_of_detections_is_skipped(tmp_path):
    path = tmp_path / "s_detections.csv"
    path.write_text("Confidence,X coordinate,Y coordinate\n0.9,10,20\n")
    det = read_detections(path)
    assert det.probs.tolist() == [0.9] and det.x_lv0.tolist() == [10.0] and det.y_lv0.tolist() == [20.0]


def test_a_numbered_first_row_read_as_a_header_is_reported(tmp_path, caplog):
    from wsi_milssl.mil.data import read_mil_csv

    path = tmp_path / "bags.csv"
    path.write_text("0,1,2\n1,1,5\n0,2,3\n0,2,4\n1,3,7\n0,3,1\n")
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.mil.data"):
        data = read_mil_csv(path)
    assert len(data) == 5
    assert any("read as pandas' column numbers" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    path.write_text("label,bag,f\n0,1,2\n1,1,5\n")
    with caplog.at_level(logging.WARNING, logger="wsi_milssl.mil.data"):
        assert len(read_mil_csv(path)) == 2
    assert not caplog.records


def test_a_digit_csv_with_a_byte_order_mark_reads(tmp_path):
    from wsi_milssl.benchmark.digits import read_mnist_csv

    rng = np.random.default_rng(0)
    rows = [",".join(map(str, [*rng.integers(0, 256, 784), d])) for d in (3, 5, 7)]
    path = tmp_path / "digits.csv"
    path.write_bytes(b"\xef\xbb\xbf" + ("\n".join(rows) + "\n").encode())
    digits = read_mnist_csv(path)
    assert len(digits.images) == 3 and digits.labels.tolist() == [3, 5, 7]


def test_an_output_onto_a_file_in_the_mnist_folder_is_refused(tmp_path):
    from wsi_milssl.cli.benchmark import refuse_shared_paths

    folder = tmp_path / "mnist"
    folder.mkdir()
    (folder / "train-images-idx3-ubyte").write_bytes(b"x")
    with pytest.raises(ConfigError, match="--json names the same file as the input .*train-images-idx3-ubyte"):
        refuse_shared_paths({"--mnist": folder}, {"--json": folder / "train-images-idx3-ubyte"})
    refuse_shared_paths({"--mnist": folder}, {"--json": folder / "results.json"})  # a new file beside them is fine
