"""Review AZ (the tool installed for a lab: a wheel, a container, a batch job). B2: with no usable temporary
folder (``/tmp`` read-only, TMPDIR unset) or a full one, `prepare` and `train` ended in a traceback (Python's tempfile, torch's caches): the README promises one error line with a fix.
main() now turns an OSError without a file name from the temporary folder into one ``error:`` line."""

from __future__ import annotations

import errno
import tempfile

import pytest

from wsi_milssl.cli import _temporary_folder_error, main


def _no_temporary_folder(*args, **kwargs):
    raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found in ['/tmp', '/var/tmp', '/usr/tmp']")


def test_no_usable_temporary_folder_is_one_error_line(tmp_path, monkeypatch, capsys):
    import wsi_milssl.synth

    monkeypatch.setattr(wsi_milssl.synth, "generate_slides", _no_temporary_folder)  # as tempfile raises it
    code = main(["synth", str(tmp_path / "slides"), "--slides", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: no writable temporary folder (TMPDIR, then /tmp, /var/tmp, /usr/tmp and the current folder were "
        "tried). Fix: set TMPDIR to a writable folder with free space (`export TMPDIR=/scratch/$USER/tmp`)."]


def test_a_full_disk_without_a_file_name_names_the_temporary_folder():
    problem = _temporary_folder_error(OSError(errno.ENOSPC, "No space left on device"))
    assert str(problem).startswith("no space left on device while writing a file the system did not name (the "
                                   f"temporary folder {tempfile.gettempdir()}, or the output folder). Fix:")


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "Input/output error"),
                                 OSError(errno.ENOSPC, "No space left on device", "/data/x.h5"),
                                 FileNotFoundError(errno.ENOENT, "No such file or directory")])
def test_other_os_errors_are_not_taken_for_the_temporary_folder(exc):
    assert _temporary_folder_error(exc) is None



def test_redirected_stdout_is_line_buffered(capsys):
    """Review AZ, C4: stdout redirected to a file (a batch job's log without PYTHONUNBUFFERED) was block-buffered,
    so its lines could land after stderr lines written later (a `run` header after its error)."""
    import sys

    assert not sys.stdout.isatty() and not sys.stdout.line_buffering
    with pytest.raises(SystemExit):
        main(["--version"])
    assert sys.stdout.line_buffering


def test_a_missing_pipeline_file_names_the_installed_ready_made_ones(tmp_path, capsys, monkeypatch):
    """Review AZ, C1: after a pip install (no checkout) `run pipelines/camelyon16.toml` said "config file not
    found; check the path" with no word of where the packaged pipelines are."""
    from wsi_milssl.cli.run import packaged_pipelines

    monkeypatch.chdir(tmp_path)
    assert main(["run", "pipelines/camelyon16.toml"]) == 1
    err = capsys.readouterr().err
    folder = packaged_pipelines()
    assert (folder / "camelyon16.toml").is_file()
    assert f"error: pipelines/camelyon16.toml: pipeline file not found. Fix: check the path; the ready-made " \
           f"pipelines installed with the package are in {folder} (camelyon16-features.toml, camelyon16.toml, " \
           "demo.toml, tcga-features.toml): copy one beside your data" in err
