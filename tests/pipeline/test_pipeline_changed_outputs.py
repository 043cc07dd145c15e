"""Output files changed outside the pipeline since their stage wrote them (review AL, finding 2). After
``wsi-milssl train --resume OUT/model`` (which the README offers for a pipeline's model) replaced best.pt and
last.pt, ``run`` said train, heatmap and evaluate were up to date, and heatmap_config.json kept the old
checkpoint's SHA-256. Now the stages that read a changed file run again ("input changed: model/best.pt"),
while the stage that wrote it keeps it (nothing trained again, nothing renamed) and says so; likewise a heatmap
file replaced by hand makes evaluate run. Stamps of earlier versions, which record no file identities, stay up
to date."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from tinypipeline import FEATURE_BAGS, GENERATED_SLIDES, feature_bags
from wsi_milssl.cli import main
from wsi_milssl.pipeline import load_pipeline, run_pipeline
from wsi_milssl.pipeline import stamps

PIPELINE = """
[pipeline]
name = "changed"
""" + GENERATED_SLIDES + """[train]
mode = "images"
model = "resnet18"
epochs = 1
batch_size = 32
mu_ramp_epochs = 0
num_workers = 0
plots = false
[heatmap]
num_workers = 0
thumbnail_px = 64
[evaluate]
thumbnail_px = 64
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("changed")
    toml = root / "changed.toml"
    toml.write_text(PIPELINE)
    run_pipeline(load_pipeline(toml, out_dir=root / "out"))
    return toml, root / "out"


@pytest.fixture()
def out(finished, tmp_path):
    toml, base = finished
    shutil.copytree(base, tmp_path / "out", symlinks=True)  # (copy2: modification times kept)
    shutil.copy(toml, tmp_path / "changed.toml")
    return tmp_path / "out"


def _run(out) -> dict[str, tuple[str, str, str]]:
    spec = load_pipeline(out.parent / "changed.toml", out_dir=out)
    return {o.stage: (o.status, o.reason, o.summary) for o in run_pipeline(spec)}


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_model_resumed_by_train_is_kept_and_heatmap_and_evaluate_run_again(out, caplog, capsys):
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}
    names = ("best.pt", "last.pt")
    old = {name: _sha256(out / "model" / name) for name in names}
    assert main(["train", "--resume", str(out / "model"), "--epochs", "2"]) == 0
    resumed = {name: _sha256(out / "model" / name) for name in names}
    # last.pt always changes; best.pt when the second epoch scores better on validation (it may not)
    changed = ", ".join(f"model/{name}" for name in names if resumed[name] != old[name])
    assert changed.endswith("model/last.pt")
    capsys.readouterr()
    assert main(["run", str(out.parent / "changed.toml"), "--out", str(out), "--until", "train"]) == 0
    assert (f"[train] skipped (up to date; kept: {changed} changed outside the pipeline (train "
            "--resume?))") in capsys.readouterr().out
    outcomes = _run(out)
    assert [outcomes[s][0] for s in ("synth", "tile", "label", "train")] == ["skipped"] * 4
    # train keeps the resumed model, and its line says that its files changed outside the pipeline
    assert outcomes["train"][2] == f"up to date; kept: {changed} changed outside the pipeline (train --resume?)"
    assert f"train: {changed} changed since the pipeline wrote " in caplog.text and "(train --resume?)" in caplog.text
    assert {name: _sha256(out / "model" / name) for name in resumed} == resumed
    assert not list(out.glob("model.replaced-*"))
    assert outcomes["heatmap"][:2] == ("ran", f"input changed: {changed}")
    assert outcomes["evaluate"][0] == "ran"
    config = json.loads((out / "heatmaps" / "test" / "heatmap_config.json").read_text())
    assert config["checkpoint_sha256"] == resumed["best.pt"]
    # then everything is up to date, without the note
    again = _run(out)
    assert {s for s, _, _ in again.values()} == {"skipped"} and again["train"][2] == "up to date"


def test_a_model_resumed_beyond_the_pipelines_epochs_is_kept_when_train_runs_again(out):
    """After ``train --resume OUT/model --epochs 2`` (the pipeline says 1), a change that makes the train stage run
    (here label, run again) stopped every run: 'last.pt holds 2 trained epochs, more than the 1 asked for' (review
    AS, finding 1). The resumed run is now read back as finished."""
    assert main(["train", "--resume", str(out / "model"), "--epochs", "2"]) == 0
    resumed = _sha256(out / "model" / "best.pt")
    run_pipeline(load_pipeline(out.parent / "changed.toml", out_dir=out), force={"label"}, until="label")
    outcomes = {stage: (status, reason) for stage, (status, reason, _) in _run(out).items()}
    assert outcomes["train"] == ("ran", "the label stage ran since its last run")
    assert _sha256(out / "model" / "best.pt") == resumed and not list(out.glob("model.replaced-*"))
    assert outcomes["evaluate"][0] == "ran"
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}


