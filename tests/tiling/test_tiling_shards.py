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
from wsi_milssl.config import TileConfig
from wsi_milssl.distributed import shard_of
from wsi_milssl.errors import StoreError
from wsi_milssl.store import find_stores
from wsi_milssl.tiling import find_slides, read_status_csv, tile_slides

ARGS = ["--magnification", "20", "--patch-size", "256", "--entropy-threshold", "4", "--threads", "1"]
SLIDES = ["slide_0", "slide_1", "slide_2", "slide_3"]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, **extra}


def _rows_without_seconds(folder) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_status_csv(folder / "tile_status.csv")]


def test_three_slurm_array_tasks_at_once_make_the_stores_of_one_run(four_slides, tmp_path, store_contents,
                                                                   same_contents, capsys):
    """Three array tasks, started together with the README's --shard $SLURM_ARRAY_TASK_ID/
    $SLURM_ARRAY_TASK_COUNT, give every store (each array and attribute), QC image, tile_config.json
    and tile_status.csv row (timing aside) of one unsharded run; a re-run of a task skips its slides."""
    slides, _ = four_slides
    assert [shard_of(s, 3) for s in SLIDES] == [0, 0, 1, 2]  # each task's slides: the hash of their stems
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert main(["tile", str(slides), "--out", str(whole), *ARGS]) == 0
    script = (f"exec {shlex.quote(sys.executable)} -m wsi_milssl tile {shlex.quote(str(slides))} --out "
              f"{shlex.quote(str(sharded))} {' '.join(ARGS)} --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT")
    procs = [subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(SLURM_ARRAY_TASK_ID=str(i), SLURM_ARRAY_TASK_COUNT="3")) for i in range(3)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    for i, (out, n) in enumerate(zip(outputs, (2, 1, 1))):
        assert f"tiled {n} slide(s) (shard {i}/3): {n} ok, 0 skipped, 0 failed" in out, out

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
    assert main(["tile", str(slides), "--out", str(sharded), *ARGS, "--shard", "0/3"]) == 0
    assert "tiled 2 slide(s) (shard 0/3): 0 ok, 2 skipped, 0 failed" in capsys.readouterr().out
    assert {name: (sharded / name).stat().st_mtime_ns for name in names} == stamps
    assert [r["status"] for r in read_status_csv(sharded / "tile_status.csv")] == ["skipped", "skipped", "ok", "ok"]


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
                rf"error: {re.escape(str(out))}: another wsi-milssl run \(shard 1/2, pid {holder.pid}, since [^)]*\) "
                r"is writing to this folder\. Fix: wait until it finishes, or write to another folder \(--out\)\.\n",
                err), err
        assert find_stores(out) == []
        assert main(["tile", str(slides), "--out", str(out), *ARGS, "--shard", "0/2"]) == 0  # the other shard runs
        assert [p.name for p in find_stores(out)] == [f"{s}.h5" for s in SLIDES if shard_of(s, 2) == 0]
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


@pytest.mark.parametrize("command", ["tile", "label", "heatmap"])
def test_a_shard_under_torchrun_is_refused(four_slides, tmp_path, monkeypatch, capsys, command):
    """The reviewer's repro: `--shard 0/2` then `--shard 1/2` with RANK=0 WORLD_SIZE=2 in the environment
    split shard 0 by position (the rank's) and shard 1 by hash, so a slide was never tiled and both
    exited 0. --shard under torchrun with several ranks is refused before anything is written."""
    slides, _ = four_slides
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "out"
    extra = {"tile": ARGS, "label": ["--annotations", str(tmp_path)], "heatmap": ["--model", str(tmp_path / "m.pt")]}
    for i in range(2):
        assert main([command, str(slides), "--out", str(out), *extra[command], "--shard", f"{i}/2"]) == 2
        assert capsys.readouterr().err == (
            f"error: --shard {i}/2 under torchrun (RANK=0, WORLD_SIZE=2): torchrun's ranks already split the slides, "
            "and --shard would split them another way. Fix: drop --shard under torchrun, or run --shard I/N "
            "without torchrun (unset RANK and WORLD_SIZE).\n")
    assert not out.exists()


