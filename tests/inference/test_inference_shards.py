"""Heatmap runs that resume (finished slides are skipped) and shards that write one folder together."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wsi_milssl.config import HeatmapConfig
from wsi_milssl.inference import make_heatmaps

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=1)


@pytest.fixture(scope="module")
def four_slides(tmp_path_factory, slide_writer):
    folder = tmp_path_factory.mktemp("four")
    boxes = [(256, 256, 1792, 1792), (0, 512, 2048, 1536), (512, 0, 1536, 2048), (128, 128, 1024, 1024)]
    return [slide_writer(folder / f"s{k}.tif", width=2048, height=2048, tissue_box=box,
                         tumour=lambda xs, ys, k=k: (xs // 300 + ys // 300 + k) % 4 == 0)
            for k, box in enumerate(boxes)]


def _status(folder: Path) -> list[dict]:
    with open(folder / "heatmap_status.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _without_timing(folder: Path) -> dict[str, bytes]:
    """Every file of a heatmap folder, with the timing column of the status CSV blanked."""
    out = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        data = path.read_bytes()
        if path.name == "heatmap_status.csv":
            rows = _status(folder)
            data = "\n".join(",".join(v for k, v in r.items() if k != "seconds") for r in rows).encode()
        out[path.name] = data
    return out


def test_a_rerun_skips_finished_slides_and_other_settings_redo_them(tmp_path, four_slides, checkpoint_factory):
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    first = make_heatmaps(four_slides[:2], ckpt, out, HeatmapConfig(**FAST))
    assert first.ok
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    events = []
    again = make_heatmaps(four_slides[:3], ckpt, out, HeatmapConfig(**FAST), progress=events.append)
    assert again.ok and [r.slide for r in again.results] == ["s0", "s1", "s2"]
    read = [e.item for e in events if e.stage == "heatmap-patches" and e.item]
    assert set(read) == {"s2"}  # only the new slide was read
    for name in ("s0_probs.npy", "s1_probs.npy", "s0_heatmap.png"):
        assert (out / name).stat().st_mtime_ns == stamps[name]  # not written again
    assert [r["slide"] for r in _status(out)] == ["s0", "s1", "s2"]
    # the workers count does not change what is made: still skipped
    make_heatmaps(four_slides[:1], ckpt, out, HeatmapConfig(**{**FAST, "num_workers": 0}))
    assert (out / "s0_probs.npy").stat().st_mtime_ns == stamps["s0_probs.npy"]
    # another detection threshold changes the files: predicted again
    make_heatmaps(four_slides[:1], ckpt, out, HeatmapConfig(**FAST, detection_threshold=0.3))
    assert (out / "s0_probs.npy").stat().st_mtime_ns != stamps["s0_probs.npy"]
    stamp = (out / "s0_probs.npy").stat().st_mtime_ns
    make_heatmaps(four_slides[:1], ckpt, out, HeatmapConfig(**FAST, detection_threshold=0.3), overwrite=True)
    assert (out / "s0_probs.npy").stat().st_mtime_ns != stamp


def test_two_shards_at_once_make_the_files_of_one_run(tmp_path, four_slides, checkpoint_factory):
    torch.manual_seed(0)
    ckpt = checkpoint_factory(model_name="resnet18")  # a registered model: the shards are separate processes
    whole = make_heatmaps(four_slides, ckpt, tmp_path / "whole", HeatmapConfig(**FAST))
    assert whole.ok
    cmd = [sys.executable, "-m", "wsi_milssl", "heatmap", *map(str, four_slides), "--model", str(ckpt),
           "--out", str(tmp_path / "sharded"), "--thumbnail-px", "128", "--batch-size", "32", "--workers", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [subprocess.Popen(cmd + ["--shard", f"{i}/2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "2 ok" in outputs[0] and "2 ok" in outputs[1]
    whole_files, sharded_files = _without_timing(tmp_path / "whole"), _without_timing(tmp_path / "sharded")
    assert sorted(whole_files) == sorted(sharded_files)
    different = [name for name in whole_files if whole_files[name] != sharded_files[name]]
    assert different == []


def test_shards_given_different_slide_lists_predict_every_slide_they_all_saw_once(tmp_path, four_slides,
                                                                                  checkpoint_factory, capsys):
    """Shard 0/2 predicts its slide of [s0, s2], then shard 1/2 is given [s0, s1, s2]. A slide's shard is the
    hash of its stem (s2 and s1: shard 0; s0: shard 1), so shard 1 predicts s0 only: every slide of both
    lists once. s1 came after its shard ran and is left to the next run, as after an unsharded run."""
    from wsi_milssl.cli import main
    from wsi_milssl.distributed import shard_of

    assert [shard_of(f"s{k}", 2) for k in range(3)] == [1, 0, 0]
    ckpt = checkpoint_factory()
    out = tmp_path / "hm"
    cmd = ["heatmap", "--model", str(ckpt), "--out", str(out), "--thumbnail-px", "128", "--workers", "0"]
    assert main([*cmd, str(four_slides[0]), str(four_slides[2]), "--shard", "0/2"]) == 0
    assert [r["slide"] for r in _status(out)] == ["s2"]
    assert main([*cmd, *map(str, four_slides[:3]), "--shard", "1/2"]) == 0
    assert [(r["slide"], r["status"]) for r in _status(out)] == [("s0", "ok"), ("s2", "ok")]
    capsys.readouterr()
    assert main([*cmd, *map(str, four_slides[:3])]) == 0
    assert "heatmaps of 3 slide(s): 3 ok" in capsys.readouterr().out
    assert [(r["slide"], r["status"]) for r in _status(out)] == [("s0", "ok"), ("s1", "ok"), ("s2", "ok")]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_shard_without_slides_names_only_the_files_it_wrote(tmp_path, four_slides, checkpoint_factory, capsys):
    from wsi_milssl.cli import main

    out = tmp_path / "hm"
    assert main(["heatmap", *map(str, four_slides[:2]), "--model", str(checkpoint_factory()), "--out", str(out),
                 "--shard", "7/8"]) == 0
    printed = capsys.readouterr().out
    assert "heatmaps of 0 slide(s)" in printed and "scores:" not in printed and not (out / "scores.csv").exists()
    assert f"status: {out / 'heatmap_status.csv'}" in printed


@pytest.mark.slow  # the ranks' end barrier is cli/sharding.py's, shared by tile, label and heatmap: the
# default run launches it under torchrun for tile (tests/tiling/test_tiling_shards.py)
def test_torchrun_ranks_with_a_failed_slide_all_finish(tmp_path, four_slides, checkpoint_factory):
    """heatmap under torchrun (2 ranks; every 2nd slide from the rank's): rank 1's only slide is
    not a slide and fails at once. It meets rank 0 in the end barrier, so torchrun does not stop rank 0
    mid-slide, then exits 1 with one line naming the status CSV."""
    torch.manual_seed(0)
    ckpt = checkpoint_factory(model_name="resnet18")  # a registered model: the ranks are separate processes
    bad = tmp_path / "s0a.tif"
    bad.write_bytes(os.urandom(5000))
    out = tmp_path / "hm"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "wsi_milssl", "heatmap", str(four_slides[0]), str(bad), str(four_slides[1]), "--model",
                           str(ckpt), "--out", str(out), "--thumbnail-px", "128", "--batch-size", "32", "--workers",
                           "0"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr
    assert f"error: 1 slide(s) failed or had no patch (shard 1/2); see {out / 'heatmap_status.csv'}" in proc.stderr
    # rank 1's own lines say so (review CO: the failed slide's line did not)
    assert any(line.startswith("[rank 1] failed: s0a: ") for line in proc.stderr.splitlines()), proc.stderr
    assert [(r["slide"], r["status"]) for r in _status(out)] == [("s0", "ok"), ("s0a", "failed"), ("s1", "ok")]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
