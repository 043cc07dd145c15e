"""Issue 13 item 2 for tile: shards of a slide list (--shard I/N, SLURM array tasks, torchrun ranks)
write one folder at once and leave what one run leaves; locks keep copies and unsharded runs out."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from wsi_milssl.cli import main
from wsi_milssl.store import find_stores
from wsi_milssl.tiling import read_status_csv

ARGS = ["--magnification", "20", "--patch-size", "256", "--entropy-threshold", "4", "--threads", "1"]
SLIDES = ["slide_0", "slide_1", "slide_2", "slide_3"]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, **extra}


def _rows_without_seconds(folder) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_status_csv(folder / "tile_status.csv")]


def test_two_slurm_array_tasks_at_once_make_the_stores_of_one_run(four_slides, tmp_path, store_contents,
                                                                 same_contents, capsys):
    """Two array tasks, started together with the README's --shard $SLURM_ARRAY_TASK_ID/
    $SLURM_ARRAY_TASK_COUNT, give every store (each array and attribute), QC image, tile_config.json
    and tile_status.csv row (timing aside) of one unsharded run; a re-run of a task skips its slides."""
    slides, _ = four_slides
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert main(["tile", str(slides), "--out", str(whole), *ARGS]) == 0
    script = (f"exec {shlex.quote(sys.executable)} -m wsi_milssl tile {shlex.quote(str(slides))} --out "
              f"{shlex.quote(str(sharded))} {' '.join(ARGS)} --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT")
    procs = [subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(SLURM_ARRAY_TASK_ID=str(i), SLURM_ARRAY_TASK_COUNT="2")) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for i, out in enumerate(outputs):
        assert f"tiled 2 slide(s) (shard {i}/2): 2 ok, 0 skipped, 0 failed" in out, out

    names = [p.name for p in find_stores(whole)]
    assert names == [f"{s}.h5" for s in SLIDES] == [p.name for p in find_stores(sharded)]
    for name in names:
        a, b = store_contents(whole / name), store_contents(sharded / name)
        assert len(a["coords"]) > 0
        same_contents(a, b)  # every dataset and attribute: nothing depends on the shard or the folder
    for stem in SLIDES:
        assert (whole / "qc" / f"{stem}.png").read_bytes() == (sharded / "qc" / f"{stem}.png").read_bytes()
    assert (whole / "tile_config.json").read_bytes() == (sharded / "tile_config.json").read_bytes()
    rows = _rows_without_seconds(sharded)
    assert [r["slide"] for r in rows] == SLIDES and rows == _rows_without_seconds(whole)
    assert sorted(p.name for p in sharded.iterdir() if p.name.startswith(".")) == []  # no lock file left

    stamps = {name: (sharded / name).stat().st_mtime_ns for name in names}
    capsys.readouterr()
    assert main(["tile", str(slides), "--out", str(sharded), *ARGS, "--shard", "1/2"]) == 0
    assert "tiled 2 slide(s) (shard 1/2): 0 ok, 2 skipped, 0 failed" in capsys.readouterr().out
    assert {name: (sharded / name).stat().st_mtime_ns for name in names} == stamps
    assert [r["status"] for r in read_status_csv(sharded / "tile_status.csv")] == ["ok", "skipped", "ok", "skipped"]


def test_a_copy_of_a_running_shard_or_an_unsharded_run_is_refused(four_slides, tmp_path, capsys):
    slides, _ = four_slides
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(out)!r}, shard=(1, 2)):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(60)\n"
    )], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for extra in (["--shard", "1/2"], []):
            capsys.readouterr()
            assert main(["tile", str(slides), "--out", str(out), *ARGS, *extra]) == 1
            err = capsys.readouterr().err
            assert re.fullmatch(
                rf"error: {out}: another wsi-milssl run \(shard 1/2, pid {holder.pid}, since [^)]*\) is writing to "
                r"this folder\. Fix: wait until it finishes, or write to another folder \(--out\)\.\n", err), err
        assert find_stores(out) == []
        assert main(["tile", str(slides), "--out", str(out), *ARGS, "--shard", "0/2"]) == 0  # the other shard runs
        assert [p.name for p in find_stores(out)] == ["slide_0.h5", "slide_2.h5"]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("command", ["tile", "label"])
@pytest.mark.parametrize("value, why", [
    ("1", r"--shard '1' is not I/N; give the 0-based shard and the count, e\.g\. --shard 0/4 \(SLURM: --shard "
          r"\$SLURM_ARRAY_TASK_ID/\$SLURM_ARRAY_TASK_COUNT\)\."),
    ("2/2", r"--shard '2/2': the shard must be 0\.\.1 of 2 \(0-based\), and the count at least 1\."),
    ("0/0", r"--shard '0/0': the shard must be 0\.\.0 of 0 \(0-based\), and the count at least 1\."),
])
def test_a_bad_shard_is_a_usage_error(tmp_path, capsys, command, value, why):
    extra = ["--annotations", str(tmp_path)] if command == "label" else []
    with pytest.raises(SystemExit) as info:
        main([command, str(tmp_path), "--out", str(tmp_path / "out"), *extra, "--shard", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: wsi-milssl {command} ")
    assert re.search(rf"^wsi-milssl {command}: error: argument --shard: {why}$", err, re.M), err
    assert not (tmp_path / "out").exists()


def _slides_folder(four_slides, folder, names):
    """A folder of hard links (or copies) to some of the four slides, under other names."""
    import shutil

    slides, _ = four_slides
    folder.mkdir(exist_ok=True)
    for new, old in names.items():
        try:
            os.link(slides / f"{old}.tif", folder / f"{new}.tif")
        except OSError:
            shutil.copy(slides / f"{old}.tif", folder / f"{new}.tif")
    return folder


def test_a_shard_given_another_slide_list_than_the_shard_before_it_is_refused(four_slides, tmp_path, capsys):
    """The reviewer's sequence: shard 0/2 tiles a folder of five slides, a sixth (sorted second) is copied
    in, shard 1/2 is run: it would tile synth_002/004 twice and synth_001x/003/005 never, with every
    shard exiting 0. It is refused (exit 2, no store, no status row); re-running shard 0 then shard 1
    tiles every slide once and leaves no record."""
    folder = _slides_folder(four_slides, tmp_path / "slidesC",
                            {f"synth_00{k}": f"slide_{k % 4}" for k in (0, 2, 3, 4, 5)})
    out = tmp_path / "shC"
    cmd = ["tile", str(folder), "--out", str(out), *ARGS]
    assert main([*cmd, "--shard", "0/2"]) == 0
    assert [p.name for p in find_stores(out)] == ["synth_000.h5", "synth_003.h5", "synth_005.h5"]
    _slides_folder(four_slides, folder, {"synth_001x": "slide_1"})
    capsys.readouterr()
    assert main([*cmd, "--shard", "1/2"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {out}: shard 1/2 has a list of 6 slide(s) or store(s), but the shard(s) of this 2-way "
                   "run that already ran here (0/2) had a list of 5 (other items, or another order), so some would "
                   "be done twice and others never. Fix: give every shard the same list; when the list changed, "
                   "re-run shard 0/2 with the new list first, then the others (finished slides are skipped).\n")
    assert [p.name for p in find_stores(out)] == ["synth_000.h5", "synth_003.h5", "synth_005.h5"]
    assert [r["slide"] for r in read_status_csv(out / "tile_status.csv")] == ["synth_000", "synth_003", "synth_005"]
    assert main([*cmd, "--shard", "0/2"]) == 0 and main([*cmd, "--shard", "1/2"]) == 0
    assert [(r["slide"], r["status"]) for r in read_status_csv(out / "tile_status.csv")] == [
        ("synth_000", "skipped"), ("synth_001x", "ok"), ("synth_002", "ok"), ("synth_003", "skipped"),
        ("synth_004", "ok"), ("synth_005", "skipped")]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_torchrun_ranks_finish_their_slides_when_a_rank_has_a_failed_slide(four_slides, tmp_path):
    """The reviewer's torchrun run: rank 1's only slide is not a slide, and fails at once. torchrun ends
    every rank when one exits non-zero, so rank 1 used to stop rank 0 mid-slide (no status rows, a
    .partial store left, the same on every re-run). Rank 1 now waits for rank 0 and then exits 1 with a
    line naming the status CSV: every good slide is tiled and torchrun still reports the failure."""
    folder = _slides_folder(four_slides, tmp_path / "slides", {"slide_0": "slide_0", "slide_1": "slide_1"})
    (folder / "slide_0a.tif").write_bytes(os.urandom(5000))  # sorted second: rank 1's share
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "wsi_milssl",
         "tile", str(folder), "--out", str(out), "--magnification", "40", "--patch-size", "64", "--pixels", "raw",
         "--threads", "1", "--openslide-only"], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr
    assert [(r["slide"], r["status"]) for r in read_status_csv(out / "tile_status.csv")] == [
        ("slide_0", "ok"), ("slide_0a", "failed"), ("slide_1", "ok")]
    assert f"error: 1 slide(s) failed (shard 1/2); see {out / 'tile_status.csv'}" in proc.stderr
    assert [p.name for p in find_stores(out)] == ["slide_0.h5", "slide_1.h5"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no .partial, no lock
