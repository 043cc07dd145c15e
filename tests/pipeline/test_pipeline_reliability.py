"""Two ``wsi-milssl run`` of one pipeline at once (issue 14 row 14): the second is refused with a clear
message while the first holds the output folder, and the first finishes untouched. (It used to die
with a traceback in synth: a ``.partial`` file vanished under it.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from wsi_milssl.cli import main
from wsi_milssl.locks import lock_holder

SYNTH_ONLY = """
[pipeline]
name = "twice"
[data]
generate = true
[synth.train]
n_slides = 2
seed = 0
width_px = 2048
height_px = 2048
[synth.test]
n_slides = 1
seed = 1000
width_px = 2048
height_px = 2048
[tile]
magnification = 10.0
patch_size_px = 32
[train]
mode = "images"
epochs = 1
"""


def test_a_second_run_of_one_pipeline_is_refused_while_the_first_runs(tmp_path, capsys):
    toml = tmp_path / "twice.toml"
    toml.write_text(SYNTH_ONLY)
    out = tmp_path / "out"
    cmd = ["run", str(toml), "--out", str(out), "--until", "synth"]
    first = subprocess.Popen([sys.executable, "-m", "wsi_milssl", *cmd], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while (lock_holder(out) or {}).get("pid") != first.pid:
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGSTOP)  # keep it mid-run while the second one starts
        try:
            code = main(cmd)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        first_out, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.search(rf"^error: {re.escape(str(out))}: another wsi-milssl run \(pid {first.pid}, since [^)]*: "
                     rf"wsi-milssl run {re.escape(str(toml))} .*\) is writing to this folder\. Fix: wait until it "
                     r"finishes, or write to another folder \(--out\)\.$", err, re.M), err
    assert "Traceback" not in err
    assert first.returncode == 0, first_err
    assert "[synth]" in first_out
    # the first run's outputs are whole: three slides, their labels, no temporary anywhere
    slides = sorted(p.name for p in (out / "slides").rglob("*.tif"))
    assert slides == ["synth_000.tif", "synth_000.tif", "synth_001.tif"]
    leftovers = [p for p in out.rglob(".*") if p.name != ".pipeline" and ".pipeline" not in p.parts]
    assert leftovers == []
    # once the first has finished, the same command runs (and finds synth up to date)
    assert main(cmd) == 0
    assert "[synth] skipped (up to date)" in capsys.readouterr().out
