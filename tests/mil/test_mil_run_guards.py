"""Training refuses what would silently give a wrong or useless run, before it trains: a validation set on
which the selection metric is never defined (no best.pt), a resume whose training or validation data
changed, an incomplete last.pt, fewer --epochs than trained; a fresh run clears an earlier run's files;
an empty store is no bag; ResNet18 never trains on a batch of one patch (BatchNorm)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import h5py
import numpy as np
import pytest
import torch

from milcsv import make_mil_csv
from wsi_milssl.cli import main
from wsi_milssl.config.train import TrainConfig
from wsi_milssl.distributed import DistContext, rank_share
from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.mil import fit, read_labels_csv, read_mil_csv, read_patch_stores
from wsi_milssl.store import write_arrays

FAST = ["--threads", "1", "--no-plots"]


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


def _features(**kw) -> TrainConfig:
    return TrainConfig(**{"mode": "features", "epochs": 2, "threads": 1, "plots": False, **kw})


# -- 1: a validation set that can never choose best.pt ---------------------------------------------------------

def test_one_class_validation_is_refused_before_training(tmp_path, image_store_factory, capsys):
    paths, labels = image_store_factory(tmp_path / "stores", n_bags=4, n_patches=16)
    val_paths, val_labels = image_store_factory(tmp_path / "val", n_bags=4, n_patches=16, seed=1)
    run = tmp_path / "run"
    normal_only = [str(p) for p in val_paths[::2]]  # bags 0 and 2: label 0
    capsys.readouterr()
    code = main(["train", *map(str, paths), "--labels", str(labels), "--val", *normal_only, "--val-labels",
                 str(val_labels), "--out", str(run), "--epochs", "1", *FAST])
    lines = _error_lines(capsys.readouterr().err)
    assert code == 1 and len(lines) == 1
    assert "the 2 validation slides (bags) are all normal (label 0): bag AUC cannot be computed" in lines[0]
    assert "--select-metric bag_nll" in lines[0] and "[data].val_fraction" in lines[0]
    assert not run.exists() or not any(run.iterdir())  # refused before anything was trained or written


def test_one_class_validation_selects_best_by_bag_nll(tmp_path, mil_csv, mil_csv_val):
    train = read_mil_csv(mil_csv)
    val = read_mil_csv(mil_csv_val)
    positive_only = val.subset_bags(np.flatnonzero(val.bag_labels == 1))
    with pytest.raises(ConfigError, match=r"all tumour \(label 1\): bag AUC cannot be computed") as refused:
        fit(train, config=_features(), out_dir=tmp_path / "auc", val=positive_only)
    # named by the validation bags themselves (a subset's source is its whole file, or in a pipeline's feature
    # mode the first training feature files)
    assert str(refused.value).startswith(f"validation slides {positive_only.bag_names[0]}, ")
    result = fit(train, config=_features(select_metric="bag_nll"), out_dir=tmp_path / "nll", val=positive_only)
    assert result.best_epoch is not None and (tmp_path / "nll" / "best.pt").is_file()


def test_instance_auc_needs_labelled_validation_of_both_classes(tmp_path, mil_csv, mil_csv_val):
    train = read_mil_csv(mil_csv)
    val = read_mil_csv(mil_csv_val)
    config = _features(select_metric="instance_auc")
    with pytest.raises(ConfigError, match=r"no instance labels .*instance AUC cannot be computed.*wsi-milssl label"):
        fit(train, config=config, out_dir=tmp_path / "a", val=dataclasses.replace(val, instance_labels=None))
    normal = val.subset_bags(np.flatnonzero(val.bag_labels == 0))
    with pytest.raises(ConfigError, match=r"every instance \(patch\) of the validation slides is normal"):
        fit(train, config=config, out_dir=tmp_path / "b", val=normal)
    # without a run folder (the benchmark scores every epoch itself) there is no best.pt to choose
    assert fit(train, config=config, val=normal).best_epoch is None


# -- 2: no training batch of one instance with BatchNorm -------------------------------------------------------

def test_resnet_never_trains_on_a_last_batch_of_one_patch(tmp_path, image_store_factory):
    paths, labels = image_store_factory(tmp_path / "stores", n_bags=2, n_patches=24)  # 48 patches
    assert main(["train", *map(str, paths), "--labels", str(labels), "--out", str(tmp_path / "run"),
                 "--epochs", "1", "--batch-size", "47", "--workers", "0", *FAST]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1  # the lone 48th patch was left out of the epoch


@pytest.mark.parametrize("n, batch, world", [(1029, 257, 1), (1029, 171, 2), (1031, 171, 2), (7, 2, 3), (8, 4, 2)])
def test_no_rank_gets_a_batch_of_one(n, batch, world):
    from wsi_milssl.mil.loader import without_lone_last

    order = without_lone_last(torch.randperm(n, generator=torch.Generator().manual_seed(0)), batch_size=batch,
                              world_size=world)
    assert n - order.numel() < 2 * world
    shares = [rank_share(order, batch_size=batch, ctx=DistContext(rank=r, world_size=world)) for r in range(world)]
    steps = {-(-int(s.numel()) // batch) for s in shares}
    assert len(steps) == 1  # every rank takes the same steps
    for share in shares:
        assert share.numel() % batch != 1


# -- 3: resume checks all of the training data and the validation data -----------------------------------------

def _resume_error(run, capsys, epochs="2"):
    capsys.readouterr()
    code = main(["train", "--resume", str(run), "--epochs", epochs])
    lines = _error_lines(capsys.readouterr().err)
    assert code == 1 and len(lines) == 1
    return lines[0]


def test_resume_notices_changed_validation_data(tmp_path, mil_csv, mil_csv_val, capsys):
    val = tmp_path / "val.csv"
    shutil.copy(mil_csv_val, val)
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--val", str(val), "--out", str(run), "--epochs", "1", *FAST]) == 0
    rows = val.read_text().splitlines()
    label, bag, first, *rest = rows[-1].split(",")
    rows[-1] = ",".join([label, bag, str(float(first) + 1.0), *rest])
    val.write_text("\n".join(rows) + "\n")
    line = _resume_error(run, capsys)
    assert "cannot resume with different settings or data (the validation data changed" in line


def test_resume_notices_a_change_after_the_first_4096_training_rows(tmp_path, capsys):
    data = make_mil_csv(tmp_path / "big.csv", n_bags=400)
    rows = data.read_text().splitlines()
    assert len(rows) > 4096 + 100
    run = tmp_path / "run"
    assert main(["train", str(data), "--out", str(run), "--epochs", "1", *FAST]) == 0
    label, bag, first, *rest = rows[-1].split(",")
    rows[-1] = ",".join([label, bag, str(float(first) + 1.0), *rest])
    data.write_text("\n".join(rows) + "\n")
    assert "the training data changed" in _resume_error(run, capsys)


def test_a_checkpoint_without_data_digests_still_resumes(tmp_path, mil_csv, mil_csv_val, caplog):
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--val", str(mil_csv_val), "--out", str(run), "--epochs", "1", *FAST]) == 0
    ckpt = torch.load(run / "last.pt", weights_only=True)
    for key in ("data_digest", "val_data_digest"):
        del ckpt["config"][key]
    torch.save(ckpt, run / "last.pt")
    saved = json.loads((run / "config.json").read_text())
    for key in ("data_digest", "val_data_digest"):
        del saved[key]
    (run / "config.json").write_text(json.dumps(saved))
    with caplog.at_level(logging.INFO, logger="wsi_milssl.mil"):
        assert main(["train", "--resume", str(run), "--epochs", "2"]) == 0
    assert ("without a digest of all of the training data and the validation data: resuming without checking"
            in caplog.text)


def test_store_digest_covers_coordinates_but_not_instance_labels(tmp_path, image_store_factory):
    from wsi_milssl.mil.run_folder import data_digest

    paths, labels = image_store_factory(tmp_path / "stores", n_bags=2, n_patches=16)
    read = lambda: read_patch_stores(paths, read_labels_csv(labels))  # noqa: E731
    before = data_digest(read())
    write_arrays(paths[1], {"instance_label": np.ones(16, dtype=np.uint8)})  # `wsi-milssl label` again
    assert data_digest(read()) == before
    assert data_digest(read(), instance_labels=True) != before
    with h5py.File(paths[1], "r+") as f:  # a store replaced by another cut of its slide
        f["coords"][3] = f["coords"][3] + 1
    assert data_digest(read()) != before


# -- 4: a fresh run clears an earlier run's files ---------------------------------------------------------------

def test_fresh_run_removes_an_earlier_runs_best_and_metrics(tmp_path, mil_csv, mil_csv_val, caplog):
    first = tmp_path / "first"
    assert main(["train", str(mil_csv), "--val", str(mil_csv_val), "--out", str(first), "--epochs", "2"]) == 0
    folder = tmp_path / "sb"
    folder.mkdir()
    for name in ("best.pt", "config.json", "metrics.jsonl", "metrics.png"):
        shutil.copy(first / name, folder / name)
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(mil_csv), "--out", str(folder), "--epochs", "1", *FAST]) == 0
    assert not (folder / "best.pt").exists() and not (folder / "metrics.png").exists()
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 1
    assert "removed best.pt, metrics.jsonl, metrics.png of an earlier run" in caplog.text


def test_fit_from_python_refuses_a_folder_that_holds_a_run_as_the_cli_does(tmp_path, mil_csv):
    """Review AX, A1: ``fit`` called again (a notebook cell run twice with another setting) deleted the earlier
    run's last.pt and best.pt; only the command line refused. Now fit itself refuses, and resume continues."""
    train = read_mil_csv(mil_csv)
    run = tmp_path / "run"
    fit(train, config=_features(epochs=1), out_dir=run)
    last = (run / "last.pt").read_bytes()
    refused = r"already holds a run \(last.pt\); pass --resume .* \(resume=True from Python\)"
    with pytest.raises(ConfigError, match=refused):
        fit(train, config=_features(epochs=1, lr=0.01), out_dir=run)
    assert (run / "last.pt").read_bytes() == last
    assert len(fit(train, config=_features(epochs=2), out_dir=run, resume=True).history) == 2


