"""atomic_open to a path that cannot be a file: one OutputError naming the user's path (not the
hidden temporary) and the fix."""

from __future__ import annotations

import os

import pytest

from wsi_milssl.atomic import atomic_open, atomic_write_text, check_writable
from wsi_milssl.cli import main
from wsi_milssl.errors import OutputError


def test_an_output_path_that_is_a_folder_names_that_path(tmp_path):
    folder = tmp_path / "adir.xml"
    folder.mkdir()
    for write in (lambda: atomic_write_text(folder, "x"), lambda: check_writable(folder)):
        with pytest.raises(OutputError) as info:
            write()
        message = str(info.value)
        assert message.startswith(f"{folder}: cannot write this file (") and ".tmp" not in message, message
        assert "adir.xml is a folder). Fix: give the path of a file, or move the folder away." in message
    assert list(folder.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["adir.xml"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_folder_that_cannot_hold_a_file_is_one_output_error():
    with pytest.raises(OutputError, match=r"^/proc/x\.xml: cannot write this file \(No such file or directory: no "
                                          r"file can be made in /proc\)\. Fix: write to a folder"):
        with atomic_open("/proc/x.xml") as fh:
            fh.write(b"x")


def test_cli_writing_onto_a_folder_is_one_error_line(tmp_path, capsys):
    src = tmp_path / "a.geojson"
    src.write_text('{"type": "Feature", "geometry": {"type": "Point", "coordinates": [1, 2]}, "properties": {}}')
    (tmp_path / "adir.xml").mkdir()
    assert main(["annotations", "convert", str(src), str(tmp_path / "adir.xml")]) == 1
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "Traceback" not in err and ".tmp" not in err, err
    assert f"error: {tmp_path / 'adir.xml'}: cannot write this file" in err
