"""``split_train_val``: a training slide without a label is a ConfigError naming the slide and the
labels file (a store named after a symlink's target once died here with a raw KeyError)."""

from __future__ import annotations

import pytest

from wsi_milssl.cohorts import read_labels
from wsi_milssl.errors import ConfigError
from wsi_milssl.pipeline import split_train_val


def test_a_slide_without_a_label_names_the_slide_and_the_labels_file(tmp_path):
    path = tmp_path / "train_labels.csv"
    path.write_text("slide,label\nn1,0\nn2,0\nLT,1\nt2,1\n")
    labels = read_labels(path)
    with pytest.raises(ConfigError) as info:
        split_train_val(["n1", "n2", "synth_006", "t2"], labels, val_fraction=0.25, seed=0)
    message = str(info.value)
    assert message.startswith(f"{path}: 1 training slide(s) have no label: synth_006. Fix:")
    with pytest.raises(ConfigError, match="the training labels: 1 training slide"):
        split_train_val(["a", "b"], {"a": 0}, val_fraction=0.0, seed=0)
    # names match without case, as everywhere
    train, val = split_train_val(["n1", "n2", "lt", "t2"], labels, val_fraction=0.5, seed=0)
    assert sorted(train + val) == ["lt", "n1", "n2", "t2"]
