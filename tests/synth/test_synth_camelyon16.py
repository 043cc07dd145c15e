"""``synth --layout camelyon16``: a miniature CAMELYON16 download to try `prepare camelyon16` on (review CR: a user
had to build the tree by hand to rehearse before the 700 GB download)."""

from __future__ import annotations

import json
import zipfile

import pytest

from wsi_milssl.cli import main
from wsi_milssl.cohorts import prepare_camelyon16
from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import ConfigError
from wsi_milssl.synth import generate_slides
from wsi_milssl.synth.camelyon16 import MANIFEST_NAME, camelyon16_names, write_camelyon16_tree

SMALL = dict(width_px=2048, height_px=2048)


def test_the_tree_is_the_release_layout_and_prepare_reads_it_with_the_generated_labels(tmp_path, capsys):
    root = tmp_path / "CAMELYON16"
    assert main(["synth", str(root), "--layout", "camelyon16", "--slides", "6", "--size-px", "2048", "2048",
                 "--seed", "3", "-q"]) == 0
    assert "next: wsi-milssl prepare camelyon16" in capsys.readouterr().out
    records = json.loads((root / MANIFEST_NAME).read_text())["slides"]
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == sorted([MANIFEST_NAME, "testing/reference.csv", "testing/lesion_annotations.zip",
                            "training/lesion_annotations.zip"]
                           + [f"{'testing/images' if r['set'] == 'test' else 'training/' + r['slide'][:-4]}/"
                              f"{r['slide']}.tif" for r in records])
    # the slides are the flat layout's, byte for byte, under the release's names
    flat = tmp_path / "flat"
    generate_slides(SynthConfig(n_slides=6, seed=3, **SMALL), flat)
    for r in records:
        (moved,) = root.rglob(f"{r['slide']}.tif")
        assert moved.read_bytes() == (flat / f"{r['generated']}.tif").read_bytes()
        assert r["label"] == (1 if (flat / f"{r['generated']}.xml").is_file() else 0)
        if r["set"] == "train":
            assert r["label"] == r["slide"].startswith("tumor")
    # annotations zipped in lesion_annotations/, one per tumour slide of the set
    for top, subset in (("training", "train"), ("testing", "test")):
        names = zipfile.ZipFile(root / top / "lesion_annotations.zip").namelist()
        assert sorted(names) == sorted(f"lesion_annotations/{r['slide']}.xml" for r in records
                                       if r["set"] == subset and r["label"])
    # reference.csv as released: no header, capitalised names, Tumor rows with a size class
    rows = (root / "testing" / "reference.csv").read_text().splitlines()
    tests = [r for r in records if r["set"] == "test"]
    assert [row.split(",")[:2] for row in rows] == [["T" + r["slide"][1:], "Tumor" if r["label"] else "Normal"]
                                                    for r in tests]
    assert all(row.split(",")[2] in ("Macro", "Micro") for row in rows if ",Tumor," in row)
    # prepare camelyon16 takes it as it is
    cohort = prepare_camelyon16(root, tmp_path / "c16")
    assert cohort.sets["test"].labels == {r["slide"]: r["label"] for r in tests}
    assert cohort.sets["train"].labels == {r["slide"]: r["label"] for r in records if r["set"] == "train"}
    assert not cohort.notes


def test_half_of_each_label_is_test_slides():
    assert camelyon16_names([True, False, True, False]) == [
        ("train", "tumor_001"), ("train", "normal_001"), ("test", "test_001"), ("test", "test_002")]
    assert [s for s, _ in camelyon16_names([True] * 3 + [False] * 3)] == ["train", "train", "test"] * 2


def test_a_run_again_replaces_its_tree_and_a_foreign_or_unusable_one_is_refused(tmp_path):
    root = tmp_path / "c16"
    write_camelyon16_tree(SynthConfig(n_slides=6, seed=0, **SMALL), root)
    (root / MANIFEST_NAME).unlink()  # a run killed before its manifest: still this command's tree
    (root / ".synth-work").mkdir()
    write_camelyon16_tree(SynthConfig(n_slides=4, seed=1, **SMALL), root)
    assert len(list(root.rglob("*.tif"))) == 4 and not (root / ".synth-work").exists()
    other = tmp_path / "other"
    (other / "training").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"already holds training, which synth --layout camelyon16 did not write"):
        write_camelyon16_tree(SynthConfig(n_slides=4, **SMALL), other)
    flat = tmp_path / "flat"  # review CT: a flat synth's files beside the tree would be taken for the download's
    generate_slides(SynthConfig(n_slides=1, **SMALL), flat)
    with pytest.raises(ConfigError, match=r"already holds synth_000.tif, labels.csv, manifest.json, which synth"):
        write_camelyon16_tree(SynthConfig(n_slides=4, **SMALL), flat)
    for n, fraction in ((3, 0.5), (4, 0.25)):  # a set without one of the labels
        with pytest.raises(ConfigError, match=r"needs tumour and normal slides in both sets; .*Fix: more slides"):
            write_camelyon16_tree(SynthConfig(n_slides=n, tumor_slide_fraction=fraction, **SMALL), tmp_path / "few")
    assert main(["synth", str(tmp_path / "few"), "--layout", "camelyon16", "--slides", "3"]) == 2


def test_a_run_killed_while_it_removed_the_earlier_tree_is_still_its_own(tmp_path, monkeypatch):
    """Review CT: the manifest went before the work folder that marks an unfinished tree was made, so a kill while
    the earlier tree was being removed left a tree the next run refused as another's."""
    import shutil

    from wsi_milssl.synth import camelyon16

    root = tmp_path / "c16"
    write_camelyon16_tree(SynthConfig(n_slides=4, seed=0, **SMALL), root)

    real_rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        if path.name == "testing":
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(camelyon16.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        write_camelyon16_tree(SynthConfig(n_slides=4, seed=1, **SMALL), root)
    monkeypatch.setattr(camelyon16.shutil, "rmtree", real_rmtree)
    assert not (root / MANIFEST_NAME).exists() and (root / "testing").exists()
    write_camelyon16_tree(SynthConfig(n_slides=4, seed=1, **SMALL), root)
    assert (root / MANIFEST_NAME).is_file()
