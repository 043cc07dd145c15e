"""An output folder to be made below a folder without write permission: the error's fix named the folder to be
made, which does not exist (`chmod u+w ../C16 dl/prep`), unquoted, so the command it gives fails twice over
(review AO, finding 4). It now names the nearest existing folder, the one that refused, quoted for a shell."""

from __future__ import annotations

import errno
import os
import shlex
import stat
import tempfile
from pathlib import Path

import pytest

from wsi_milssl.atomic import atomic_write_text, output_error
from wsi_milssl.errors import OutputError

NOBODY = 65534


def _as_unprivileged(fn) -> str:
    """``fn()``'s text, run where permissions count: as this user, or (as root, which ignores them) in a forked
    child that drops to uid/gid 65534."""
    if os.geteuid() != 0:
        return fn()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, fn().encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write, f"child failed: {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        text = fh.read().decode()
    os.waitpid(pid, 0)
    return text


@pytest.fixture()
def base():
    """A folder anyone may enter (tmp_path of root is not; nor a TMPDIR below a private folder: /tmp itself is the
    parent, review DC), holding a read-only "C16 dl"."""
    folder = Path(tempfile.mkdtemp(prefix="atomic-ro-", dir="/tmp" if os.path.isdir("/tmp") else None))
    folder.chmod(0o755)
    (folder / "C16 dl").mkdir()
    (folder / "C16 dl").chmod(0o555)
    yield folder
    (folder / "C16 dl").chmod(0o755)
    for path in sorted(folder.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir()


def test_a_folder_below_a_read_only_one_names_the_read_only_one_quoted(base):
    def write() -> str:
        before = os.getcwd()
        os.chdir(base)
        try:
            atomic_write_text(Path("C16 dl") / "prep" / "pipeline.toml", "x")
        except OutputError as exc:
            return str(exc)
        finally:  # as a non-root user this runs in the test process itself (review DC: its folder was then removed)
            os.chdir(before)
        return "written"

    message = _as_unprivileged(write)
    assert message == ("C16 dl/prep/pipeline.toml: cannot write this file (Permission denied: no permission to write "
                       "in C16 dl). Fix: make it writable (`chmod u+w 'C16 dl'`) or write to another folder.")
    assert shlex.split("chmod u+w 'C16 dl'")[-1] == "C16 dl"


def test_the_fix_names_the_nearest_existing_folder(base):
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    deep = base / "C16 dl" / "a b" / "c" / "out.csv"
    message = str(output_error(deep, denied))
    assert f"no permission to write in {base / 'C16 dl'})" in message
    assert f"`chmod u+w {shlex.quote(str(base / 'C16 dl'))}`" in message
    # an existing folder that refused is named itself
    message = str(output_error(base / "C16 dl" / "out.csv", denied))
    assert f"`chmod u+w {shlex.quote(str(base / 'C16 dl'))}`" in message
    assert stat.S_IMODE((base / "C16 dl").stat().st_mode) == 0o555


def test_a_full_disk_names_the_folder_quoted(base):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    message = str(output_error(base / "C16 dl" / "x.h5", full))
    assert f"(`df -h {shlex.quote(str(base / 'C16 dl'))}`)" in message
