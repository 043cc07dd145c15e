"""docs/cli.md: every subcommand's ``--help``, rendered from the parsers themselves.

    python -m wsi_milssl.cli.reference > docs/cli.md

``tests/cli/test_cli_reference.py`` fails when docs/cli.md and the parsers drift apart.
"""

from __future__ import annotations

import argparse
import os
from typing import Iterator

from wsi_milssl.cli import build_parser

__all__ = ["render_cli_reference"]

_WIDTH = "100"  # argparse wraps help to $COLUMNS


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...],
                                                                                           argparse.ArgumentParser]]:
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _subcommands(sub, path + (name,))


def render_cli_reference() -> str:
    """Markdown with the top-level help and each (nested) subcommand's help, in registry order."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _WIDTH
    try:
        parser = build_parser()
        parts = ["# Command-line reference", "",
                 "Generated from the parsers by `python -m wsi_milssl.cli.reference > docs/cli.md`; "
                 "a test keeps it current.", "", "## wsi-milssl", "", "```text", parser.format_help().rstrip(), "```"]
        for path, sub in _subcommands(parser, ()):
            parts += ["", f"## wsi-milssl {' '.join(path)}", "", "```text", sub.format_help().rstrip(), "```"]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render_cli_reference(), end="")
