"""The label stage on real HDF5 and Zarr stores made for the generated slides."""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from matplotlib.path import Path as MplPath

from diskfaults import can_mount, read_only_folder
from processes import hold_lock
from wsi_milssl.annotations import rasterize_region, read_annotations
from wsi_milssl.cli import main
from wsi_milssl.config import LabelConfig
from wsi_milssl.errors import ConfigError, FolderLockedError, StoreError
from wsi_milssl.labeling import STATUS_CSV, label_store, label_stores, read_eval_mask
from wsi_milssl.store import create_writer, open_store

SLIDE_PX = 4096
PATCH_LV0 = 192
STRIDE_LV0 = 160  # overlapping patches: order and overlap must not matter


def _make_store(path, stem, slide_path):
    xs, ys = np.meshgrid(np.arange(0, SLIDE_PX - PATCH_LV0 + 1, STRIDE_LV0),
                         np.arange(0, SLIDE_PX - PATCH_LV0 + 1, STRIDE_LV0))
    coords = np.c_[xs.ravel(), ys.ravel()].astype(np.int64)
    with create_writer(path, pixels="none", patch_size_px=PATCH_LV0 // 2) as writer:
        writer.append(coords=coords, entropy_bits=np.full(len(coords), 5.0), tissue_fraction=np.ones(len(coords)))
        writer.finalize({
            "slide_path": str(slide_path), "slide_stem": stem, "dimensions_lv0": [SLIDE_PX, SLIDE_PX], "mpp": 0.25,
            "target_mpp": 0.5, "patch_size_px": PATCH_LV0 // 2, "patch_size_lv0": PATCH_LV0,
            "stride_px": STRIDE_LV0 // 2, "stride_lv0": STRIDE_LV0, "pixels": "none", "config_hash": "test",
        })
    return path


@pytest.fixture
def stores(synth_dir, tmp_path, request):
    fmt = getattr(request, "param", "h5")
    out = tmp_path / "stores"
    paths = {}
    for stem in ("synth_000", "synth_001"):
        paths[stem] = _make_store(out / f"{stem}.{fmt}", stem, synth_dir / f"{stem}.tif")
    return paths


def _tree_digest(path):
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _reference_fraction(xml_path, coords, size, samples=24):
    """Independent: stdlib XML + matplotlib point-in-polygon on samples x samples points per patch."""
    tumour, holes = [], []
    for el in ET.parse(xml_path).getroot().iter("Annotation"):
        xy = np.array([[float(c.get("X")), float(c.get("Y"))] for c in el.iter("Coordinate")])
        (holes if el.get("PartOfGroup") == "_2" else tumour).append(MplPath(xy))
    offs = (np.arange(samples) + 0.5) * size / samples
    ox, oy = np.meshgrid(offs, offs)
    pts = (coords[:, None, :] + np.c_[ox.ravel(), oy.ravel()][None]).reshape(-1, 2)
    inside = np.zeros(len(pts), bool)
    for p in tumour:
        inside |= p.contains_points(pts)
    for p in holes:
        inside &= ~p.contains_points(pts)
    return inside.reshape(len(coords), -1).mean(axis=1)


@pytest.mark.parametrize("stores", ["h5", "zarr"], indirect=True)
def test_label_stores_writes_fractions_labels_and_masks(stores, synth_dir, tmp_path):
    out = tmp_path / "labels"
    report = label_stores(list(stores.values()), annotations_dir=synth_dir, labels_csv=synth_dir / "labels.csv",
                          out_dir=out)
    assert report.n_failed == 0
    assert report.unmatched_annotations == [] and report.stores_without_annotation == ["synth_001"]
    by_stem = {r.stem: r for r in report.results}
    assert by_stem["synth_000"].label_status == "annotated" and by_stem["synth_001"].label_status == "negative"

    with open_store(stores["synth_000"]) as store:
        fraction = store.read_array("tumor_fraction")
        labels = store.read_array("instance_label")
        attrs = store.attrs
        coords = store.coords
    assert fraction.dtype == np.float32 and labels.dtype == np.uint8 and fraction.shape == (len(coords),)
    ref = _reference_fraction(synth_dir / "synth_000.xml", coords, PATCH_LV0)
    assert (ref > 0).sum() > 20
    assert np.abs(fraction - ref).max() < 0.01
    np.testing.assert_array_equal(labels, (fraction >= 0.25).astype(np.uint8))
    assert 0 < labels.sum() == attrs["n_positive_patches"] == by_stem["synth_000"].n_positive
    assert attrs["slide_label"] == 1 and attrs["slide_label_source"] == "labels.csv"
    assert attrs["positive_fraction"] == 0.25 and attrs["label_annotation"].endswith("synth_000.xml")

    with open_store(stores["synth_001"]) as store:
        assert store.attrs["slide_label"] == 0
        assert not store.read_array("tumor_fraction").any() and not store.read_array("instance_label").any()

    mask, meta = read_eval_mask(by_stem["synth_000"].mask_path)
    assert meta["downsample"] == 32 and meta["level"] == 5 and meta["dimensions_lv0"] == [SLIDE_PX, SLIDE_PX]
    expected = rasterize_region(read_annotations(synth_dir / "synth_000.xml").region,
                                dimensions_lv0=(SLIDE_PX, SLIDE_PX), downsample=32)
    np.testing.assert_array_equal(mask, expected)
    assert mask.sum() > 100
    normal_mask, _ = read_eval_mask(out / "synth_001_tumor_mask.json")
    assert normal_mask.shape == (128, 128) and not normal_mask.any()

    with open(out / STATUS_CSV) as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["slide"], r["status"], r["slide_label"]) for r in rows] == [("synth_000", "ok", "1"),
                                                                          ("synth_001", "ok", "0")]
    assert (out / "label_config.json").is_file()


