"""Every ``error: ...`` line and ``interrupted`` also reach ``--log-file`` (review AG): a batch run
(nohup, sbatch) that ended on a usage error, a failed slide or Ctrl-C leaves a log that says so,
not an empty log or one that just stops. stderr and the exit codes are as before."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import wsi_milssl.cli.synth as synth_cli
from wsi_milssl.cli import main
from wsi_milssl.config import SynthConfig
from wsi_milssl.synth import generate_slides

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


@pytest.fixture(scope="module")
def small_slide(tmp_path_factory):
    """One 1024 x 1024 px generated slide (fast to tile)."""
    out = tmp_path_factory.mktemp("slides")
    generate_slides(SynthConfig(n_slides=1, seed=3, width_px=1024, height_px=1024), out)
    return out / "synth_000.tif"


def _logged_error(log, stderr: str) -> str:
    """The error line of stderr, checked to be in the log file with a timestamp; returns it."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    assert log.exists(), "no log file"
    text = log.read_text()
    assert re.search(rf"^{STAMP} ERROR wsi_milssl.cli: {re.escape(lines[0])}$", text, re.M), text
    return lines[0]


def _usage_errors(slide, tmp_path):
    missing = str(tmp_path / "none")
    return {
        "tile": ["tile", str(slide), "--out", str(tmp_path / "t"), "--workers", "-1"],
        "heatmap": ["heatmap", str(slide), "--model", missing, "--out", str(tmp_path / "h"), "--alpha", "3"],
        "features": ["features", str(slide), "--out", str(tmp_path / "f"), "--input-size", "0"],
        "evaluate": ["evaluate", "--predictions", missing, "--annotations", missing, "--slides", missing,
                     "--labels", missing, "--out", str(tmp_path / "e"), "--positive-fraction", "2"],
        "label": ["label", missing, "--annotations", missing, "--out", str(tmp_path / "l")],
        # review BQ: a bad option value gave exit code 1 from these three, 2 from the others
        "label-value": ["label", missing, "--annotations", missing, "--positive-fraction", "2"],
        "train": ["train", missing, "--labels", missing, "--out", str(tmp_path / "r"), "--epochs", "0"],
        "synth": ["synth", str(tmp_path / "s"), "--slides", "0"],
    }


@pytest.mark.parametrize("command", ["tile", "heatmap", "features", "evaluate", "label", "label-value", "train",
                                     "synth"])
def test_usage_errors_reach_the_log_file(small_slide, tmp_path, capsys, monkeypatch, command):
    if command == "label":
        monkeypatch.setenv("RANK", "x")  # a malformed torchrun environment
        monkeypatch.setenv("WORLD_SIZE", "2")
    log = tmp_path / "logs" / "e.log"
    assert main([*_usage_errors(small_slide, tmp_path)[command], "-q", "--log-file", str(log)]) == 2
    _logged_error(log, capsys.readouterr().err)


def test_tile_store_error_reaches_the_log_file(small_slide, tmp_path, capsys):
    out = tmp_path / "tiles"
    assert main(["tile", str(small_slide), "--out", str(out), "--workers", "1", "-q"]) == 0
    capsys.readouterr()
    log = tmp_path / "t.log"
    assert main(["tile", str(small_slide), "--out", str(out), "--workers", "1", "--patch-size", "128", "-q",
                 "--log-file", str(log)]) == 2
    assert "different settings" in _logged_error(log, capsys.readouterr().err)


def test_failed_slides_line_reaches_the_log_file(tmp_path, capsys):
    log = tmp_path / "t.log"
    assert main(["tile", str(tmp_path / "gone.tif"), "--out", str(tmp_path / "t"), "-q", "--log-file", str(log)]) == 1
    assert "1 slide(s) failed; see" in _logged_error(log, capsys.readouterr().err)


def test_info_error_reaches_the_log_file(tmp_path, capsys):
    log = tmp_path / "i.log"
    assert main(["info", str(tmp_path / "gone.tif"), "--log-file", str(log)]) == 1
    _logged_error(log, capsys.readouterr().err)


