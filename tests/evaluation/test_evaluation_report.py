"""report.html opened in a real browser engine (headless Chromium): every image must load.

Chromium is a test requirement (Debian: ``apt-get install -y chromium``; CI installs it). When it is
missing these tests fail with that instruction; they never skip. Set ``WSI_MILSSL_CHROMIUM`` to use
another Chromium/Chrome binary.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from wsi_milssl.evaluation.plots import froc_png
from wsi_milssl.evaluation.report import ReportData, png_data_uri, render_report_html

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)

# Runs after every image has loaded or failed; writes the outcome into the DOM that --dump-dom prints.
CHECK_SCRIPT = """<script>
window.addEventListener('load', function () {
  var imgs = document.images, ok = 0, broken = [];
  for (var i = 0; i < imgs.length; i++) {
    if (imgs[i].complete && imgs[i].naturalWidth > 0 && imgs[i].naturalHeight > 0) { ok++; }
    else { broken.push(imgs[i].getAttribute('alt') || String(i)); }
  }
  document.body.setAttribute('data-images-ok', ok + '/' + imgs.length);
  document.body.setAttribute('data-images-broken', broken.join('|'));
});
</script>"""


def chromium_env() -> dict[str, str]:
    """The environment for Chromium, with a short TMPDIR: it puts its SingletonSocket below TMPDIR, and a socket path
    takes at most 107 bytes (review DC: a TMPDIR of 62 characters or more aborted it)."""
    return {**os.environ, "TMPDIR": "/tmp"} if os.path.isdir("/tmp") else dict(os.environ)


def chromium_binary() -> str:
    explicit = os.environ.get("WSI_MILSSL_CHROMIUM")
    if explicit:
        return explicit
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "headless Chromium is required to check report.html and was not found "
        f"(looked for {', '.join(CHROMIUM_NAMES)} on PATH and $WSI_MILSSL_CHROMIUM). "
        "Install it: apt-get update && apt-get install -y chromium"
    )


def images_in_browser(html_path: Path, work: Path) -> tuple[int, int, list[str]]:
    """(loaded, total, alt texts of the broken ones) for the page at ``html_path`` in Chromium."""
    page = html_path.read_text(encoding="utf-8")
    assert page.count("</body>") == 1
    probe = work / f"{html_path.stem}_probe.html"
    probe.write_text(page.replace("</body>", CHECK_SCRIPT + "</body>"), encoding="utf-8")
    profile = work / "chromium-profile"
    profile.mkdir(exist_ok=True)
    cmd = [chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", probe.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=chromium_env())
    found = re.search(r'data-images-ok="(\d+)/(\d+)"', proc.stdout)
    assert found, f"Chromium printed no result (exit {proc.returncode}); stderr tail:\n{proc.stderr[-2000:]}"
    broken = re.search(r'data-images-broken="([^"]*)"', proc.stdout).group(1)
    return int(found.group(1)), int(found.group(2)), [b for b in broken.split("|") if b]


def test_report_images_load_in_chromium(evaluated, tmp_path):
    """FROC + 2 ROC plots, the tumour slide's heatmap and FROC view, the normal slide's heatmap: 6."""
    _, out, _ = evaluated
    ok, total, broken = images_in_browser(out / "report.html", tmp_path)
    assert broken == []
    assert (ok, total) == (6, 6)


def test_report_is_self_contained_and_complete(evaluated):
    result, out, info = evaluated
    html = (out / "report.html").read_text(encoding="utf-8")
    srcs = re.findall(r'<img[^>]*\bsrc="([^"]*)"', html)
    assert len(srcs) == 6 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<script" not in html and "<link" not in html and "http://" not in html and "https://" not in html
    for key in ("Instance AUC", "Bag AUC", "FROC score", "sensitivity at 1/4 FP/slide", "sensitivity at 8 FP/slide"):
        assert key in html
    assert f"{result.metrics['froc']:.4f}" in html
    assert info["tumor"] in html and info["normal"] in html
    assert "&quot;positive_fraction&quot;: 0.25" in html  # the configuration section
    for uri in srcs:
        assert base64.b64decode(uri.split(",", 1)[1]).startswith(b"\x89PNG")


def test_the_browser_check_catches_broken_images(evaluated, tmp_path):
    """The check must be able to fail: a corrupt embedded image and an image pointing to a file
    that does not exist are both reported broken."""
    _, out, _ = evaluated
    html = (out / "report.html").read_text(encoding="utf-8")
    first = re.search(r'src="(data:image/png;base64,[^"]*)"', html).group(1)
    garbage = "data:image/png;base64," + base64.b64encode(b"not a png at all" * 8).decode()
    html = html.replace(first, garbage, 1)
    html = html.replace("</h1>", '</h1><img src="froc_missing.png" alt="missing-file">', 1)
    bad = tmp_path / "broken.html"
    bad.write_text(html, encoding="utf-8")
    ok, total, broken = images_in_browser(bad, tmp_path)
    assert (ok, total) == (5, 7)
    assert "missing-file" in broken and len(broken) == 2


def test_report_renders_unavailable_metrics_and_escapes_text():
    from wsi_milssl.evaluation.froc import froc_curve, match_detections
    import numpy as np

    curve = froc_curve([match_detections(np.array([0.5]), np.array([1.0]), np.array([1.0]), mask=None)])
    data = ReportData(
        title="<b>run</b> & co",
        metrics={"instance_auc": None, "bag_auc": 0.75, "froc": None, "froc_sensitivities": [None] * 6,
                 "fp_rates": [0.25, 0.5, 1, 2, 4, 8], "n_slides": 1, "n_lesions": 0,
                 "reasons": {"instance_auc": "no <patches>", "froc": "no lesions"}},
        plots=[("FROC", froc_png(curve, score=None))],
        slide_rows=[{"slide": "s<1>", "label": 0}],
        configuration={"note": "</pre><script>x</script>"},
    )
    page = render_report_html(data)
    assert "<b>run</b>" not in page and "&lt;b&gt;run&lt;/b&gt; &amp; co" in page
    assert "no &lt;patches&gt;" in page and "0.7500" in page and "n/a" in page
    assert "<script>" not in page and "s&lt;1&gt;" in page


def test_png_data_uri_rejects_non_png():
    with pytest.raises(ValueError, match="PNG signature"):
        png_data_uri(b"GIF89a")