def _store_stamps(stores):
    """Per store: its content digest and the modification times (ns) of its files (a Zarr store is a folder)."""
    def mtimes(path):
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return [f.stat().st_mtime_ns for f in files]
    return {stem: (_tree_digest(path), mtimes(path)) for stem, path in stores.items()}


@pytest.mark.parametrize("stores", ["h5", "zarr"], indirect=True)
@pytest.mark.parametrize("via", ["api", "cli"])
def test_a_changed_mask_downsample_writes_the_masks_alone(stores, synth_dir, tmp_path, via):
    """revAC 1: changing mask_downsample (a setting of the mask PNGs alone) rewrote every store, so heatmap
    predicted every slide again. The stores stay untouched (same content and modification time); the masks are
    written again at the new downsample (status 'mask'); a further run skips everything."""
    out = tmp_path / "labels"

    def label(downsample):
        if via == "cli":
            assert main(["label", str(tmp_path / "stores"), "--annotations", str(synth_dir), "--labels",
                         str(synth_dir / "labels.csv"), "--out", str(out), "--mask-downsample", str(downsample)]) == 0
            return {stem: row["status"] for stem, row in _read_status(out).items()}
        report = label_stores(list(stores.values()), annotations_dir=synth_dir, labels_csv=synth_dir / "labels.csv",
                              out_dir=out, config=LabelConfig(mask_downsample=downsample))
        return {r.stem: r.status for r in report.results}

    assert label(32) == {"synth_000": "ok", "synth_001": "ok"}
    before = _store_stamps(stores)
    assert label(16) == {"synth_000": "mask", "synth_001": "mask"}
    assert _store_stamps(stores) == before
    mask, meta = read_eval_mask(out / "synth_000_tumor_mask.png")
    assert meta["downsample"] == 16 and mask.shape == (SLIDE_PX // 16, SLIDE_PX // 16)
    expected = rasterize_region(read_annotations(synth_dir / "synth_000.xml").region,
                                dimensions_lv0=(SLIDE_PX, SLIDE_PX), downsample=16)
    np.testing.assert_array_equal(mask, expected)
    assert read_eval_mask(out / "synth_001_tumor_mask.png")[1]["downsample"] == 16
    assert _read_status(out)["synth_000"]["mask"] == str(out / "synth_000_tumor_mask.png")
    assert label(16) == {"synth_000": "skipped", "synth_001": "skipped"}
    assert _store_stamps(stores) == before


def test_write_masks_turned_on_or_off_leaves_the_stores_alone(stores, synth_dir, tmp_path):
    """revAC 1: turning write_masks on after a run without masks rewrote every store. Now the masks alone are
    written; turning it off again skips the stores and leaves the masks written before in place."""
    out = tmp_path / "labels"

    def label(write_masks):
        report = label_stores(list(stores.values()), annotations_dir=synth_dir, labels_csv=synth_dir / "labels.csv",
                              out_dir=out, config=LabelConfig(write_masks=write_masks))
        assert report.n_failed == 0
        return {r.stem: (r.status, r.mask_path) for r in report.results}

    assert label(False) == {"synth_000": ("ok", None), "synth_001": ("ok", None)}
    assert not list(out.glob("*_tumor_mask*"))
    before = _store_stamps(stores)
    masks = {stem: out / f"{stem}_tumor_mask.png" for stem in stores}
    assert label(True) == {stem: ("mask", masks[stem]) for stem in stores}
    assert _store_stamps(stores) == before
    assert read_eval_mask(masks["synth_000"])[0].sum() > 100
    (out / "synth_001_tumor_mask.png").unlink()  # a deleted mask is written again, the store left alone
    assert label(True) == {"synth_000": ("skipped", masks["synth_000"]), "synth_001": ("mask", masks["synth_001"])}
    assert label(False) == {"synth_000": ("skipped", None), "synth_001": ("skipped", None)}
    assert _store_stamps(stores) == before
    assert all(path.is_file() for path in masks.values())


def test_positive_fraction_threshold(stores, synth_dir):
    result = label_store(stores["synth_000"], annotation_path=synth_dir / "synth_000.xml",
                         config=LabelConfig(positive_fraction=0.9))
    with open_store(stores["synth_000"]) as store:
        fraction = store.read_array("tumor_fraction")
        np.testing.assert_array_equal(store.read_array("instance_label"), fraction >= np.float32(0.9))
        assert store.attrs["slide_label_source"] == "annotations" and store.attrs["slide_label"] == 1
    assert result.mask_path is None  # no mask_dir given
    assert 0 < result.n_positive < (fraction >= 0.25).sum()


@pytest.mark.parametrize("stores", ["h5", "zarr"], indirect=True)
def test_hostile_xml_rejected_and_store_untouched(stores, synth_dir, tmp_path, capsys):
    ann_dir = tmp_path / "ann"
    ann_dir.mkdir()
    (ann_dir / "synth_000.xml").write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>\n'
        '<ASAP_Annotations><Annotations><Annotation Name="&lol2;" PartOfGroup="_0"/></Annotations>'
        "</ASAP_Annotations>\n"
    )
    before = _tree_digest(stores["synth_000"])
    out = tmp_path / "labels"
    code = main(["label", str(stores["synth_000"]), "--annotations", str(ann_dir), "--out", str(out)])
    assert code == 1
    printed = capsys.readouterr().out
    assert "failed" in printed and "refused XML with a DOCTYPE" in printed
    assert _tree_digest(stores["synth_000"]) == before
    with open_store(stores["synth_000"]) as store:
        assert not store.has("tumor_fraction") and "slide_label" not in store.attrs
    assert not list(out.glob("synth_000_tumor_mask*"))
    rows = list(csv.DictReader(open(out / STATUS_CSV)))
    assert rows[0]["status"] == "failed" and "XXE" in rows[0]["error"]


