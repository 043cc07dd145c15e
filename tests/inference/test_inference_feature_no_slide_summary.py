"""Review AU, finding 4: ``heatmap --features`` without slide files (which --help allows) warned once per
slide "slide file not available; <slide>_heatmap.png not drawn": 400 lines for 400 slides. Now the run says it
once, at the end (how many slides, why, and the fix: pass the slide files); per slide at debug level only."""

from __future__ import annotations

import logging

import pytest

from feature_heads import train_head, write_ours
from wsi_milssl.cli import main


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return train_head(tmp_path_factory.mktemp("nosl"))


def test_feature_heatmaps_without_slides_warn_once_at_the_end(tmp_path, head, caplog):
    for i in range(7):
        write_ours(tmp_path / "test" / f"t{i}.h5", f"t{i}", seed=i)
    with caplog.at_level(logging.DEBUG, logger="wsi_milssl.inference"):
        assert main(["heatmap", "--features", str(tmp_path / "test"), "--model", str(head / "last.pt"),
                     "--out", str(tmp_path / "hm")]) == 0
    assert not list((tmp_path / "hm").glob("*_heatmap.png"))
    assert len(list((tmp_path / "hm").glob("*_probs.npy"))) == 7
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    overlay = [r.getMessage() for r in warnings if "not drawn" in r.getMessage() or "overlay" in r.getMessage()]
    assert len(overlay) == 1, overlay
    assert overlay[0].startswith(f"7 slide(s) have no overlay PNG (<slide>_heatmap.png) in {tmp_path / 'hm'}")
    assert "(t0, t1, t2, t3, t4 and 2 more)" in overlay[0] and "pass the slide files" in overlay[0]
    assert overlay == [r.getMessage() for r in caplog.records if "overlay PNG" in r.getMessage()]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "not drawn" in r.getMessage()]
    assert len(debug) == 7, debug
    assert caplog.records.index(next(r for r in caplog.records if "overlay PNG" in r.getMessage())) > max(
        i for i, r in enumerate(caplog.records) if "patches, score" in r.getMessage())  # after the last slide
