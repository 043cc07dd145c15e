"""docs/cli.md stays in step with the parsers: every subcommand has its section and every option is in it."""

from __future__ import annotations

from pathlib import Path

from wsi_milssl.cli import build_parser
from wsi_milssl.cli.reference import _subcommands, render_cli_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _sections(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for block in text.split("\n## ")[1:]:
        title, _, body = block.partition("\n")
        out[title.strip()] = body
    return out


def test_docs_cli_md_lists_every_subcommand_and_option():
    sections = _sections(DOC.read_text())
    paths = list(_subcommands(build_parser(), ()))
    assert len(paths) >= 11
    for path, parser in paths:
        title = "wsi-milssl " + " ".join(path)
        assert title in sections, f"docs/cli.md has no section {title!r}: regenerate it (python -m wsi_milssl.cli.reference)"
        for action in parser._actions:
            for option in action.option_strings:
                assert option in sections[title], f"{title}: {option} missing from docs/cli.md; regenerate it"


def test_the_renderer_covers_nested_subcommands():
    text = render_cli_reference()
    assert "## wsi-milssl annotations convert" in text and "## wsi-milssl benchmark bags" in text
    assert "--no-fuse-batchnorm" in _sections(text)["wsi-milssl heatmap"]



def test_docs_cli_md_has_every_description_and_help_text_as_it_is_now():
    """Help text changed without regenerating the page (an option's wording, a description) passed the test
    above, which checks only that every option is named. Compared with whitespace left out (argparse wraps
    lines, also inside hyphenated words, and lays out options differently across Python versions)."""
    flat = lambda text: "".join(text.split())  # noqa: E731
    sections = {title: flat(body) for title, body in _sections(DOC.read_text()).items()}
    for path, parser in _subcommands(build_parser(), ()):
        title = "wsi-milssl " + " ".join(path)
        formatter = parser._get_formatter()
        texts = [parser.description or ""] + [formatter._expand_help(a) for a in parser._actions
                                              if a.help and a.help != "==SUPPRESS=="]
        for text in texts:
            assert flat(text) in sections[title], (
                f"{title}: {' '.join(text.split())[:80]!r}... is not in docs/cli.md as it is now; regenerate it "
                f"(python -m wsi_milssl.cli.reference > docs/cli.md)")