def test_shards_under_one_rank_split_by_hash(four_slides, tmp_path, monkeypatch, capsys):
    """With RANK=0 WORLD_SIZE=1 (one rank: torchrun does not split), --shard 0/2 and 1/2 take the
    slides whose stem hashes to them, and together tile every slide once."""
    slides, _ = four_slides
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "out"
    for i in range(2):
        assert main(["tile", str(slides), "--out", str(out), *ARGS, "--shard", f"{i}/2"]) == 0
        assert [r["slide"] for r in read_status_csv(out / "tile_status.csv") if shard_of(r["slide"], 2) == i] == [
            s for s in SLIDES if shard_of(s, 2) == i]
    assert [r["slide"] for r in read_status_csv(out / "tile_status.csv")] == SLIDES


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


#: Five slides and their shards of 2 (the hash of the stem): shard 0 tiles case_02 and case_04, shard 1 the others.
CASES = ["case_00", "case_01", "case_02", "case_03", "case_04"]


def _cases(four_slides, folder, names=CASES):
    return _slides_folder(four_slides, folder, {name: f"slide_{k % 4}" for k, name in enumerate(names)})


def _hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_array_tasks_given_different_lists_tile_every_slide_they_all_saw_once(four_slides, tmp_path, capsys):
    """The reviewer's sequence: shard 0/2 tiles a folder of five slides, two slides are copied in, shard
    1/2 is run on the seven. A slide's shard is the hash of its stem, not its place in the list, so
    shard 1 tiles its three slides of the five and the new slide of its share, none of shard 0's, and
    exits 0. The new slide of shard 0's share is left, as after an unsharded run: the next run tiles it."""
    assert [shard_of(s, 2) for s in [*CASES, "case_00a", "case_02x"]] == [1, 1, 0, 1, 0, 0, 1]
    folder = _cases(four_slides, tmp_path / "slides")
    out = tmp_path / "out"
    cmd = ["tile", str(folder), "--out", str(out), *ARGS]
    assert main([*cmd, "--shard", "0/2"]) == 0
    assert [r["slide"] for r in read_status_csv(out / "tile_status.csv")] == ["case_02", "case_04"]
    _slides_folder(four_slides, folder, {"case_00a": "slide_1", "case_02x": "slide_0"})  # sorted 2nd and 5th
    capsys.readouterr()
    assert main([*cmd, "--shard", "1/2"]) == 0
    assert "tiled 4 slide(s) (shard 1/2): 4 ok, 0 skipped, 0 failed" in capsys.readouterr().out
    assert [(r["slide"], r["status"]) for r in read_status_csv(out / "tile_status.csv")] == [
        ("case_00", "ok"), ("case_01", "ok"), ("case_02", "ok"), ("case_02x", "ok"), ("case_03", "ok"),
        ("case_04", "ok")]  # case_00a: its shard ran before it came
    assert _hidden(out) == []
    capsys.readouterr()
    assert main(cmd) == 0
    assert "tiled 7 slide(s): 1 ok, 6 skipped, 0 failed" in capsys.readouterr().out
    assert [p.name for p in find_stores(out)] == sorted(f"{s}.h5" for s in [*CASES, "case_00a", "case_02x"])


class _Killed(Exception):
    pass


def _kill_after_first_slide(event):
    if event.stage == "tile" and event.item:
        raise _Killed


def test_a_requeued_shard_given_a_changed_list_tiles_its_share_of_both(four_slides, tmp_path):
    """Shard 1/2 is killed after its first slide and re-queued after a slide was added (and one of
    shard 0's removed): it tiles the rest of its share of the old list, and no slide of shard 0's. The
    re-run of shard 0 on the new list tiles only the new slide of its share. No shard leaves a file
    behind that a later run would stumble on."""
    config = TileConfig(magnification=20, patch_size_px=256, entropy_threshold_bits=4, threads=1)
    folder = _cases(four_slides, tmp_path / "slides")
    out = tmp_path / "out"
    first = tile_slides(find_slides([folder]), out, config, shard=(0, 2))
    assert [r.slide for r in first.results] == ["case_02", "case_04"]
    with pytest.raises(_Killed):
        tile_slides(find_slides([folder]), out, config, shard=(1, 2), progress=_kill_after_first_slide)
    _slides_folder(four_slides, folder, {"case_00a": "slide_1"})
    (folder / "case_04.tif").unlink()
    again = tile_slides(find_slides([folder]), out, config, shard=(1, 2))
    assert [(r.slide, r.status) for r in again.results] == [("case_00", "skipped"), ("case_01", "ok"),
                                                             ("case_03", "ok")]
    assert [(r["slide"], r["status"]) for r in read_status_csv(out / "tile_status.csv")] == [
        ("case_00", "skipped"), ("case_01", "ok"), ("case_02", "ok"), ("case_03", "ok"), ("case_04", "ok")]
    last = tile_slides(find_slides([folder]), out, config, shard=(0, 2))
    assert [(r.slide, r.status) for r in last.results] == [("case_00a", "ok"), ("case_02", "skipped")]
    assert _hidden(out) == []


