"""The readers' shared memory (review T4, T5): a /dev/shm too small for the slots (Docker's default is
64 MB), a file-size limit below them, or a /dev/shm that fills up before a reader pool is restarted,
is one OutputError naming /dev/shm, the bytes needed and the fix. Before, the slots were created
sparse: a reader died of a SIGBUS when it first wrote one (with ``workers == 0`` the whole process,
"Bus error"), a restarted pool then failed in a semaphore with a traceback, and a file-size limit
was a traceback from ``os.ftruncate``.

Where this machine allows it, /dev/shm is a small tmpfs mounted in a private mount namespace
(``unshare -m``) of a child process, so nothing else on the machine sees it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest

from diskfaults import can_mount, file_size_limit
from wsi_milssl import shm as shm_rules
from wsi_milssl.errors import OutputError
from wsi_milssl.inference.predict import _Readers

_TESTS = str(Path(__file__).resolve().parents[1])


@lru_cache(maxsize=1)
def can_unshare() -> bool:
    """Whether a child process can get its own /dev/shm (root, mount allowed, util-linux ``unshare``)."""
    if not can_mount() or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                          capture_output=True).returncode == 0


def run_with_small_shm(argv: list[str], *, size: str, **kw) -> subprocess.CompletedProcess:
    """Run ``argv`` in a child whose /dev/shm is a fresh tmpfs of ``size`` (``can_unshare()`` must hold)."""
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *argv], capture_output=True, text=True,
                          timeout=600, **kw)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {_TESTS!r})\n" + textwrap.dedent(code)]


def test_slots_past_the_file_size_limit_are_one_clear_error():
    """``ulimit -f`` applies to shared memory: the slots' 4 MiB against a 200 KB limit (real EFBIG
    from the kernel on the old code, a traceback from ``os.ftruncate``)."""
    with file_size_limit(200_000):
        with pytest.raises(OutputError, match=(
                r"^/dev/shm: cannot make the patch readers' shared memory: 4 slots of 1\.0 MiB \(0 workers\) need "
                r"4\.0 MiB, more than the file-size limit of 0\.2 MiB\. Fix: raise the file-size limit \(`ulimit "
                r"-f`: shared memory counts as a file\), or run with fewer --workers \(each takes 2 slots\) or a "
                r"smaller --batch-size\.$")):
            _Readers(workers=0, slot_bytes=1 << 20, n_slots=4, setup_kwargs={})


_FILL_SLOTS = """
    import numpy as np
    from wsi_milssl.errors import OutputError
    from wsi_milssl.inference.predict import _Readers
    try:
        readers = _Readers(workers={workers}, slot_bytes=1 << 20, n_slots={n_slots}, setup_kwargs={{}})
    except OutputError as exc:
        print("ERROR", exc)
    else:
        for slot in range(readers.n_slots):  # what the readers do with their slots
            readers.view(slot, (1 << 20,), np.uint8)[:] = 7
        readers.close()
        print("WROTE")
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_too_small_dev_shm_is_one_clear_error(workers, monkeypatch):
    """Slots of 4 or 6 MiB in a 3 MiB /dev/shm: the old code made them, and writing them was a SIGBUS."""
    n_slots = max(1, workers) * 2 + 2
    expected = (rf"/dev/shm: too little shared memory for the patch readers: {n_slots} slots of 1\.0 MiB "
                rf"\({workers} workers\) need {n_slots}\.0 MiB, \d\.\d MiB are free\. Fix: give the container more "
                r"shared memory \(`docker run --shm-size=16g`, or `--ipc=host`\) or free /dev/shm \(`df -h /dev/shm`\), "
                r"or run with fewer --workers \(each takes 2 slots\) or a smaller --batch-size\.")
    if can_unshare():
        result = run_with_small_shm(_python(_FILL_SLOTS.format(workers=workers, n_slots=n_slots)), size="3m")
        assert result.returncode == 0, (result.returncode, result.stderr[-3000:])  # not -7 (SIGBUS)
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        assert re.fullmatch(rf"ERROR {expected}\n", result.stdout), result.stdout
    else:  # no private /dev/shm here: the free space it reports is made small
        monkeypatch.setattr(shm_rules, "free_bytes", lambda: 3 << 20)
        with pytest.raises(OutputError, match=f"^{expected}$"):
            _Readers(workers=workers, slot_bytes=1 << 20, n_slots=n_slots, setup_kwargs={})