def test_a_deleted_last_pt_trains_again_and_keeps_the_earlier_model_aside(out, caplog):
    """Deleting last.pt (twice best.pt's size) trained from scratch and deleted best.pt and the metrics of the
    run (review AS, finding 7): they are now kept in model.replaced-<time>."""
    best = _sha256(out / "model" / "best.pt")
    (out / "model" / "last.pt").unlink()
    outcomes = _run(out)
    assert outcomes["train"][:2] == ("ran", f"output missing: {out / 'model' / 'last.pt'}")
    (aside,) = out.glob("model.replaced-*")
    assert _sha256(aside / "best.pt") == best and (aside / "metrics.jsonl").is_file()
    assert "lacks the last.pt a run continues from" in caplog.text and "removed" not in caplog.text
    assert (out / "model" / "last.pt").is_file()


def test_an_edited_annotation_of_generated_slides_makes_the_stages_after_synth_run(out):
    """In a pipeline of generated slides, an annotation corrected by hand in OUT/slides was ignored: every stage
    stayed up to date while evaluate, when forced, read the new file (review AS, finding 2)."""
    xml = next((out / "slides" / "test").glob("*.xml"))
    xml.write_text(xml.read_text().replace('Order="0" X="', 'Order="0" X="1'))  # a vertex moved
    outcomes = _run(out)
    assert outcomes["synth"][0] == "skipped" and "kept: slides/test/" in outcomes["synth"][2]
    assert outcomes["tile"][:2] == ("ran", f"input changed: slides/test/{xml.name}")
    assert outcomes["evaluate"][0] == "ran"
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}


def test_stamps_of_a_setting_spelled_as_an_int_stay_up_to_date(out):
    """Before configs made ints of float settings floats (0950977), ``magnification = 10`` was recorded as 10, and
    its digest differs from 10.0's: every stage of such a pipeline would run again after the upgrade (hours on a
    real cohort). Stamps that recorded the same values (10 == 10.0) keep their digests and stay up to date."""
    from wsi_milssl.pipeline import digests

    spec = load_pipeline(out.parent / "changed.toml", out_dir=out)
    state = out / ".pipeline"
    chain = {}
    for stage in ("synth", "tile", "label", "train", "heatmap", "evaluate"):  # the stamps an int spelling wrote
        settings, inputs = digests.digest_parts(spec, stage, chain, state, form="all")
        stamp = json.loads((state / f"{stage}.json").read_text())
        if stage == "tile":
            assert settings["section"]["magnification"] == 10.0
            settings["section"]["magnification"] = 10
            stamp["settings"]["tile.magnification"] = 10
        chain[stage] = stamp["digest"] = stamps.stamp_digest(settings, inputs)
        stamp["inputs"] = json.loads(json.dumps(inputs))
        (state / f"{stage}.json").write_text(json.dumps(stamp))
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}
    assert json.loads((state / "tile.json").read_text())["digest"] == chain["tile"]


def test_a_deleted_overlay_is_drawn_again(out):
    """The heatmap stage recorded four files per slide, so a deleted overlay PNG or viewer file stayed missing
    while every stage said up to date (review AS, finding 9)."""
    png = out / "heatmaps" / "test" / "synth_000_heatmap.png"
    png.unlink()
    outcomes = _run(out)
    assert outcomes["heatmap"][:2] == ("ran", f"output missing: {png}") and "1 drawn again" in outcomes["heatmap"][2]
    assert png.is_file()


def test_a_heatmap_file_replaced_by_hand_makes_evaluate_run(out):
    probs = out / "heatmaps" / "test" / "synth_000_probs.npy"
    import numpy as np

    np.save(probs, np.load(probs) * 0.5)  # other probabilities, the same size
    outcomes = _run(out)
    assert outcomes["heatmap"][0] == "skipped"
    assert outcomes["heatmap"][2] == ("up to date; kept: heatmaps/test/synth_000_probs.npy changed outside the "
                                      "pipeline (heatmap run by hand?)")
    assert outcomes["evaluate"][:2] == ("ran", "input changed: heatmaps/test/synth_000_probs.npy")
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}