@pytest.mark.parametrize("other, why", [
    ([], None),
    (["--format", "zarr"], "format 'h5' -> 'zarr'"),
    (["--patch-size", "128"], "patch_size_px 256 -> 128; stride_px 256 -> 128"),
])
def test_a_shard_started_with_other_settings_is_refused(four_slides, tmp_path, other, why):
    """The reviewer's race: shard 0/2 and shard 1/2 start together with another format (or patch size).
    Shard 1 used to find no store yet, pass the check and fill the folder with stores of two settings
    (exit 0, tile_config.json describing one). The first shard records the run's settings in
    tile_config.json before its first slide, so shard 1, started while shard 0 tiles, is refused with
    one error naming both settings; with the same settings it tiles its share."""
    slides, _ = four_slides
    out = tmp_path / "out"
    config = TileConfig(magnification=20, patch_size_px=256, entropy_threshold_bits=4, threads=1)
    started: list[subprocess.CompletedProcess] = []

    def start_shard_1(event):  # shard 0 holds the folder and has not tiled a slide yet
        if not started:
            started.append(subprocess.run(
                [sys.executable, "-m", "wsi_milssl", "tile", str(slides), "--out", str(out), *ARGS, *other,
                 "--shard", "1/2"], env=_env(), capture_output=True, text=True, timeout=300))

    assert tile_slides(find_slides([slides]), out, config, shard=(0, 2), progress=start_shard_1).ok
    proc, = started
    if why is None:
        assert proc.returncode == 0, proc.stderr
        assert [p.name for p in find_stores(out)] == [f"{s}.h5" for s in SLIDES]
        return
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        f"error: {out / 'tile_config.json'}: this folder is tiled with other settings than this shard's ({why}); "
        "the shards of one run must use the same settings. Fix: give this shard the settings of the other shards, "
        "or write to a new folder with --out (or, when no other shard is running, pass --overwrite to re-tile "
        "with these settings).\n")
    assert [p.name for p in find_stores(out)] == [f"{s}.h5" for s in SLIDES if shard_of(s, 2) == 0]
    assert [r["slide"] for r in read_status_csv(out / "tile_status.csv")] == [s for s in SLIDES if shard_of(s, 2) == 0]


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
    # rank 1's lines say so, as the README promises (review CI: these two did not)
    lines = proc.stderr.splitlines()
    assert any(line.startswith("[rank 1] failed: slide_0a: ") for line in lines), proc.stderr
    assert f"[rank 1] error: 1 slide(s) failed (shard 1/2); see {out / 'tile_status.csv'}" in lines, proc.stderr
    assert [p.name for p in find_stores(out)] == ["slide_0.h5", "slide_1.h5"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no .partial, no lock


LATE_RANK = """\
import os, sys, time
from pathlib import Path
from wsi_milssl.cli import main

rank = os.environ["RANK"]
if rank == "0":
    time.sleep(float(sys.argv[1]))  # a rank that starts late (a slow node, a slow file system)
code = main(sys.argv[3:])
Path(sys.argv[2], f"rank{rank}-exit{code}").touch()
sys.exit(code)
"""


@pytest.mark.slow  # a third torchrun launch of the end barrier that the failed-slide test above exercises
def test_a_failed_rank_waits_for_a_rank_that_starts_late(four_slides, tmp_path):
    """The reviewer's third case: an earlier `--shard 0/2` run tiled into the folder, then torchrun's
    rank 1 fails its slide at once while rank 0 starts 3 s late. Rank 1 waits in the barrier for rank 0
    (it used to find shard 0 'finished' in the earlier run's record and exit, and torchrun killed rank 0
    before it began); both ranks end, rank 0 with 0, rank 1 with 1."""
    folder = _slides_folder(four_slides, tmp_path / "slides", {"slide_0": "slide_0", "slide_1": "slide_1"})
    (folder / "slide_0a.tif").write_bytes(os.urandom(5000))  # sorted second: rank 1's share
    out, marks = tmp_path / "out", tmp_path / "marks"
    marks.mkdir()
    tile = ["tile", str(folder), "--out", str(out), "--magnification", "40", "--patch-size", "64", "--pixels",
            "raw", "--threads", "1", "--openslide-only"]
    assert main([*tile, "--shard", "0/2"]) == 0
    script = tmp_path / "late_rank.py"
    script.write_text(LATE_RANK)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), "3", str(marks), *tile], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr
    assert sorted(p.name for p in marks.iterdir()) == ["rank0-exit0", "rank1-exit1"], proc.stderr
    assert f"error: 1 slide(s) failed (shard 1/2); see {out / 'tile_status.csv'}" in proc.stderr
    assert [(r["slide"], r["status"]) for r in read_status_csv(out / "tile_status.csv")] == [
        ("slide_0", "skipped"), ("slide_0a", "failed"), ("slide_1", "skipped")]
    assert _hidden(out) == []


