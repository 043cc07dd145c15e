"""What a pipeline's training run is started with: [train] weights_path counts, by content (review CG: new weights
behind the same path left the finished model and its report "up to date"; a file touched, or a stamp and run folder
of a version that did not count it, trains nothing again); in feature mode the feature files, not every file of
their folder."""

from __future__ import annotations

import functools
import os

import torch

from tinypipeline import FEATURE_BAGS, feature_bags
from wsi_milssl.mil.models import FeatureHead
from wsi_milssl.pipeline import digests, load_pipeline, run_pipeline


def _weights(path, seed: int) -> None:
    torch.manual_seed(seed)
    torch.save(FeatureHead(8, num_classes=2).state_dict(), path)


def _setup(tmp_path):
    feature_bags(tmp_path / "bags" / "train", 8, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    weights = tmp_path / "w.pt"
    _weights(weights, 1)
    (tmp_path / "p.toml").write_text('[pipeline]\nname = "weights"\n' + FEATURE_BAGS
                                     + f'weights_path = "{weights}"\nmu_ramp_epochs = 1\n')
    out = tmp_path / "out"

    def run():
        return {o.stage: o for o in run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=out))}

    return weights, out, run


def test_new_weights_behind_the_same_path_train_again_and_a_touch_does_not(tmp_path):
    weights, out, run = _setup(tmp_path)
    assert run()["train"].status == "ran"
    first = (out / "model" / "best.pt").read_bytes()
    assert {o.status for o in run().values()} == {"skipped"}
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched (or copied again): the same weights
    assert {o.status for o in run().values()} == {"skipped"}
    _weights(weights, 2)  # other weights, same path and size
    assert weights.stat().st_size == st.st_size
    outcomes = run()
    assert outcomes["train"].status == "ran" and outcomes["train"].reason.startswith("input changed"), outcomes["train"]
    assert outcomes["evaluate"].status == "ran"
    assert (out / "model" / "best.pt").read_bytes() != first
    assert not list(out.glob("model.replaced-*")) or all(  # the earlier run, set aside, is not read back
        (p / "best.pt").read_bytes() == first for p in out.glob("model.replaced-*"))


def _run_of_earlier_version(run, monkeypatch) -> None:
    """Run the pipeline as versions before 2026-11-29 recorded it: no weights in the train stamp and run record."""
    with monkeypatch.context() as earlier:
        earlier.setattr(digests, "train_weights", lambda spec: [])
        earlier.setattr(digests, "_run_fingerprint", functools.partial(digests._run_fingerprint, weights=False))
        assert run()["train"].status == "ran"


def _newer(path, than) -> None:
    """Give ``path`` a modification time one second after ``than``'s (new weights written after that run)."""
    later = than.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))


def test_a_run_of_a_version_that_did_not_count_the_weights_stays_up_to_date(tmp_path, monkeypatch):
    """Stamps and run records written before the weights counted hold no row of them: the finished work is kept on
    upgrade, not trained again, while the weights file is older than them."""
    weights, out, run = _setup(tmp_path)
    _run_of_earlier_version(run, monkeypatch)
    best = (out / "model" / "best.pt").read_bytes()
    last = (out / "model" / "last.pt").stat().st_mtime_ns
    assert {o.status for o in run().values()} == {"skipped"}
    assert (out / "model" / "best.pt").read_bytes() == best
    # without its stamp the stage runs: the run folder's record of that version is accepted, nothing trains
    (out / ".pipeline" / "train.json").unlink()
    assert run()["train"].status == "ran"
    assert (out / "model" / "last.pt").stat().st_mtime_ns == last and not list(out.glob("model.replaced-*"))


def test_other_files_in_the_training_features_folder_train_nothing_again(tmp_path):
    """Review CG: every file of the folder counted (its labels CSV, notes, the features stage's status files): a
    note added, or the labels' rows reordered, trained the head again to the same weights."""
    weights, out, run = _setup(tmp_path)
    assert run()["train"].status == "ran"
    last = (out / "model" / "last.pt").stat().st_mtime_ns
    folder = tmp_path / "bags" / "train"
    (folder / "notes.txt").write_text("scanned 2026-11-29\n")
    rows = (folder / "labels.csv").read_text().splitlines()
    (folder / "labels.csv").write_text("\n".join([rows[0], *reversed(rows[1:])]) + "\n")
    run()
    assert (out / "model" / "last.pt").stat().st_mtime_ns == last and not list(out.glob("model.replaced-*"))
    # a training bag's label changed is a change
    (folder / "labels.csv").write_text("\n".join([rows[0], *[r.replace(",1", ",0") for r in rows[1:3]], *rows[3:]])
                                       + "\n")
    assert run()["train"].status == "ran"
    assert (out / "model" / "last.pt").stat().st_mtime_ns != last


def test_weights_replaced_after_a_run_of_an_earlier_version_train_again(tmp_path, monkeypatch):
    """Review CL: such a run was accepted whatever the weights, and the next time train ran (a test label corrected)
    it kept the model of the old weights and recorded the new ones; after `--force train`, weights changed again
    brought back the first run, set aside, under the newest weights. Weights written after a record are a change."""
    weights, out, run = _setup(tmp_path)
    _run_of_earlier_version(run, monkeypatch)
    first = (out / "model" / "best.pt").read_bytes()
    _weights(weights, 2)
    _newer(weights, out / "model" / "pipeline_run.json")
    outcomes = run()
    assert outcomes["train"].status == "ran" and "w.pt" in outcomes["train"].reason, outcomes["train"]
    second = (out / "model" / "best.pt").read_bytes()
    assert second != first
    assert {o.status for o in run().values()} == {"skipped"}
    _weights(weights, 3)  # the first run, set aside without a record of its weights, is not brought back
    _newer(weights, out / "model" / "pipeline_run.json")
    assert run()["train"].status == "ran"
    assert (out / "model" / "best.pt").read_bytes() not in (first, second)
    assert not any((p / "best.pt").read_bytes() not in (first, second) for p in out.glob("model.replaced-*"))
