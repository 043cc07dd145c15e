"""Issue 13 item 2 for label: shards of the stores (--shard I/N or a torchrun rank) write one --out at
once and leave what one run leaves; a re-run skips stores labelled with the same inputs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np

from wsi_milssl.cli import main
from wsi_milssl.config import LabelConfig, TileConfig
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


def test_two_shards_at_once_label_the_stores_as_one_run_and_a_rerun_skips(four_slides, tmp_path, capsys):
    """Shard 0 by --shard 0/2, shard 1 by torchrun's RANK=1 WORLD_SIZE=2, at once: the same arrays and
    attributes in every store, and the same label_status.csv, masks and sidecars (folder names aside)."""
    slides, annotations = four_slides
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
    procs = [subprocess.Popen(cmd + ["--shard", "0/2"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True),
             subprocess.Popen(cmd, env=_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert [re.findall(r"^(slide_\d)\s+ok\s", out, re.M) for out in outputs] == [["slide_0", "slide_2"],
                                                                                 ["slide_1", "slide_3"]]

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

    # a re-run skips what is labelled exactly so; other settings, a lost mask or --overwrite label again
    stores = sharded / "stores"
    stamps = {p.name: p.stat().st_mtime_ns for p in find_stores(stores)}
    again = label_stores(stores, annotations_dir=annotations, out_dir=sharded / "labels", shard=(1, 2))
    assert [(r.stem, r.status) for r in again.results] == [("slide_1", "skipped"), ("slide_3", "skipped")]
    assert again.n_failed == 0 and {p.name: p.stat().st_mtime_ns for p in find_stores(stores)} == stamps
    assert _text(sharded / "labels" / STATUS_CSV, sharded).replace(",skipped,", ",ok,") == status
    (sharded / "labels" / "slide_3_tumor_mask.png").unlink()
    third = label_stores(stores, annotations_dir=annotations, out_dir=sharded / "labels", shard=(1, 2))
    assert [(r.stem, r.status) for r in third.results] == [("slide_1", "skipped"), ("slide_3", "ok")]
    assert (sharded / "labels" / "slide_3_tumor_mask.png").is_file()
    fourth = label_stores(stores, annotations_dir=annotations, out_dir=sharded / "labels",
                          config=LabelConfig(positive_fraction=0.5))
    assert [r.status for r in fourth.results] == ["ok"] * 4
    capsys.readouterr()
    assert main(["label", str(stores), "--annotations", str(annotations), "--out", str(sharded / "labels"),
                 "--positive-fraction", "0.5", "--overwrite", "--shard", "0/2"]) == 0
    assert re.findall(r"^(slide_\d)\s+(\w+)\s", capsys.readouterr().out, re.M) == [("slide_0", "ok"), ("slide_2", "ok")]


def _stores(four_slides, folder):
    slides, _ = four_slides
    run = tile_slides(find_slides([slides]), folder, TileConfig(magnification=20, patch_size_px=256, pixels="none",
                                                               threads=1))
    assert run.ok
    return folder


def test_a_shard_given_another_store_list_than_the_shard_before_it_is_refused(four_slides, tmp_path, capsys):
    """Shard 0/2 labels slide_0 and slide_3 of three stores, slide_1's store arrives, shard 1/2 is run on
    four: it would label slide_1 and slide_3 (again) and leave slide_2 unlabelled without a word. It is
    refused (exit 2, nothing labelled); re-running shard 0 then shard 1 on the new list labels every
    store, and the two leave no record behind."""
    _, annotations = four_slides
    stores = _stores(four_slides, tmp_path / "stores")
    (tmp_path / "later").mkdir()
    os.replace(stores / "slide_1.h5", tmp_path / "later" / "slide_1.h5")
    out = tmp_path / "labels"
    cmd = ["label", str(stores), "--annotations", str(annotations), "--out", str(out)]
    assert main([*cmd, "--shard", "0/2"]) == 0
    os.replace(tmp_path / "later" / "slide_1.h5", stores / "slide_1.h5")
    capsys.readouterr()
    assert main([*cmd, "--shard", "1/2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: shard 1/2 has a list of 4 slide(s) or store(s), but the shard(s) of this "
                          "2-way run that already ran here (0/2) had a list of 3"), err
    assert "Fix: give every shard the same list" in err
    assert [line.split(",")[0] for line in (out / STATUS_CSV).read_text().splitlines()[1:]] == ["slide_0", "slide_3"]
    assert main([*cmd, "--shard", "0/2"]) == 0 and main([*cmd, "--shard", "1/2"]) == 0
    assert [line.split(",")[:3] for line in (out / STATUS_CSV).read_text().splitlines()[1:]] == [
        [stem, str(stores / f"{stem}.h5"), status] for stem, status in
        (("slide_0", "skipped"), ("slide_1", "ok"), ("slide_2", "ok"), ("slide_3", "skipped"))]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_torchrun_rank_with_a_failed_store_exits_only_after_the_other_rank(four_slides, tmp_path):
    """torchrun ends every rank when one exits non-zero, so rank 1, whose share holds a damaged store,
    waits for rank 0 (here a process holding shard 0/2's lock for 5 s on the same store list, as a
    running rank 0 does) before it exits 1 with one line naming the status CSV."""
    _, annotations = four_slides
    stores = _stores(four_slides, tmp_path / "stores")
    (stores / "slide_0x.h5").write_bytes(b"not a store" * 100)  # sorted second: rank 1's first store
    out = tmp_path / "labels"
    names = [p.name for p in find_stores(stores)]
    rank0 = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from pathlib import Path\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(out)!r}, shard=(0, 2), items={names!r}):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(5)\n"
        f"    Path({str(tmp_path / 'rank0_done')!r}).touch()\n"
    )], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert rank0.stdout.readline().strip() == "locked"
        rank1 = subprocess.run([sys.executable, "-m", "wsi_milssl", "label", str(stores), "--annotations",
                                str(annotations), "--out", str(out)], env=_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1"),
                               capture_output=True, text=True, timeout=300)
        assert (tmp_path / "rank0_done").exists(), "rank 1 exited while rank 0 was still labelling"
    finally:
        rank0.wait(timeout=60)
    assert rank1.returncode == 1, rank1.stderr
    assert rank1.stderr.rstrip().endswith(f"error: 1 store(s) failed (shard 1/2); see {out / STATUS_CSV}")
    assert "waiting for shard(s) 0 of 2 to finish before exiting" in rank1.stderr
