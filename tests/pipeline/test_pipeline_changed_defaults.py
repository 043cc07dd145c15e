"""A default that changes between versions changes what a stage's stamp covers (review BA): stamps recorded only
the settings that differed from their defaults, so a pipeline finished before a default changed skipped the
stage that the new default changes, and kept outputs made with the old one. Stamps now record every setting;
stamps of the earlier form stay up to date after the upgrade, and are compared with the defaults they knew
(``EARLIER_DEFAULTS``)."""

from __future__ import annotations

import json
import shutil

import pytest

from tinypipeline import FEATURE_BAGS, feature_bags
from wsi_milssl.config import train as train_config
from wsi_milssl.pipeline import digests, load_pipeline, run_pipeline, stamps

PIPELINE = """
[pipeline]
name = "defaults"
""" + FEATURE_BAGS


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    feature_bags(root / "bags" / "train", 8, 0)
    feature_bags(root / "bags" / "test", 4, 1)
    (root / "p.toml").write_text(PIPELINE)
    run_pipeline(load_pipeline(root / "p.toml", out_dir=root / "out"))
    return root


@pytest.fixture()
def root(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "r", symlinks=True)
    return tmp_path / "r"


def _run(root, *overrides: str) -> dict[str, tuple[str, str]]:
    spec = load_pipeline(root / "p.toml", out_dir=root / "out", overrides=list(overrides))
    return {o.stage: (o.status, o.reason) for o in run_pipeline(spec)}


def _new_default_lr(monkeypatch, lr: float) -> None:
    """As if a later version made ``lr`` feature mode's default learning rate (1e-3 when the run finished)."""
    monkeypatch.setitem(train_config.MODE_DEFAULTS, "features", {**train_config.MODE_DEFAULTS["features"], "lr": lr})


def _stamps_of_the_changed_form(root) -> None:
    """Rewrite the finished run's stamps as the previous version wrote them: its settings that differ from their
    defaults alone, digests chained over those, no ``settings_form``."""
    spec = load_pipeline(root / "p.toml", out_dir=root / "out")
    state = root / "out" / ".pipeline"
    chain: dict[str, str] = {}
    for stage in ("train", "evaluate"):
        stamp = json.loads((state / f"{stage}.json").read_text())
        assert stamp.pop(stamps.SETTINGS_FORM) == "all"
        settings, inputs = digests.digest_parts(spec, stage, chain, state, form="changed")
        named = digests.setting_names(stage, settings)
        chain[stage] = stamp["digest"] = stamps.stamp_digest(named, inputs)
        stamp["settings"], stamp["inputs"] = json.loads(json.dumps(named)), json.loads(json.dumps(inputs))
        (state / f"{stage}.json").write_text(json.dumps(stamp))
    assert "train.lr" not in json.loads((state / "train.json").read_text())["settings"]


def test_stamps_record_every_setting_and_a_changed_default_runs_its_stage_again(root, monkeypatch):
    train = json.loads((root / "out" / ".pipeline" / "train.json").read_text())
    assert train[stamps.SETTINGS_FORM] == "all" and train["settings"]["train.lr"] == 1e-3
    assert {status for status, _ in _run(root).values()} == {"skipped"}
    before = (root / "out" / "model" / "last.pt").read_bytes()
    _new_default_lr(monkeypatch, 0.05)
    outcomes = _run(root)
    assert outcomes["train"] == ("ran", "settings changed: train.lr")
    assert outcomes["evaluate"][0] == "ran"
    assert (root / "out" / "model" / "last.pt").read_bytes() != before  # trained with the new default
    assert list((root / "out").glob("model.replaced-*"))  # the run of the old default, kept aside
    assert {status for status, _ in _run(root).values()} == {"skipped"}


def test_stamps_of_the_earlier_form_stay_up_to_date_and_know_their_defaults(root, monkeypatch):
    _stamps_of_the_changed_form(root)
    assert {status for status, _ in _run(root).values()} == {"skipped"}  # the upgrade runs nothing
    assert stamps.SETTINGS_FORM not in json.loads((root / "out" / ".pipeline" / "train.json").read_text())
    # the default changed, and EARLIER_DEFAULTS says what it was: a setting at the old default left out of the
    # stamp is that value, so a pipeline that spells it out is up to date and one that leaves it out is not
    _new_default_lr(monkeypatch, 0.05)
    monkeypatch.setitem(digests.EARLIER_DEFAULTS, "train", {"lr": 1e-3})
    assert {status for status, _ in _run(root, "train.lr=0.001").values()} == {"skipped"}
    outcomes = _run(root)
    assert outcomes["train"] == ("ran", "settings changed: train.lr")
    stamp = json.loads((root / "out" / ".pipeline" / "train.json").read_text())
    assert stamp[stamps.SETTINGS_FORM] == "all" and stamp["settings"]["train.lr"] == 0.05
    assert {status for status, _ in _run(root).values()} == {"skipped"}


def test_a_stage_of_the_earlier_form_that_runs_again_says_which_setting_changed(root):
    _stamps_of_the_changed_form(root)
    outcomes = _run(root, "train.epochs=4")
    assert outcomes["train"] == ("ran", "settings changed: train.epochs")
    assert outcomes["evaluate"] == ("ran", "the train stage ran before it")


def test_image_modes_new_default_t_is_a_change_for_stamps_of_the_earlier_form(tmp_path):
    """Image mode's default T (mu_ramp_epochs) went from 10 to 5: an image pipeline finished with the old default
    trains again (its stamp lacks T, which was 10); one that spells out T = 10, and a feature pipeline (its default
    stays 10), are up to date."""
    from tinypipeline import GENERATED_SLIDES

    def changed_form(text: str, name: str) -> dict:
        (tmp_path / name).write_text('[pipeline]\nname = "t"\n' + text)
        spec = load_pipeline(tmp_path / name, out_dir=tmp_path / "out")
        return digests.stage_settings(spec, "train", form="changed")["section"]

    assert changed_form(GENERATED_SLIDES, "a.toml")["mu_ramp_epochs"] == 5
    assert "mu_ramp_epochs" not in changed_form(GENERATED_SLIDES + "[train]\nmu_ramp_epochs = 10\n", "b.toml")
    assert "mu_ramp_epochs" not in changed_form(FEATURE_BAGS, "c.toml")
    (tmp_path / "d.toml").write_text('[pipeline]\nname = "t"\n' + GENERATED_SLIDES)
    spec = load_pipeline(tmp_path / "d.toml", out_dir=tmp_path / "out")
    assert digests.stage_settings(spec, "train")["section"]["mu_ramp_epochs"] == 5  # the form stamps record now
