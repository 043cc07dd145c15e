"""``train`` under hostile conditions (issue 14): a full disk (row 1), a read-only ``--out`` (row 5),
the temporary of a checkpoint save killed with SIGKILL (row 13), two runs into one folder."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from contextlib import nullcontext

import pytest

from milcsv import make_mil_csv
from processes import hold_lock, release
from diskfaults import file_size_limit, full_disk, read_only_folder
from wsi_milssl.cli import main

# T = 1 reaches μ in the last epoch: no μ-schedule warning before the errors these tests check
TRAIN = ["--epochs", "2", "--threads", "1", "--no-plots", "--mu-ramp-epochs", "1"]


def test_train_on_a_full_disk_is_one_clear_error(tmp_path, capsys):
    """The checkpoint does not fit: one error naming the run folder and the fix, no traceback, no
    temporary left (a 64 KB tmpfs where the machine allows a mount, else a 64 KB file-size limit)."""
    data = make_mil_csv(tmp_path / "wide.csv", dim=64)  # a checkpoint of ~200 KB
    run = tmp_path / "disk" / "run"
    with full_disk(run.parent, n_bytes=64_000) as (method, _):
        with file_size_limit(64_000) if method == "rlimit" else nullcontext():
            code = main(["train", str(data), "--out", str(run), *TRAIN])
        err = capsys.readouterr().err
        left = sorted(p.name for p in run.iterdir())
    assert code == 1, (method, err)
    assert "Traceback" not in err
    assert re.fullmatch(
        rf"error: {re.escape(str(run))}/last\.pt: cannot write this file \((No space left on device: the disk is "
        r"full|File too large: the file grew past a size limit)\)\. Fix: [^\n]*\. No epoch of this run was saved "
        rf"yet: start it again once {re.escape(str(run))} can be written\.\n", err), (method, err)
    assert left == ["config.json"]  # no .last.pt.*.tmp, no lock file


def test_a_checkpoint_that_fails_later_says_how_to_resume(tmp_path, capsys, monkeypatch, mil_csv):
    """The disk fills up at epoch 2: the error says that last.pt holds epoch 1 and how to resume."""
    import errno

    from wsi_milssl.atomic import output_error
    from wsi_milssl.mil import selftrain

    real = selftrain.save_checkpoint
    calls = []

    def save(ckpt, path):
        calls.append(path)
        if len(calls) == 2:
            raise output_error(path, OSError(errno.ENOSPC, "No space left on device"))
        return real(ckpt, path)

    monkeypatch.setattr(selftrain, "save_checkpoint", save)
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), *TRAIN]) == 1
    err = capsys.readouterr().err
    assert err.endswith(
        f"Fix: free disk space where {run} lives (`df -h {shlex.quote(str(run))}`), or write to another folder, and "
        f"re-run. The run folder {run} keeps the checkpoint of epoch 1 (last.pt): once there is space, continue with "
        f"`wsi-milssl train --resume {shlex.quote(str(run))}` (in a pipeline: run it again).\n"), err
    monkeypatch.undo()
    assert main(["train", "--resume", str(run), "--epochs", "2", "--threads", "1", "--no-plots"]) == 0


def test_train_into_a_read_only_folder_is_one_clear_error(tmp_path, capsys, mil_csv):
    ro = tmp_path / "ro"
    with read_only_folder(ro) as method:
        code = main(["train", str(mil_csv), "--out", str(ro / "run"), *TRAIN])
    err = capsys.readouterr().err
    assert code == 1, (method, err)
    assert err == (f"error: {ro / 'run'}: cannot create this output folder (Read-only file system: {ro / 'run'} is "
                   "on a read-only file system). Fix: write to a folder on a writable disk (another --out), or "
                   "remount it read-write.\n"), method


def test_resume_of_a_read_only_run_folder_is_refused_before_its_start_line(tmp_path, capsys, mil_csv):
    """A run folder on a read-only disk (an archive, a colleague's share): `train --resume` printed "training ...
    on N instances" and read the inputs before it failed on the folder (review CB)."""
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), *TRAIN]) == 0
    capsys.readouterr()
    with read_only_folder(run) as method:
        code = main(["train", "--resume", str(run), "--epochs", "3", "--threads", "1", "--no-plots"])
    out, err = capsys.readouterr()
    assert code == 1, (method, err)
    assert out == "", method
    # review EV, B1: the fix was "another --out", which --resume refuses: the run folder itself is named now
    assert re.fullmatch(rf"error: {re.escape(str(run))}: cannot write to this run folder \(Read-only file "
                        rf"system: {re.escape(str(run))} is on a read-only file system\)\. Fix: remount it read-write, "
                        r"or copy the folder to a writable disk and use the copy\.\n", err), (method, err)
    assert "--out" not in err


