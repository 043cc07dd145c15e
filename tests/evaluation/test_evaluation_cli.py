"""``wsi-milssl evaluate`` through the real command-line entry point."""

from __future__ import annotations

import json
import os

import pytest

from wsi_milssl.cli import COMMANDS, main
from wsi_milssl.config import EvaluateConfig
from wsi_milssl.errors import ConfigError, EvaluationError


def test_evaluate_command(synth_dir, annotations_dir, predictions, tmp_path, capsys):
    pred_dir, _ = predictions
    out = tmp_path / "out"
    rc = main(["evaluate", "--predictions", str(pred_dir), "--annotations", str(annotations_dir),
               "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out),
               "--title", "CLI run"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "FROC 0.8333" in printed and "report:" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["froc"] == pytest.approx(5 / 6)
    assert "<title>CLI run</title>" in (out / "report.html").read_text()
    assert "evaluate" in COMMANDS


def test_evaluate_command_reports_input_errors(synth_dir, annotations_dir, tmp_path, capsys):
    rc = main(["evaluate", "--predictions", str(tmp_path / "nope"), "--annotations", str(annotations_dir),
               "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "o")])
    assert rc == 1
    assert "the predictions folder does not exist" in capsys.readouterr().err
    a_file = tmp_path / "scores.csv"
    a_file.write_text("slide,score\n")
    rc = main(["evaluate", "--predictions", str(a_file), "--annotations", str(annotations_dir),
               "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "o")])
    assert rc == 1
    assert "the predictions folder is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "pred").mkdir()  # review EW, C7: an annotation file for the folder was "does not exist"
    rc = main(["evaluate", "--predictions", str(tmp_path / "pred"), "--annotations", str(a_file),
               "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "o")])
    assert rc == 1
    assert f"{a_file}: is a file, not the annotations folder. Fix: check --annotations" in capsys.readouterr().err


def test_evaluate_command_requires_its_inputs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", "--predictions", "x"])
    assert exc.value.code == 2
    assert "--annotations" in capsys.readouterr().err


def test_evaluate_config_validation():
    with pytest.raises(ConfigError, match=r"EvaluateConfig.positive_fraction must satisfy 0.0 < value <= 1.0"):
        EvaluateConfig(positive_fraction=0.0)
    with pytest.raises(ConfigError, match=r"EvaluateConfig.mpp must satisfy"):
        EvaluateConfig(mpp=-1.0)
    with pytest.raises(ConfigError, match=r"EvaluateConfig.thumbnail_px must be int"):
        EvaluateConfig(thumbnail_px=100.0)


def _without_one_slide(pred_dir, tmp_path):
    """A copy of the predictions folder with one slide's files removed; (copy, removed stem)."""
    import shutil

    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    stem = sorted(p.name[: -len("_detections.csv")] for p in copy.glob("*_detections.csv"))[-1]
    for path in copy.glob(f"{stem}_*"):
        path.unlink()
    return copy, stem


def test_evaluate_names_labelled_slides_without_predictions(synth_dir, annotations_dir, predictions, tmp_path,
                                                            capsys):
    copy, stem = _without_one_slide(predictions[0], tmp_path)
    out = tmp_path / "out"
    args = ["evaluate", "--predictions", str(copy), "--annotations", str(annotations_dir), "--slides",
            str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)]
    assert main(args) == 0
    assert "not evaluated: 1 labelled slide(s) without predictions" in capsys.readouterr().out
    assert json.loads((out / "metrics.json").read_text())["not_evaluated"] == [stem]
    assert f"are not evaluated: {stem}." in (out / "report.html").read_text()


def test_evaluate_refuses_when_the_heatmap_stage_failed_on_a_labelled_slide(synth_dir, annotations_dir, predictions,
                                                                            tmp_path, capsys):
    copy, stem = _without_one_slide(predictions[0], tmp_path)
    (copy / "heatmap_status.csv").write_text(f"slide,status,n_patches,score,seconds,error\n{stem},failed,0,,0.1,"
                                             "SlideReadError: cannot read\n")
    out = tmp_path / "out"
    assert main(["evaluate", "--predictions", str(copy), "--annotations", str(annotations_dir), "--slides",
                 str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"the heatmap stage failed on labelled slides {stem} (SlideReadError: cannot read)" in err
    assert "Fix: mend and re-run the heatmap stage for them" in err and "Traceback" not in err
    assert not out.exists()


def _evaluate(pred_dir, synth_dir, annotations_dir, out):
    from wsi_milssl.evaluation import evaluate_predictions

    return evaluate_predictions(pred_dir, labels_csv=synth_dir / "labels.csv", out_dir=out,
                                annotations_dir=annotations_dir, slides=synth_dir).metrics


def test_a_tumour_slide_the_heatmap_found_empty_counts_with_its_lesions_missed(synth_dir, annotations_dir,
                                                                              predictions, tmp_path):
    """No tissue patch -> no detection file: the slide is evaluated with no detection (its lesion missed,
    score 0), not dropped (which took its lesions out of the sensitivity and raised the FROC)."""
    import shutil

    pred_dir, info = predictions
    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    for path in copy.glob(f"{info['tumor']}_*"):
        path.unlink()
    (copy / "scores.csv").write_text(f"slide,score\n{info['normal']},0.2\n")
    (copy / "heatmap_status.csv").write_text(f"slide,status,n_patches,score,seconds,error\n{info['tumor']},empty,0,,"
                                             f"0.1,no patch\n{info['normal']},ok,256,0.2,0.1,\n")
    m = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert m["n_slides"] == 2 and m["n_lesions"] == 1 and m["n_lesions_detected"] == 0
    assert m["froc"] == 0.0 and m["not_evaluated"] == []
    assert m["bag_auc"] == 0.0  # the tumour slide's 0 ranks below the normal slide's 0.2
    # review BS: said on stderr only; now in metrics.json and as a note and a card text in the report
    assert m["no_tissue"] == [info["tumor"]]
    report = (tmp_path / "out" / "report.html").read_text()
    assert f"1 slide(s) had no tissue patch in the heatmap stage and count with a score of 0 in the bag AUC and no " \
           f"detection (a tumour slide&#x27;s lesions missed): {info['tumor']}." in report
    assert "no tissue patch: the heatmap stage found none on this slide, which scores 0" in report


def test_detection_files_named_in_another_case_match_their_slides(synth_dir, annotations_dir, predictions,
                                                                   tmp_path):
    """The challenge's capitalised CSV names (Synth_000.csv) against lower-case slide files and scores: the
    same FROC and bag AUC as the heatmap's own names; a slide is never counted twice."""
    import shutil

    pred_dir, info = predictions
    reference = _evaluate(pred_dir, synth_dir, annotations_dir, tmp_path / "ref")
    copy = tmp_path / "preds"
    copy.mkdir()
    for stem in (info["tumor"], info["normal"]):
        shutil.copy(pred_dir / f"{stem}_detections.csv", copy / f"{stem.capitalize()}.csv")
    shutil.copy(pred_dir / "scores.csv", copy / "scores.csv")
    m = _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert m["n_slides"] == 2 and m["froc"] == reference["froc"] and m["bag_auc"] == reference["bag_auc"]
    shutil.copy(pred_dir / f"{info['normal']}_detections.csv", copy / f"{info['normal'].upper()}_detections.csv")
    shutil.copy(pred_dir / f"{info['normal']}_detections.csv", copy / f"{info['normal']}_detections.csv")
    with pytest.raises(EvaluationError, match=r"are files of one slide \(names match without case\)"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out2")


def test_detections_off_a_normal_slide_are_reported_too(synth_dir, annotations_dir, predictions, tmp_path, caplog):
    """Outside-the-slide detections were only checked on tumour slides (against their mask)."""
    import shutil

    pred_dir, info = predictions
    copy = tmp_path / "preds"
    shutil.copytree(pred_dir, copy)
    with open(copy / f"{info['normal']}_detections.csv", "a") as fh:
        fh.write("0.99,-5,10\n")
    with caplog.at_level("WARNING", logger="wsi_milssl.evaluation.froc"):
        _evaluate(copy, synth_dir, annotations_dir, tmp_path / "out")
    assert any(f"{info['normal']}: 1 detection(s) lie outside the slide (4096 x 4096 level-0 px)" in r.getMessage()
               for r in caplog.records)
    assert "1 detection(s) lie outside their slide" in (tmp_path / "out" / "report.html").read_text()


def test_evaluate_refuses_a_predictions_folder_that_heatmap_shards_still_write(synth_dir, annotations_dir,
                                                                             predictions, tmp_path, capsys):
    """While a heatmap shard holds the folder (another process here, holding it as shard 1/2 does), the
    folder holds some slides only: evaluate stops, naming the shard's pid and the fix, and evaluates
    once the shard has finished."""
    import shutil
    import subprocess
    import sys

    pred_dir = tmp_path / "heatmaps"
    shutil.copytree(predictions[0], pred_dir)
    cmd = ["evaluate", "--predictions", str(pred_dir), "--annotations", str(annotations_dir), "--slides",
           str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(tmp_path / "out")]
    shard = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(pred_dir)!r}, shard=(1, 2)):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(60)\n"
    )], stdout=subprocess.PIPE, text=True)
    try:
        assert shard.stdout.readline().strip() == "locked"
        assert main(cmd) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {pred_dir}: another wsi-milssl run (shard 1/2, pid {shard.pid}"), err
        assert err.rstrip().endswith("is still writing this folder, so its predictions are not complete. Fix: wait "
                                     "until that heatmap run (every shard of it) finishes, then evaluate.")
        assert not (tmp_path / "out" / "metrics.json").exists()
    finally:
        shard.kill()
        shard.wait()
    assert main(cmd) == 0


def test_a_second_evaluate_into_an_out_being_written_is_refused(synth_dir, annotations_dir, predictions, tmp_path,
                                                                 monkeypatch):
    """revS 3: two evaluate runs into one --out left metrics.json from one and report.html, CSVs and plots from
    the other, both with rc 0. Here a second evaluate (another process) starts while the first writes its
    files: it is refused naming the first, and the folder holds the first run's files only."""
    import subprocess
    import sys

    from wsi_milssl.evaluation import stage

    out = tmp_path / "out"
    cmd = ["evaluate", "--predictions", str(predictions[0]), "--annotations", str(annotations_dir), "--slides",
           str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)]
    second = []
    real_write_report = stage.write_report

    def write_report(*args, **kwargs):  # metrics.json and the CSVs are written; report.html comes last
        second.append(subprocess.run([sys.executable, "-m", "wsi_milssl", *cmd, "--title", "second"],
                                     capture_output=True, text=True))
        return real_write_report(*args, **kwargs)

    monkeypatch.setattr(stage, "write_report", write_report)
    assert main(cmd + ["--title", "first"]) == 0
    assert len(second) == 1 and second[0].returncode == 1, second
    err = second[0].stderr
    assert f"\nerror: {out}: another wsi-milssl run (pid {os.getpid()}" in err, err
    assert err.rstrip().endswith(" is writing to this folder. Fix: wait until it finishes, or write to another "
                                 "folder (--out).")
    assert "<title>first</title>" in (out / "report.html").read_text()
    assert json.loads((out / "config.json").read_text())["title"] == "first"
    assert not (out / ".wsi-milssl.lock").exists()


def test_evaluate_into_an_out_that_another_run_holds_writes_nothing(synth_dir, annotations_dir, predictions,
                                                                     tmp_path, capsys):
    from processes import hold_lock, release

    out = tmp_path / "out"
    other = hold_lock(out)  # holds --out as a running evaluate does
    try:
        assert main(["evaluate", "--predictions", str(predictions[0]), "--annotations", str(annotations_dir),
                     "--slides", str(synth_dir), "--labels", str(synth_dir / "labels.csv"), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert f"\nerror: {out}: another wsi-milssl run (pid {other.pid}" in err, err
        assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == []
    finally:
        release(other)
