"""Review AM, finding 3: under torchrun every rank printed the same message about the whole run: train's setup
errors (--out already holds a run, all validation bags are training bags), its warning about inputs a stopped
tile run left short, heatmap's warning about a checkpoint whose run stopped early. Now torchrun's rank 0
alone reports them (as it does the μ warning): the other ranks log no such warning, and on an error they wait
for torchrun to end them (it does as soon as rank 0 exits), still exiting non-zero."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from wsi_milssl.config import TileConfig, TrainConfig
from wsi_milssl.tiling import find_slides, tile_slides

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "wsi_milssl"]
TILE = TileConfig(target_mpp=2.0, patch_size_px=32, entropy_threshold_bits=3.0, min_tissue=0.3, mask_mpp=8.0,
                  threads=1)


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    return subprocess.run([*TORCHRUN, *args], env=env, capture_output=True, text=True, timeout=300)


def test_train_setup_error_is_printed_once(tmp_path, mil_csv):
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(b"an earlier run's")
    proc = _torchrun("train", str(mil_csv), "--out", str(run), "--epochs", "1", "--device", "cpu")
    assert proc.returncode != 0
    assert proc.stderr.count("already holds a run") == 1, proc.stderr
    assert "[rank 1]" not in proc.stderr, proc.stderr


def test_train_warning_and_error_about_the_inputs_come_once(four_slides, tmp_path):
    """A folder left by a stopped tile run (the warning), given as --val too (the error, before training)."""
    slides, _ = four_slides
    stores = tmp_path / "st"

    def crash(event):
        if event.stage == "tile" and event.done >= 2:
            raise RuntimeError("a crash")

    with pytest.raises(RuntimeError):
        tile_slides(find_slides([slides]), stores, TILE, progress=crash)
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nslide_0,1\nslide_1,0\nslide_2,1\nslide_3,0\n")
    proc = _torchrun("train", str(stores), "--labels", str(labels), "--val", str(stores), "--out", str(tmp_path / "r"),
                     "--epochs", "1", "--device", "cpu", "--workers", "0", "--threads", "1")
    assert proc.returncode != 0
    for option in ("INPUTS", "--val"):
        assert proc.stderr.count(f"{option} {stores}: the last `wsi-milssl tile` run into this folder did not "
                                 "finish") == 1, proc.stderr
    assert proc.stderr.count("validation bags are training bags") == 1, proc.stderr
    assert "[rank 1]" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("rank, warned", [(0, True), (1, False)])
def test_heatmap_warns_about_a_stopped_run_on_rank_0_alone(tmp_path, mil_csv, monkeypatch, caplog, rank, warned):
    from wsi_milssl.inference.model import check_run_finished
    from wsi_milssl.mil import read_mil_csv
    from wsi_milssl.mil.selftrain import fit

    class Killed(Exception):
        pass

    def stop(event):
        if event.stage == "train" and event.done == 1:
            raise Killed

    run = tmp_path / "run"
    with pytest.raises(Killed):  # stopped after epoch 1 of 3
        fit(read_mil_csv(mil_csv), config=TrainConfig(mode="features", model="mlp", epochs=3, threads=1, plots=False),
            out_dir=run, progress=stop)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING):
        check_run_finished(run)
    assert ("its run stopped after epoch 1 of the 3" in caplog.text) is warned, caplog.text
