"""The ``wsi-milssl`` command line: one module per subcommand, each thin.

Every subcommand module defines ``register(subparsers)`` (adds its parser, with every option's unit
and default in ``--help``) and ``run(args) -> int`` (builds a config, calls one stage function and
renders progress). Exit codes: 0 success, 1 a stage failed (error message on stderr), 2 usage error,
141 when the reader of stdout went away (``wsi-milssl info SLIDE | head``; quiet, as for SIGPIPE).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from wsi_milssl import __version__
from wsi_milssl.errors import WsiMilsslError

__all__ = ["main", "build_parser", "COMMANDS"]

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
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults in --help and keep the description's line breaks."""


_ALL = object()


def build_parser(command: str | None | object = _ALL) -> argparse.ArgumentParser:
    """The ``wsi-milssl`` parser. ``command``: the one subcommand to build in full (its options may
    import torch or scikit-image); the others get a one-line entry, enough for ``--help`` and for
    argparse's errors. By default every subcommand is built in full."""
    parser = argparse.ArgumentParser(
        prog="wsi-milssl",
        description="Whole-slide images to an instance-level tumour classifier with MIL-SSL.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"wsi_milssl.cli.{module_name}")
        if command is _ALL or command == name:
            module.register(sub)
        else:
            sub.add_parser(name, help=module.SUMMARY)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not a top-level option), or None."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_in(argv))
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = int(args.run(args) or 0)
    except BrokenPipeError:
        return _stdout_closed()
    except WsiMilsslError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    try:
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at interpreter exit
    except BrokenPipeError:
        return _stdout_closed()
    return code


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