_RESTART = """
    import os
    from wsi_milssl.errors import OutputError
    from wsi_milssl.inference.predict import _Readers
    readers = _Readers(workers=1, slot_bytes=1 << 16, n_slots=4, setup_kwargs={{}})
    try:
        {fill}
        try:
            readers.restart()  # what run_slides does after a reader died
        except OutputError as exc:
            print("ERROR", exc)
        else:
            print("RESTARTED")
    finally:
        {unfill}
        readers.close()
    print("CLOSED")
"""

_FILL_DEV_SHM = """shutdown = readers.pool.shutdown

        def shutdown_then_fill(*args, **kwargs):  # the old pool frees its semaphores; /dev/shm fills up
            shutdown(*args, **kwargs)
            with open("/dev/shm/filler", "wb", buffering=0) as fh:
                for block in (1 << 16, 1):
                    try:
                        while True:
                            fh.write(bytes(block))
                    except OSError:
                        pass

        readers.pool.shutdown = shutdown_then_fill"""


def test_a_reader_pool_that_cannot_be_restarted_is_one_clear_error():
    """After a reader died, the new pool's semaphores (in /dev/shm too) cannot be made: /dev/shm filled
    up once the old pool was shut down (where a private one can be mounted), else a 1-byte file-size
    limit (the semaphore's file fails; Python reports it as errno 0). The old code let the OSError out
    with a traceback."""
    if can_unshare():
        code = _RESTART.format(fill=_FILL_DEV_SHM, unfill='os.unlink("/dev/shm/filler")')
        result = run_with_small_shm(_python(code), size="2m")
        cause = r"No space left on device"
    else:
        code = ("from diskfaults import file_size_limit\n"
                + textwrap.dedent(_RESTART).replace("{fill}", "limit = file_size_limit(1); limit.__enter__()")
                .replace("{unfill}", "limit.__exit__(None, None, None)").format())
        result = subprocess.run(_python(code), capture_output=True, text=True, timeout=600)
        cause = r"[^)]*"
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.fullmatch(
        rf"ERROR /dev/shm: cannot make the patch readers' semaphores \({cause}\)\. Fix: give the container more "
        r"shared memory \(`docker run --shm-size=16g`, or `--ipc=host`\) or free /dev/shm \(`df -h /dev/shm`\), "
        r".*or run with fewer --workers \(each takes 2 slots\) or a smaller --batch-size\.\nCLOSED\n",
        result.stdout), (result.stdout, result.stderr[-3000:])


@pytest.mark.parametrize("workers", ["0", "2"])
def test_features_with_too_little_shared_memory_is_one_error_line(synth_dir, tmp_path, workers):
    """The reviewer's run: ``features`` of slides with a 3 MiB /dev/shm (where a private one can be
    mounted; else a 200 KB file-size limit). The old code: with 0 workers a "Bus error" (exit 135),
    with 2 a reader died of it and the restarted pool's semaphore failed with a traceback."""
    argv = [sys.executable, "-m", "wsi_milssl", "features", str(synth_dir), "--out", str(tmp_path / "f"),
            "--encoder", "resnet18", "--weights", "random", "--workers", workers]
    if can_unshare():
        result = run_with_small_shm(argv, size="3m")
        problem = r"too little shared memory for the patch readers: .* MiB are free"
    else:
        from diskfaults import _limit_child

        result = subprocess.run(argv, capture_output=True, text=True, timeout=600, preexec_fn=_limit_child(200_000))
        problem = r"cannot make the patch readers' shared memory: .*, more than the file-size limit of 0\.2 MiB"
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.search(rf"^error: /dev/shm: {problem}\. Fix: .*--workers", result.stderr, re.M), result.stderr[-3000:]
