"""Instance readers (MIL CSV, HDF5 features, labels CSV), preprocessing and augmentation."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest
import torch

from wsi_milssl.errors import ConfigError, StoreError
from wsi_milssl.mil import read_feature_files, read_labels_csv, read_mil_csv, to_tensor
from wsi_milssl.mil.data import NORMALISATION, to_unit_float
from wsi_milssl.mil.pixels import LUMA_WEIGHTS, prepare_patches


def test_read_mil_csv(mil_csv):
    inst = read_mil_csv(mil_csv)
    assert inst.kind == "features" and inst.n_bags == 40 and inst.in_features == 8
    assert inst.bag_labels.sum() == 20 and inst.features.dtype == np.float32
    assert inst.instance_labels is not None
    sub = inst.subset_bags([3, 0])
    assert sub.bag_names == [inst.bag_names[3], inst.bag_names[0]]
    assert np.all(np.diff(sub.bag_ids) >= 0) and len(sub) == np.isin(inst.bag_ids, [0, 3]).sum()


def test_mil_csv_with_bag_labels_only_has_no_instance_labels(tmp_path):
    # MUSK/ELEPHANT repeat the bag label on every instance: that says nothing about instances
    path = tmp_path / "bags.csv"
    path.write_text("1,a,0.1,0.2\n1,a,0.3,0.1\n0,b,0.0,0.0\n")
    inst = read_mil_csv(path)
    assert inst.instance_labels is None and inst.bag_labels.tolist() == [1, 0]


def test_a_bag_id_whose_rows_are_apart_is_warned_about(tmp_path, caplog):
    """Review CD: ids reused for other bags further down the file merged two bags without a word."""
    path = tmp_path / "bags.csv"
    path.write_text("0,a,0.1,0.2\n0,b,0.3,0.1\n1,c,0.0,0.0\n1,a,0.5,0.5\n")
    inst = read_mil_csv(path)
    assert inst.bag_names == ["a", "b", "c"] and inst.bag_labels.tolist() == [1, 0, 1]
    assert "the rows of 1 bag id(s) are not together (a): rows with one id are one bag" in caplog.text
    caplog.clear()
    path.write_text("0,a,0.1,0.2\n0,a,0.3,0.1\n1,c,0.0,0.0\n")  # each bag's rows together: no word
    read_mil_csv(path)
    assert "not together" not in caplog.text


@pytest.mark.parametrize(
    "text, match",
    [("1,a\n", "at least one feature"), ("1,a,0.1\n0,b,0.1,0.2\n", "line 2 has 4 columns, expected 3"),
     ("2,a,0.1\n", "must be 0 or 1"), ("1,a,x\n", "non-numeric")],
)
def test_mil_csv_errors(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_mil_csv(path)


def test_labels_csv(tmp_path):
    from wsi_milssl.errors import LabelsError

    path = tmp_path / "labels.csv"
    path.write_text("slide,label\nslides/a.tif,1\nb,0\nc,tumor\n")
    assert read_labels_csv(path) == {"a": 1, "b": 0, "c": 1}
    path.write_text("name_of_thing,y\na,1\n")
    with pytest.raises(LabelsError, match="is neither a header with a name column"):
        read_labels_csv(path)
    path.write_text("slide,label\na,maybe\n")
    with pytest.raises(LabelsError, match="line 2: label 'maybe'"):
        read_labels_csv(path)
    with pytest.raises(LabelsError, match="labels file not found"):
        read_labels_csv(tmp_path / "missing.csv")


def test_read_feature_files_per_slide_and_multi_bag(tmp_path):
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "s1.h5", "w") as fh:
        fh["features"] = rng.normal(size=(5, 4)).astype(np.float32)
        fh["instance_label"] = np.array([1, 0, 0, 0, 0], dtype=np.uint8)
    with h5py.File(tmp_path / "many.h5", "w") as fh:
        fh["features"] = rng.normal(size=(6, 4)).astype(np.float32)
        fh["bag_ids"] = np.array([b"x", b"y", b"x", b"y", b"x", b"y"])
        fh["instance_label"] = np.zeros(6, dtype=np.uint8)
    inst = read_feature_files([tmp_path / "s1.h5", tmp_path / "many.h5"], {"s1": 1, "x": 0, "y": 0})
    assert inst.bag_names == ["s1", "x", "y"] and inst.bag_labels.tolist() == [1, 0, 0]
    assert len(inst) == 11 and inst.instance_labels.sum() == 1
    assert np.all(np.diff(inst.bag_ids) >= 0)
    with pytest.raises(ConfigError, match="bag 'y' has no row in the labels;"):
        read_feature_files([tmp_path / "many.h5"], {"x": 0})
    (tmp_path / "te").mkdir()  # labels read from a file are named by it (review BX: always "labels.csv")
    (tmp_path / "te" / "val_labels.csv").write_text("slide,label\nx,0\n")
    labels = re.escape(str(tmp_path / "te" / "val_labels.csv"))
    with pytest.raises(ConfigError, match=rf"bag 'y' has no row in {labels};"):
        read_feature_files([tmp_path / "many.h5"], read_labels_csv(tmp_path / "te" / "val_labels.csv"))
    with h5py.File(tmp_path / "nofeat.h5", "w") as fh:
        fh["coords"] = np.zeros((2, 2))
    with pytest.raises(StoreError, match="no 'features' dataset"):
        read_feature_files([tmp_path / "nofeat.h5"], {"nofeat": 1})


def test_to_tensor_layout_and_normalisation():
    patches = np.zeros((2, 4, 5, 3), dtype=np.uint8)
    patches[1, ..., 0] = 255
    x = to_tensor(patches)
    assert x.shape == (2, 3, 4, 5) and x.dtype == torch.float32
    mean, std = NORMALISATION["mean"], NORMALISATION["std"]
    assert x[0, 0, 0, 0].item() == pytest.approx(-mean[0] / std[0])
    assert x[1, 0, 0, 0].item() == pytest.approx((1 - mean[0]) / std[0])
    with pytest.raises(ValueError, match="uint8 \\(B, H, W, 3\\)"):
        to_tensor(np.zeros((2, 4, 4, 3), dtype=np.float32))


def _reference_augment(x_unit: torch.Tensor, draws: torch.Tensor, jitter: float) -> torch.Tensor:
    """The augmentation written out step by step (float (B, 3, H, W) in [0, 1]), as docs describe it."""
    out = []
    w = torch.tensor(LUMA_WEIGHTS).view(3, 1, 1)
    for img, d in zip(x_unit, draws):
        if d[0] < 0.5:
            img = img.flip(-1)
        if d[1] < 0.5:
            img = img.flip(-2)
        if d[2] < 0.5:
            img = img.rot90(1, (1, 2))
        b, c, s = (1.0 + (2.0 * d[3:6] - 1.0) * jitter).tolist()
        img = img * b
        m = (img * w).sum(0).mean()
        img = (img - m) * c + m
        gray = (img * w).sum(0, keepdim=True)
        img = ((img - gray) * s + gray).clamp(0, 1)
        out.append(img)
    return torch.stack(out)


def test_prepare_patches_matches_the_written_out_augmentation():
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, size=(16, 8, 8, 3), dtype=np.uint8))
    mean = torch.tensor(NORMALISATION["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(NORMALISATION["std"]).view(1, 3, 1, 1)
    for jitter in (0.0, 0.3):
        got = prepare_patches(pixels, generator=torch.Generator().manual_seed(1), colour_jitter=jitter)
        draws = torch.rand(16, 6, generator=torch.Generator().manual_seed(1))
        want = (_reference_augment(to_unit_float(pixels), draws, jitter) - mean) / std
        assert got.shape == (16, 3, 8, 8) and got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    plain = prepare_patches(pixels)  # no generator: the normalisation alone
    torch.testing.assert_close(plain, (to_unit_float(pixels) - mean) / std, atol=1e-6, rtol=0)


@pytest.mark.gpu
def test_cuda_augmentation_never_waits_for_the_device_and_matches_the_cpu():
    # deselected by default (pyproject addopts); run on a GPU machine with: pytest -m gpu
    # A blocking host-to-device copy waits for every queued kernel: once per training step it left the
    # GPU idle while the next step was launched (training pass 0.59x the bare step on an H100).
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, size=(32, 16, 16, 3), dtype=np.uint8))
    on_gpu = pixels.cuda()
    torch.cuda.synchronize()
    for jitter in (0.0, 0.3):
        want = prepare_patches(pixels, generator=torch.Generator().manual_seed(4), colour_jitter=jitter)
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
        try:
            got = prepare_patches(on_gpu, generator=torch.Generator().manual_seed(4), colour_jitter=jitter)
            plain = prepare_patches(on_gpu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=0)
        torch.testing.assert_close(plain.cpu(), prepare_patches(pixels), atol=1e-5, rtol=0)


def test_prepare_patches_is_reproducible_and_geometric_only_without_jitter():
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, size=(16, 8, 8, 3), dtype=np.uint8))
    a = prepare_patches(pixels, generator=torch.Generator().manual_seed(1), colour_jitter=0.05)
    b = prepare_patches(pixels, generator=torch.Generator().manual_seed(1), colour_jitter=0.05)
    x = prepare_patches(pixels)
    assert torch.equal(a, b) and not torch.equal(a, x)
    low = (0 - torch.tensor(NORMALISATION["mean"])) / torch.tensor(NORMALISATION["std"])
    high = (1 - torch.tensor(NORMALISATION["mean"])) / torch.tensor(NORMALISATION["std"])
    assert (a >= low.view(1, 3, 1, 1) - 1e-6).all() and (a <= high.view(1, 3, 1, 1) + 1e-6).all()
    g = prepare_patches(pixels, generator=torch.Generator().manual_seed(2), colour_jitter=0.0)
    changed = 0
    for i in range(16):  # each output is one of the 8 symmetries of its input square
        variants = [torch.rot90(x[i], k, (1, 2)) for k in range(4)]
        variants += [v.flip(-1) for v in variants]
        assert any(torch.equal(g[i], v) for v in variants)
        changed += not torch.equal(g[i], x[i])
    assert changed > 8


def test_each_patch_gets_the_symmetry_its_draws_name():
    """The symmetry of patch i is fixed by its own draws (bit 0 horizontal flip, bit 1 vertical flip, bit 2
    rotation after the flips), whatever the other patches of the batch get, so a seed gives the same
    batch in every version of the batched transform."""
    rng = np.random.default_rng(3)
    pixels = torch.from_numpy(rng.integers(0, 256, size=(40, 6, 6, 3), dtype=np.uint8))
    got = prepare_patches(pixels, generator=torch.Generator().manual_seed(9), colour_jitter=0.0)
    draws = torch.rand(40, 6, generator=torch.Generator().manual_seed(9))
    want = []
    for i in range(40):
        p = pixels[i]
        if draws[i, 0] < 0.5:
            p = p.flip(1)
        if draws[i, 1] < 0.5:
            p = p.flip(0)
        if draws[i, 2] < 0.5:
            p = p.rot90(1, (0, 1))
        want.append(p)
    assert torch.equal(got, prepare_patches(torch.stack(want)))
    codes = {(bool(d[0] < 0.5), bool(d[1] < 0.5), bool(d[2] < 0.5)) for d in draws}
    assert len(codes) == 8  # every symmetry occurs, so each transform is checked against the others


@pytest.mark.parametrize("value", ["nan", "inf", "1e40"])
def test_a_mil_csv_with_a_non_finite_feature_is_refused(tmp_path, value):
    """Was read as it is: a NaN feature then made the training loss NaN, reported as a diverged run."""
    path = tmp_path / "bad.csv"
    path.write_text(f"label,bag,f1,f2\n0,a,1,2\n1,b,3,{value}\n1,b,1,1\n0,a,0,0\n")
    with pytest.raises(ConfigError, match=r"bad\.csv: 1 instance row\(s\) have a NaN or infinite feature .* the first "
                                          r"on line 3; fix"):
        read_mil_csv(path)
