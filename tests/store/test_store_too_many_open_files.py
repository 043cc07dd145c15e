"""Running out of file handles while opening a patch store is reported as that, with `ulimit -n` as the fix,
not as a corrupt store to delete (review AU 2)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import wsi_milssl
from wsi_milssl.store.base import too_many_open_files


def test_emfile_is_recognised_directly_wrapped_and_by_message():
    assert too_many_open_files(OSError(errno.EMFILE, "Too many open files"))
    assert too_many_open_files(OSError(errno.ENFILE, "Too many open files in system"))
    try:
        try:
            raise OSError(errno.EMFILE, "x")
        except OSError as inner:
            raise RuntimeError("backend failed") from inner
    except RuntimeError as outer:
        assert too_many_open_files(outer)
    assert too_many_open_files(OSError("Unable to open file (errno = 24, error message = 'Too many open files')"))
    assert not too_many_open_files(OSError(errno.EIO, "Input/output error"))
    assert not too_many_open_files(ValueError("truncated file"))


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_opening_a_store_without_free_file_handles_names_ulimit_not_corruption(tmp_path, make_store, fmt):
    store = tmp_path / f"s1.{fmt}"
    make_store(store, pixels="raw", n=5)
    script = textwrap.dedent(f"""
        import os, resource
        from wsi_milssl.errors import StoreError
        from wsi_milssl.store import open_store
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (80, hard))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            with open_store({str(store)!r}) as s:
                s.read_patches([0, 1])
        except StoreError as exc:
            msg = str(exc)
        else:
            msg = "NO ERROR"
        for fd in held:
            os.close(fd)
        print(msg)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(wsi_milssl.__file__).resolve().parent.parent))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    msg = res.stdout
    assert "too many open files" in msg.lower(), msg
    assert "ulimit -n" in msg and "now 80" in msg, msg
    assert "corrupt" not in msg.lower() and "delete it" not in msg, msg


def test_a_feature_file_read_without_free_file_handles_is_not_called_damaged():
    """A feature file that cannot be opened for want of file handles is not damaged: the message says so and names
    `ulimit -n`, where it said to delete the file and make it again."""
    import errno

    from wsi_milssl.features.schema import damaged_message

    message = damaged_message("bag.h5", OSError(errno.EMFILE, "Too many open files"))
    assert "too many open files" in message and "ulimit -n" in message and "the file is not damaged" in message
    assert "delete" not in message
    assert "looks damaged" in damaged_message("bag.h5", OSError("truncated file"))
