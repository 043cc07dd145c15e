"""Two writers of one slide at once (issue 14 row 14): each writes its own temporary file, so both
finish and the slide is whole. (With one shared ``.x.tif.partial`` name, the second writer's file
vanished under it: the first renamed it away.) A synth run also holds its folder's lock."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from wsi_milssl.config import SynthConfig
from wsi_milssl.errors import FolderLockedError
from wsi_milssl.slide.reader import open_slide
from wsi_milssl.synth import generate_slides
from wsi_milssl.synth.pyramid import write_pyramidal_tiff


def test_two_writers_of_one_slide_at_once_both_finish(tmp_path):
    path = tmp_path / "x.tif"
    both_open = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []

    def render(x0, y0, x1, y1):
        if x0 == 0 and y0 == 0:
            both_open.wait()  # both writers have created their temporary file before either finishes
        return np.full((y1 - y0, x1 - x0, 3), 200, np.uint8)

    def write():
        try:
            write_pyramidal_tiff(path, render, width=1024, height=1024, mpp=0.5, min_level_size_px=256)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tif"]  # no temporary or scratch folder left
    with open_slide(path) as slide:
        assert slide.dimensions == (1024, 1024) and slide.mpp == pytest.approx(0.5)


def test_synth_into_a_folder_another_run_holds_is_refused(tmp_path):
    out = tmp_path / "slides"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(out)!r}):\n"
        "    print('locked', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderLockedError,
                           match=rf"^{re.escape(str(out))}: another wsi-milssl run \(pid {holder.pid}") as caught:
            generate_slides(SynthConfig(n_slides=1, width_px=1024, height_px=1024), out)
        # synth takes its folder as an argument: the fix names it so, not an --out synth does not have
        assert str(caught.value).endswith("or write to another folder (OUT_DIR).")
    finally:
        holder.kill()
        holder.wait()
    assert list(out.iterdir()) == [out / ".wsi-milssl.lock"]  # nothing written; the lock file of the killed run
    generate_slides(SynthConfig(n_slides=1, width_px=1024, height_px=1024), out)
    assert sorted(p.name for p in out.iterdir()) == ["labels.csv", "manifest.json", "synth_000.tif"]


def test_a_new_run_into_a_used_folder_leaves_none_of_the_old_runs_slides_or_annotations(tmp_path):
    """Three tumour slides, then two normal ones into the same folder: the old annotations and the third
    slide (listed in the old manifest) go (before this, the normal slide kept its tumour XML and
    labelling gave it positive patches); files the command did not write stay."""
    import csv

    out = tmp_path / "data"
    generate_slides(SynthConfig(n_slides=3, width_px=1024, height_px=1024, tumor_slide_fraction=1.0), out)
    assert len(list(out.glob("synth_*.xml"))) == 3
    for name in ("notes.txt", "synth_0001.xml", "tumor_001.tif"):  # files synth did not write stay
        (out / name).write_text("mine")
    generate_slides(SynthConfig(n_slides=2, width_px=1024, height_px=1024, tumor_slide_fraction=0.0, seed=5), out)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "labels.csv", "manifest.json", "notes.txt", "synth_000.tif", "synth_0001.xml", "synth_001.tif",
        "tumor_001.tif"]
    with (out / "labels.csv").open() as fh:
        assert [row["label"] for row in csv.DictReader(fh)] == ["0", "0"]


def test_synth_onto_a_full_disk_is_one_clear_error(tmp_path):
    """The reduced pyramid levels are kept in memory-mapped scratch files beside the slide. They were
    sparse, so a full disk surfaced as a SIGBUS when the map was written (exit 135, "Bus error"), with
    the partial slide, the scratch folder and the lock left behind. Now the scratch files are
    preallocated: a 2 MB disk (level 1 of a 2048-px slide takes 3 MB) is one error line naming the
    slide and the fix, exit 1, and nothing is left. A 2 MB file-size limit where no tmpfs can be
    mounted (see tests/diskfaults.py)."""
    from diskfaults import full_disk

    out = tmp_path / "disk" / "slides"
    with full_disk(out.parent, n_bytes=2 << 20) as (method, preexec):
        result = subprocess.run([sys.executable, "-m", "wsi_milssl", "synth", str(out), "--slides", "2",
                                 "--size-px", "2048", "2048"], capture_output=True, text=True, timeout=300,
                                preexec_fn=preexec)
        left = sorted(p.name for p in out.iterdir()) if out.exists() else []  # a folder left empty is removed
    assert result.returncode == 1, (method, result.returncode, result.stderr[-3000:])  # not 135 / -7 (SIGBUS)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.search(
        rf"{re.escape(str(out))}/synth_000\.tif: cannot write this slide \((No space left on device: the disk is "
        r"full|File too large: the file grew past a size limit)\)\. Fix: ", result.stderr), (
        method, result.stderr[-3000:])
    assert not [n for n in left if n.startswith(".") or n.endswith(".tif")], left  # no partial, scratch or lock
