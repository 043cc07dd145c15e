"""revT T2: a `tile` or `features` run stopped midway (Ctrl-C, kill -9, a crash) left a folder that looked
finished (its config JSON as a finished run writes it, a status row per slide done, no lock), and `train` on
it trained on the slides there without a word (4 of 6 bags, rc 0). Now a run marks its folder unfinished
before its first slide and clears the mark only after its last (failed slides count as done); `train`
warns about such a folder (INPUTS, --val), naming it, the slides labelled in labels.csv that the stopped
run did not make, the stores (feature files) it holds and the fix (run that command again). Shards each
mark their own part, so one shard finishing does not clear another's."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap

import pytest

from wsi_milssl.cli import main
from wsi_milssl.config import TileConfig
from wsi_milssl.distributed import shard_of
from wsi_milssl.store import find_stores
from wsi_milssl.tiling import find_slides, read_status_csv, tile_slides
from wsi_milssl.tiling.status import unfinished_runs

#: coarse (4 µm/px, 32 px patches: about 25 patches a slide), so that tiling and training take well under a second a
#: slide (the warnings are about which stores a folder holds, not how many patches)
TILE = TileConfig(target_mpp=4.0, patch_size_px=32, entropy_threshold_bits=3.0, min_tissue=0.3, mask_mpp=8.0,
                  threads=1)
SLIDES = ["slide_0", "slide_1", "slide_2", "slide_3"]
TRAIN = ["--epochs", "1", "--threads", "1", "--workers", "0", "--no-plots", "--amp", "off", "--batch-size", "16"]
FEATURES = "FeaturesConfig(encoder='resnet18', weights='random', num_workers=0, threads=1, amp='off', device='cpu')"


@pytest.fixture(scope="module")
def cohort(four_slides, tmp_path_factory):
    """(the four slides' folder, labels.csv of all four: slide_0 and slide_2 tumour)."""
    slides, _ = four_slides
    labels = tmp_path_factory.mktemp("labels") / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"{s},{1 - k % 2}\n" for k, s in enumerate(SLIDES)))
    return slides, labels


@pytest.fixture(scope="module")
def stores(cohort, tmp_path_factory):
    """The four slides' stores, from a finished run."""
    out = tmp_path_factory.mktemp("stores") / "st"
    assert tile_slides(find_slides([cohort[0]]), out, TILE).ok
    return out


def _stop_after(n: int, sig: int, body: str, stage: str) -> None:
    """Run ``body`` (a tile or features call with ``progress=stop``) in a new process that sends itself
    ``sig`` (Ctrl-C's SIGINT, kill -9's SIGKILL) once ``n`` slides of ``stage`` are done."""
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from wsi_milssl.config import FeaturesConfig, TileConfig
        from wsi_milssl.features import extract_features
        from wsi_milssl.tiling import find_slides, tile_slides
        TILE = {TILE!r}

        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
        sent = []

        def stop(event):  # >=: under load the progress events may skip a count
            if event.stage == {stage!r} and event.done >= {n} and not sent:
                sent.append(True)
                os.kill(os.getpid(), {int(sig)})
    """) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == -sig, proc.stderr


def _train(inputs, labels, run, capsys, *more) -> str:
    capsys.readouterr()
    assert main(["train", *map(str, inputs), "--labels", str(labels), "--out", str(run), *TRAIN, *more]) == 0
    return capsys.readouterr().err


def _warning(err: str, option: str, folder, stage: str, missing: list[str], held: int, what: str) -> None:
    n = len(missing)
    assert re.search(
        rf"WARNING wsi_milssl\.cli\.train: {re.escape(option)} {re.escape(str(folder))}: the last `wsi-milssl "
        rf"{stage}` run into this folder did not finish \(stopped or killed; started [0-9-]+ [0-9:]+: [^\n]*\): "
        rf"{n} slides? of labels\.csv that it was to make ha(s|ve) no {what} here \({re.escape(', '.join(missing))}\), "
        rf"so training goes on without (it|them); the folder holds {held} {what}s?\. Fix, unless that is what you "
        r"want: run that command again to finish the folder \(it skips the slides done\), then "
        r"train again\.", err), err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_train_warns_about_the_stores_of_a_stopped_tile_run(cohort, tmp_path, capsys, sig):
    slides, labels = cohort
    out = tmp_path / "st"
    _stop_after(2, sig, f"tile_slides(find_slides([{str(slides)!r}]), {str(out)!r}, TILE, progress=stop)", "tile")
    # what the review saw: a folder that looks finished, two stores short
    assert [p.stem for p in find_stores(out)] == SLIDES[:2]
    assert [r["slide"] for r in read_status_csv(out / "tile_status.csv")] == SLIDES[:2]
    assert (out / "tile_config.json").is_file()
    if sig == signal.SIGINT:
        assert not (out / ".wsi-milssl.lock").exists()  # (kill -9 leaves the file: no lock, taken over)
    assert [r["slides"] for r in unfinished_runs(out, "tile")] == [SLIDES]

    err = _train([out], labels, tmp_path / "run", capsys)
    _warning(err, "INPUTS", out, "tile", SLIDES[2:], 2, "store")

    # the same stores given one by one (a shell glob) are as short
    err = _train(find_stores(out), labels, tmp_path / "run2", capsys)
    _warning(err, "INPUTS", out, "tile", SLIDES[2:], 2, "store")

    # the fix: the same run again finishes the folder (skipping the slides done), and the mark is gone
    assert tile_slides(find_slides([slides]), out, TILE).ok
    assert unfinished_runs(out, "tile") == [] and not list(out.glob(".wsi-milssl.*"))
    assert "did not finish" not in _train([out], labels, tmp_path / "run3", capsys)


def test_a_finished_run_with_failed_slides_leaves_no_mark(cohort, tmp_path, capsys):
    """Failed slides are a finished run's: they are in tile_status.csv, and train does not warn."""
    slides, labels = cohort
    out = tmp_path / "st"
    run = tile_slides([*find_slides([slides]), tmp_path / "missing.tif"], out, TILE)
    assert run.n_failed == 1
    assert unfinished_runs(out, "tile") == []
    assert "did not finish" not in _train([out], labels, tmp_path / "run", capsys)


