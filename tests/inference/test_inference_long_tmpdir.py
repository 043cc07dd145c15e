"""A long TMPDIR (a scheduler's per-job folder) is no reason for the readers to fail: multiprocessing puts its
fork server's socket below TMPDIR, and a socket path takes at most 107 bytes, so on Python 3.11 heatmap and
features stopped with ``OSError: AF_UNIX path too long`` (review DC)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_the_readers_start_under_a_tmpdir_too_long_for_a_socket(tmp_path):
    long_tmp = tmp_path / ("t" * 90)
    long_tmp.mkdir()
    script = textwrap.dedent("""
        import multiprocessing.util, tempfile
        from wsi_milssl.inference.predict import _reader_context, prestart_readers
        prestart_readers()
        ctx = _reader_context()
        with ctx.Pool(1) as pool:  # a process of the fork server: its socket works
            assert pool.apply(len, ("abc",)) == 3
        print(tempfile.gettempdir())
        print(multiprocessing.util.get_temp_dir())
    """)
    env = {**os.environ, "TMPDIR": str(long_tmp)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tmp, sockets = done.stdout.split()
    assert tmp == str(long_tmp)  # everything else still goes to the user's TMPDIR
    assert len(os.fsencode(sockets)) + 34 <= 107 and not sockets.startswith(str(long_tmp))
    assert not os.path.exists(sockets)  # removed at exit


def test_a_short_tmpdir_keeps_the_sockets_below_it(tmp_path):
    script = ("import multiprocessing.util\nfrom wsi_milssl.inference.predict import prestart_readers\n"
              "prestart_readers()\nprint(multiprocessing.util.get_temp_dir())")
    short = tmp_path / "t"
    short.mkdir()
    env = {**os.environ, "TMPDIR": str(short)}
    if len(os.fsencode(str(short))) + 34 > 107:  # the test's own folder is long: its parent stands in
        short = tmp_path.anchor + "tmp"
        env["TMPDIR"] = str(short)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(os.path.join(str(short), "pymp-"))