def test_a_checkpoint_save_killed_with_sigkill_leaves_a_temporary_that_resume_removes(tmp_path, mil_csv):
    """Row 13: kill -9 during the save of last.pt leaves ``.last.pt.<pid>.<random>.tmp``; the next run
    into the folder (here ``--resume``) removes it, and last.pt was never touched."""
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    before = (run / "last.pt").read_bytes()
    child = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.atomic import atomic_open\n"  # the writer save_checkpoint uses
        f"with atomic_open({str(run / 'last.pt')!r}) as fh:\n"
        "    fh.write(b'x' * 2_000_000); fh.flush(); print('written', flush=True); time.sleep(60)\n"
    )], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert len(list(run.glob(f".last.pt.{child.pid}.*.tmp"))) == 1 and (run / "last.pt").read_bytes() == before
    assert main(["train", "--resume", str(run), "--epochs", "2", "--threads", "1", "--no-plots"]) == 0
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []


def test_a_second_train_into_a_busy_run_folder_is_refused(tmp_path, capsys, mil_csv):
    from wsi_milssl.locks import folder_lock

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from wsi_milssl.locks import folder_lock\n"
        f"with folder_lock({str(run)!r}):\n"
        "    print('locked', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", str(mil_csv), "--out", str(run), *TRAIN]) == 1
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"error: {run}: another wsi-milssl run (pid {holder.pid}" in err and "Fix: wait until it finishes" in err
    assert "or write to another folder (--out)." in err
    assert not (run / "last.pt").exists()
    with folder_lock(run):  # the killed holder's lock is free again
        pass


def test_resuming_a_run_another_process_holds_names_waiting_as_the_fix(tmp_path, capsys, mil_csv):
    """--resume continues its own folder: writing elsewhere is no fix, so the refusal names waiting only."""
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    holder = hold_lock(run)
    try:
        capsys.readouterr()
        assert main(["train", "--resume", str(run), "--epochs", "2", "--threads", "1", "--no-plots"]) == 1
    finally:
        release(holder)
    captured = capsys.readouterr()
    err = captured.err
    assert f"another wsi-milssl run (pid {holder.pid}" in err and err.rstrip().endswith("Fix: wait until it finishes."), err
    assert "training" not in captured.out  # refused before the inputs are read and the start line (review BJ)
    # review CQ: a live run in its first epoch has no last.pt yet; that is no run "that never finished an epoch"
    live = tmp_path / "live"
    live.mkdir()
    (live / "config.json").write_text((run / "config.json").read_text())
    holder = hold_lock(live)
    try:
        assert main(["train", "--resume", str(live), "--threads", "1", "--no-plots"]) == 1
    finally:
        release(holder)
    err = capsys.readouterr().err
    assert f"another wsi-milssl run (pid {holder.pid}" in err and "never finished an epoch" not in err, err


def test_a_diverged_training_stops_with_one_error_and_saves_no_non_finite_weights(tmp_path, capsys, mil_csv):
    """A learning rate far too high makes the loss non-finite in epoch 1: one error with the fix, exit 1,
    no checkpoint (before this, the run exited 0 with NaN weights in last.pt)."""
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), *TRAIN, "--lr", "1e30"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.fullmatch(r"error: training diverged in epoch 1: the (loss|weights) became non-finite \(loss [^)]*\)\. "
                        r"No checkpoint was written\. Fix: lower the learning rate \(--lr\), e\.g\. by 10x, and train "
                        r"again\.\n", err), err
    assert not (run / "last.pt").exists() and not (run / "best.pt").exists()


