"""One features run per output folder: a second run into it is refused, runs into one folder keep each
other's status rows, and torchrun's ranks are refused instead of each embedding every slide."""

from __future__ import annotations

import csv
import subprocess
import sys

from wsi_milssl.cli import main
from wsi_milssl.features.stage import STATUS_FILENAME

ARGS = ["--encoder", "resnet18", "--weights", "random", "--workers", "0", "--threads", "1", "--amp", "off"]


def _rows(path) -> list[tuple[str, str]]:
    with open(path, newline="") as fh:
        return [(row["slide"], row["status"]) for row in csv.DictReader(fh)]


def test_a_second_run_into_the_folder_is_refused(tmp_path, labelled_stores, capsys):
    """A features run holds the folder's lock (here another process holds it, as a running features run
    does): the second run stops with the folder, the other pid and the fix, and writes nothing."""
    out = tmp_path / "feats"
    other = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(out)!r}):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(60)\n"
    )], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        assert main(["features", str(labelled_stores), "--out", str(out), *ARGS]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {out}: another wsi-milssl run (pid {other.pid}"), err
        assert err.rstrip().endswith("Fix: wait until it finishes, or write to another folder (--out).")
        assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == []
    finally:
        other.kill()
        other.wait()


def test_runs_of_other_slides_into_one_folder_keep_each_others_status_rows(tmp_path, labelled_stores, capsys):
    out = tmp_path / "feats"
    assert main(["features", str(labelled_stores / "synth_001.h5"), "--out", str(out), *ARGS]) == 0
    assert main(["features", str(labelled_stores / "synth_000.h5"), "--out", str(out), *ARGS]) == 0
    assert _rows(out / STATUS_FILENAME) == [("synth_000", "ok"), ("synth_001", "ok")]
    assert main(["features", str(labelled_stores / "synth_001.h5"), "--out", str(out), *ARGS]) == 0
    assert _rows(out / STATUS_FILENAME) == [("synth_000", "ok"), ("synth_001", "skipped")]


def test_torchrun_ranks_are_refused(tmp_path, labelled_stores, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    out = tmp_path / "feats"
    assert main(["features", str(labelled_stores), "--out", str(out), *ARGS]) == 2
    err = capsys.readouterr().err
    # rank 1, started by hand (no torchrun agent to end it when rank 0 refuses): it says so itself, tagged
    assert err.startswith("[rank 1] error: 2 ranks (RANK and WORLD_SIZE are set, without torchrun): features are not "
                          "split into shards"), err
    assert ("Fix: unset RANK and WORLD_SIZE (something other than torchrun set them) and run one process (it uses "
            "the GPU and a pool of readers)") in err  # review DU: the fix the user had already followed; DW: wording
    assert not out.exists()