def test_a_copy_without_modification_times_is_up_to_date(out, tmp_path):
    """``cp -r`` gives every file a new modification time: the model and heatmap files are then compared by
    their bytes, so nothing runs again."""
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=True, copy_function=shutil.copyfile)
    for path in (copy / "model" / "best.pt", copy / "heatmaps" / "test" / "synth_000_probs.npy"):
        assert path.stat().st_mtime_ns != (out / path.relative_to(copy)).stat().st_mtime_ns
    outcomes = _run(copy)
    assert {s for s, _, _ in outcomes.values()} == {"skipped"}
    assert outcomes["train"][2] == "up to date" and outcomes["heatmap"][2] == "up to date"


def test_stores_changed_in_place_are_not_checked(out):
    """label writes the instance labels into tile's stores after tile's stamp, and a folder copied without its
    modification times (``cp -r``) would look changed: only the model and heatmap files are checked, so tile
    says nothing and label and train stay up to date."""
    store = out / "stores" / "train" / "synth_000.h5"
    st = store.stat()
    os.utime(store, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert json.loads((out / ".pipeline" / "label.json").read_text())[stamps.INPUT_IDS] == {}
    outcomes = _run(out)
    assert {s for s, _, _ in outcomes.values()} == {"skipped"}
    assert outcomes["tile"][2] == "up to date" and outcomes["label"][2] == "up to date"


def test_stamps_without_file_identities_stay_up_to_date(out):
    for path in (out / ".pipeline").glob("*.json"):
        stamp = json.loads(path.read_text())
        stamp.pop(stamps.OUTPUT_IDS)
        stamp.pop(stamps.INPUT_IDS)
        path.write_text(json.dumps(stamp))
    best = out / "model" / "best.pt"
    st = best.stat()
    os.utime(best, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    outcomes = _run(out)
    assert {s for s, _, _ in outcomes.values()} == {"skipped"} and outcomes["train"][2] == "up to date"


FEATURES = """
[pipeline]
name = "feat"
""" + FEATURE_BAGS


def test_a_resumed_feature_model_makes_evaluate_run_again(tmp_path):
    """In a feature pipeline evaluate reads the model itself (no heatmap stage)."""
    feature_bags(tmp_path / "bags" / "train", 8, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    (tmp_path / "p.toml").write_text(FEATURES)
    out = tmp_path / "out"

    def run():
        return {o.stage: (o.status, o.reason, o.summary)
                for o in run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=out))}

    run()
    assert main(["train", "--resume", str(out / "model"), "--epochs", "4"]) == 0
    outcomes = run()
    assert outcomes["train"][0] == "skipped" and "kept: model/best.pt" in outcomes["train"][2]
    assert outcomes["evaluate"][0] == "ran" and outcomes["evaluate"][1].startswith("input changed: model/")
    assert {s for s, _, _ in run().values()} == {"skipped"}


def test_an_evaluation_written_by_hand_into_out_runs_evaluate_again(tmp_path):
    """Review BG: `evaluate --out OUT/evaluation` of another model's predictions (or other settings) left the
    pipeline's report holding them while run said every stage was up to date; no later stage reads the
    evaluation, so it is written again, not kept. A copy of the run without modification times stays up to date."""
    feature_bags(tmp_path / "bags" / "train", 8, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    (tmp_path / "p.toml").write_text(FEATURES)

    def run(out):
        return {o.stage: (o.status, o.reason, o.summary)
                for o in run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=out))}

    out = tmp_path / "out"
    run(out)
    metrics = out / "evaluation" / "metrics.json"
    ours = metrics.read_text()
    metrics.write_text(ours.replace('"bag_auc": ', '"bag_auc": 0.0, "was": '))  # another evaluation's figures
    outcomes = run(out)
    assert outcomes["evaluate"][:2] == ("ran", "output changed outside the pipeline: evaluation/metrics.json "
                                               "(evaluate run by hand?)")
    assert metrics.read_text() == ours
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, copy_function=shutil.copyfile)  # every file a new modification time
    assert {s for s, _, _ in run(copy).values()} == {"skipped"}
    # a stamp of an earlier version holds no checksums: a copy without times runs evaluate again, and says why
    stamp = copy / ".pipeline" / "evaluate.json"
    recorded = json.loads(stamp.read_text())
    recorded["output_ids"] = {k: v[:2] for k, v in recorded["output_ids"].items()}
    stamp.write_text(json.dumps(recorded))
    older = tmp_path / "older"
    shutil.copytree(copy, older, copy_function=shutil.copyfile)
    outcomes = run(older)
    assert outcomes["evaluate"][0] == "ran" and outcomes["evaluate"][1].startswith(
        "output changed, or copied without its modification times: evaluation/")
    assert outcomes["evaluate"][1].endswith("(its stamp, of an earlier version, holds no checksums to tell which)")


