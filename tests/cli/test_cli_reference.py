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
