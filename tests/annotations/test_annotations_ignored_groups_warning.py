"""The warning about annotation groups that are neither tumour nor non-tumour named the Python config
(LabelConfig.tumor_groups) and the CLI flags only; in a pipeline the setting is [label] tumor_groups (review
AQ). It now names both."""

from __future__ import annotations

import json
import logging

from wsi_milssl.annotations import read_annotations


def test_ignored_groups_name_the_flags_and_the_pipeline_keys(tmp_path, caplog):
    square = [[0, 0], [100, 0], [100, 100], [0, 100], [0, 0]]
    path = tmp_path / "s.geojson"
    path.write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [square]},
         "properties": {"objectType": "annotation", "classification": {"name": group}}}
        for group in ("Tumor", "metastases")]}))
    with caplog.at_level(logging.WARNING):
        annotations = read_annotations(path)
    assert annotations.has_tumor
    assert ("ignored 1 polygon(s) in group(s) 'metastases'" in caplog.text
            and "add the group to --tumor-groups or --non-tumor-groups (in a pipeline: [label] tumor_groups or "
                "non_tumor_groups)" in caplog.text)