def test_a_model_file_cut_short_is_set_aside_and_trained_again(out, caplog):
    """Review EM, B1: a best.pt cut short was kept as a hand edit ("train --resume?"), and every later run failed
    on it with fixes for the hand commands. A changed output that does not read is set aside now, and its stage
    runs again."""
    best = out / "model" / "best.pt"
    whole = best.read_bytes()
    best.write_bytes(whole[:1000])
    outcomes = _run(out)
    status, reason, _ = outcomes["train"]
    (aside,) = out.glob("model.replaced-*")
    assert status == "ran" and reason.startswith(f"output damaged: {best} (") and reason.endswith(
        f"the model folder set aside as {aside.name}"), reason
    # the whole folder: a best.pt of an earlier epoch than the last cannot be made again without training (review EN)
    assert (aside / "best.pt").read_bytes() == whole[:1000] and not (aside / "pipeline_run.json").exists()
    import torch

    again, before = torch.load(best, weights_only=True), torch.load(aside / "last.pt", weights_only=True)
    assert all(torch.equal(again["model"][k], v) for k, v in before["model"].items())  # trained again: the same
    assert "Fix: pass RUN_DIR" not in reason, reason
    assert outcomes["evaluate"][0] == "ran"
    assert "holds a damaged best.pt" in caplog.text and "so the model trains again" in caplog.text
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}


@pytest.mark.parametrize("name, cut", [("synth_000_patches.csv", "at a line's end"),
                                       ("synth_000_patches.csv", "inside a line"),
                                       ("synth_000_detections.csv", "inside a line")])
