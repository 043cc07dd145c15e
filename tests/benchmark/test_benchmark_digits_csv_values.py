"""read_mnist_csv: a NaN value is refused, a first row in scientific notation is data, and a pandas-numbered
header (0,1,...,784) is a header (the rule of wsi_milssl.mil.data.is_csv_header)."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_milssl.benchmark.digits import read_mnist_csv
from wsi_milssl.errors import ConfigError


def _rows(n: int, first: str = "0") -> list[str]:
    rng = np.random.default_rng(0)
    rows = [",".join(str(v) for v in rng.integers(0, 256, size=784)) + f",{i % 10}" for i in range(n)]
    rows[0] = first + rows[0][rows[0].index(","):]
    return rows


def test_a_nan_value_is_refused(tmp_path):
    rows = _rows(3)
    rows[1] = "nan" + rows[1][rows[1].index(","):]
    path = tmp_path / "nan.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ConfigError, match=r"nan\.csv: 1 row\(s\) hold a NaN or infinite value, the first is "
                                          r"data row 2"):
        read_mnist_csv(path)


def test_a_first_row_in_scientific_notation_is_data(tmp_path):
    path = tmp_path / "sci.csv"
    path.write_text("\n".join(_rows(3, first="1e2")) + "\n")
    got = read_mnist_csv(path)
    assert got.images.shape == (3, 28, 28) and got.images[0, 0, 0] == pytest.approx(100 / 255)


def test_a_numbered_header_is_a_header(tmp_path):
    path = tmp_path / "pandas.csv"
    path.write_text(",".join(str(i) for i in range(785)) + "\n" + "\n".join(_rows(3)) + "\n")
    assert read_mnist_csv(path).images.shape == (3, 28, 28)