# -- 5: a store without patches is no bag ----------------------------------------------------------------------

def test_an_empty_store_is_left_out_so_a_run_without_positives_is_refused(tmp_path, synth_dir, image_store_factory,
                                                                           capsys, caplog):
    tumour = synth_dir / "synth_000.tif"
    assert "synth_000,1" in (synth_dir / "labels.csv").read_text()
    assert main(["tile", str(tumour), "--out", str(tmp_path / "empty"), "--magnification", "10", "--patch-size",
                 "32", "--entropy-threshold", "7.99"]) == 0
    empty = tmp_path / "empty" / "synth_000.h5"
    paths, labels = image_store_factory(tmp_path / "stores", n_bags=4, n_patches=8)
    both = tmp_path / "labels.csv"
    both.write_text(labels.read_text() + "synth_000,1\n")
    negatives = [str(p) for p in paths[::2]]
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        code = main(["train", str(empty), *negatives, "--labels", str(both), "--out", str(tmp_path / "run"),
                     "--epochs", "1", *FAST])
    lines = _error_lines(capsys.readouterr().err)
    assert code == 1 and len(lines) == 1 and "no positive bag among the 2 training bags" in lines[0]
    assert f"{empty}: no patches" in caplog.text
    instances = read_patch_stores([empty, *paths], read_labels_csv(both))
    assert instances.n_bags == 4 and "synth_000" not in instances.bag_names
    assert instances.store_paths == [str(p) for p in paths]
    # review CS: errors about the whole set start with its source, which named the first store alone
    assert instances.source == f"{paths[0]}, {paths[1]}, {paths[2]} and 1 more"