def test_a_heatmap_table_cut_short_is_set_aside_and_made_again(out, name, cut):
    """Review EM, B1: a `_patches.csv` cut short (at a line's end: its rows no longer the sidecar's count) was
    kept as a hand run's, and every evaluate failed on it. Review EU, C5: a table no sidecar counts (the
    detections), cut inside a line, is told by its missing final newline."""
    table = out / "heatmaps" / "test" / name
    whole = table.read_text()
    lines = whole.splitlines(keepends=True)
    table.write_text("".join(lines[:5]) if cut == "at a line's end" else whole[: len(whole) // 2 + 3])
    outcomes = _run(out)
    status, reason, _ = outcomes["heatmap"]
    assert status == "ran" and reason.startswith(f"output damaged: {table} ("), reason
    assert table.read_text() == whole
    assert outcomes["evaluate"][0] == "ran"
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}


def test_more_epochs_continue_the_finished_run_as_train_resume_does(out, tmp_path, caplog):
    """Review EM, B3: raising [train] epochs trained from scratch, though with a constant learning rate the first
    epochs are the finished run's (hours at CAMELYON16's scale). The run continues from its last.pt now, and ends
    as a run of that many epochs from scratch ends; the shorter run is kept as a copy and comes back with its epochs
    (review EN, B3); a learning-rate schedule trains again."""
    import torch

    one_epoch = _sha256(out / "model" / "best.pt")
    spec = load_pipeline(out.parent / "changed.toml", out_dir=out, overrides=["train.epochs=2"])
    outcomes = {o.stage: o for o in run_pipeline(spec)}
    assert outcomes["train"].status == "ran" and "settings changed" in outcomes["train"].reason
    assert "epochs went up from 1 to 2" in caplog.text
    (copy,) = out.glob("model.replaced-*")
    assert _sha256(copy / "best.pt") == one_epoch
    # continued, not trained again (review EU, C5: the weights are the same either way): epoch 1's line, with its
    # wall time, is the shorter run's
    first = (copy / "metrics.jsonl").read_text().splitlines()
    assert len(first) == 1 and (out / "model" / "metrics.jsonl").read_text().splitlines()[0] == first[0]
    fresh = tmp_path / "fresh"
    run_pipeline(load_pipeline(out.parent / "changed.toml", out_dir=fresh, overrides=["train.epochs=2"]))
    continued, scratch = (torch.load(d / "model" / "last.pt", weights_only=True) for d in (out, fresh))
    assert continued["epoch"] == scratch["epoch"] == 2
    for name, tensor in scratch["model"].items():
        assert torch.equal(continued["model"][name], tensor), name
    two_epochs = _sha256(out / "model" / "last.pt")
    back = {o.stage: o for o in _run_all(out)}  # the pipeline's 1 epoch again: the run of 1 epoch is back
    assert back["train"].status == "ran" and _sha256(out / "model" / "best.pt") == one_epoch
    caplog.clear()  # and 2 again: the finished run of 2 epochs is back, not continued again (review EU, C3)
    run_pipeline(load_pipeline(out.parent / "changed.toml", out_dir=out, overrides=["train.epochs=2"]), until="train")
    assert "epochs went up" not in caplog.text and "is back from" in caplog.text
    assert _sha256(out / "model" / "last.pt") == two_epochs
    assert len(list(out.glob("model.replaced-*"))) == 1  # the 1-epoch run, aside again; no copy more
    caplog.clear()
    spec = load_pipeline(out.parent / "changed.toml", out_dir=out, overrides=["train.epochs=2",
                                                                              'train.scheduler="cosine"'])
    run_pipeline(spec, until="train")
    assert "epochs went up" not in caplog.text


def test_a_run_continued_by_hand_past_the_new_epochs_is_not_taken_as_them(out, caplog):
    """Review EN, A1: a pipeline run of 1 epoch continued by hand to 3 (`train --resume --epochs 3`), then run with
    epochs = 2: the 3-epoch model was kept as the 2-epoch run; it trains a run of 2 epochs now."""
    import torch

    assert main(["train", "--resume", str(out / "model"), "--epochs", "3"]) == 0
    run_pipeline(load_pipeline(out.parent / "changed.toml", out_dir=out, overrides=["train.epochs=2"]),
                 until="train")
    assert "epochs went up" not in caplog.text
    assert torch.load(out / "model" / "last.pt", weights_only=True)["epoch"] == 2


def _run_all(out):
    return run_pipeline(load_pipeline(out.parent / "changed.toml", out_dir=out))


def test_a_checkpoint_of_another_run_copied_in_is_refused(out):
    """Review EM, B2: a best.pt trained with other settings, copied into OUT/model, was kept as a `train --resume`
    ("train --resume?") and its heatmaps and report made under this pipeline's settings."""
    import torch

    from wsi_milssl.errors import ConfigError

    best = out / "model" / "best.pt"
    ckpt = torch.load(best, weights_only=True)
    ckpt["config"] = {**ckpt["config"], "lr": ckpt["config"]["lr"] * 10, "seed": 5}
    torch.save(ckpt, best)
    with pytest.raises(ConfigError) as err:
        _run(out)
    message = str(err.value)
    assert message.startswith(f"{best}: trained with other settings or data than the pipeline's run in "
                              f"{best.parent} (")
    assert "seed: 5 -> 0" in message and "--force train" in message


def test_a_model_folder_without_its_record_says_so_when_set_aside(out, caplog):
    """Review EM, C2: a model folder whose pipeline_run.json was deleted was set aside at the next train as "a
    training run started with other settings, data or labels", which it was not."""
    (out / "model" / "pipeline_run.json").unlink()
    # a change to the test set alone: the train stage runs, and kept the model while the record was there
    outcomes = run_pipeline(load_pipeline(out.parent / "changed.toml", out_dir=out,
                                          overrides=["synth.test.seed=1001"]), until="train")
    assert [o.status for o in outcomes if o.stage == "train"] == ["ran"]
    assert "holds a training run without a readable pipeline_run.json" in caplog.text
    assert "started with other settings" not in caplog.text


@pytest.mark.parametrize("hand", ["tile", "label"])
def test_stores_tiled_or_labelled_by_hand_with_other_settings_are_made_again(out, capsys, hand):
    """Review EV, A1: `tile --overwrite` (or `label`) by hand into OUT/stores with other settings went unnoticed:
    every stage was up to date, the resolved pipeline named settings that did not make the stores, and heatmap and
    evaluate read them. The stores' recorded settings are compared now: tile (or label) runs again."""
    test_stores = out / "stores" / "test"
    slides = out / "slides" / "test"
    from wsi_milssl.store import open_store

    def contents():
        out = {}
        for path in sorted(test_stores.glob("*.h5")):
            with open_store(path) as store:
                out[path.name] = (len(store), store.attrs.get("label_config_hash"))
        return out

    before = contents()
    untouched = (test_stores / "synth_001.h5").stat()
    if hand == "tile":  # one slide's store (review EY: one store tiled by hand re-tiled the whole set)
        assert main(["tile", str(slides / "synth_000.tif"), "--out", str(test_stores), "--overwrite",
                     "--magnification", "10", "--patch-size", "32", "--entropy-threshold", "4", "--min-tissue",
                     "0.95"]) == 0
    else:
        assert main(["label", str(test_stores / "synth_000.h5"), "--annotations", str(slides), "--labels",
                     str(slides / "labels.csv"), "--out", str(out / "labels" / "test"), "--positive-fraction",
                     "0.9"]) == 0
    capsys.readouterr()
    outcomes = _run(out)
    status, reason, _ = outcomes[hand]
    assert status == "ran" and reason.startswith("output changed outside the pipeline: 1 store(s) of the test set "), \
        reason
    if hand == "tile":
        now = (test_stores / "synth_001.h5").stat()  # the store tiled by hand was tiled again alone
        assert (now.st_ino, now.st_mtime_ns) == (untouched.st_ino, untouched.st_mtime_ns)
    assert all(outcomes[s][0] == "ran" for s in ("heatmap", "evaluate"))
    assert contents() == before  # the pipeline's stores again: as many patches, labelled with its settings
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}


