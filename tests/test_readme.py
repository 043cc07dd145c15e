"""The README opens with the two commands CI and users run, and .ci/run runs the second verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_demo_and_test_commands():
    demo, tests = _commands()
    assert demo.endswith("wsi-milssl demo demo_out") and "pip install -e ." in demo
    assert tests.endswith("pytest") and "pip install -e '.[test]'" in tests
    head = (ROOT / "README.md").read_text().split("```bash")[0]
    assert head.strip() == "# wsi-milssl"  # the commands come first


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _commands()[1] in ci
