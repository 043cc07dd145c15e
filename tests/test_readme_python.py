"""The README's "From Python" scripts run as written (the image path, then the feature path on its stores), on
smaller generated slides: a renamed function or a changed signature fails here, not in a user's notebook."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_python_scripts_run(tmp_path):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## From Python"):text.index("\n## ", text.index("## From Python") + 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the section shows the image path and the feature path"
    assert "width_px=4096, height_px=4096" in blocks[0]
    # each script on its own (the second reads the first one's stores), as a reader copies them
    (tmp_path / "images.py").write_text(blocks[0].replace("width_px=4096, height_px=4096",
                                                          "width_px=2048, height_px=2048"))
    (tmp_path / "features.py").write_text(blocks[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for script in ("images.py", "features.py"):
        done = subprocess.run([sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (script, done.stderr[-3000:])
        assert done.stdout == ""  # the library prints nothing; logging goes to stderr
        assert "WARNING" not in done.stderr, (script, done.stderr[-3000:])  # review DT: the μ-schedule warning
    for folder in ("evaluation", "evaluation_head"):
        metrics = json.loads((tmp_path / folder / "metrics.json").read_text())
        assert metrics["n_slides"] == 4, metrics
    assert sorted(p.name for p in (tmp_path / "features" / "test").glob("*.h5")) == [f"synth_00{i}.h5"
                                                                                       for i in range(4)]
