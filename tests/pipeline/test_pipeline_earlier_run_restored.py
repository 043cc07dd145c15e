"""A setting changed and changed back: the training run made with it, renamed aside (`model.replaced-*`) when the
setting changed, is renamed back and used instead of training again; under `--force` it is not (a fresh run)."""

from __future__ import annotations

import json
import logging

from tinypipeline import FEATURE_BAGS, feature_bags
from wsi_milssl.pipeline import load_pipeline, run_pipeline

FEATURES = """
[pipeline]
name = "back"
""" + FEATURE_BAGS


def _epochs(model_dir) -> list[int]:
    return [json.loads(line)["epoch"] for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_setting_changed_back_finds_its_earlier_run(tmp_path, caplog):
    feature_bags(tmp_path / "bags" / "train", 8, 0)
    feature_bags(tmp_path / "bags" / "test", 4, 1)
    (tmp_path / "p.toml").write_text(FEATURES)
    out = tmp_path / "out"

    def run(*overrides: str, force: tuple[str, ...] = ()):
        return run_pipeline(load_pipeline(tmp_path / "p.toml", out_dir=out, overrides=list(overrides)), force=force)

    with caplog.at_level(logging.WARNING):
        run()
    assert "the μ schedule never reaches" in caplog.text  # T = 10 > 3 epochs
    first = (out / "model" / "best.pt").read_bytes(), (out / "model" / "last.pt").stat().st_mtime_ns
    run("train.lr=0.05")
    assert len(list(out.glob("model.replaced-*"))) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        outcomes = run()  # back to the first settings: that run comes back, nothing is trained
    assert "is back from model.replaced-" in caplog.text
    assert "never reaches" not in caplog.text  # said when it trained, not again when it is read back
    train = next(o for o in outcomes if o.stage == "train")
    assert train.status == "ran" and train.reason == "settings changed: train.lr"
    assert ((out / "model" / "best.pt").read_bytes(), (out / "model" / "last.pt").stat().st_mtime_ns) == first
    assert _epochs(out / "model") == [1, 2, 3]
    aside = list(out.glob("model.replaced-*"))
    assert len(aside) == 1 and json.loads((aside[0] / "config.json").read_text())["lr"] == 0.05
    # a run of these settings killed before its first epoch (its record and config.json, no last.pt) makes way
    run("train.lr=0.05")  # the lr=0.05 run is back, the first one aside again
    killed = out / "model"
    for name in ("last.pt", "best.pt", "metrics.jsonl"):
        (killed / name).unlink()
    aside = next(out.glob("model.replaced-*"))
    (killed / "pipeline_run.json").write_text((aside / "pipeline_run.json").read_text())
    run()
    assert ((out / "model" / "best.pt").read_bytes(), (out / "model" / "last.pt").stat().st_mtime_ns) == first
    assert len(list(out.glob("model.replaced-*"))) == 1  # the killed run's folder, kept
    # with --force the model is trained again from scratch, whatever was trained before
    run(force=("train",))
    assert (out / "model" / "last.pt").stat().st_mtime_ns != first[1]
    assert len(list(out.glob("model.replaced-*"))) == 2
