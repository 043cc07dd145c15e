"""``heatmap`` resumes a slide only when its own outputs were made by the same checkpoint and settings.

The folder's ``heatmap_config.json`` names the latest run's fingerprint, written before any slide is
done; a run killed after a few slides with a new checkpoint must not make the old checkpoint's other
slides look finished. Each ``<stem>_probs.json`` records the fingerprint that made it, once every file of
the slide is written (one partly rewritten is not reused), and must agree with the status row.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from wsi_milssl.config import HeatmapConfig
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.inference import stage as stage_module

FAST = dict(thumbnail_px=128, batch_size=32, num_workers=0)
#: a second "checkpoint": the same oracle model, other weights (scores differ from the default's)
OTHER = dict(model_kwargs={"gain": 5.0, "min_fraction": 0.5})


@pytest.fixture(scope="module")
def slides(tmp_path_factory, slide_writer) -> list[Path]:
    """Two different 2048-px slides (other tissue and tumour layouts)."""
    folder = tmp_path_factory.mktemp("ckpt_changed")
    a = slide_writer(folder / "a.tif", width=2048, height=2048, tissue_box=(256, 256, 1792, 1792),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300) % 4 == 0)
    b = slide_writer(folder / "b.tif", width=2048, height=2048, tissue_box=(0, 512, 2048, 1536),
                     tumour=lambda xs, ys: (xs // 300 + ys // 300 + 1) % 4 == 0)
    return [a, b]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, checkpoint_writer) -> tuple[Path, Path]:
    """(last.pt, best.pt) of one run: two checkpoints with different weights."""
    run = tmp_path_factory.mktemp("run1")
    return checkpoint_writer(run / "last.pt"), checkpoint_writer(run / "best.pt", **OTHER)


@pytest.fixture(scope="module")
def alone(tmp_path_factory, slides, checkpoints) -> dict[str, Path]:
    """Folders of each checkpoint's uninterrupted run over both slides: {'last': ..., 'best': ...}."""
    out = {}
    for name, ckpt in zip(("last", "best"), checkpoints):
        out[name] = tmp_path_factory.mktemp(f"alone_{name}")
        assert make_heatmaps(slides, ckpt, out[name], HeatmapConfig(**FAST)).ok
    assert _scores(out["last"]) != _scores(out["best"])  # the test needs checkpoints that disagree
    return out


def _status(folder: Path) -> dict[str, dict]:
    with open(folder / "heatmap_status.csv", newline="") as fh:
        return {r["slide"]: r for r in csv.DictReader(fh)}


def _scores(folder: Path) -> dict[str, str]:
    with open(folder / "scores.csv", newline="") as fh:
        return {r["slide"]: r["score"] for r in csv.DictReader(fh)}


def _read(events) -> set[str]:
    """Slides whose patches a run read (predicted, not skipped)."""
    return {e.item for e in events if e.stage == "heatmap-patches" and e.item}


def _assert_made_by(out: Path, reference: Path, ckpt: Path) -> None:
    """Every slide's map, score and status in ``out`` are those of ``reference`` (one checkpoint's run)."""
    assert _scores(out) == _scores(reference)
    status, expected = _status(out), _status(reference)
    assert {s: (r["status"], r["score"], r["n_patches"]) for s, r in status.items()} == \
        {s: (r["status"], r["score"], r["n_patches"]) for s, r in expected.items()}
    config = json.loads((out / "heatmap_config.json").read_text())
    assert config["checkpoint"] == str(ckpt)
    for stem in status:
        np.testing.assert_array_equal(np.load(out / f"{stem}_probs.npy"), np.load(reference / f"{stem}_probs.npy"))
        sidecar = json.loads((out / f"{stem}_probs.json").read_text())
        assert sidecar["checkpoint"] == str(ckpt)
        assert sidecar["fingerprint"] == config["fingerprint"]
        assert (out / f"{stem}_detections.csv").read_bytes() == (reference / f"{stem}_detections.csv").read_bytes()


