"""The ``wsi-milssl`` command line: one module per subcommand, each thin.

Every subcommand module defines ``register(subparsers)`` (adds its parser, with every option's unit
and default in ``--help``) and ``run(args) -> int`` (builds a config, calls one stage function and
renders progress). Exit codes: 0 success, 1 a stage failed (error message on stderr), 2 usage error,
141 when the reader of stdout went away (``wsi-milssl info SLIDE | head``; quiet, as for SIGPIPE).

``-v``/``-vv`` (more log output), ``-q`` (errors only, no progress on stderr) and ``--log-file FILE``
(log records and progress lines appended with timestamps) are accepted before or after the
subcommand. When stderr is not a terminal, progress is one timestamped line per slide, epoch and
stage instead of bars (:mod:`wsi_milssl.cli.progress`).

Under torchrun with several ranks only the subcommands that split their work between the ranks run
(:data:`SPLIT_BY_RANK`): ``train`` (one job; rank 0 alone reports progress and info lines, the other
ranks their warnings and errors) and the slide stages (each rank its own shard, its own summary). Every
other subcommand is refused before it starts, with one error from rank 0 (exit code 2). The log lines and
errors of ranks other than 0 start with ``[rank r]``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from wsi_milssl import __version__
from wsi_milssl.errors import OptionError, WsiMilsslError
from wsi_milssl.paths import escaped_text

__all__ = ["main", "build_parser", "report_error", "rank_tag", "COMMANDS"]

# Subcommand name -> module under wsi_milssl.cli. Later stages add their line here.
COMMANDS = {
    "synth": "synth",
    "info": "info",
    "demo": "demo",
    "prepare": "prepare",
    "run": "run",
    "tile": "tile",
    "evaluate": "evaluate",
    "label": "label",
    "annotations": "annotations",
    "features": "features",
    "train": "train",
    "benchmark": "benchmark",
    "heatmap": "heatmap",
    "docs": "docs",
}


#: The subcommands that split their work between torchrun's ranks: train (one job, its batches split between
#: the ranks) and the slide stages (each rank its own shard of the slides; heatmap not with --features).
SPLIT_BY_RANK = ("train", "tile", "label", "heatmap")
#: How long a rank other than 0 waits, after a refusal under torchrun, for torchrun to end it (which it does
#: as soon as rank 0 exits, after printing the refusal once) before it prints the refusal itself.
RANK0_WAIT_S = 60.0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults in --help and keep the description's line breaks. An option whose default is None
    (taken from --config or the settings' own default, which its help names in brackets) shows no
    "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse's parser (every subcommand's too: ``add_subparsers`` makes them of this class) that keeps the
    ``PROG: error: ...`` line of a usage error (exit code 2) for :func:`main`, which appends it to the
    ``--log-file`` named in the command line: argparse exits before the log is set up."""

    def error(self, message: str):
        global _USAGE_ERROR
        _USAGE_ERROR = f"{self.prog}: error: {message}"
        if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK", "0") != "0":
            # every rank parses the same command line: rank 0 alone prints the usage error (review DA: 8 copies on
            # 8 GPUs); torchrun's agent ends this rank as soon as rank 0 exits, and one on another node (whose
            # agent may not end it) says it after the wait (review DU)
            time.sleep(RANK0_WAIT_S)
        super().error(message)


#: The line of the last usage error of :class:`_Parser` (None when parsing did not fail).
_USAGE_ERROR: str | None = None

_ALL = object()