# -- 6: an incomplete last.pt is one error line ----------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(mil_csv, tmp_path_factory):
    run = tmp_path_factory.mktemp("guards") / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--epochs", "2", *FAST]) == 0
    return run


def _copy_with(run, tmp_path, change):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    ckpt = torch.load(copy / "last.pt", weights_only=True)
    change(ckpt)
    torch.save(ckpt, copy / "last.pt")
    return copy


@pytest.mark.parametrize("key", ["pseudo_labels", "config", "model", "optimizer", "rng", "epoch", "step"])
def test_resume_from_a_last_pt_without_a_part(finished_run, tmp_path, capsys, key):
    copy = _copy_with(finished_run, tmp_path, lambda ckpt: ckpt.pop(key))
    line = _resume_error(copy, capsys, epochs="3")
    assert f"{copy / 'last.pt'}: " in line and f"'{key}'" in line and "missing" in line
    assert "The checkpoint is incomplete" in line


def test_resume_from_a_last_pt_with_damaged_pseudo_labels(finished_run, tmp_path, capsys):
    copy = _copy_with(finished_run, tmp_path, lambda ckpt: ckpt["pseudo_labels"].pop("targets"))
    line = _resume_error(copy, capsys, epochs="3")
    assert "cannot restore the run from it (KeyError" in line and "The checkpoint is incomplete" in line
    assert "without --resume into a new --out" in line  # how to go on, not how to load a model