FEWER_SLIDES_ON_RANK_1 = """\
import os, sys
from wsi_milssl.cli import main

args = sys.argv[1:]
if os.environ["RANK"] == "1":
    args.remove(args[1])  # its listing missed the first slide (still being copied in when it looked)
sys.exit(main(args))
"""


@pytest.mark.slow  # another torchrun launch (~20 s on CI); the default run's failed-slide test above compares the
# ranks' lists too (the same lists: no failure)
def test_torchrun_ranks_that_split_different_lists_of_slides_fail(four_slides, tmp_path):
    """Review CI: ranks split every N-th slide of their own listing; a slide missing from one rank's list (a folder
    still being copied into) left slides tiled by no rank, or by two, with exit status 0. The ranks compare their
    lists at the end and every rank fails, saying so."""
    folder = _slides_folder(four_slides, tmp_path / "slides", {"slide_0": "slide_0", "slide_1": "slide_1",
                                                                "slide_2": "slide_2"})
    out = tmp_path / "out"
    script = tmp_path / "fewer.py"
    script.write_text(FEWER_SLIDES_ON_RANK_1)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "tile",
         *(str(folder / f"slide_{i}.tif") for i in range(3)), "--out", str(out), "--magnification", "40",
         "--patch-size", "64", "--pixels", "raw", "--threads", "1", "--openslide-only"],
        env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr
    assert ("the ranks split different lists of slides (rank 0: 3 (slide_0, slide_2), rank 1: 2 (slide_1, slide_2): "
            "the number of slides, the first and the last)") in proc.stderr, proc.stderr
    assert "Fix: give every rank the same slides, and run the same command again" in proc.stderr


def test_a_shard_into_a_finished_folder_of_other_settings_gets_the_unsharded_error(four_slides, tmp_path):
    """A sharded run (torchrun) into the folder of an earlier, finished run with another patch size used to be
    told 'the shards of one run must use the same settings' (as if another shard were running); it gets the
    unsharded run's error about the folder's stores, whose fix (--out or --overwrite) is the right one."""
    slides, _ = four_slides
    out = tmp_path / "out"
    assert tile_slides(find_slides([slides]), out,
                       TileConfig(magnification=20, patch_size_px=256, entropy_threshold_bits=4, threads=1)).ok
    with pytest.raises(StoreError) as err:
        tile_slides(find_slides([slides]), out, TileConfig(magnification=20, patch_size_px=128,
                                                           entropy_threshold_bits=4, threads=1), shard=(0, 2))
    assert "shards of one run" not in str(err.value)
    assert "made with different settings" in str(err.value) and "--overwrite" in str(err.value)


def test_a_shard_with_other_settings_while_another_shard_writes_gets_the_shard_error(four_slides, tmp_path):
    """Review AD: after a9bd6ce checked the folder's stores first, a shard with another patch size started while
    another shard of the run was still tiling (its stores written) was told the folder's stores differ, with
    '--overwrite' as a fix; following it mixed two patch sizes in one folder. While another shard holds the
    folder, the shards' settings decide, as before; with no shard running, the folder's error stays."""
    from processes import hold_lock, release

    slides, _ = four_slides
    out = tmp_path / "out"
    assert tile_slides(find_slides([slides]), out,
                       TileConfig(magnification=20, patch_size_px=256, entropy_threshold_bits=4, threads=1)).ok
    other = TileConfig(magnification=20, patch_size_px=128, entropy_threshold_bits=4, threads=1)
    shard_0 = hold_lock(out, shard=(0, 2))  # shard 0 of the run, still writing
    try:
        with pytest.raises(StoreError, match="the shards of one run must use the same settings"):
            tile_slides(find_slides([slides]), out, other, shard=(1, 2))
    finally:
        release(shard_0)
    with pytest.raises(StoreError, match="made with different settings"):
        tile_slides(find_slides([slides]), out, other, shard=(1, 2))
