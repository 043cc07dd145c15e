"""Review AL, finding 1: `prepare folder` copied the packaged CAMELYON16 template's `[evaluate] froc_mpp = 0.243`,
so any cohort's FROC was measured at CAMELYON16's 0.243 µm/px and called "CAMELYON16" (at 0.5 µm/px three of four
test lesions became isolated-cell regions). On the packaged template the folder layout now leaves it out (each
slide's own µm/px); CAMELYON16's layout, and a --template the user gives, keep it."""

from __future__ import annotations

from prepare_trees import distinct_copy, gigadb_tree

from wsi_milssl.cohorts import prepare_camelyon16, prepare_folder
from wsi_milssl.cohorts.prepare import default_template
from wsi_milssl.pipeline.spec import load_pipeline, stage_config


def _folder_cohort(root, synth_slides):
    lines = ["slide,label"]
    for k, label in enumerate((0, 0, 1, 1)):
        distinct_copy(synth_slides["tumor" if label else "normal"], root / f"s{k}.tif")
        if label:
            (root / f"s{k}.xml").write_bytes(synth_slides["tumor"].with_suffix(".xml").read_bytes())
        lines.append(f"s{k},{label}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def _froc_mpp(pipeline):
    return stage_config(load_pipeline(pipeline), "evaluate").froc_mpp


def test_prepare_folder_measures_the_froc_at_each_slides_own_resolution(tmp_path, synth_slides):
    root = _folder_cohort(tmp_path / "cohort", synth_slides)
    result = prepare_folder(root, root / "labels.csv", tmp_path / "out", test_fraction=0.5)
    assert _froc_mpp(result.pipeline_toml) is None
    assert "# froc_mpp = 0.243" in result.pipeline_toml.read_text()  # shown, commented out, with the reason

    given = prepare_folder(root, root / "labels.csv", tmp_path / "out_given", test_fraction=0.5,
                           template=default_template())
    assert _froc_mpp(given.pipeline_toml) == 0.243  # the user's template is taken as written


def test_prepare_camelyon16_keeps_the_challenges_resolution(tmp_path, synth_slides):
    root = gigadb_tree(tmp_path / "C16", synth_slides)
    assert _froc_mpp(prepare_camelyon16(root, tmp_path / "out").pipeline_toml) == 0.243