# -- 7: fewer epochs than trained --------------------------------------------------------------------------------

def test_resume_with_fewer_epochs_than_trained_is_refused_and_keeps_config(finished_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    config = (copy / "config.json").read_text()
    line = _resume_error(copy, capsys, epochs="1")
    assert "holds 2 trained epochs, more than the 1 asked for (--epochs)" in line and "--epochs 2 or more" in line
    assert (copy / "config.json").read_text() == config
    assert main(["train", "--resume", str(copy), "--epochs", "2"]) == 0  # as many: nothing to train, no error


def test_a_checkpoint_error_is_raised_by_fit_too(finished_run, tmp_path, mil_csv):
    copy = _copy_with(finished_run, tmp_path, lambda ckpt: ckpt.pop("rng"))
    with pytest.raises(CheckpointError, match="'rng' is missing"):
        fit(read_mil_csv(mil_csv), config=_features(epochs=3), out_dir=copy, resume=True)


# -- 8: validation scores that are not finite ------------------------------------------------------------------

def _feature_bags(folder, names, *, extreme=None, seed=0):
    """One CLAM-like feature file per name (10 rows of 8 features; even bags positive, 3 shifted rows); the
    bag ``extreme`` gets a row of 3e38, finite in float32 but beyond what a model's sums can hold."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        feats = rng.normal(size=(10, 8)).astype(np.float32)
        feats[:3] += 2.0 * (i % 2 == 0)
        if name == extreme:
            feats[0] = 3e38
        with h5py.File(folder / f"{name}.h5", "w") as fh:
            fh["features"] = feats
            fh["coords"] = np.stack([np.arange(10) * 256, np.zeros(10)], 1).astype(np.int64)
    return "".join(f"{name},{int(i % 2 == 0)}\n" for i, name in enumerate(names))


def test_a_validation_bag_with_non_finite_scores_stops_training_naming_it(tmp_path, capsys):
    """Was evaluated on the finite rest: val_bag_auc and val_bag_accuracy (1/3 with 4 bags) of 3 bags, and best.pt
    chosen on them, without a word."""
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\n" + _feature_bags(tmp_path / "tr", [f"s{i}" for i in range(8)])
                      + _feature_bags(tmp_path / "va", ["v0", "v1", "v2", "v3"], extreme="v2", seed=1))
    run = tmp_path / "run"
    capsys.readouterr()
    code = main(["train", str(tmp_path / "tr"), "--labels", str(labels), "--val", str(tmp_path / "va"), "--out",
                 str(run), "--epochs", "2", "--warmup-epochs", "1", *FAST])
    lines = _error_lines(capsys.readouterr().err)
    assert code == 1 and len(lines) == 1, lines
    assert ("the model gives NaN or infinite probabilities for 1 of the 4 bags evaluated" in lines[0]
            and f"v2 ({(tmp_path / 'va' / 'v2.h5').resolve()})" in lines[0])
    assert "The model's weights are finite, so the inputs of those bags are the cause" in lines[0]
    assert "Fix: check those bags' inputs for extreme values" in lines[0] and "--lr" not in lines[0]
    assert not (run / "best.pt").exists() and not (run / "last.pt").exists()


@pytest.mark.parametrize("pooling", ["max", "mean"])
def test_evaluate_never_scores_a_set_on_its_finite_rest(tmp_path, mil_csv_val, pooling):
    """A diverged model (NaN weights) is told from extreme inputs: its error names the learning rate."""
    from wsi_milssl.errors import StoreError, TrainingDivergedError
    from wsi_milssl.mil.models import create_model
    from wsi_milssl.mil.selftrain import evaluate, resolve_runtime

    val = read_mil_csv(mil_csv_val)
    config = _features()
    runtime = resolve_runtime(config)
    model = create_model("mlp", in_features=val.in_features)
    assert evaluate(model, val, runtime=runtime, bag_pooling=pooling)["bag_auc"] is not None
    val.features[np.flatnonzero(val.bag_ids == 3)[0]] = 3e38
    with pytest.raises(StoreError, match=r"1 of the 40 bags evaluated: b003 \(/.*toy_val\.csv#b003\),.*The model's "
                                         r"weights are finite"):
        evaluate(model, val, runtime=runtime, bag_pooling=pooling)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.raises(TrainingDivergedError, match=r"40 of the 40 bags evaluated: .* the model's weights hold NaN or "
                                                    r"infinity .*Fix: lower the learning rate \(--lr\)"):
        evaluate(model, val, runtime=runtime, bag_pooling=pooling)


def test_an_interrupt_while_metrics_png_is_drawn_keeps_the_epoch(tmp_path, monkeypatch):
    """Review BN, C3: metrics.png (1-2 s of matplotlib) was drawn between best.pt and last.pt, so a Ctrl-C or
    SIGTERM then left best.pt and metrics.jsonl of the epoch but no last.pt, and the next run trained the epoch
    again. The plot comes after last.pt now."""
    from wsi_milssl.mil import run_folder, selftrain

    def interrupted(out, history):
        raise KeyboardInterrupt

    monkeypatch.setattr(selftrain, "_draw_metrics", interrupted)
    assert run_folder._draw_metrics is not interrupted
    train = read_mil_csv(make_mil_csv(tmp_path / "bags.csv", n_bags=12))
    with pytest.raises(KeyboardInterrupt):
        fit(train, config=_features(epochs=3, plots=True), out_dir=tmp_path / "run")
    last = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert last["epoch"] == 1
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_ctrl_c_while_best_pt_is_written_waits_for_the_epochs_other_files(tmp_path, monkeypatch):
    """Review CA: the test above interrupts the plot only; the save block that makes best.pt, metrics.jsonl and
    last.pt one step for Ctrl-C (review BN) had no guard. A SIGINT that lands while best.pt is written stops the
    run only once last.pt holds the epoch."""
    import os
    import signal

    from wsi_milssl.mil import selftrain

    real = selftrain.save_checkpoint

    def save_with_ctrl_c(ckpt, path):
        if path.name == "best.pt":
            os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread at once: inside the block
        return real(ckpt, path)

    monkeypatch.setattr(selftrain, "save_checkpoint", save_with_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as the CLI has it
    train = read_mil_csv(make_mil_csv(tmp_path / "bags.csv", n_bags=12))
    val = read_mil_csv(make_mil_csv(tmp_path / "val.csv", n_bags=8, seed=1))
    try:
        with pytest.raises(KeyboardInterrupt):
            fit(train, val=val, config=_features(epochs=3, plots=False), out_dir=tmp_path / "run")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["epoch"] == 1
    assert torch.load(tmp_path / "run" / "best.pt", weights_only=True)["epoch"] == 1
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