def test_weights_that_turn_non_finite_in_a_later_epoch_keep_the_last_finite_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                      mil_csv):
    import torch

    from wsi_milssl.mil import selftrain

    real = selftrain.train_one_epoch

    def poisoned(model, *args, **kwargs):
        stats = real(model, *args, **kwargs)
        if kwargs["step"] > 0:  # the second epoch: a weight becomes NaN, the loss stays finite
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        return stats

    monkeypatch.setattr(selftrain, "train_one_epoch", poisoned)
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), *TRAIN]) == 1
    err = capsys.readouterr().err
    assert "training diverged in epoch 2: the weights became non-finite" in err
    assert f"{run / 'last.pt'} still holds epoch 1 (the last finite one)." in err
    ckpt = torch.load(run / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("amp", ["bf16", "off"])
def test_weights_broken_under_a_finite_loss_name_amp_off_only_under_bfloat16(tmp_path, capsys, monkeypatch, mil_csv,
                                                                             amp):
    """bfloat16 autocast has no gradient scaler to skip a step with non-finite gradients: weights that break
    while the loss stays finite name ``--amp off`` beside the learning rate; without mixed precision the fix
    is the learning rate alone."""
    import torch

    from wsi_milssl.mil import selftrain

    real = selftrain.train_one_epoch

    def poisoned(model, *args, **kwargs):
        stats = real(model, *args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
        return stats

    monkeypatch.setattr(selftrain, "train_one_epoch", poisoned)
    assert main(["train", str(mil_csv), "--out", str(tmp_path / "run"), *TRAIN, "--amp", amp]) == 1
    err = capsys.readouterr().err
    assert "training diverged in epoch 1: the weights became non-finite" in err
    assert ("train again without it (--amp off)" in err) == (amp == "bf16"), err
    assert "lower the learning rate (--lr), e.g. by 10x" in err


def test_an_infinite_learning_rate_is_refused():
    import pytest

    from wsi_milssl.config.train import TrainConfig
    from wsi_milssl.errors import ConfigError

    for field in ("lr", "weight_decay", "lam"):
        with pytest.raises(ConfigError, match=field):
            TrainConfig(**{field: float("inf")})


class _Killed(BaseException):
    """Stands in for SIGKILL in the middle of an epoch's saves."""


def _kill_at(monkeypatch, name: str, epoch: int):
    """Make the save of ``name`` (last.pt / best.pt) at ``epoch`` die, once."""
    from wsi_milssl.mil import selftrain

    real, fired = selftrain.save_checkpoint, []

    def save(ckpt, path):
        if path.name == name and ckpt["epoch"] == epoch and not fired:
            fired.append(path)
            raise _Killed()
        return real(ckpt, path)

    monkeypatch.setattr(selftrain, "save_checkpoint", save)
    return fired


def test_a_kill_between_an_epochs_saves_resumes_to_the_same_best_and_metrics(tmp_path, monkeypatch, mil_csv,
                                                                            mil_csv_val):
    """Killed as epoch 2's last.pt is written (best.pt and metrics.jsonl already hold epoch 2): the resume
    runs epoch 2 again; best.pt is the epoch last.pt names and metrics.jsonl lists every epoch once, as in
    an uninterrupted run (before, last.pt was written first and a kill left best.pt stale for good)."""
    import json

    import torch

    args = ["--val", str(mil_csv_val), "--epochs", "3", "--threads", "1", "--no-plots"]
    whole = tmp_path / "whole"
    assert main(["train", str(mil_csv), "--out", str(whole), *args]) == 0
    run = tmp_path / "run"
    fired = _kill_at(monkeypatch, "last.pt", 2)
    try:
        main(["train", str(mil_csv), "--out", str(run), *args])
    except _Killed:
        pass
    assert fired and torch.load(run / "last.pt", weights_only=True)["epoch"] == 1
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    for folder in (whole, run):
        last = torch.load(folder / "last.pt", weights_only=True)
        assert torch.load(folder / "best.pt", weights_only=True)["epoch"] == last["best"]["epoch"]
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3]
    whole_best = torch.load(whole / "best.pt", weights_only=True)
    run_best = torch.load(run / "best.pt", weights_only=True)
    assert whole_best["epoch"] == run_best["epoch"]
    assert all(torch.equal(whole_best["model"][k], run_best["model"][k]) for k in whole_best["model"])


def test_resume_rewrites_a_missing_best_checkpoint_from_last_when_last_is_the_best(tmp_path, mil_csv, mil_csv_val):
    """A run of an earlier version killed between last.pt and best.pt: best.pt missing while last.pt names
    its own epoch as the best. The resume writes best.pt from last.pt before it goes on."""
    import torch

    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--val", str(mil_csv_val), "--epochs", "1", "--threads",
                 "1", "--no-plots"]) == 0
    assert torch.load(run / "last.pt", weights_only=True)["best"]["epoch"] == 1
    (run / "best.pt").unlink()
    assert main(["train", "--resume", str(run), "--epochs", "2"]) == 0
    last = torch.load(run / "last.pt", weights_only=True)
    assert torch.load(run / "best.pt", weights_only=True)["epoch"] == last["best"]["epoch"]


