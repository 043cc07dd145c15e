"""`heatmap SLIDES --features FILES` draws a feature file only over the slide it was made from (review
finding F6): a slide of the same name but another level-0 size, or another slide file of another size
while the recorded one is there, fails that slide; the same slide reached by another path is used.
And `--shard` is refused with --features instead of being ignored (F9)."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest

from wsi_milssl.cli import main
from wsi_milssl.features import write_feature_file


def _file(path, name, *, slide_path="", dims=(4096, 4096), seed=0):
    """A feature file of a 6 x 6 grid of 512-px patches (this project's attributes, 8-d features)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:6, 0:6]
    coords = np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1)
    feats = rng.normal(size=(len(coords), 8)).astype(np.float32)
    feats[:6] += 3.0 * (seed % 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_feature_file(path, features=feats, coords=coords,
                       attrs={"slide_stem": name, "slide_path": slide_path, "mpp": 0.25, "dimensions_lv0": list(dims),
                              "encoder": "resnet18", "target_mpp": 0.5, "patch_size_px": 256},
                       coords_attrs={"patch_size": 256}, features_attrs={"encoder": "resnet18"})
    return path


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairing")
    names = [f"s{i}" for i in range(4)]
    for i, n in enumerate(names):
        _file(root / "train" / f"{n}.h5", n, seed=i)
    (root / "labels.csv").write_text("slide,label\n" + "".join(f"{n},{i % 2}\n" for i, n in enumerate(names)))
    assert main(["train", str(root / "train"), "--labels", str(root / "labels.csv"), "--out", str(root / "run"),
                 "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return root / "run"


def _status(folder):
    return {r["slide"]: r for r in csv.DictReader((folder / "heatmap_status.csv").open())}


def test_features_are_drawn_only_over_their_own_slide(tmp_path, head, synth_dir):
    train_slide = synth_dir / "synth_000.tif"
    feats = tmp_path / "feats"
    _file(feats / "synth_000.h5", "synth_000", slide_path=str(train_slide.resolve()))
    # a test slide of the same name (another slide, of the same level-0 size, another file size)
    test_slide = tmp_path / "test" / "synth_000.tif"
    test_slide.parent.mkdir()
    shutil.copy(synth_dir / "synth_001.tif", test_slide)
    assert test_slide.stat().st_size != train_slide.stat().st_size
    rc = main(["heatmap", str(test_slide), "--features", str(feats), "--model", str(head), "--out", str(tmp_path / "a"),
               "--thumbnail-px", "128"])
    assert rc == 1
    row = _status(tmp_path / "a")["synth_000"]
    assert row["status"] == "failed"
    assert f"the feature file {feats / 'synth_000.h5'} was made from another slide of the same name" in row["error"]
    assert f"{train_slide.resolve()}, {train_slide.stat().st_size} bytes; this slide: {test_slide.stat().st_size} " \
           "bytes" in row["error"]
    assert not (tmp_path / "a" / "synth_000_probs.json").exists()
    # its own slide, and the same slide reached by another path, are drawn
    copy = tmp_path / "copy" / "synth_000.tif"
    copy.parent.mkdir()
    shutil.copy(train_slide, copy)
    for slide, out in ((train_slide, tmp_path / "b"), (copy, tmp_path / "c")):
        assert main(["heatmap", str(slide), "--features", str(feats), "--model", str(head), "--out", str(out),
                     "--thumbnail-px", "128"]) == 0
        assert json.loads((out / "synth_000_probs.json").read_text())["slide_path"] == str(slide)


def test_a_slide_of_another_level0_size_is_not_the_files_slide(tmp_path, head, synth_dir):
    feats = tmp_path / "feats"
    _file(feats / "synth_001.h5", "synth_001", dims=(3072, 3072))  # no slide path recorded (another tool, say)
    rc = main(["heatmap", str(synth_dir / "synth_001.tif"), "--features", str(feats), "--model", str(head), "--out",
               str(tmp_path / "a"), "--thumbnail-px", "128"])
    assert rc == 1
    error = _status(tmp_path / "a")["synth_001"]["error"]
    assert "made from another slide of the same name (slide not recorded, 3072 x 3072 px; this slide: 4096 x 4096 " \
           "px)" in error and "Fix: pass the feature files of this slide" in error
    # without the slide, the file is drawn from its own facts
    assert main(["heatmap", "--features", str(feats), "--model", str(head), "--out", str(tmp_path / "b")]) == 0


def test_heatmap_features_refuses_shards(tmp_path, head, capsys):
    _file(tmp_path / "feats" / "s0.h5", "s0")
    rc = main(["heatmap", "--features", str(tmp_path / "feats"), "--model", str(head), "--out", str(tmp_path / "a"),
               "--shard", "0/2"])
    assert rc == 2
    assert "--shard 0/2: heatmaps of feature files (--features) are not split into shards" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert main(["heatmap", "--features", str(tmp_path / "feats"), "--model", str(head), "--out", str(tmp_path / "b"),
                 "--shard", "0/1"]) == 0


def test_a_feature_slide_that_fails_loses_its_earlier_files_and_score(tmp_path, head):
    """As the image heatmap does: an earlier run's files of a slide that now fails would be evaluated as
    this run's (evaluate also refuses a failed slide)."""
    feats = tmp_path / "feats"
    for i in range(2):
        _file(feats / f"t{i}.h5", f"t{i}", seed=i)
    out = tmp_path / "hm"
    assert main(["heatmap", "--features", str(feats), "--model", str(head), "--out", str(out),
                 "--thumbnail-px", "128"]) == 0
    assert sorted(out.glob("t1_*")) and "t1" in (out / "scores.csv").read_text()
    # t1 now has features of another width: the head cannot read them, so the slide fails
    rng = np.random.default_rng(1)
    ys, xs = np.mgrid[0:6, 0:6]
    write_feature_file(feats / "t1.h5", features=rng.normal(size=(36, 16)).astype(np.float32),
                       coords=np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1),
                       attrs={"slide_stem": "t1", "slide_path": "", "mpp": 0.25, "dimensions_lv0": [4096, 4096],
                              "encoder": "resnet18", "target_mpp": 0.5, "patch_size_px": 256},
                       coords_attrs={"patch_size": 256}, features_attrs={"encoder": "resnet18"})
    assert main(["heatmap", "--features", str(feats), "--model", str(head), "--out", str(out),
                 "--thumbnail-px", "128"]) != 0
    assert _status(out)["t1"]["status"] == "failed"
    assert not sorted(out.glob("t1_*")) and "t1" not in (out / "scores.csv").read_text()
    assert sorted(out.glob("t0_*")) and "t0" in (out / "scores.csv").read_text()


# -- the run that made a feature heatmap (review findings F1, F2, F3b) -------------------------------

def _evaluate_normals(folder, tmp_path, stems, name="eval"):
    """``evaluate`` of ``folder`` with every slide of ``stems`` labelled normal (no annotation needed)."""
    from wsi_milssl.config import EvaluateConfig
    from wsi_milssl.evaluation import evaluate_predictions

    labels = tmp_path / f"{name}_labels.csv"
    labels.write_text("slide,label\n" + "".join(f"{s},0\n" for s in stems))
    return evaluate_predictions(folder, labels_csv=labels, out_dir=tmp_path / name, config=EvaluateConfig())


def _heatmap(feats, model, out, *extra) -> int:
    return main(["heatmap", "--features", str(feats), "--model", str(model), "--out", str(out), "--thumbnail-px", "128",
                 *extra])


def test_two_heads_saved_at_one_path_are_not_evaluated_as_one_run(tmp_path, head):
    """A head retrained into the same --out between two partial runs: the sidecars recorded no fingerprint and
    the same checkpoint path, so evaluate mixed the two heads' slides silently."""
    import hashlib

    import torch

    from wsi_milssl.errors import EvaluationError
    from wsi_milssl.mil.checkpoint import resolve_checkpoint_path, save_checkpoint

    run = tmp_path / "run"
    shutil.copytree(head, run)
    path = resolve_checkpoint_path(run)
    for i in range(2):
        _file(tmp_path / f"only{i}.h5", f"t{i}", seed=i)
    out = tmp_path / "hm"
    assert _heatmap(tmp_path / "only0.h5", run, out) == 0
    before = path.read_bytes()
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ckpt["model"] = {k: v + 1.0 if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    ckpt.pop("format", None)
    save_checkpoint(ckpt, path)  # "retrained": other weights, the same file name
    assert _heatmap(tmp_path / "only1.h5", run, out) == 0
    with pytest.raises(EvaluationError) as exc:
        _evaluate_normals(out, tmp_path, ["t0", "t1"])
    message = str(exc.value)
    assert "its slides were predicted by 2 different heatmap runs" in message
    assert "What differs: slides t1 against slides t0: checkpoint file contents differ" in message
    sides = {s: json.loads((out / f"{s}_probs.json").read_text()) for s in ("t0", "t1")}
    assert sides["t0"]["checkpoint"] == sides["t1"]["checkpoint"] == str(path)
    assert sides["t0"]["checkpoint_sha256"] == hashlib.sha256(before).hexdigest()
    assert sides["t1"]["checkpoint_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sides["t0"]["fingerprint"] and sides["t0"]["fingerprint"] != sides["t1"]["fingerprint"]


def test_one_head_named_two_ways_is_one_run(tmp_path, head, monkeypatch):
    """`--model run` and `--model /abs/run/best.pt` are the same head; a second partial run with other drawing
    settings (another fingerprint) is the same run too."""
    from wsi_milssl.mil.checkpoint import resolve_checkpoint_path

    for i in range(2):
        _file(tmp_path / f"only{i}" / f"t{i}.h5", f"t{i}", seed=i)
    out = tmp_path / "hm"
    monkeypatch.chdir(head.parent)
    assert _heatmap(tmp_path / "only0", head.name, out) == 0
    recorded = json.loads((out / "heatmap_config.json").read_text())["checkpoint"]  # absolute (review CO)
    assert recorded == str(resolve_checkpoint_path(head).resolve())
    assert _heatmap(tmp_path / "only1", resolve_checkpoint_path(head).resolve(), out, "--colormap", "magma") == 0
    result = _evaluate_normals(out, tmp_path, ["t0", "t1"])
    assert result.metrics["n_slides"] == 2
    assert "describes a later heatmap run" not in (tmp_path / "eval" / "report.html").read_text()
    sides = {s: json.loads((out / f"{s}_probs.json").read_text()) for s in ("t0", "t1")}
    # both recorded by the absolute path (review CN: the first was recorded as typed, relative)
    assert sides["t0"]["checkpoint"] == sides["t1"]["checkpoint"] == str(resolve_checkpoint_path(head).resolve())
    assert sides["t0"]["checkpoint_sha256"] == sides["t1"]["checkpoint_sha256"]


def test_a_later_partial_feature_run_keeps_the_failed_row_of_an_earlier_one(tmp_path, head):
    """heatmap_status.csv held only the latest call's slides, so a partial run erased t1's 'failed' row and
    evaluate, finding neither files nor a failure for it, evaluated t0 alone."""
    from wsi_milssl.errors import EvaluationError

    feats = tmp_path / "feats"
    _file(feats / "t0.h5", "t0", seed=0)
    rng = np.random.default_rng(1)
    ys, xs = np.mgrid[0:6, 0:6]
    write_feature_file(feats / "t1.h5", features=rng.normal(size=(36, 16)).astype(np.float32),  # another width
                       coords=np.stack([xs.ravel() * 512, ys.ravel() * 512], axis=1),
                       attrs={"slide_stem": "t1", "slide_path": "", "mpp": 0.25, "dimensions_lv0": [4096, 4096],
                              "encoder": "resnet18", "target_mpp": 0.5, "patch_size_px": 256},
                       coords_attrs={"patch_size": 256}, features_attrs={"encoder": "resnet18"})
    out = tmp_path / "hm"
    assert _heatmap(feats, head, out) != 0
    assert _status(out)["t1"]["status"] == "failed"
    assert _heatmap(feats / "t0.h5", head, out) == 0  # t0 again, alone
    rows = _status(out)
    assert rows["t0"]["status"] == "ok" and rows["t1"]["status"] == "failed"
    assert list(rows) == ["t0", "t1"]
    with pytest.raises(EvaluationError, match=r"the heatmap stage failed on labelled slides t1 \("):
        _evaluate_normals(out, tmp_path, ["t0", "t1"])


def test_a_head_without_a_checkpoint_file_predicts_and_records_none(tmp_path, head):
    """A FeatureHead object built in Python (no file behind it) is accepted; review CP: recording the checkpoint by
    its absolute path raised a TypeError for it (before, the string "None" was recorded)."""
    import dataclasses

    from wsi_milssl.inference.feature_maps import load_feature_head, make_feature_heatmaps
    from wsi_milssl.mil.checkpoint import resolve_checkpoint_path

    _file(tmp_path / "feats" / "t0.h5", "t0")
    memory = dataclasses.replace(load_feature_head(resolve_checkpoint_path(head)), checkpoint_path=None)
    assert make_feature_heatmaps([tmp_path / "feats" / "t0.h5"], memory, tmp_path / "hm").ok
    assert json.loads((tmp_path / "hm" / "heatmap_config.json").read_text())["checkpoint"] is None
    assert json.loads((tmp_path / "hm" / "t0_probs.json").read_text())["checkpoint"] is None


def test_options_that_change_nothing_with_features_are_said(tmp_path, head, caplog):
    """Review DB: --workers, --decode, --min-tissue (for patches read from slides) and a --slide-mpp that the
    file's own record overrides were accepted with --features without a word."""
    import logging

    feats = _file(tmp_path / "f" / "s9.h5", "s9")
    with caplog.at_level(logging.WARNING):
        assert main(["heatmap", "--features", str(feats), "--model", str(head), "--out", str(tmp_path / "out"),
                     "--workers", "3", "--min-tissue", "0.9", "--slide-mpp", "0.5", "--thumbnail-px", "64"]) == 0
    assert ("--workers, --min-tissue: for patches read from slides or stores; with --features (the patches are "
            "already embedded) they change nothing.") in caplog.text
    assert (f"{feats}: the file records level-0 0.25 µm/px (the slide's when its patches were cut), not the 0.5 "
            "µm/px given (--slide-mpp, or the slide's metadata): the file's is used.") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["heatmap", "--features", str(feats), "--model", str(head), "--out", str(tmp_path / "out2"),
                     "--thumbnail-px", "64"]) == 0
    assert "change nothing" not in caplog.text and "the file's is used" not in caplog.text


def test_a_feature_file_named_twice_is_mapped_once(tmp_path, head):
    """Review DU: `heatmap --features DIR DIR/x.h5` failed that slide, naming the same path twice."""
    feats = _file(tmp_path / "f" / "s7.h5", "s7")
    assert main(["heatmap", "--features", str(feats.parent), str(feats), "--model", str(head), "--out",
                 str(tmp_path / "out"), "--thumbnail-px", "64"]) == 0
    assert [r["status"] for r in _status(tmp_path / "out").values()] == ["ok"]


def test_a_slide_that_matches_no_feature_file_is_named(tmp_path, head, caplog):
    """Review EL, B2: a SLIDE argument named unlike every feature file was passed over without a word (and the
    feature file's own messages then said to pass the slide the user had passed)."""
    from wsi_milssl.inference.feature_maps import make_feature_heatmaps

    _file(tmp_path / "feats" / "t0.h5", "t0")
    with caplog.at_level("WARNING"):
        assert make_feature_heatmaps([tmp_path / "feats"], head, tmp_path / "hm",
                                     slides=[tmp_path / "slide-of-t0.tif"]).ok
    named = [r.getMessage() for r in caplog.records if "match no feature file" in r.getMessage()]
    assert len(named) == 1 and str(tmp_path / "slide-of-t0.tif") in named[0], caplog.text
    assert "matched to its feature file by name" in named[0] and "Fix:" in named[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        make_feature_heatmaps([tmp_path / "feats"], head, tmp_path / "hm2", slides=[])
    assert "match no feature file" not in caplog.text