def test_a_run_resumed_with_a_new_checkpoint_predicts_the_old_checkpoints_slides_again(
        tmp_path, slides, checkpoints, alone):
    last, best = checkpoints
    out = tmp_path / "H5"
    assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST)).ok
    # `heatmap --model best.pt` killed after its first slide: the folder names best.pt, slide b is last.pt's
    assert make_heatmaps(slides[:1], best, out, HeatmapConfig(**FAST)).ok
    assert json.loads((out / "heatmap_config.json").read_text())["checkpoint"] == str(best)
    events = []
    run = make_heatmaps(slides, best, out, HeatmapConfig(**FAST), progress=events.append)
    assert run.ok
    assert _read(events) == {"b"}  # a was finished by best.pt; b was last.pt's
    _assert_made_by(out, alone["best"], best)
    # the same checkpoint and settings again: everything skipped
    events = []
    assert make_heatmaps(slides, best, out, HeatmapConfig(**FAST), progress=events.append).ok
    assert _read(events) == set()
    # each slide's progress line says so (review EW: "(ok)", where the other slide stages say "(skipped)")
    assert sorted((e.item, e.message) for e in events if e.stage == "heatmap" and e.item) == [
        ("a", "skipped"), ("b", "skipped")]
    _assert_made_by(out, alone["best"], best)


def test_a_folder_config_rewritten_for_another_checkpoint_does_not_adopt_the_slides(
        tmp_path, slides, checkpoints, alone):
    """The killed run wrote its config and no slide: every slide is predicted again with its checkpoint."""
    last, best = checkpoints
    out = tmp_path / "hm"
    assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST)).ok
    shutil.copyfile(alone["best"] / "heatmap_config.json", out / "heatmap_config.json")
    events = []
    assert make_heatmaps(slides, best, out, HeatmapConfig(**FAST), progress=events.append).ok
    assert _read(events) == {"a", "b"}
    _assert_made_by(out, alone["best"], best)


def test_shards_resumed_with_a_new_checkpoint_predict_their_own_old_slides_again(
        tmp_path, slides, checkpoints, alone):
    from wsi_milssl.distributed import shard_of

    last, best = checkpoints
    out = tmp_path / "hm"
    assert [shard_of(stem, 3) for stem in ("a", "b")] == [1, 2]  # shard 0 of 3 has no slide
    for i in range(3):
        assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST), shard=(i, 3)).ok
    # shard 1 of the best.pt run finished, shard 2 was killed before its slide
    events = []
    assert make_heatmaps(slides, best, out, HeatmapConfig(**FAST), shard=(1, 3), progress=events.append).ok
    assert _read(events) == {"a"}
    events = []
    run = make_heatmaps(slides, best, out, HeatmapConfig(**FAST), shard=(2, 3), progress=events.append)
    assert run.ok and [r.slide for r in run.results] == ["b"]
    assert _read(events) == {"b"}  # its slide is last.pt's: predicted again, not reported ok
    _assert_made_by(out, alone["best"], best)
    for i in range(3):  # each shard again: nothing to do
        events = []
        assert make_heatmaps(slides, best, out, HeatmapConfig(**FAST), shard=(i, 3), progress=events.append).ok
        assert _read(events) == set()


def test_going_back_to_the_old_checkpoint_predicts_the_new_ones_slides_again(tmp_path, slides, checkpoints, alone):
    last, best = checkpoints
    out = tmp_path / "hm"
    assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST)).ok
    assert make_heatmaps(slides[:1], best, out, HeatmapConfig(**FAST)).ok
    events = []
    assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST), progress=events.append).ok
    assert _read(events) == {"a"}  # b is still last.pt's own
    _assert_made_by(out, alone["last"], last)