def test_non_finite_batchnorm_statistics_count_as_a_diverged_epoch():
    """A forward pass that overflows under float16 updates BatchNorm's running statistics even when the
    gradient scaler then skips the step: finite parameters with an infinite running variance are a broken
    model (every eval-mode output NaN), so the epoch is reported as diverged, not checkpointed."""
    import torch

    from wsi_milssl.errors import TrainingDivergedError
    from wsi_milssl.mil.selftrain import _check_finite

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    _check_finite(model, 0.5, amp=True, epoch=1, out=None)  # finite: no error
    model[1].running_var[0] = float("inf")
    with pytest.raises(TrainingDivergedError, match="the weights became non-finite"):
        _check_finite(model, 0.5, amp=True, epoch=1, out=None)


def test_a_run_that_diverges_before_a_refresh_inside_an_epoch_is_a_diverged_run(tmp_path, capsys, mil_csv):
    """With --refresh-every the pseudo labels are refreshed inside the epoch: a run that diverged before such a
    refresh gets the diverged-run error (before, the non-finite probabilities reached the Sinkhorn step and
    ended in a ValueError traceback)."""
    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), *TRAIN, "--lr", "1e30", "--refresh-every", "2", "--batch-size", "8",
                 "--warmup-epochs", "0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ValueError" not in err, err
    assert re.fullmatch(r"error: training diverged in epoch 1: the weights became non-finite \(found at a pseudo-label "
                        r"refresh inside the epoch\)\. No checkpoint was written\. Fix: lower the learning rate "
                        r"\(--lr\), e\.g\. by 10x, and train again\.\n", err), err
    assert not (run / "last.pt").exists()


@pytest.mark.parametrize("where", ["parameter", "buffer"])
def test_a_checkpoint_holding_non_finite_weights_is_refused_on_resume(tmp_path, capsys, mil_csv, where):
    """A last.pt holding NaN (in a parameter, or in a floating-point buffer such as a BatchNorm statistic, as an
    earlier version could save): the resume says so and that the run cannot be resumed, instead of a
    ValueError traceback from the first pseudo-label refresh."""
    import torch

    from wsi_milssl.mil.models import create_model

    run = tmp_path / "run"
    assert main(["train", str(mil_csv), "--out", str(run), *TRAIN, "--epochs", "1"]) == 0
    ckpt = torch.load(run / "last.pt", weights_only=True)
    model = create_model(ckpt["config"]["model"], **ckpt["config"]["model_kwargs"])
    params = {n for n, _ in model.named_parameters()}
    name = next(k for k, v in ckpt["model"].items() if v.is_floating_point() and (k in params) == (where == "parameter"))
    ckpt["model"][name].view(-1)[0] = float("nan")
    torch.save(ckpt, run / "last.pt")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--epochs", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.startswith(f"error: {run / 'last.pt'}: holds non-finite weights (NaN or infinity: a diverged run), so "
                          "the run cannot be resumed from it. Fix: train again into a new --out"), err
    assert err.rstrip().endswith("e.g. with a lower learning rate (--lr)."), err
