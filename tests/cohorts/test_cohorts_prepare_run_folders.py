"""An earlier run's output folder below a download is not searched for slides (review AO, finding 9)."""

from __future__ import annotations

from prepare_trees import distinct_copy, gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16


def test_an_earlier_runs_output_below_the_download_is_not_searched(tmp_path, synth_slides):
    """run --out ROOT/x left heatmaps/*_probs.tif below the download: prepare listed them as badly named slides."""
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    run = root / "x"
    (run / ".pipeline").mkdir(parents=True)
    (run / "resolved_pipeline.toml").write_text('[pipeline]\nname = "x"\n')
    distinct_copy(synth_slides["normal"], run / "heatmaps" / "test" / "Test_001_probs.tif")
    distinct_copy(synth_slides["normal"], run / "heatmaps" / "test" / "Test_004.tif")
    result = prepare_camelyon16(root, tmp_path / "out")
    assert sorted(result.sets["test"].slides) == ["Test_001", "Test_002", "Test_003"]