def test_other_settings_recorded_per_slide(tmp_path, slides, checkpoints):
    """A settings change is in the per-slide fingerprint too (not only the checkpoint): a slide made with other
    detection settings (a drawing setting) is drawn again from its saved probabilities, not skipped."""
    last, _ = checkpoints
    out = tmp_path / "hm"
    assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST)).ok
    stamp = (out / "b_detections.csv").stat().st_mtime_ns
    assert make_heatmaps(slides[:1], last, out, HeatmapConfig(**FAST, detection_threshold=0.3)).ok
    events = []
    run = make_heatmaps(slides, last, out, HeatmapConfig(**FAST, detection_threshold=0.3), progress=events.append)
    assert run.ok and run.skipped == ("a",) and run.redrawn == ("b",)
    assert _read(events) == set()  # no patch read: b's probabilities are the saved ones
    assert (out / "b_detections.csv").stat().st_mtime_ns != stamp
    assert json.loads((out / "b_probs.json").read_text())["detection_threshold"] == 0.3


def test_outputs_without_a_recorded_fingerprint_are_predicted_again(tmp_path, slides, checkpoints):
    """A folder written before the per-slide fingerprint existed: its slides are predicted again (safe)."""
    last, _ = checkpoints
    out = tmp_path / "hm"
    assert make_heatmaps(slides[:1], last, out, HeatmapConfig(**FAST)).ok
    sidecar = json.loads((out / "a_probs.json").read_text())
    assert sidecar["fingerprint"] == json.loads((out / "heatmap_config.json").read_text())["fingerprint"]
    del sidecar["fingerprint"], sidecar["prediction_fingerprint"]  # neither was recorded then
    (out / "a_probs.json").write_text(json.dumps(sidecar))
    events = []
    assert make_heatmaps(slides[:1], last, out, HeatmapConfig(**FAST), progress=events.append).ok
    assert _read(events) == {"a"}
    assert "fingerprint" in json.loads((out / "a_probs.json").read_text())


def test_a_status_row_older_than_the_slides_files_is_not_trusted(tmp_path, slides, checkpoints, alone):
    """Killed after a slide's files but before its status row: the row (and scores.csv) are the previous
    checkpoint's, so the slide is predicted again rather than reported with the old score."""
    last, best = checkpoints
    out = tmp_path / "hm"
    assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST)).ok
    shutil.copyfile(alone["best"] / "heatmap_config.json", out / "heatmap_config.json")
    for path in alone["best"].glob("a_*"):  # best.pt's files of slide a, but not its status or score
        shutil.copyfile(path, out / path.name)
    events = []
    assert make_heatmaps(slides, best, out, HeatmapConfig(**FAST), progress=events.append).ok
    assert _read(events) == {"a", "b"}
    _assert_made_by(out, alone["best"], best)


class _Killed(BaseException):
    """Stands for the process being killed (not an error a slide is recorded as failed for)."""


def test_a_slide_whose_files_were_partly_rewritten_is_predicted_again(tmp_path, slides, checkpoints, alone,
                                                                     monkeypatch):
    last, best = checkpoints
    out = tmp_path / "hm"
    assert make_heatmaps(slides[:1], last, out, HeatmapConfig(**FAST)).ok

    def killed(*args, **kwargs):
        raise _Killed()

    # best.pt's run dies while writing slide a's files: its map is written, its detections are not
    with monkeypatch.context() as m:
        m.setattr(stage_module, "write_detections_csv", killed)
        with pytest.raises(_Killed):
            make_heatmaps(slides[:1], best, out, HeatmapConfig(**FAST))
    # no sidecar until every file is written
    assert not (out / "a_probs.json").exists()
    assert _status(out)["a"]["score"] == _status(alone["last"])["a"]["score"]  # the old row is still there
    for ckpt, name in ((best, "best"), (last, "last")):
        events = []
        assert make_heatmaps(slides[:1], ckpt, out, HeatmapConfig(**FAST), progress=events.append).ok
        assert _read(events) == {"a"}
        assert _scores(out)["a"] == _scores(alone[name])["a"]
        assert (out / "a_detections.csv").read_bytes() == (alone[name] / "a_detections.csv").read_bytes()