def test_a_crashed_tile_run_and_a_later_run_of_other_slides(cohort, tmp_path, capsys):
    """A run stopped by an error leaves its mark; a later run of some slides only clears its own, so the
    slides the stopped run did not make are still warned about; a run of all of them clears both."""
    slides, labels = cohort
    out = tmp_path / "st"
    every = find_slides([slides])

    def crash(event):
        if event.stage == "tile" and event.done == 1:
            raise RuntimeError("a crash")

    with pytest.raises(RuntimeError):
        tile_slides(every, out, TILE, progress=crash)
    assert tile_slides(every[1:2], out, TILE).ok  # slide_1 only
    assert [r["slides"] for r in unfinished_runs(out, "tile")] == [SLIDES]
    _warning(_train([out], labels, tmp_path / "run", capsys), "INPUTS", out, "tile", SLIDES[2:], 2, "store")
    assert tile_slides(every, out, TILE).ok
    assert unfinished_runs(out, "tile") == []


def test_shards_keep_their_own_marks(cohort, tmp_path, capsys):
    """Shard 0/3 stopped after its first slide leaves its mark while shards 1/3 and 2/3 finish and clear
    their own; running shard 0/3 again clears it."""
    slides, labels = cohort
    out = tmp_path / "st"
    every = find_slides([slides])
    assert [shard_of(s, 3) for s in SLIDES] == [0, 0, 1, 2]
    _stop_after(1, signal.SIGKILL, f"tile_slides(find_slides([{str(slides)!r}]), {str(out)!r}, TILE, "
                                   "progress=stop, shard=(0, 3))", "tile")
    for i in (1, 2):
        assert tile_slides(every, out, TILE, shard=(i, 3)).ok
    assert [(r["shard"], r["slides"]) for r in unfinished_runs(out, "tile")] == [("0/3", SLIDES[:2])]
    _warning(_train([out], labels, tmp_path / "run", capsys), "INPUTS", out, "tile", ["slide_1"], 3, "store")
    assert tile_slides(every, out, TILE, shard=(0, 3)).ok
    assert unfinished_runs(out, "tile") == []
    assert "did not finish" not in _train([out], labels, tmp_path / "run2", capsys)


def test_validation_stores_of_a_stopped_run_are_warned_about(cohort, stores, tmp_path, capsys):
    """--val: slides of the stopped run that are read from the training stores are not missing."""
    slides, labels = cohort
    val = tmp_path / "val"
    _stop_after(1, signal.SIGKILL, f"tile_slides(find_slides([{str(slides)!r}])[2:], {str(val)!r}, TILE, "
                                   "progress=stop)", "tile")
    train = tmp_path / "train"
    train.mkdir()
    for name in ("slide_0.h5", "slide_1.h5"):
        (train / name).symlink_to(stores / name)
    err = _train([train], labels, tmp_path / "run", capsys, "--val", str(val), "--select-metric", "bag_nll")
    _warning(err, "--val", val, "tile", ["slide_3"], 1, "store")
    assert "INPUTS" not in err
    # a slide it was to make that is read from the training stores is not missing
    (train / "slide_3.h5").symlink_to(stores / "slide_3.h5")
    err = _train([train], labels, tmp_path / "run2", capsys, "--val", str(val), "--select-metric", "bag_nll")
    assert "did not finish" not in err


def test_train_warns_about_the_features_of_a_killed_features_run(cohort, stores, tmp_path, capsys):
    """kill -9 as the third feature file is about to be written (files are written in slide order)."""
    slides, labels = cohort
    out = tmp_path / "f"
    _stop_after(2, signal.SIGKILL, f"""
        from wsi_milssl.features import schema
        write = schema.write_feature_file

        def write_or_die(path, **kwargs):
            if Path(path).stem == "slide_2":
                os.kill(os.getpid(), signal.SIGKILL)
            return write(path, **kwargs)

        schema.write_feature_file = write_or_die
        extract_features([{str(stores)!r}], {str(out)!r}, {FEATURES})
    """, "features")
    assert sorted(p.stem for p in out.glob("*.h5")) == SLIDES[:2]
    assert (out / "features_config.json").is_file()
    _warning(_train([out], labels, tmp_path / "run", capsys), "INPUTS", out, "features", SLIDES[2:], 2,
             "feature file")
    # the same command again finishes the folder
    capsys.readouterr()
    assert main(["features", str(stores), "--out", str(out), "--encoder", "resnet18", "--weights", "random",
                 "--workers", "0", "--threads", "1", "--amp", "off", "--device", "cpu"]) == 0
    assert unfinished_runs(out, "features") == []
    assert "did not finish" not in _train([out], labels, tmp_path / "run2", capsys)
