"""Issue 13 item 2 for label: shards of the stores (--shard I/N or a torchrun rank) write one --out at
once and leave what one run leaves; a re-run skips stores labelled with the same inputs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.config import LabelConfig, TileConfig
from wsi_milssl.distributed import shard_of
from wsi_milssl.labeling import STATUS_CSV, label_stores
from wsi_milssl.store import find_stores, open_store
from wsi_milssl.tiling import find_slides, tile_slides

STEMS = ["slide_0", "slide_1", "slide_2", "slide_3"]


def _contents(path) -> dict:
    with open_store(path) as s:
        return {"attrs": s.attrs, **{name: s.read_array(name) for name in s.names()}}


def _text(path, root) -> str:
    return path.read_text().replace(str(root), "ROOT")


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, **extra}


def test_three_shards_at_once_label_the_stores_as_one_run_and_a_rerun_skips(four_slides, tmp_path, capsys):
    """--shard 0/3, 1/3 and 2/3 at once: the same arrays and attributes in every store, and the same
    label_status.csv, masks and sidecars (folder names aside) as one run."""
    slides, annotations = four_slides
    assert [shard_of(s, 3) for s in STEMS] == [0, 0, 1, 2]  # each shard's stores: the hash of their stems
    tiled = tmp_path / "tiled"
    run = tile_slides(find_slides([slides]), tiled, TileConfig(magnification=20, patch_size_px=256, pixels="none",
                                                             threads=1))
    assert run.ok
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    for root in (whole, sharded):
        shutil.copytree(tiled, root / "stores")
    assert main(["label", str(whole / "stores"), "--annotations", str(annotations), "--out",
                 str(whole / "labels")]) == 0
    cmd = [sys.executable, "-m", "wsi_milssl", "label", str(sharded / "stores"), "--annotations", str(annotations),
           "--out", str(sharded / "labels")]
    procs = [subprocess.Popen(cmd + ["--shard", f"{i}/3"], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(3)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert [re.findall(r"^(slide_\d)\s+ok\s", out, re.M) for out in outputs] == [["slide_0", "slide_1"],
                                                                                 ["slide_2"], ["slide_3"]]

    for stem in STEMS:
        a, b = _contents(whole / "stores" / f"{stem}.h5"), _contents(sharded / "stores" / f"{stem}.h5")
        assert a["attrs"] == b["attrs"] and a["attrs"]["label_status"] == ("annotated" if stem in ("slide_0", "slide_2")
                                                                          else "negative")
        assert set(a) == set(b) and {"tumor_fraction", "instance_label"} <= set(a)
        for name in a:
            if name != "attrs":
                np.testing.assert_array_equal(a[name], b[name], err_msg=f"{stem}: {name}")
        for suffix in ("_tumor_mask.png", "_tumor_mask.json"):
            assert (whole / "labels" / f"{stem}{suffix}").is_file()
        assert ((whole / "labels" / f"{stem}_tumor_mask.png").read_bytes()
                == (sharded / "labels" / f"{stem}_tumor_mask.png").read_bytes())
        assert (_text(whole / "labels" / f"{stem}_tumor_mask.json", whole)
                == _text(sharded / "labels" / f"{stem}_tumor_mask.json", sharded))
    status = _text(sharded / "labels" / STATUS_CSV, sharded)
    assert status == _text(whole / "labels" / STATUS_CSV, whole)
    assert [line.split(",")[:3] for line in status.splitlines()[1:]] == [
        [stem, f"ROOT/stores/{stem}.h5", "ok"] for stem in STEMS]
    for name in ("label_config.json",):
        assert (whole / "labels" / name).read_bytes() == (sharded / "labels" / name).read_bytes()
    assert [p.name for p in (sharded / "labels").iterdir() if p.name.startswith(".")] == []

    # a re-run skips what is labelled exactly so; a lost mask is written alone (the store kept: revAC 1);
    # other settings or --overwrite label again
    stores = sharded / "stores"
    stamps = {p.name: p.stat().st_mtime_ns for p in find_stores(stores)}
    again = label_stores(stores, annotations_dir=annotations, out_dir=sharded / "labels", shard=(0, 3))
    assert [(r.stem, r.status) for r in again.results] == [("slide_0", "skipped"), ("slide_1", "skipped")]
    assert again.n_failed == 0 and {p.name: p.stat().st_mtime_ns for p in find_stores(stores)} == stamps
    assert _text(sharded / "labels" / STATUS_CSV, sharded).replace(",skipped,", ",ok,") == status
    (sharded / "labels" / "slide_1_tumor_mask.png").unlink()
    third = label_stores(stores, annotations_dir=annotations, out_dir=sharded / "labels", shard=(0, 3))
    assert [(r.stem, r.status) for r in third.results] == [("slide_0", "skipped"), ("slide_1", "mask")]
    assert (sharded / "labels" / "slide_1_tumor_mask.png").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in find_stores(stores)} == stamps
    fourth = label_stores(stores, annotations_dir=annotations, out_dir=sharded / "labels",
                          config=LabelConfig(positive_fraction=0.5))
    assert [r.status for r in fourth.results] == ["ok"] * 4
    capsys.readouterr()
    assert main(["label", str(stores), "--annotations", str(annotations), "--out", str(sharded / "labels"),
                 "--positive-fraction", "0.5", "--overwrite", "--shard", "2/3"]) == 0
    assert re.findall(r"^(slide_\d)\s+(\w+)\s", capsys.readouterr().out, re.M) == [("slide_3", "ok")]


def _stores(four_slides, folder):
    slides, _ = four_slides
    run = tile_slides(find_slides([slides]), folder, TileConfig(magnification=20, patch_size_px=256, pixels="none",
                                                               threads=1))
    assert run.ok
    return folder


def test_shards_given_different_store_lists_label_every_store_they_all_saw_once(four_slides, tmp_path, capsys):
    """Shard 0/3 labels its store of three (slide_1's store is not there yet), slide_1's store arrives,
    shards 1/3 and 2/3 label theirs of four: a store's shard is the hash of its slide's stem, so every
    store that all three saw is labelled once and slide_1 (shard 0's, which ran before it came) is left,
    as after an unsharded run, to the next run of shard 0."""
    _, annotations = four_slides
    stores = _stores(four_slides, tmp_path / "stores")
    (tmp_path / "later").mkdir()
    os.replace(stores / "slide_1.h5", tmp_path / "later" / "slide_1.h5")
    out = tmp_path / "labels"
    cmd = ["label", str(stores), "--annotations", str(annotations), "--out", str(out)]

    def labelled(*shards):
        capsys.readouterr()
        assert [main([*cmd, "--shard", shard]) for shard in shards] == [0] * len(shards)
        return re.findall(r"^(slide_\d)\s+(\w+)\s", capsys.readouterr().out, re.M)

    assert labelled("0/3") == [("slide_0", "ok")]
    os.replace(tmp_path / "later" / "slide_1.h5", stores / "slide_1.h5")
    assert labelled("1/3", "2/3") == [("slide_2", "ok"), ("slide_3", "ok")]
    rows = [line.split(",")[:3] for line in (out / STATUS_CSV).read_text().splitlines()[1:]]
    assert rows == [[stem, str(stores / f"{stem}.h5"), "ok"] for stem in ("slide_0", "slide_2", "slide_3")]
    assert labelled("0/3") == [("slide_0", "skipped"), ("slide_1", "ok")]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow  # the ranks' end barrier is cli/sharding.py's, shared by tile, label and heatmap: the
# default run launches it under torchrun for tile (tests/tiling/test_tiling_shards.py)
def test_torchrun_ranks_with_a_failed_store_all_finish(four_slides, tmp_path):
    """Under torchrun (2 ranks on the CPU) rank 1's first store is damaged: every rank labels its share
    (every 2nd store, sorted by path) and meets the others before rank 1 exits 1 with one line naming the
    status CSV."""
    _, annotations = four_slides
    stores = _stores(four_slides, tmp_path / "stores")
    (stores / "slide_0x.h5").write_bytes(b"not a store" * 100)  # sorted second: rank 1's first store
    out = tmp_path / "labels"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "wsi_milssl", "label", str(stores), "--annotations", str(annotations), "--out", str(out)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr
    assert f"error: 1 store(s) failed (shard 1/2); see {out / STATUS_CSV}" in proc.stderr
    assert sorted(re.findall(r"^(slide_\w+)\s+(\w+)\s", proc.stdout, re.M)) == [  # the ranks' lines interleave
        ("slide_0", "ok"), ("slide_0x", "failed"), ("slide_1", "ok"), ("slide_2", "ok"), ("slide_3", "ok")]
    assert [line.split(",")[2] for line in (out / STATUS_CSV).read_text().splitlines()[1:]] == [
        "ok", "failed", "ok", "ok", "ok"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_moved_folder_of_stores_annotations_and_masks_is_not_labelled_again(four_slides, tmp_path):
    """A cohort folder moved as a whole (stores, annotations and masks together, e.g. a `prepare` folder with
    its run) used to be labelled again store by store, because the annotation file's and the store's absolute
    paths had changed: every store was rewritten, so every heatmap was predicted again. The same file names
    with the same content (SHA-256) are the same labels; other content still labels again."""
    slides, annotations = four_slides
    old = tmp_path / "old"
    assert tile_slides(find_slides([slides]), old / "stores", TileConfig(magnification=20, patch_size_px=256,
                                                                         pixels="none", threads=1)).ok
    shutil.copytree(annotations, old / "annotations")
    assert label_stores(old / "stores", annotations_dir=old / "annotations", out_dir=old / "labels").n_failed == 0
    new = tmp_path / "new"
    old.rename(new)
    stamps = {p.name: p.stat().st_mtime_ns for p in find_stores(new / "stores")}
    again = label_stores(new / "stores", annotations_dir=new / "annotations", out_dir=new / "labels")
    assert [r.status for r in again.results] == ["skipped"] * 4
    assert {p.name: p.stat().st_mtime_ns for p in find_stores(new / "stores")} == stamps
    changed = new / "annotations" / "slide_0.xml"
    changed.write_text(changed.read_text().replace("<Annotations>", "<Annotations>\n"))  # other bytes, same regions
    third = label_stores(new / "stores", annotations_dir=new / "annotations", out_dir=new / "labels")
    assert [(r.stem, r.status) for r in third.results] == [("slide_0", "ok")] + [(s, "skipped") for s in STEMS[1:]]


def test_shards_labelling_at_once_with_other_settings_are_refused(four_slides, tmp_path):
    """Review DA: shards given two --positive-fraction values labelled one training set two ways, and
    label_config.json named one of them. The other shard's record, written after this shard's, is found at this
    shard's end; shards of one setting, at once or one after the other, are accepted."""
    import json

    from wsi_milssl.errors import ConfigError

    slides, annotations = four_slides
    stores = tmp_path / "stores"
    assert tile_slides(find_slides([slides]), stores, TileConfig(magnification=20, patch_size_px=256, pixels="none",
                                                                 threads=1)).ok
    out = tmp_path / "labels"

    def the_other_shard_starts(event) -> None:
        if event.stage == "label" and event.done == 1:
            record = json.loads((out / "label_config.json").read_text())
            (out / "label_config.json").write_text(json.dumps({**record, "positive_fraction": 0.9}))

    with pytest.raises(ConfigError, match=r"label_config\.json: another shard of this run labels with other "
                                          r"settings \(positive_fraction 0\.9, this shard's 0\.25\); the shards of one "
                                          r"run must use the same settings"):
        label_stores(stores, annotations_dir=annotations, config=LabelConfig(), out_dir=out, shard=(0, 3),
                     progress=the_other_shard_starts)
    for i in range(3):
        label_stores(stores, annotations_dir=annotations, config=LabelConfig(), out_dir=out, shard=(i, 3))
    assert json.loads((out / "label_config.json").read_text())["positive_fraction"] == 0.25

    def masks_off(event) -> None:  # review DT: mask settings do not change the stores' labels
        if event.stage == "label" and event.done == 1:
            record = json.loads((out / "label_config.json").read_text())
            (out / "label_config.json").write_text(json.dumps({**record, "write_masks": False,
                                                               "mask_downsample": 64}))

    label_stores(stores, annotations_dir=annotations, config=LabelConfig(), out_dir=out, shard=(0, 3),
                 overwrite=False, progress=masks_off)


def test_a_shard_without_stores_prints_no_table_and_folder_notes_come_from_shard_0(four_slides, tmp_path, capsys):
    """Review DA: under torchrun a rank with no stores printed a bare table header, and every rank repeated the
    annotation files that match no store."""
    slides, annotations = four_slides
    stores = tmp_path / "stores"
    assert tile_slides(find_slides([slides]), stores, TileConfig(magnification=20, patch_size_px=256, pixels="none",
                                                                 threads=1)).ok
    extra = tmp_path / "annotations"
    shutil.copytree(annotations, extra)
    shutil.copy(next(extra.glob("*.xml")), extra / "no_such_slide.xml")
    count = 6
    empty = next(i for i in range(count) if all(shard_of(s, count) != i for s in STEMS))
    full = shard_of(STEMS[0], count)
    printed = {}
    for i in sorted({0, empty, full}):
        assert main(["label", str(stores), "--annotations", str(extra), "--out", str(tmp_path / "labels"),
                     "--shard", f"{i}/{count}"]) == 0
        printed[i] = capsys.readouterr().out
    assert f"labels of 0 store(s) (shard {empty}/{count})\n" in printed[empty] and "slide  " not in printed[empty]
    assert "slide  " in printed[full] and STEMS[0] in printed[full]
    assert [("no_such_slide.xml" in printed[i]) for i in sorted(printed)] == [i == 0 for i in sorted(printed)]


def _tiled_with_labels(four_slides, tmp_path):
    """(stores folder, annotations folder, labels CSV) of the four slides tiled at 20x (slide_0 and slide_2 tumour)."""
    slides, annotations = four_slides
    stores = tmp_path / "stores"
    assert tile_slides(find_slides([slides]), stores, TileConfig(magnification=20, patch_size_px=256, pixels="jpeg",
                                                                 threads=1)).ok
    labels_csv = tmp_path / "labels.csv"
    labels_csv.write_text("slide,label\n" + "".join(f"{s},{int(s in ('slide_0', 'slide_2'))}\n" for s in STEMS))
    return stores, annotations, labels_csv


def test_stores_labelled_with_two_settings_are_warned_about_when_read(four_slides, tmp_path, caplog):
    """Review DU: a label shard re-run later with another --positive-fraction labels its stores otherwise, and the
    folder's record names one setting; reading the stores says so."""
    import logging

    from wsi_milssl.mil import read_labels_csv, read_patch_stores

    stores, annotations, labels_csv = _tiled_with_labels(four_slides, tmp_path)
    out = tmp_path / "labels"
    label_stores(stores, annotations_dir=annotations, config=LabelConfig(), out_dir=out, shard=(0, 3))
    label_stores(stores, annotations_dir=annotations, config=LabelConfig(positive_fraction=0.9), out_dir=out,
                 shard=(1, 3))
    with caplog.at_level(logging.WARNING):
        read_patch_stores([stores], read_labels_csv(labels_csv))
    assert "were labelled with different label settings (positive_fraction 0.25 and 0.9" in caplog.text
    caplog.clear()
    label_stores(stores, annotations_dir=annotations, config=LabelConfig(), out_dir=out, overwrite=True)
    with caplog.at_level(logging.WARNING):
        read_patch_stores([stores], read_labels_csv(labels_csv))
    assert "different label settings" not in caplog.text


def test_unannotated_stores_labelled_with_another_setting_are_no_cause_for_the_warning(four_slides, tmp_path, caplog):
    """Review DW, C1: a store without an annotation holds all-0 labels under any setting, yet its setting counted,
    so re-labelling the annotated stores alone warned that the labels "mean two things", naming a negative store."""
    import logging

    from wsi_milssl.mil import read_labels_csv, read_patch_stores

    stores, annotations, labels_csv = _tiled_with_labels(four_slides, tmp_path)
    label_stores(stores, annotations_dir=annotations, config=LabelConfig(), out_dir=tmp_path / "all")
    annotated = [p for p in find_stores([stores]) if p.stem in ("slide_0", "slide_2")]
    label_stores(annotated, annotations_dir=annotations, config=LabelConfig(positive_fraction=0.9),
                 out_dir=tmp_path / "again", overwrite=True)
    with caplog.at_level(logging.WARNING):
        read_patch_stores([stores], read_labels_csv(labels_csv))
    assert "different label settings" not in caplog.text
    label_stores(annotated[:1], annotations_dir=annotations, config=LabelConfig(), out_dir=tmp_path / "one",
                 overwrite=True)
    with caplog.at_level(logging.WARNING):
        read_patch_stores([stores], read_labels_csv(labels_csv))
    assert "slide_0.h5 and " in caplog.text and "slide_2.h5 were labelled with different label settings" in caplog.text