def test_a_run_folder_as_the_model_is_fingerprinted_by_the_checkpoint_it_loads(tmp_path, slides, checkpoints):
    """``--model RUN_DIR``: the folder was kept as the checkpoint path, no bytes were hashed, and a retrained
    run's heatmaps reused the old model's slides."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(checkpoints[0], run / "best.pt")
    out = tmp_path / "hm"
    assert make_heatmaps(slides, run, out, HeatmapConfig(**FAST)).ok
    first = _scores(out)
    shutil.copy(checkpoints[1], run / "best.pt")  # the run trained again
    assert make_heatmaps(slides, run, out, HeatmapConfig(**FAST)).ok
    assert _scores(out) != first
    assert json.loads((out / "heatmap_config.json").read_text())["checkpoint"] == str(run / "best.pt")


def test_a_run_killed_once_a_slides_files_are_written_leaves_its_rows(tmp_path, slides, checkpoints, alone,
                                                                     monkeypatch):
    """`heatmap --overwrite` with best.pt killed right after the writer thread finished slide a's files: its
    scores.csv and status rows waited for the main thread, so they stayed last.pt's beside best.pt's files
    (and evaluate took last.pt's score). The writer writes them with the files now."""
    from concurrent.futures import ALL_COMPLETED

    last, best = checkpoints
    out = tmp_path / "hm"
    assert make_heatmaps(slides, last, out, HeatmapConfig(**FAST)).ok
    real_wait = stage_module.wait

    def killed_once_written(futures, timeout=None, return_when=ALL_COMPLETED):
        real_wait(futures, return_when=ALL_COMPLETED)  # the slides' files are written ...
        raise _Killed()  # ... and the process dies before the main thread collects them

    with monkeypatch.context() as m:
        m.setattr(stage_module, "wait", killed_once_written)
        with pytest.raises(_Killed):
            make_heatmaps(slides, best, out, HeatmapConfig(**FAST), overwrite=True)
    assert json.loads((out / "a_probs.json").read_text())["checkpoint"] == str(best)
    assert _scores(out)["a"] == _scores(alone["best"])["a"] != _scores(alone["last"])["a"]
    for stem in ("a", "b"):  # whichever run made a slide's files, its rows are that run's
        sidecar = json.loads((out / f"{stem}_probs.json").read_text())
        assert _scores(out)[stem] == _status(out)[stem]["score"] == f"{sidecar['score']:.6f}"
        assert int(_status(out)[stem]["n_patches"]) == sidecar["n_patches"]


def test_shards_writing_at_once_with_two_checkpoints_are_refused(tmp_path, slides, checkpoints):
    """Review DA: shards started together with two checkpoints filled one folder (and scores.csv) with maps of two
    models, and heatmap_config.json named one of them. The other shard's record, written after this shard's, is
    found at this shard's end."""
    from wsi_milssl.errors import ConfigError

    last, best = checkpoints
    records = {}
    for name, ckpt, config in (("best", best, HeatmapConfig(**FAST)),
                               ("other settings", last, HeatmapConfig(**FAST, detection_threshold=0.3))):
        records[name] = tmp_path / name
        assert make_heatmaps(slides[:1], ckpt, records[name], config).ok

    def the_other_shard_starts(out, record):
        def on_event(event) -> None:
            if event.stage == "heatmap" and event.done == 0:  # after this shard wrote its record
                shutil.copyfile(record / "heatmap_config.json", out / "heatmap_config.json")
        return on_event

    for name, message in (("best", r"holds maps made with the checkpoint .*best\.pt, not this shard's .*last\.pt; "
                                   r"the shards of one run must use the same checkpoint and settings"),
                          ("other settings", "holds maps made with other settings than this shard's")):
        out = tmp_path / f"hm_{name}"
        with pytest.raises(ConfigError, match=message):
            make_heatmaps(slides, last, out, HeatmapConfig(**FAST), shard=(0, 2),
                          progress=the_other_shard_starts(out, records[name]))
    # shards of one checkpoint and settings: accepted (above: a shard run again later with a new checkpoint predicts
    # its own slides again)
    out = tmp_path / "same"
    assert all(make_heatmaps(slides, last, out, HeatmapConfig(**FAST), shard=(i, 2)).ok for i in (0, 1))
