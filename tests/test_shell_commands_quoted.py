"""Commands a message tells the user to run name paths as a shell takes them (a helper's finding while making the
tests pass under a TMPDIR with ``+`` and parentheses): an unquoted ``df -h``, ``chmod u+w``, ``train --resume``
path, or a recorded command that evaluate shows to run again, broke at the first space or parenthesis."""

from __future__ import annotations

import errno
import json
import shlex
import sys

from wsi_milssl.locks import folder_write_error
from wsi_milssl.mil.run_folder import existing_run_error
from wsi_milssl.tiling.status import marking_unfinished


def test_a_run_in_progress_records_its_command_as_a_shell_takes_it(tmp_path, monkeypatch):
    folder = tmp_path / "my slides (2)"
    folder.mkdir()
    monkeypatch.setattr(sys, "argv", ["wsi-milssl", "tile", str(folder), "--out", str(folder / "out")])
    with marking_unfinished(folder, "tile", ["a"]) as mark:
        command = json.loads(mark.read_text())["command"]
    assert shlex.split(command) == ["wsi-milssl", "tile", str(folder), "--out", str(folder / "out")]


def test_fixes_quote_the_folder_they_name(tmp_path):
    folder = tmp_path / "run (copy)"
    quoted = shlex.quote(str(folder))
    assert quoted != str(folder)
    # a folder the run must write where it is (the stores label rewrites, a run folder train --resume continues)
    for code, command in ((errno.EACCES, "chmod u+w"), (errno.ENOSPC, "df -h")):
        error = folder_write_error(folder, OSError(code, "refused"), "cannot write to this", named_by=None)
        assert f"`{command} {quoted}`" in str(error), error
    assert f"pass --resume {quoted} " in str(existing_run_error(folder))