def test_interrupted_reaches_the_log_file(tmp_path, capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth_cli, "run", interrupted)  # Ctrl-C while synth runs
    log = tmp_path / "i.log"
    assert main(["synth", str(tmp_path / "s"), "--slides", "1", "--log-file", str(log)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted"
    assert re.search(rf"^{STAMP} ERROR wsi_milssl.cli: interrupted$", log.read_text(), re.M), log.read_text()


@pytest.mark.parametrize("words, before", [
    (["evaluate", "--predictions", "p", "--annotations", "a", "--slides", "s", "--labels", "l.csv", "--out", "e",
      "--froc-mpp", "abc"], False),
    (["tile", "slide.tif", "--out", "t", "--shard", "3/2"], True),
    (["heatmap", "slide.tif"], False),  # --model and --out are required
    (["tile", "slide.tif"], True),  # --out is required
])
def test_argparse_usage_errors_reach_the_log_file(tmp_path, capsys, words, before):
    """Review AJ, finding 2: argparse's usage errors (exit code 2) were printed before the log was set up, so a
    batch run's --log-file was not even made. Now its ``PROG: error: ...`` line is appended there too (with
    --log-file before or after the command name, as FILE or =FILE), stderr and the exit code as before."""
    log = tmp_path / "logs" / "usage.log"
    log.parent.mkdir()
    log.write_text("earlier line\n")
    argv = ["--log-file", str(log), *words] if before else [*words, f"--log-file={log}"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: wsi-milssl ")
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    assert line.startswith(f"wsi-milssl {words[0]}: error: ")
    text = log.read_text()
    assert text.startswith("earlier line\n")  # appended
    assert re.search(rf"^{STAMP} ERROR wsi_milssl.cli: {re.escape(line)}$", text, re.M), text


def test_a_usage_error_without_log_file_writes_no_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["tile", "slide.tif", "--shard", "3/2", "--out", "t"])
    assert exc.value.code == 2 and "error: argument --shard" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_printed_results_reach_the_log_file(tmp_path, capsys):
    """Review BS, C1: the lines a command prints on stdout (``run``'s stage lines and report path, a stage's
    summary) were missing from --log-file, so a batch run's log ended before its results. They are in it
    now, with timestamps, and stdout is unchanged; stdout is put back after the command."""
    stdout = sys.stdout
    log = tmp_path / "s.log"
    assert main(["synth", str(tmp_path / "s"), "--slides", "1", "--size-px", "1024", "1024", "--log-file",
                 str(log)]) == 0
    assert sys.stdout is stdout
    printed = capsys.readouterr().out.splitlines()
    assert printed and printed[-1].startswith("wrote 1 slide(s)")
    assert re.search(rf"^{STAMP} INFO wsi_milssl.stdout: {re.escape(printed[-1])}$", log.read_text(), re.M), \
        log.read_text()


def _stopped_by_sigterm(tmp_path, module: str, argv: str, env_extra: dict) -> tuple[int, str]:
    """Run ``main`` on ``argv`` (a list as Python text, such as ``"['train', 'x.csv']"``) plus ``--log-file
    tmp_path/t.log`` in a child process whose stage sleeps once started, stop it with SIGTERM, and return its exit
    status and stderr. A ``TORCHELASTIC_RUN_ID`` of the test's own environment is dropped unless given."""
    stage = "run_mil_csv" if module == "benchmark" else "run"  # the function the subcommand's parser names
    code = (f"import time, wsi_milssl.cli.{module} as s; from wsi_milssl.cli import main\n"
            f"s.{stage} = lambda args: (print('started', flush=True), time.sleep(60))\n"
            f"main({argv[:-1]}, '--log-file', {str(tmp_path / 't.log')!r}])\n")
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"},
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **env_extra}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "started\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


@pytest.mark.parametrize("module, argv, again", [
    ("synth", "['synth', 'x']", "run the same command again to continue"),
    # review BZ: the same command with --force (--overwrite) starts that work over instead of continuing it
    ("tile", "['tile', 'x', '--out', 'o', '--overwrite']",
     "run the same command again without --overwrite to continue (with it, that work starts over)"),
    # review CQ: train named a placeholder RUN instead of its own run folder
    ("train", "['train', 'x.csv', '--out', 'my run']",
     "run `wsi-milssl train --resume 'my run'` to continue from the last finished epoch"),
    ("train", "['train', '--resume', 'r1']", "run `wsi-milssl train --resume r1` to continue from the last finished epoch"),
    # review CY: before its first epoch a run has no last.pt to resume from
    ("train", "['train', 'x.csv', '--out', 'new']",
     "run the same command again (no epoch had finished, so it starts from epoch 1)"),
    # review ED: a benchmark writes its tables at the end; "what finished is kept ... to continue" was untrue
    ("benchmark", "['benchmark', 'mil-csv', 'x.csv']", "run the same command again (it starts over)"),
])
def test_sigterm_is_said_on_stderr_and_in_the_log_file(tmp_path, module, argv, again):
    """Review BS, C2: a SIGTERM (a scheduler's time limit, ``docker stop``) ended the log without a word. The
    process now says so on stderr and in the log file, and still ends as the signal does (exit status -15)."""
    for run in ("my run", "r1"):  # runs that finished an epoch
        (tmp_path / run).mkdir()
        (tmp_path / run / "last.pt").write_bytes(b"")
    returncode, err = _stopped_by_sigterm(tmp_path, module, argv, {})
    assert returncode == -signal.SIGTERM
    assert err.startswith("error: stopped by SIGTERM"), err
    kept = "; it does not continue a stopped run" if module == "benchmark" else "; what finished is kept"
    assert f"{kept}. Fix: " in err, err
    log = (tmp_path / "t.log").read_text()
    assert re.search(rf"^{STAMP} ERROR wsi_milssl.cli: error: stopped by SIGTERM .* Fix: {re.escape(again)}\.$",
                     log, re.M), log


@pytest.mark.parametrize("rank", ["0", "1"])
def test_sigterm_under_torchrun_is_said_by_rank_0_alone(tmp_path, rank):
    """Review DA: under torchrun a SIGTERM (a scheduler stopping the job) left only torchrun's traceback and a log
    that just stopped. Rank 0 alone says it, for both of torchrun's reasons (its agent also ends the ranks with
    SIGTERM when one fails), and names the resume."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(b"")
    returncode, err = _stopped_by_sigterm(tmp_path, "train", "['train', '--resume', 'run']", {
        "TORCHELASTIC_RUN_ID": "test", "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2"})
    assert returncode == -signal.SIGTERM
    log = tmp_path / "t.log"
    if rank == "0":
        assert err == ("error: stopped by SIGTERM from torchrun, which stops every rank when one fails (its summary "
                       "names it) or when it is stopped itself (a scheduler's time limit, `kill`); what finished is kept. "
                       "Fix: run `wsi-milssl train --resume run` to continue from the last finished epoch (through "
                       "torchrun, as before).\n"), err
        assert "error: stopped by SIGTERM from torchrun" in log.read_text()
    else:
        assert "SIGTERM" not in err and "SIGTERM" not in (log.read_text() if log.exists() else "")


def test_a_log_file_that_cannot_be_written_is_said_once_and_the_command_goes_on(tmp_path, capsys):
    """Review ES, B10: a --log-file on a full disk printed logging's traceback for every record."""
    assert main(["synth", "--slides", "1", "--size-px", "1024", "1024", str(tmp_path / "s"),
                 "--log-file", "/dev/full"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: cannot write the log file /dev/full (No space left on device)") == 1, err
    assert "Traceback" not in err and "Logging error" not in err
    assert (tmp_path / "s" / "labels.csv").is_file()


def _log_to_file(path, *records: tuple) -> str:
    """The text of the --log-file ``path`` after logging ``records`` (each a message and its arguments) through it."""
    import logging

    from wsi_milssl.cli import _open_log_file

    handler = _open_log_file(path)
    log = logging.getLogger(f"wsi_milssl.test_log_file.{path.parent.name}")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        for record in records:
            log.info(*record)
    finally:
        log.removeHandler(handler)
        handler.close()
    return path.read_text()


def test_a_record_that_does_not_format_leaves_the_log_file_on(tmp_path, capsys):
    """Review EU, B3: any error in writing a record stopped the log file for the rest of the run, saying to free disk
    space; one record whose arguments do not format (from any library) is logging's usual report now, and the
    records after it are written."""
    text = _log_to_file(tmp_path / "run.log", ("first line",), ("bad %d", "x"), ("a later line",))
    assert "first line" in text and "a later line" in text
    err = capsys.readouterr().err
    assert "cannot write the log file" not in err and "Logging error" in err


def test_a_record_naming_a_file_that_is_no_utf8_is_written_escaped(tmp_path, capsys):
    """Review EY, C2: a slide file name of undecodable bytes (a surrogate escape) made logging print its traceback
    and drop the record."""
    text = _log_to_file(tmp_path / "run.log", ("slide %s", b"caf\xe9.tif".decode("utf-8", "surrogateescape")))
    assert "slide caf\\udce9.tif" in text
    assert "Logging error" not in capsys.readouterr().err