def build_parser(command: str | None | object = _ALL) -> argparse.ArgumentParser:
    """The ``wsi-milssl`` parser. ``command``: the one subcommand to build in full (its options may
    import torch or scikit-image); the others get a one-line entry, enough for ``--help`` and for
    argparse's errors. By default every subcommand is built in full."""
    parser = _Parser(
        prog="wsi-milssl",
        description="Whole-slide images to an instance-level tumour classifier with MIL-SSL.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_output_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"wsi_milssl.cli.{module_name}")
        if command is _ALL or command == name:
            module.register(sub)
            for sub_parser in _parser_tree(sub.choices[name]):
                if not any(isinstance(a, argparse._SubParsersAction) for a in sub_parser._actions):
                    _add_output_options(sub_parser, top=False)  # the commands that run (leaves)
        else:
            sub.add_parser(name, help=module.SUMMARY)
    return parser


def _add_output_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """-v/-q/--log-file, on the top-level parser and again on every subcommand (so they may follow it;
    the subcommand's copies write other names, merged in :func:`main`)."""
    suffix, default = ("", 0) if top else ("_after", argparse.SUPPRESS)
    group = parser.add_argument_group("output") if not top else parser
    group.add_argument("-v", "--verbose", action="count", default=default, dest=f"verbose{suffix}",
                       help="more log output (-vv for debug)")
    group.add_argument("-q", "--quiet", action="count", default=default, dest=f"quiet{suffix}",
                       help="errors only: no progress and no warnings on stderr")
    group.add_argument("--log-file", type=Path, default=None if top else argparse.SUPPRESS, dest=f"log_file{suffix}",
                       metavar="FILE", help="append log records and timestamped progress lines to FILE")


def _parser_tree(parser: argparse.ArgumentParser):
    """``parser`` and every parser nested under it (``prepare camelyon16``, ``annotations convert``)."""
    yield parser
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parser_tree(child)


def _command_in(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not a top-level option), or None."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--log-file":
            skip = True  # its value is not the subcommand
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


_OUR_HANDLERS: list[logging.Handler] = []
#: The --log-file's handler of this run (None without --log-file): where :func:`report_error` logs.
_LOG_FILE_HANDLER: logging.Handler | None = None


def _configure_output(*, verbose: int, quiet: int, log_file: Path | None, tag: str = "",
                      floor: int = logging.NOTSET) -> logging.Handler | None:
    """Log records to stderr (WARNING; -v INFO; -vv DEBUG; -q ERROR) and, with ``log_file``, every
    record from INFO up and the progress lines to that file, with timestamps. Returns the file's handler.
    ``tag`` starts every line (``[rank 1] ``: a torchrun rank other than 0); ``floor``: no record below
    this level anywhere (WARNING for train's ranks other than 0, whose progress rank 0 reports)."""
    from wsi_milssl.cli.progress import EscapingFormatter, configure_progress_lines

    global _LOG_FILE_HANDLER
    _LOG_FILE_HANDLER = None
    level = max(logging.ERROR if quiet else logging.WARNING - 10 * min(verbose, 2), floor)
    root = logging.getLogger()
    for handler in _OUR_HANDLERS:  # main() may run more than once in a process (tests)
        root.removeHandler(handler)
        handler.close()
    _OUR_HANDLERS.clear()
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(EscapingFormatter(f"{tag}%(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [console]
    file_handler = None
    if log_file is not None:
        file_handler = _open_log_file(log_file, tag)
        file_handler.setLevel(max(min(level, logging.INFO), floor))
        handlers.append(file_handler)
    for handler in handlers:
        root.addHandler(handler)
        _OUR_HANDLERS.append(handler)
    _LOG_FILE_HANDLER = file_handler
    root.setLevel(min(h.level for h in handlers))
    configure_progress_lines(stderr=not quiet and not sys.stderr.isatty(), log_handler=file_handler,
                             bars=False if quiet else None, tag=tag)
    return file_handler


class _LogFileHandler(logging.FileHandler):
    """A ``--log-file`` handler that, when a record cannot be written (a full disk), says so once on stderr and
    stops writing, instead of logging's traceback for every record (review ES); the command goes on."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if self.failed:
            return
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):  # a record that does not format (review EU: one such record from any
            return super().handleError(record)  # library stopped the file); logging says so, and the file goes on
        self.failed = True
        why = getattr(exc, "strerror", None) or exc
        stderr_line(f"warning: cannot write the log file {self.baseFilename} ({why}); nothing more is written to "
                    "it. Fix: free disk space there, or give --log-file another path.")

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the buffered lines cannot be written either; said once above when a record failed
            pass


def _open_log_file(log_file: Path, tag: str = "") -> logging.FileHandler:
    """A handler appending timestamped records to ``log_file`` (its folder made); WsiMilsslError naming the
    file when it cannot be written."""
    from wsi_milssl.cli.progress import EscapingFormatter

    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = _LogFileHandler(log_file, mode="a", encoding="utf-8")
    except OSError as exc:
        raise WsiMilsslError(f"{log_file}: cannot write the log file ({exc.strerror}). Fix: give a writable "
                             "path to --log-file.") from None
    handler.setFormatter(EscapingFormatter(f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s",
                                           datefmt="%Y-%m-%d %H:%M:%S"))
    return handler


def _log_file_in(argv: list[str]) -> Path | None:
    """The ``--log-file FILE`` (or ``--log-file=FILE``) of a command line that argparse refused, before or
    after the subcommand (the last one given, as :func:`main` takes the one after the subcommand); None
    without one. Words after ``--`` are arguments, not options."""
    found = None
    for i, word in enumerate(argv):
        if word == "--":
            break
        if word == "--log-file" and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith("--log-file="):
            found = word.split("=", 1)[1]
    return Path(found) if found else None


def _log_usage_error(argv: list[str], line: str) -> None:
    """Append argparse's ``line`` (``PROG: error: ...``, already on stderr) as an ERROR record to the
    ``--log-file`` of ``argv``, if any: a batch run (nohup, sbatch) refused for its options leaves a log
    that says why. A log file that cannot be written is passed over (stderr has the error)."""
    log_file = _log_file_in(argv)
    if log_file is None:
        return
    try:
        handler = _open_log_file(log_file)
    except WsiMilsslError:
        return
    try:
        handler.handle(logging.makeLogRecord({"name": "wsi_milssl.cli", "levelno": logging.ERROR,
                                              "levelname": "ERROR", "msg": line}))
    finally:
        handler.close()


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the command started (its imports): no traceback (review BN)
        stderr_line("interrupted")
        return 130


def _main(argv: list[str] | None) -> int:
    global _USAGE_ERROR
    argv = sys.argv[1:] if argv is None else list(argv)
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # redirected (a batch log): lines in the order they happen
    parser = build_parser(_command_in(argv))
    _USAGE_ERROR = None
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # --help and --version exit 0 with no error line
        if _USAGE_ERROR is not None:
            _log_usage_error(argv, _USAGE_ERROR)
        raise
    verbose = args.verbose + getattr(args, "verbose_after", 0)
    quiet = args.quiet + getattr(args, "quiet_after", 0)
    log_file = getattr(args, "log_file_after", None) or args.log_file
    rank, world = _torchrun_place()
    tag = f"[rank {rank}] " if rank else ""
    global _RANK_TAG
    _RANK_TAG = tag  # for the lines the subcommands print to stderr themselves (review CI)
    floor = logging.WARNING if rank and args.command == "train" else logging.NOTSET
    try:
        _configure_output(verbose=verbose, quiet=quiet, log_file=log_file, tag=tag, floor=floor)
    except WsiMilsslError as exc:
        stderr_line(f"{tag}error: {exc}")
        return 2
    run_dir = getattr(args, "resume", None) or getattr(args, "out", None) if args.command == "train" else None
    stdout, on_sigterm = sys.stdout, _say_when_terminated(args.command, _restarts(args), run_dir=run_dir)
    if _LOG_FILE_HANDLER is not None:
        sys.stdout = _StdoutCopy(stdout, _LOG_FILE_HANDLER)
    try:
        return _run_command(args, rank=rank, world=world, tag=tag)
    finally:
        if isinstance(sys.stdout, _StdoutCopy):
            sys.stdout.close_copy()
            sys.stdout = stdout
        if on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)


def _run_command(args: argparse.Namespace, *, rank: int, world: int, tag: str) -> int:
    """:func:`main` once the output is set up: the subcommand, its errors as one line each."""
    refusal = _not_split_by_rank(args, world)
    if refusal is not None:
        if rank and os.environ.get("TORCHELASTIC_RUN_ID"):
            # torchrun's agent ends every rank as soon as rank 0 exits: rank 0 alone says it
            time.sleep(RANK0_WAIT_S)
        return report_error(refusal, code=2, tag=tag)
    try:
        code = int(args.run(args) or 0)
    except BrokenPipeError:
        return _stdout_closed()
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
        if exc.filename is None:
            raise
        code = report_error(_in_the_way(exc), code=1, tag=tag)
    except WsiMilsslError as exc:
        code = report_error(exc, code=2 if isinstance(exc, OptionError) else 1, tag=tag)
    except OSError as exc:
        problem = _temporary_folder_error(exc)
        if problem is None:
            raise
        code = report_error(problem, code=1, tag=tag)
    except KeyboardInterrupt:
        stderr_line(f"{tag}interrupted")
        _log_to_file("interrupted")  # a batch run's log then says why it stopped
        code = 130
    try:
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at interpreter exit
    except BrokenPipeError:
        return _stdout_closed()
    return code


class _StdoutCopy:
    """``sys.stdout`` while a ``--log-file`` is open: every line a command prints (``run``'s line per stage and
    its report's path, a stage's summary) goes to stdout and, as an INFO record, to the log file, so that a
    batch run's log ends with its results (review BS)."""

    def __init__(self, stream, handler: logging.Handler) -> None:
        self._stream, self._handler, self._pending = stream, handler, ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._log(line)
        return written

    def _log(self, line: str) -> None:
        if line.strip():
            self._handler.handle(logging.makeLogRecord({"name": "wsi_milssl.stdout", "levelno": logging.INFO,
                                                        "levelname": "INFO", "msg": line.rstrip()}))

    def close_copy(self) -> None:
        """Log a last line not ended by a newline."""
        self._log(self._pending)
        self._pending = ""

    def __getattr__(self, name: str):  # flush, fileno, isatty, encoding, ...: the stream's own
        return getattr(self._stream, name)


def _restarts(args: argparse.Namespace) -> str | None:
    """The option of this command line that starts work over (``--force STAGE``, ``--overwrite``), as typed, or None:
    the same command run again would not continue with it (review BZ)."""
    if getattr(args, "force", None):
        return "--force " + " ".join(args.force)
    if getattr(args, "overwrite", False) is True:
        return "--overwrite"
    return None


#: Commands that do not continue a stopped run: run again, they start over.
STARTS_OVER = ("benchmark", "evaluate", "info", "prepare", "docs")


def _say_when_terminated(command: str, restarts: str | None = None, *, run_dir: Path | None = None):
    """On SIGTERM (a scheduler's time limit, ``docker stop``, ``kill``): say so on stderr and in the
    ``--log-file``, then end as the signal does (exit status 143), so that a batch run's log does not just stop.
    Returns the handler it replaced (for :func:`main` to put back), or None when it installs none: on torchrun's
    ranks other than 0 (rank 0 alone says it, for both of torchrun's reasons: its agent also ends the ranks with
    SIGTERM when one fails; review DA) or outside the main thread. Reader processes forked from this one inherit
    the handler and end silently."""
    import threading

    under_torchrun = bool(os.environ.get("TORCHELASTIC_RUN_ID"))
    if under_torchrun and os.environ.get("RANK", "0") != "0":
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    pid = os.getpid()

    def terminated(signum, frame) -> None:
        if os.getpid() == pid:
            resume = shlex.quote(str(run_dir)) if run_dir is not None else "RUN"
            started = run_dir is None or (Path(run_dir) / "last.pt").is_file()  # else no epoch finished (review CY)
            kept = "what finished is kept"
            if command in STARTS_OVER:  # review ED, EH: nothing of the stopped run is continued
                kept, again = "it does not continue a stopped run", "run the same command again (it starts over)"
            elif command == "train":
                again = (f"run `wsi-milssl train --resume {resume}` to continue from the last finished epoch"
                         if started else "run the same command again (no epoch had finished, so it starts from epoch 1)")
            else:
                again = (f"run the same command again without {restarts} to continue (with it, that work starts over)"
                         if restarts else "run the same command again to continue")
            why = ("from torchrun, which stops every rank when one fails (its summary names it) or when it is "
                   "stopped itself (a scheduler's time limit, `kill`)" if under_torchrun else
                   "(a scheduler's time limit, `docker stop` or `kill`)")
            launcher = " (through torchrun, as before)" if under_torchrun else ""
            message = f"stopped by SIGTERM {why}; {kept}. Fix: {again}{launcher}."
            _log_to_file(f"error: {message}")
            _write_without_blocking(sys.stderr, f"error: {message}\n")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    return signal.SIG_DFL if previous is None else previous  # None: a handler not set from Python


def _write_without_blocking(stream, text: str) -> None:
    """Write ``text`` to ``stream``'s file descriptor unless that would block (a full pipe whose reader is paused:
    a SIGTERM must still end the process; review BT) or the stream has none."""
    import fcntl

    try:
        fd = stream.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        try:
            os.write(fd, text.encode("utf-8", "replace"))
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except (OSError, ValueError, AttributeError):  # would block, closed, or no descriptor (a test's capture)
        pass


def _temporary_folder_error(exc: OSError) -> WsiMilsslError | None:
    """The error line for an OSError that names no file and comes from the temporary folder (Python's
    ``tempfile``, torch's caches): none usable (``/tmp`` read-only or missing), or a full disk; None for any
    other OSError (a traceback: a bug)."""
    import errno
    import tempfile

    from wsi_milssl.errors import OutputError

    if exc.filename is not None:
        return None
    candidates = "TMPDIR, then /tmp, /var/tmp, /usr/tmp and the current folder"
    if isinstance(exc, FileNotFoundError) and "No usable temporary directory" in str(exc):
        return OutputError(f"no writable temporary folder ({candidates} were tried). Fix: set TMPDIR to a "
                           "writable folder with free space (`export TMPDIR=/scratch/$USER/tmp`).")
    if exc.errno == errno.ENOSPC:
        return OutputError(f"no space left on device while writing a file the system did not name (the temporary "
                           f"folder {tempfile.gettempdir()}, or the output folder). Fix: free space there, or set "
                           "TMPDIR to a folder with free space.", errno=exc.errno)
    return None


def _torchrun_place() -> tuple[int, int]:
    """(rank, world size) of this process under torchrun; (0, 1) without it. A malformed RANK or
    WORLD_SIZE is left to the subcommands that split their work by rank, which name it."""
    from wsi_milssl.distributed import torchrun_env

    try:
        env = torchrun_env()
    except WsiMilsslError:
        return 0, 1
    return (env[0], env[1]) if env is not None else (0, 1)


def _not_split_by_rank(args: argparse.Namespace, world: int) -> WsiMilsslError | None:
    """The error for a subcommand that does not split its work between torchrun's ``world`` ranks
    (each rank would run all of it into the same files), or None (one process, or :data:`SPLIT_BY_RANK`)."""
    command = args.command
    if world <= 1 or (command in SPLIT_BY_RANK and not (command == "heatmap" and args.features is not None)):
        return None
    torchrun = bool(os.environ.get("TORCHELASTIC_RUN_ID"))
    one = ("run one process without torchrun" if torchrun else  # review DU, DW
           "unset RANK and WORLD_SIZE (something other than torchrun set them) and run one process")
    if command == "features":
        why = ("features are not split into shards (every rank would embed every slide into the same files). Fix: "
               f"{one} (it uses the GPU and a pool of readers), or give each process its own stores and --out.")
    elif command == "heatmap":
        why = ("heatmaps of feature files (--features) are not split into shards (each takes well under a second, "
               f"and every rank would write the same files). Fix: {one}.")
    else:
        why = (f"`wsi-milssl {command}` is not split between ranks (every rank would run all of it, into the same "
               f"files). Fix: {one}; only {', '.join(SPLIT_BY_RANK[:-1])} and {SPLIT_BY_RANK[-1]} run under "
               "torchrun.")
    who = (f"torchrun's {world} ranks" if torchrun else
           f"{world} ranks (RANK and WORLD_SIZE are set, without torchrun)")  # review DA
    return WsiMilsslError(f"{who}: {why}")


def _in_the_way(exc: OSError) -> WsiMilsslError:
    """One error for an output path that a file or folder is in the way of (``--out`` naming an existing
    file, a folder where a file is expected): every stage makes its folders with ``mkdir``, and this
    names the path and the fix once for all of them."""
    path = exc.filename
    if isinstance(exc, IsADirectoryError):
        return WsiMilsslError(f"{path}: is a folder where a file is expected ({exc.strerror}). Fix: give the path "
                              "of a file, or move the folder away.")
    return WsiMilsslError(f"{path}: cannot be made or used as a folder ({exc.strerror}): a file is in the way. "
                          "Fix: give a folder path that is not an existing file (e.g. another --out), or move "
                          "the file away.")


#: ``[rank r] `` under torchrun for a rank other than 0, else "": starts the lines a command prints to stderr
_RANK_TAG = ""


def rank_tag() -> str:
    """``[rank r] `` for a torchrun rank other than 0, else "": the start of every stderr line of the command."""
    return _RANK_TAG


def stderr_line(line: str) -> None:
    """``line`` and its newline to stderr in one write: ``print`` writes them apart, and under torchrun (``python
    -u``: each write goes straight out) two ranks' lines could then be glued together (review EJ)."""
    sys.stderr.write(escaped_text(line) + "\n")  # whatever the stream's error handler
    sys.stderr.flush()


def report_error(error: object, *, code: int, tag: str | None = None) -> int:
    """Print ``error: {error}`` to stderr, after ``tag`` (``[rank r] ``; by default this rank's,
    :func:`rank_tag`), and log it to the ``--log-file`` (if any, whatever -q says); returns ``code``, the exit
    code. Every subcommand's error path goes through this, so that the log of a batch run (nohup, sbatch) that
    ended on an error says why."""
    tag = _RANK_TAG if tag is None else tag
    stderr_line(f"{tag}error: {error}")
    _log_to_file(f"error: {error}")
    return code


def _log_to_file(message: str) -> None:
    """An ERROR record of ``message`` to the ``--log-file`` only (stderr has the line already)."""
    if _LOG_FILE_HANDLER is not None:
        _LOG_FILE_HANDLER.handle(logging.makeLogRecord({"name": "wsi_milssl.cli", "levelno": logging.ERROR,
                                                        "levelname": "ERROR", "msg": message}))


def _stdout_closed() -> int:
    """The reader of stdout exited (``| head``): stop quietly, as a program killed by SIGPIPE would.

    stdout is pointed at /dev/null so that Python's final flush does not raise again (the recipe in
    the documentation of the ``signal`` module).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (replaced in tests)
        pass
    return 141
