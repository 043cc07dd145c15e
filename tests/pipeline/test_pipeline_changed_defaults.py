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
from wsi_milssl.pipeline.run_folders import RUN_MARKER

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


#: the note a reason gets when feature mode's default learning rate went from 1e-3 to 0.05 (:func:`_new_default_lr`)
KEEP_LR = (" (the default of train.lr is 0.05 since this version, 0.001 before: set train.lr = 0.001 to keep the "
           "earlier result)")


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
    assert outcomes["train"] == ("ran", "settings changed: train.lr" + KEEP_LR)  # the earlier default, from the table
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


#: every stage's settings when stamps began to record every setting (2026-11-28): a setting added since is in
#: ADDED_SETTINGS with the value that does what the stage did before it, or every finished run would run again
SETTINGS_OF_2026_11_28 = {
    "synth": "height_px jpeg_quality level_downsample min_level_size_px mpp n_slides seed tile_size_px "
             "tumor_slide_fraction width_px",
    "tile": "allow_upsample batch_size direct_tiff_read entropy_threshold_bits format jpeg_quality magnification "
            "mask_mpp min_tissue patch_size_px pixels slide_mpp stride_px target_mpp threads tissue workers",
    "label": "mask_downsample non_tumor_groups positive_fraction tumor_groups write_masks",
    "features": "amp batch_size channels_last decode device dtype encoder encoder_kwargs fuse_batchnorm input_size_px "
                "num_workers slide_mpp threads weights",
    "train": "amp augment bag_pooling batch_size channels_last colour_jitter compile decode device dropout epochs "
             "eval_batch_size fixed_mu global_constraint hidden_dims lam local_constraint lr mode model momentum mu "
             "mu_ramp_epochs num_workers online_pseudo_labels optimizer plots pseudo_negative_weight refresh_every "
             "scheduler seed select_metric shuffle_block sinkhorn_max_iter sinkhorn_tol soft_labels threads "
             "warmup_epochs weight_decay weights_path",
    "heatmap": "alpha amp annotation_color annotation_width_px batch_size channels_last clip_to_tissue colorbar "
               "colormap decode detection_threshold device fuse_batchnorm mask_mpp min_tissue nms_radius_um "
               "non_tumor_groups num_workers ome_downsample overlay_threshold scale_bar slide_mpp smooth_um threads "
               "thumbnail_px tissue title tumor_groups tumor_threshold vmax vmin",
    "evaluate": "froc_mpp itc_major_axis_um margin_um mpp non_tumor_groups positive_fraction thumbnail_px title "
                "tumor_groups",
}


def test_every_setting_added_since_stamps_record_every_setting_is_registered():
    """A setting added to a stage's config without an ADDED_SETTINGS entry changes every stamp and training run
    record of that stage: `run` would redo finished work after the upgrade (review BC finding 2)."""
    from wsi_milssl import config as cfg
    from wsi_milssl.pipeline.spec import _stage_classes

    classes = {**_stage_classes(), "synth": cfg.SynthConfig}
    for stage, names in SETTINGS_OF_2026_11_28.items():
        added = set(classes[stage].__dataclass_fields__) - set(names.split())
        missing = sorted(added - set(digests.ADDED_SETTINGS.get(stage, {})))
        assert not missing, (f"[{stage}] {', '.join(missing)}: add to wsi_milssl.pipeline.digests.ADDED_SETTINGS with "
                             "the value that does what the stage did before the setting existed")
    for stage, added in digests.ADDED_SETTINGS.items():  # as a stamp holds them: a tuple is a list there
        for name, value in added.items():
            assert cfg.config_to_dict(classes[stage](**{name: value}))[name] == value, (stage, name, value)


def test_a_setting_added_at_its_old_behaviour_leaves_finished_work_up_to_date(root, monkeypatch):
    """As if a version added train.lr, at 1e-3 (what training did without it): the stamps and the run's record of a
    pipeline finished before (which lack it) stay up to date; another value of it trains again."""
    state = root / "out" / ".pipeline"
    monkeypatch.setitem(digests.ADDED_SETTINGS, "train", {"lr": 1e-3})
    spec = load_pipeline(root / "p.toml", out_dir=root / "out")
    chain: dict[str, str] = {}
    for stage in ("train", "evaluate"):  # the stamps the version before the setting wrote
        stamp = json.loads((state / f"{stage}.json").read_text())
        settings, inputs = digests.digest_parts(spec, stage, chain, state, form="all")
        named = digests.setting_names(stage, settings)
        assert "train.lr" not in named
        chain[stage] = stamp["digest"] = stamps.stamp_digest(named, inputs)
        stamp["settings"], stamp["inputs"] = json.loads(json.dumps(named)), json.loads(json.dumps(inputs))
        (state / f"{stage}.json").write_text(json.dumps(stamp))
    record_path = root / "out" / "model" / RUN_MARKER
    record = json.loads(record_path.read_text())
    del record["settings"]["lr"]
    record_path.write_text(json.dumps(record))
    assert {status for status, _ in _run(root).values()} == {"skipped"}
    stamps.mark_outdated(state, ["train"], by="features")  # train runs: the run folder's record is compared
    before = (root / "out" / "model" / "last.pt").read_bytes()
    assert _run(root)["train"][0] == "ran"
    assert (root / "out" / "model" / "last.pt").read_bytes() == before  # the finished run, continued: nothing trained
    assert not list((root / "out").glob("model.replaced-*"))
    outcomes = _run(root, "train.lr=0.05")
    assert outcomes["train"] == ("ran", "settings changed: train.lr")
    assert list((root / "out").glob("model.replaced-*"))


