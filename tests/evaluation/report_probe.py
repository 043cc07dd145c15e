"""Measure a report.html in headless Chromium: a script run after load writes a JSON object into the DOM that
``--dump-dom`` prints (Chromium is a test requirement; see test_evaluation_report.py)."""

from __future__ import annotations

import base64
import html
import json
import re
import subprocess
from pathlib import Path

from test_evaluation_report import CHROMIUM_FLAGS, chromium_binary, chromium_env


def probe(page: Path, work: Path, body: str, *, window: str = "1280,2000") -> dict:
    """Run ``body`` (JavaScript that fills the object ``out``) on ``page`` after load, in a window of
    ``window`` CSS px; return ``out``."""
    script = ("<script>window.addEventListener('load', function () { var out = {};\n" + body
              + "\ndocument.body.setAttribute('data-probe', JSON.stringify(out)); });</script>")
    copy = work / f"{page.stem}_probe.html"
    copy.write_text(page.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8")
    profile = work / "chromium-profile"
    profile.mkdir(exist_ok=True)
    proc = subprocess.run([chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={window}",
                           "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=180,
                          env=chromium_env())
    found = re.search(r'data-probe="([^"]*)"', proc.stdout)
    assert found, f"Chromium printed no result (exit {proc.returncode}); stderr tail:\n{proc.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def embedded_pngs(page: str) -> dict[str, bytes]:
    """alt text -> PNG bytes of every image embedded in a report's HTML."""
    return {html.unescape(alt): base64.b64decode(data) for data, alt in
            re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)"', page)}
