"""``wsi-milssl docs [PAGE]``: the documentation pages installed with the package.

The pages are the checkout's ``docs/*.md`` (shipped inside the package, as the ready-made pipelines are), so an
installed copy without a checkout can still read what its help texts and ``OUT/README.txt`` point at.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["SUMMARY", "PAGES", "register", "run", "page_file"]

#: one line for ``wsi-milssl --help``
SUMMARY = "print a documentation page (artifacts: every file's columns; method: formulas; cli: options)"

#: page name -> what it holds (the file is ``docs/<name>.md``)
PAGES = {
    "artifacts": "every file a stage writes for another: names, columns, units, formats",
    "method": "the method MIL-SSL and its formulas, with the paper's equation numbers",
    "cli": "every command's options, units and defaults (as --help prints them)",
    "pipeline": "running pipelines: when stages run again, interruptions, moved folders, upgrades",
    "cohorts": "prepare camelyon16 / prepare folder in detail: layouts, names, errors, notes",
    "performance": "speed: the engine's design, benchmark scripts and every measurement",
    "benchmarks": "MIL benchmarks in full: protocols, how the presets were chosen, ablations",
    "reliability": "what holds on bad input, and the tests that keep it holding",
    "scaling": "torchrun, several GPUs and machines, sharded slide stages: every rule",
}


def page_file(name: str):
    """The installed ``docs/<name>.md`` (a Traversable; ``str()`` of it is a path for a regular install)."""
    from importlib.resources import files

    return files("wsi_milssl") / "docs" / f"{name}.md"


def register(subparsers) -> None:
    from wsi_milssl.cli import HelpFormatter

    p = subparsers.add_parser(
        "docs",
        help=SUMMARY,
        description="Print a documentation page installed with the package (Markdown; pipe it to `less`).\n"
        "Without PAGE, list the pages and where they are installed. Pages:\n"
        + "".join(f"  {name:<{max(map(len, PAGES))}} {what}\n" for name, what in PAGES.items()),
        formatter_class=HelpFormatter,
    )
    p.add_argument("page", nargs="?", choices=sorted(PAGES), metavar="PAGE",
                   help=f"the page to print: {', '.join(sorted(PAGES))}")
    p.add_argument("--path", action="store_true", help="print the page's installed file path instead of its text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from wsi_milssl.errors import WsiMilsslError

    names = [args.page] if args.page else list(PAGES)
    missing = [name for name in names if not page_file(name).is_file()]
    if missing:
        raise WsiMilsslError(
            f"{page_file(missing[0])}: documentation page not installed with this copy of wsi-milssl; "
            "reinstall the package (from a checkout, as the README installs it: pip install --force-reinstall -e .) "
            "or read docs/ of its repository")
    if args.page is None:
        width = max(map(len, PAGES))
        for name, what in PAGES.items():
            print(f"{name:<{width}} {what}\n{'':<{width}} {page_file(name)}")
        return 0
    if args.path:
        print(page_file(args.page))
        return 0
    sys.stdout.write(page_file(args.page).read_text(encoding="utf-8"))
    return 0