def test_stores_found_unchanged_are_not_opened_again(out, monkeypatch):
    """Review EZ: every run opened every store twice to compare its settings (two thirds of a run with nothing to do
    at 400 slides). A store found as its stage made it is recorded by inode, size and time, and not opened again."""
    import wsi_milssl.tiling as tiling

    from wsi_milssl.pipeline.runner import CHECKED_STORES_FILENAME

    checked = []
    real = tiling.check_existing_store
    monkeypatch.setattr(tiling, "check_existing_store",
                        lambda path, *a, **k: checked.append(path) or real(path, *a, **k))
    (out / ".pipeline" / CHECKED_STORES_FILENAME).unlink(missing_ok=True)  # (as a run of an earlier version left it)
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}
    n_stores = len(list((out / "stores").glob("*/*.h5")))
    assert len(checked) == n_stores > 0
    record = json.loads((out / ".pipeline" / CHECKED_STORES_FILENAME).read_text())
    assert len(record["tile"]["stores"]) == len(record["label"]["stores"]) == n_stores
    checked.clear()
    assert {s for s, _, _ in _run(out).values()} == {"skipped"}
    assert checked == []
    # stores tile and label have just made are recorded as they finish: the next run opens none (review FA)
    run_pipeline(load_pipeline(out.parent / "changed.toml", out_dir=out), force=["tile"], until="label")
    checked.clear()
    outcomes = _run(out)
    assert outcomes["tile"][0] == outcomes["label"][0] == "skipped" and checked == []


def test_a_zarr_stores_identity_covers_its_attributes_file(tmp_path):
    """Review FA, A1: `cp -r` of another run's Zarr store into the folder rewrote its files in place and left the
    folder's inode, size and time: the cache took it for the checked store. Its root zarr.json counts too."""
    from wsi_milssl.pipeline.runner import _identity

    store = tmp_path / "s.zarr"
    store.mkdir()
    (store / "zarr.json").write_text('{"attributes": {"config_hash": "a"}}')
    before = _identity(store)
    folder = os.stat(store)
    (tmp_path / "other.json").write_text('{"attributes": {"config_hash": "b"}}')
    shutil.copy(tmp_path / "other.json", store / "zarr.json")  # as `cp -r OTHER/s.zarr OUT/stores/train/` writes it
    assert (os.stat(store).st_ino, os.stat(store).st_mtime_ns) == (folder.st_ino, folder.st_mtime_ns)
    assert _identity(store) != before and _identity(store) is not None


def test_a_feature_file_where_a_store_goes_is_refused_not_removed(out):
    """Review FA, A2: a feature file at OUT/stores/<set>/<slide>.h5 was taken for an unreadable store, removed and
    tiled over; tile never replaces a feature file."""
    import numpy as np

    from wsi_milssl.errors import FeatureFileGivenError
    from wsi_milssl.features import write_feature_file

    path = out / "stores" / "train" / "synth_001.h5"
    path.unlink()
    write_feature_file(path, features=np.zeros((2, 4), np.float32), coords=np.array([[0, 0], [32, 0]]),
                       attrs={"slide_stem": "synth_001"}, coords_attrs={}, features_attrs={})
    kept = _sha256(path)
    with pytest.raises(FeatureFileGivenError):
        _run(out)
    assert _sha256(path) == kept
