"""The commands prepare prints and writes quote paths with spaces (review AO, finding 8)."""

from __future__ import annotations

import shlex

from prepare_trees import gigadb_tree

from wsi_milssl.cli import main


def test_paths_with_spaces_are_quoted_in_the_next_command_and_the_pipeline_header(tmp_path, monkeypatch, capsys,
                                                                               synth_slides):
    gigadb_tree(tmp_path / "C 16", synth_slides)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "camelyon16", "C 16", "--out", "prep one"]) == 0
    lines = capsys.readouterr().out.splitlines()
    next_line = [line for line in lines if line.startswith("next: ")]
    assert len(next_line) == 1 and shlex.split(next_line[0][len("next: "):]) == ["wsi-milssl", "run",
                                                                                "prep one/pipeline.toml"]
    header = (tmp_path / "prep one" / "pipeline.toml").read_text().splitlines()[2]
    assert shlex.split(header.split("Run it as it is:", 1)[1]) == ["wsi-milssl", "run", "prep one/pipeline.toml"]