def test_tumour_slide_without_annotations_and_name_mismatches(stores, synth_dir, tmp_path, caplog, capsys):
    ann_dir = tmp_path / "ann"
    ann_dir.mkdir()
    shutil.copy(synth_dir / "synth_000.xml", ann_dir / "synth_000.xml")
    shutil.copy(synth_dir / "synth_000.xml", ann_dir / "slide_999.xml")  # matches no store
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nsynth_000.tif,1\nsynth_001,tumor\n")
    with caplog.at_level(logging.WARNING):
        code = main(["label", str(stores["synth_000"].parent), "--annotations", str(ann_dir), "--labels", str(labels),
                     "--out", str(tmp_path / "out")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "annotation files matching no store (1): slide_999.xml" in printed
    assert "tumour slides without annotations (1): synth_001" in printed
    assert "synth_001: tumour-labelled slide without annotations" in caplog.text
    assert "1 annotation file(s) in" in caplog.text and "slide_999.xml" in caplog.text
    with open_store(stores["synth_001"]) as store:
        assert store.attrs["slide_label"] == 1 and store.attrs["label_status"] == "unannotated"
        assert not store.has("tumor_fraction") and not store.has("instance_label")
    assert not (tmp_path / "out" / "synth_001_tumor_mask.png").exists()


def test_missing_stores_or_folder_and_bad_config(tmp_path, stores):
    with pytest.raises(StoreError, match="no such file or folder"):
        label_stores(tmp_path / "nothing", annotations_dir=tmp_path)
    with pytest.raises(Exception, match="annotation folder not found"):
        label_stores(stores["synth_000"], annotations_dir=tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"LabelConfig.positive_fraction must satisfy 0.0 < value <= 1.0; got 0"):
        LabelConfig(positive_fraction=0)
    with pytest.raises(ConfigError, match=r"group\(s\) _2 are in both tumor_groups and non_tumor_groups"):
        LabelConfig(tumor_groups=("_0", "_2"))


def test_two_stores_of_one_slide_are_refused(stores, synth_dir, tmp_path, capsys):
    """The reviewer's folder: `tile --format zarr --overwrite` after an HDF5 run leaves synth_001.h5 and
    synth_001.zarr. label used to label both, print the slide twice and keep one row in
    label_status.csv; it now stops with one error naming both stores, as `heatmap --store` does, and
    labels the store it is given."""
    folder = stores["synth_000"].parent
    zarr = _make_store(folder / "synth_001.zarr", "synth_001", synth_dir / "synth_001.tif")
    out = tmp_path / "labels"
    assert main(["label", str(folder), "--annotations", str(synth_dir), "--out", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"error: stores {stores['synth_001']} and {zarr} are both for slide 'synth_001'; pass one (give its path, "
        "or move the other to another folder).\n")
    assert not out.exists()
    report = label_stores([stores["synth_000"], zarr], annotations_dir=synth_dir, out_dir=out)
    assert [(r.stem, r.status) for r in report.results] == [("synth_000", "ok"), ("synth_001", "ok")]


# -- concurrent runs on the stores (revS 4, 6) ---------------------------------------------------------

@pytest.mark.parametrize("given", ["folder", "stores"])
def test_label_refuses_stores_that_another_run_writes(stores, synth_dir, tmp_path, capsys, given):
    """revS 4 and 2c: label locked only its --out, so a second label (another --out) or a tile still writing the
    stores folder went on, and the stores ended half from one run, half from the other."""
    folder = tmp_path / "stores"
    before = {stem: _tree_digest(path) for stem, path in stores.items()}
    other = hold_lock(folder)
    try:
        inputs = [str(folder)] if given == "folder" else [str(p) for p in stores.values()]
        assert main(["label", *inputs, "--annotations", str(synth_dir), "--labels", str(synth_dir / "labels.csv"),
                     "--out", str(tmp_path / "LB")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folder}: another wsi-milssl run (pid {other.pid}"), err
        assert err.rstrip().endswith(" is writing to this folder. Fix: wait until it finishes.")  # not --out
    finally:
        other.kill()
        other.wait()
    assert {stem: _tree_digest(path) for stem, path in stores.items()} == before
    assert not (tmp_path / "LB" / STATUS_CSV).exists()


@pytest.mark.parametrize("out", ["elsewhere", "stores"])
def test_label_holds_the_stores_folder_while_it_rewrites_its_stores(stores, synth_dir, tmp_path, out):
    """Another process sees the stores folder written by this label run (so tile, another label, or a reader that
    checks, are refused); with --out the stores folder itself the run holds one lock, not two."""
    folder = tmp_path / "stores"
    out_dir = tmp_path / "LA" if out == "elsewhere" else folder
    seen = []

    def progress(event):
        if event.done == 1:
            probe = subprocess.run([sys.executable, "-c", "import sys\nfrom wsi_milssl.locks import folder_writer\n"
                                    "print(folder_writer(sys.argv[1]))", str(folder)],
                                   capture_output=True, text=True, check=True)
            seen.append(probe.stdout.strip())

    report = label_stores(folder, annotations_dir=synth_dir, labels_csv=synth_dir / "labels.csv", out_dir=out_dir,
                          progress=progress)
    assert [r.status for r in report.results] == ["ok", "ok"]
    assert len(seen) == 1 and f"pid {os.getpid()}" in seen[0], seen
    assert not (folder / ".wsi-milssl.lock").exists()


def test_label_removes_the_temporaries_a_killed_run_left_in_the_stores_folder(stores, synth_dir, tmp_path):
    """revS 6: a label killed while it rewrote a store (write_arrays copies it to a hidden temporary) left the
    full-size copy, and later label runs never removed it; a temporary of a process that still runs stays."""
    folder = tmp_path / "stores"
    store = stores["synth_000"]
    made = subprocess.run([sys.executable, "-c", (
        "import os, shutil, sys\n"
        "from wsi_milssl.atomic import temp_path\n"
        "tmp = temp_path(sys.argv[1])\n"
        "shutil.copyfile(sys.argv[1], tmp)\n"
        "print(tmp.name, flush=True)\n"
        "os._exit(9)\n"  # dies in the middle, as a killed run does
    ), str(store)], capture_output=True, text=True)
    dead = made.stdout.strip()
    assert made.returncode == 9 and (folder / dead).is_file()
    pid = dead.split(".")[-3]
    live = dead.replace(f".{pid}.", f".{os.getppid()}.")  # of pytest's parent, which still runs
    shutil.copyfile(store, folder / live)
    label_stores(folder, annotations_dir=synth_dir, labels_csv=synth_dir / "labels.csv", out_dir=tmp_path / "LA")
    assert not (folder / dead).exists() and (folder / live).exists()


@contextmanager
def _read_only_stores(folder):
    """``folder`` (holding stores) made read-only: a read-only bind mount of itself (``mount -o bind,ro``, as on a
    shared or archived disk) where this machine may mount, else diskfaults' injected EROFS for paths under it."""
    if can_mount() and subprocess.run(["mount", "-o", "bind,ro", str(folder), str(folder)],
                                      capture_output=True).returncode == 0:
        try:
            yield "mount"
        finally:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
    else:
        with read_only_folder(folder) as method:
            yield method


def _read_status(out):
    with open(out / STATUS_CSV, newline="") as fh:
        return {row["slide"]: row for row in csv.DictReader(fh)}


@pytest.mark.parametrize("given", ["folder", "store"])
def test_label_of_stores_in_a_read_only_folder(stores, synth_dir, tmp_path, capsys, given):
    """revV V1: since the stores folder is locked, re-running label on stores in a folder that cannot be written
    (read-only mount; a user without write permission on a shared folder) failed as a whole, calling the stores
    folder an output with the fix "another --out". Up-to-date stores are skipped again (exit 0); a store that
    must be rewritten fails alone, naming its folder and a fix that works."""
    folder = tmp_path / "stores"
    labels = tmp_path / "labels.csv"
    labels.write_text((synth_dir / "labels.csv").read_text())
    args = ["--annotations", str(synth_dir), "--out", str(tmp_path / "LB")]
    assert main(["label", str(folder), "--labels", str(labels), *args]) == 0
    before = {stem: _tree_digest(path) for stem, path in stores.items()}
    tumour = {row["slide"]: row["label"] for row in csv.DictReader(labels.open())}
    flipped = tmp_path / "flipped.csv"  # synth_001 gets the other label: its store must be rewritten
    flipped.write_text("slide,label\n" + "".join(f"{s},{1 - int(v) if s == 'synth_001' else v}\n"
                                                  for s, v in tumour.items()))
    inputs = [str(folder)] if given == "folder" else [str(p) for p in stores.values()]
    capsys.readouterr()
    with _read_only_stores(folder):
        assert main(["label", *inputs, "--labels", str(labels), *args]) == 0
        captured = capsys.readouterr()
        assert "error" not in captured.err, captured.err
        rows = _read_status(tmp_path / "LB")
        assert [(s, rows[s]["status"]) for s in sorted(rows)] == [("synth_000", "skipped"), ("synth_001", "skipped")]

        assert main(["label", *inputs, "--labels", str(flipped), *args]) == 1
        rows = _read_status(tmp_path / "LB")
        assert rows["synth_000"]["status"] == "skipped" and rows["synth_001"]["status"] == "failed"
        assert rows["synth_001"]["error"] == (
            f"{stores['synth_001']}: cannot label this store: label writes the labels into the store, and its "
            f"folder {folder} cannot be written (Read-only file system). Fix: make {folder} writable (remount it "
            "read-write, or get write permission), or copy the stores to a writable folder and label the copy.")
    assert {stem: _tree_digest(path) for stem, path in stores.items()} == before


def test_label_help_and_readme_say_which_folders_label_locks(capsys):
    """revV V6: neither `label --help` nor the README's reliability notes said that label locks the folders of its
    stores (so it stops while tile or another label writes there) nor what it does in one it cannot write."""
    with pytest.raises(SystemExit):
        main(["label", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "label locks --out and the folders of the stores (it stops while tile or another label writes there" in text
    assert "A stores folder it cannot write (read-only, no permission) is not locked" in text
    # the README's reliability notes moved to docs/reliability.md
    readme = " ".join((Path(__file__).parents[2] / "docs" / "reliability.md").read_text(encoding="utf-8").split())
    bullet = readme[readme.index("**Locks, temporaries, full disks.**"):readme.index("**Fuzzing.**")]
    assert "`label` also locks the writable folders of its input stores" in bullet
    assert "`evaluate`, `prepare` (while it writes) and `run` lock their output folder" in bullet
