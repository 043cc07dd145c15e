"""An existing scores.csv saved with a byte-order mark (Excel) is still a scores file for the heatmap stage."""

from __future__ import annotations

from wsi_milssl.evaluation.inputs import read_scores
from wsi_milssl.inference.exports import update_scores_csv


def test_update_scores_keeps_the_rows_of_a_scores_file_with_a_byte_order_mark(tmp_path):
    (tmp_path / "scores.csv").write_text("\ufeffslide,score\na,0.250000\n", encoding="utf-8")
    update_scores_csv(tmp_path, {"b": 0.5})
    assert (tmp_path / "scores.csv").read_text(encoding="utf-8") == "slide,score\na,0.250000\nb,0.500000\n"
    assert read_scores(tmp_path / "scores.csv") == {"a": 0.25, "b": 0.5}
