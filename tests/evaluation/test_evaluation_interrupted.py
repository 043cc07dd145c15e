"""An ``evaluate`` stopped part-way (Ctrl-C, a full disk) over an earlier evaluation never leaves a folder that
mixes the two runs and looks finished (review finding: the new ``metrics.json`` and ``per_slide.csv`` beside the
earlier run's ``config.json``, plots and ``report.html``). The stage removes the earlier run's files first and
writes ``metrics.json`` last, so a folder without it is an unfinished run's; other files in the folder are kept."""

from __future__ import annotations

import errno
import json
import os

import pytest

import wsi_milssl.evaluation.stage as stage
from wsi_milssl.artifacts import EVALUATION_FILES
from wsi_milssl.config import EvaluateConfig
from wsi_milssl.evaluation import evaluate_predictions

OLD_NS = 1_000_000_000 * 10**9  # 2001: the first run's files are marked with this modification time


def _evaluate(predictions, synth_dir, annotations_dir, out, **settings):
    return evaluate_predictions(predictions[0], labels_csv=synth_dir / "labels.csv", out_dir=out,
                                annotations_dir=annotations_dir, slides=synth_dir,
                                config=EvaluateConfig(thumbnail_px=64, **settings))


def _first_run(predictions, synth_dir, annotations_dir, out):
    """A finished evaluation in ``out`` (every file of it, with a file of the user's beside them), its files'
    modification times set to :data:`OLD_NS` to tell them from a later run's."""
    _evaluate(predictions, synth_dir, annotations_dir, out)
    (out / "notes.txt").write_text("mine")
    for name in EVALUATION_FILES.values():
        assert (out / name).exists(), name
        os.utime(out / name, ns=(OLD_NS, OLD_NS))


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("where, exc", [
    ("froc_png", KeyboardInterrupt()),  # Ctrl-C after metrics/per_slide/curves were written (the old order)
    ("write_report", OSError(errno.ENOSPC, "No space left on device")),  # a full disk at the last file
])
def test_a_failed_run_leaves_no_file_of_the_earlier_run_and_no_metrics(
        synth_dir, annotations_dir, predictions, tmp_path, monkeypatch, where, exc):
    out = tmp_path / "evaluation"
    _first_run(predictions, synth_dir, annotations_dir, out)
    with monkeypatch.context() as patch:
        patch.setattr(stage, where, _raise(exc))
        with pytest.raises(type(exc)):
            _evaluate(predictions, synth_dir, annotations_dir, out, positive_fraction=0.9)
    left = sorted(name for name in EVALUATION_FILES.values() if (out / name).exists())
    earlier = [name for name in left if (out / name).stat().st_mtime_ns == OLD_NS]
    assert earlier == [], f"files of the first run beside the second's: {earlier} (left: {left})"
    assert not (out / "metrics.json").exists(), "a failed run left metrics.json: the folder looks finished"
    assert (out / "notes.txt").read_text() == "mine"
    assert not list(out.glob(".*.tmp")) and not list(out.glob("*.tmp"))

    # the next run finishes the folder: every file of it, metrics.json written last
    _evaluate(predictions, synth_dir, annotations_dir, out, positive_fraction=0.9)
    times = {name: (out / name).stat().st_mtime_ns for name in EVALUATION_FILES.values()}
    assert OLD_NS not in times.values()
    assert times["metrics.json"] == max(times.values())
    assert json.loads((out / "config.json").read_text())["positive_fraction"] == 0.9
    assert (out / "notes.txt").read_text() == "mine"