def test_a_grid_setting_is_not_the_tables_and_its_changed_default_is_not_a_change(tmp_path):
    """[train.grid] sets T for every point, so the table's T is not used: a pipeline finished before T's default
    changed is up to date (the packaged camelyon16.toml; review BC finding 1), and its top-level T does not count."""
    from tinypipeline import GENERATED_SLIDES

    def spec(extra: str):
        (tmp_path / "g.toml").write_text('[pipeline]\nname = "g"\n' + GENERATED_SLIDES + "[train]\n" + extra
                                         + "[train.grid]\nmu_ramp_epochs = [0, 10]\n")
        return load_pipeline(tmp_path / "g.toml", out_dir=tmp_path / "out")

    changed = digests.stage_settings(spec(""), "train", form="changed")["section"]
    assert "mu_ramp_epochs" not in changed and changed["grid"] == {"mu_ramp_epochs": [0, 10]}
    assert digests.stage_settings(spec("mu_ramp_epochs = 20\n"), "train", form="changed")["section"]["mu_ramp_epochs"] == 20
    every = digests.stage_settings(spec(""), "train")["section"]
    assert "mu_ramp_epochs" not in every and every["grid"] == {"mu_ramp_epochs": [0, 10]}
    assert digests.stage_settings(spec("mu_ramp_epochs = 20\n"), "train") == digests.stage_settings(spec(""), "train")


def test_a_default_that_changed_is_named_and_the_value_that_keeps_the_earlier_result_keeps_it(root, monkeypatch):
    """After the upgrade, a stamp of the earlier form that left a setting out at a default that changed since: the
    reason says so and gives the value that keeps the earlier result, which brings that result back."""
    _stamps_of_the_changed_form(root)
    _new_default_lr(monkeypatch, 0.05)
    monkeypatch.setitem(digests.EARLIER_DEFAULTS, "train", {"lr": 1e-3})
    assert _run(root)["train"] == ("ran", "settings changed: train.lr" + KEEP_LR)
    # a setting the pipeline gives is its own, and a stamp of this version's form may hold one it gave: no note
    assert _run(root, "train.lr=0.01")["train"] == ("ran", "settings changed: train.lr")
    assert _run(root)["train"] == ("ran", "settings changed: train.lr")
    # the value the note gives brings the earlier run back (it was set aside, not deleted)
    assert {status for status, _ in _run(root, "train.lr=0.001").values()} <= {"ran", "skipped"}
    assert _run(root, "train.lr=0.001") == {"train": ("skipped", ""), "evaluate": ("skipped", "")}


def test_an_earlier_stage_that_ran_again_is_the_reason_for_a_later_stamp_of_the_earlier_form(tmp_path):
    """After the upgrade, a stage that runs again writes a stamp of this version's form, whose digest the later
    stages' stamps of the earlier form do not hold: they run because it ran, and say so, not "input changed: the
    label stage's settings or inputs" (review BC finding 3)."""
    state = tmp_path / ".pipeline"
    old = {"upstream": {"label": "digest-of-the-earlier-form"}, "external": [["a.csv", 3, "abc"]]}
    now = {"upstream": {"label": "digest-of-this-form"}, "external": [["a.csv", 3, "abc"]]}
    settings = {"train.epochs": 3}
    stamps.write_stamp(state, "train", digest="d-old", outputs=[], settings=settings, inputs=old)
    reason = lambda **kw: stamps.stale_reason(state, "train", ("d-new",), **kw)  # noqa: E731
    assert reason(settings=settings, inputs=now, ran=["label"]) == "the label stage ran before it"
    assert reason(settings=settings, inputs=now) == "input changed: the label stage's settings or inputs"
    stamps.mark_outdated(state, ["train"], by="label")  # a run that ran label alone (--until label)
    assert reason(settings=settings, inputs=now) == "the label stage ran since its last run"
    assert reason(settings={"train.epochs": 4}, inputs=now, ran=["label"]).startswith("settings changed: train.epochs")
    changed_file = {**now, "external": [["a.csv", 3, "abd"]]}
    assert reason(settings=settings, inputs=changed_file, ran=["label"]).startswith("input changed:")
