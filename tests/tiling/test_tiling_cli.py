"""``wsi-milssl tile`` as a real process: exit codes, bad slides, and SIGKILL mid-slide then resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from wsi_milssl.config import TileConfig
from wsi_milssl.tiling import read_status_csv, tile_slides


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wsi_milssl", "tile", *args], capture_output=True, text=True, **kw)


FAST_ARGS = ["--magnification", "20", "--patch-size", "256", "--entropy-threshold", "4", "--pixels", "none"]


def test_bad_slide_fails_others_finish_exit_1(synth_slides, tmp_path):
    bad = tmp_path / "broken.tif"
    bad.write_text("not a slide\n")
    result = _cli(str(synth_slides["normal"]), str(bad), "--out", str(tmp_path / "out"), *FAST_ARGS)
    assert result.returncode == 1, result.stderr
    assert "1 ok, 0 skipped, 1 failed" in result.stdout
    assert "failed: broken: " in result.stderr and "OpenSlide does not recognise this file" in result.stderr
    rows = {r["slide"]: r for r in read_status_csv(tmp_path / "out" / "tile_status.csv")}
    assert rows["broken"]["status"] == "failed" and rows[synth_slides["normal"].stem]["status"] == "ok"
    assert (tmp_path / "out" / f"{synth_slides['normal'].stem}.h5").is_file()


def test_usage_errors_exit_2(synth_slides, tmp_path, capsys):
    from wsi_milssl.cli import main

    def tile(*args: str) -> tuple[int, str, str]:
        try:
            code = main(["tile", *args])
        except SystemExit as exc:  # argparse usage errors
            code = exc.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    slide, out = str(synth_slides["normal"]), str(tmp_path / "o")
    code, _, err = tile(slide, "--out", out, "--magnification", "10", "--mpp", "1")
    assert code == 2 and "not allowed with argument" in err
    code, _, err = tile(slide, "--out", out, "--patch-size", "0")
    assert code == 2 and "TileConfig.patch_size_px must satisfy 8 <= value <= 8192; got 0" in err
    code, _, err = tile(slide, "--out", out, "--tissue", "magic")
    assert code == 2 and "TileConfig.tissue must be one of 'none', 'otsu'; got 'magic'" in err
    assert tile(slide, "--out", out, *FAST_ARGS)[0] == 0
    code, stdout, _ = tile(slide, "--out", out, *FAST_ARGS)
    assert code == 0 and "0 ok, 1 skipped, 0 failed" in stdout
    code, _, err = tile(slide, "--out", out, *FAST_ARGS[:-2], "--pixels", "jpeg")
    assert code == 2
    assert "made with different settings (jpeg_quality None -> 90; pixels 'none' -> 'jpeg')" in err
    assert "--overwrite" in err
    assert tile(slide, "--out", out, *FAST_ARGS[:-2], "--pixels", "jpeg", "--overwrite")[0] == 0


# Dense enough that one slide takes a second or two, so the kill lands inside it. The killed and
# resumed runs read through OpenSlide only; the reference run uses the direct TIFF tile reads, so
# the comparison also checks that both read paths give identical stores.
KILL_ARGS = ["--magnification", "40", "--patch-size", "128", "--stride", "48", "--entropy-threshold", "4",
             "--threads", "1", "--batch-size", "64", "--openslide-only"]


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_sigkill_mid_slide_then_rerun_equals_uninterrupted(synth_slides, tmp_path, fmt, store_contents,
                                                          same_contents):
    slide = synth_slides["tumor"]
    out = tmp_path / "killed"
    final = out / f"{slide.stem}.{fmt}"

    def partials() -> list:  # the writer's temporary store: .<stem>.<fmt>.<pid>.<random>.partial
        return sorted(out.glob(f".{slide.stem}.{fmt}.*.partial"))

    cmd = [sys.executable, "-m", "wsi_milssl", "tile", str(slide), "--out", str(out), "--format", fmt, *KILL_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not partials() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        time.sleep(0.25)  # let it write a few batches
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed_partial = partials()
    assert len(killed_partial) == 1 and not final.exists(), "the kill must land in the middle of the slide"
    assert f".{proc.pid}." in killed_partial[0].name

    rerun = subprocess.run(cmd, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    # the re-run removed the killed run's temporary store (issue 14 row 13) and wrote the final one
    assert final.exists() and partials() == []

    reference = tile_slides([slide], tmp_path / "reference",
                            TileConfig(magnification=40, patch_size_px=128, stride_px=48, entropy_threshold_bits=4.0,
                                       format=fmt))
    assert reference.ok and reference.results[0].n_patches > 500
    killed, ref = store_contents(final), store_contents(reference.results[0].store_path)
    # the killed run read through OpenSlide, the reference directly: the same content, and plans that
    # differ only in the reader choice
    same_contents(killed, ref, ignore_attrs=("tiling_plan",))
    plans = [json.loads(c["attrs"]["tiling_plan"]) for c in (killed, ref)]
    assert [p.pop("direct_tiff_read") for p in plans] == [False, True] and plans[0] == plans[1]
