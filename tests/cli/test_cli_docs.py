"""``wsi-milssl docs``: the documentation pages that help texts and OUT/README.txt point at are installed with
the package (a wheel install has no checkout to read docs/ from)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from wsi_milssl.cli import main
from wsi_milssl.cli.docs import PAGES

REPO = Path(__file__).resolve().parents[2]


def test_docs_lists_every_page_of_the_checkout_with_its_installed_path(capsys):
    assert main(["docs"]) == 0
    out = capsys.readouterr().out
    assert set(PAGES) == {p.stem for p in (REPO / "docs").glob("*.md")}
    for name in PAGES:
        path = Path(out.split(f"{name} ", 1)[1].splitlines()[1].strip())
        assert path.read_bytes() == (REPO / "docs" / f"{name}.md").read_bytes()


@pytest.mark.parametrize("page", sorted(PAGES))
def test_docs_page_prints_the_page(capsys, page):
    assert main(["docs", page]) == 0
    assert capsys.readouterr().out == (REPO / "docs" / f"{page}.md").read_text(encoding="utf-8")


def test_the_wheel_ships_the_pages_and_the_pipelines(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    for name in ("wsi_milssl", "docs", "pipelines"):
        shutil.copytree(REPO / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"wsi_milssl/docs/{page}.md" for page in PAGES} <= names
    assert {f"wsi_milssl/pipelines/{p.name}" for p in (REPO / "pipelines").glob("*.toml")} <= names
