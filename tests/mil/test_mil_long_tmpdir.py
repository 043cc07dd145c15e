"""Training's DataLoader workers under a TMPDIR too long for a socket: they hand their batches over through sockets
below TMPDIR, and on Python 3.11 training with --workers hung after ``OSError: AF_UNIX path too long`` (review DT;
:mod:`wsi_milssl.sockets`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_batches_are_read_by_workers_under_a_long_tmpdir(tmp_path, image_store_factory):
    paths, labels_csv = image_store_factory(tmp_path / "stores", fmt="h5")
    long_tmp = tmp_path / ("t" * 90)
    long_tmp.mkdir()
    script = textwrap.dedent(f"""
        import numpy as np
        from wsi_milssl.mil import read_labels_csv, read_patch_stores
        from wsi_milssl.mil.data import iterate_batches
        inst = read_patch_stores({[str(p) for p in paths]!r}, read_labels_csv({str(labels_csv)!r}))
        batches = list(iterate_batches(inst, np.arange(40), batch_size=16, num_workers=2))
        print(sum(len(i) for i, _ in batches))
    """)
    env = {**os.environ, "TMPDIR": str(long_tmp), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["40"]
