"""MNIST IDX reading (files written here in the real IDX format; nothing is downloaded)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.errors import ConfigError
from wsi_milssl.benchmark.digits import load_digit_images, normal_protocol, read_idx, read_mnist_idx


def _idx_bytes(array: np.ndarray) -> bytes:
    assert array.dtype == np.uint8
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _write_mnist(folder: Path, *, n_train: int, n_test: int, gz: bool) -> tuple[np.ndarray, np.ndarray]:
    """Write 28x28 MNIST-format files made by upscaling scikit-learn's digits; return (images, labels)."""
    digits = load_digit_images()
    n = n_train + n_test
    src = np.repeat(np.repeat(digits.images[:n], 3, axis=1), 3, axis=2)  # 24x24
    images = np.zeros((n, 28, 28), dtype=np.uint8)
    images[:, 2:26, 2:26] = np.round(src * 255).astype(np.uint8)
    labels = digits.labels[:n].astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    parts = {"train-images-idx3-ubyte": images[:n_train], "train-labels-idx1-ubyte": labels[:n_train],
             "t10k-images-idx3-ubyte": images[n_train:], "t10k-labels-idx1-ubyte": labels[n_train:]}
    for name, arr in parts.items():
        data = _idx_bytes(arr)
        if gz:
            with gzip.open(folder / f"{name}.gz", "wb") as fh:
                fh.write(data)
        else:
            (folder / name).write_bytes(data)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_read_mnist_pools_train_and_test_files(tmp_path, gz):
    images, labels = _write_mnist(tmp_path / "mnist", n_train=900, n_test=300, gz=gz)
    got = read_mnist_idx(tmp_path / "mnist")
    assert got.images.shape == (1200, 28, 28) and got.images.dtype == np.float32
    assert np.allclose(got.images, images / 255.0)
    assert np.array_equal(got.labels, labels.astype(np.int64))
    assert "MNIST IDX" in got.source
    assert load_digit_images(tmp_path / "mnist").images.shape == (1200, 28, 28)


def test_mnist_images_make_bags_of_784_features(tmp_path):
    _write_mnist(tmp_path / "m", n_train=1200, n_test=0, gz=False)
    train, test = normal_protocol(read_mnist_idx(tmp_path / "m"), ratio=0.1, bag_size=10, seed=0)
    assert train.features.shape[1] == 784 and train.image_shape == (28, 28)
    assert train.n_bags > 0 and test.n_bags > 0


def test_read_idx_round_trip_and_errors(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "ok").write_bytes(_idx_bytes(arr))
    assert np.array_equal(read_idx(tmp_path / "ok"), arr)
    (tmp_path / "bad").write_bytes(b"PK\x03\x04not idx")
    with pytest.raises(ConfigError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(_idx_bytes(arr)[:-5])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        read_idx(tmp_path / "short")
    with pytest.raises(ConfigError, match="IDX file not found"):
        read_idx(tmp_path / "missing")


def test_mnist_folder_errors_name_the_missing_piece(tmp_path):
    with pytest.raises(ConfigError, match="MNIST folder not found"):
        read_mnist_idx(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no MNIST IDX files found"):
        read_mnist_idx(tmp_path / "empty")
    half = tmp_path / "half"
    half.mkdir()
    (half / "train-images-idx3-ubyte").write_bytes(_idx_bytes(np.zeros((2, 28, 28), np.uint8)))
    with pytest.raises(ConfigError, match="but not its labels file"):
        read_mnist_idx(half)
