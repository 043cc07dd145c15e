"""Review EG (mutation test, round 2): a folder of another tool's detections (no ``<stem>_probs.json`` score) takes
each slide's score from scores.csv, matched as stems are, without case; no test held it, and the synth stems are
all lower case (a real ``Test_001`` written ``test_001`` would get no score)."""

from __future__ import annotations

from types import SimpleNamespace

from wsi_milssl.evaluation.stage import _slide_scores


def test_a_scores_csv_row_is_found_for_a_stem_in_other_case(tmp_path):
    (tmp_path / "scores.csv").write_text("slide,score\nTest_001,0.8\ntest_002,0.3\n")
    results = [SimpleNamespace(stem="Test_001", files=SimpleNamespace(detections=tmp_path / "Test_001.csv")),
               SimpleNamespace(stem="Test_002", files=SimpleNamespace(detections=tmp_path / "Test_002.csv"))]
    scores, stale = _slide_scores(results, {}, tmp_path / "scores.csv")
    assert scores == {"Test_001": 0.8, "Test_002": 0.3} and stale == []
