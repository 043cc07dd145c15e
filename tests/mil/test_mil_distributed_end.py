"""Review AB, findings 1, 3, 6 and 7: how a training run on several ranks ends, and what it refuses.

Ranks are started by hand (RANK/WORLD_SIZE as torchrun sets them, gloo on the CPU) so that each can be
given its own wrapper: rank 0 whose saves are slow or fail, rank 1 that records how it left. A finished
run's non-main ranks used to exit while rank 0 still wrote the last epoch (torchrun then killed rank 0
when one of them aborted at interpreter exit, leaving last.pt one epoch behind metrics.jsonl); a rank
that lost rank 0 to a failed save named the next epoch; fewer instances than ranks trained no step
without a word; a resume on another number of ranks changed the global batch without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import free_port

from wsi_milssl.cli import main
from wsi_milssl.distributed import DistContext, rank_share
from wsi_milssl.errors import ConfigError
from wsi_milssl.mil.loader import without_lone_last

COMMON = ["--threads", "1", "--workers", "0", "--device", "cpu", "--no-plots", "--batch-size", "8"]

# rank 0: its last save of epoch EPOCH takes SLOW seconds more; the time it finished goes to DONE
SLOW_RANK0 = """
import sys, time
from wsi_milssl.mil import selftrain
epoch, slow, done = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
real = selftrain.save_checkpoint
def save(ckpt, path):
    if path.name == "last.pt" and ckpt["epoch"] == epoch:
        time.sleep(slow)
        real(ckpt, path)
        open(done, "w").write(repr(time.time()))
        return
    return real(ckpt, path)
selftrain.save_checkpoint = save
from wsi_milssl.cli import main
raise SystemExit(main(sys.argv[4:]))
"""

# rank 1: prints a line without flushing it, and marks the interpreter's shutdown (atexit) in a file
MARKED_RANK1 = """
import atexit, sys
marker = sys.argv[1]
atexit.register(lambda: open(marker, "w").write("shutdown ran"))
print("rank 1 was here")
from wsi_milssl.cli import main
raise SystemExit(main(sys.argv[2:]))
"""

# rank 0: the disk fills up at the save of epoch EPOCH (ENOSPC)
FULL_DISK_RANK0 = """
import errno, sys
from wsi_milssl.atomic import output_error
from wsi_milssl.mil import selftrain
epoch = int(sys.argv[1])
real = selftrain.save_checkpoint
def save(ckpt, path):
    if ckpt["epoch"] == epoch:
        raise output_error(path, OSError(errno.ENOSPC, "No space left on device"))
    return real(ckpt, path)
selftrain.save_checkpoint = save
from wsi_milssl.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def _start_ranks(rank_argv: list[list[str]]) -> list[subprocess.Popen]:
    """Start ``python <argv>`` as the ranks of one gloo group (rank = position)."""
    port = free_port()
    procs = []
    for rank, argv in enumerate(rank_argv):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(rank_argv))}
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _ended_at(procs: list[subprocess.Popen], *, timeout_s: float = 240) -> list[float]:
    """Wait for ``procs``; the time.time() at which each was seen ended (within 10 ms)."""
    ended: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    while None in ended:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError("the ranks did not end")
        time.sleep(0.01)
    return ended  # type: ignore[return-value]


def _train(*args: str) -> list[str]:
    return ["train", *args, *COMMON]


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_the_other_ranks_end_after_rank_0_wrote_the_last_epoch_and_skip_the_interpreter_shutdown(tmp_path, mil_csv):
    """Finding 1. Rank 0's last save is made 3 s slow: rank 1 must not end before it is done (it used to
    end right after its last collective, so an abort at its exit let torchrun kill rank 0 mid-save), and
    rank 1 leaves without the interpreter's shutdown (where the abort came from), its output flushed."""
    run, done, marker = tmp_path / "run", tmp_path / "saved_at", tmp_path / "rank1_shutdown"
    (tmp_path / "rank0.py").write_text(SLOW_RANK0)
    (tmp_path / "rank1.py").write_text(MARKED_RANK1)
    args = _train(str(mil_csv), "--out", str(run), "--epochs", "2")
    procs = _start_ranks([[str(tmp_path / "rank0.py"), "2", "3", str(done), *args],
                          [str(tmp_path / "rank1.py"), str(marker), *args]])
    ended = _ended_at(procs)
    outputs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    saved_at = float(done.read_text())
    assert ended[1] >= saved_at, (ended[1] - saved_at, outputs)  # rank 1 waited for rank 0's last.pt
    assert torch.load(run / "last.pt", weights_only=True)["epoch"] == 2
    assert [h["epoch"] for h in _history(run)] == [1, 2]
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "last.pt", "metrics.jsonl"]  # no lock, no .tmp
    assert "rank 1 was here" in outputs[1]  # flushed before it left
    assert not marker.exists(), "rank 1 went through the interpreter's shutdown"


def test_a_rank_that_loses_rank_0_to_a_failed_save_names_that_epoch(tmp_path, mil_csv):
    """Finding 7. Rank 0 cannot save epoch 2 (full disk): rank 0 says so and how to resume; rank 1 said
    'lost the other ranks during epoch 3', the epoch it had gone on to."""
    run = tmp_path / "run"
    (tmp_path / "rank0.py").write_text(FULL_DISK_RANK0)
    args = _train(str(mil_csv), "--out", str(run), "--epochs", "3")
    procs = _start_ranks([[str(tmp_path / "rank0.py"), "2", *args], ["-m", "wsi_milssl", *args]])
    _ended_at(procs)
    first, second = (p.communicate()[0] for p in procs)
    assert procs[0].returncode == 1 and procs[1].returncode == 1, (first, second)
    assert "No space left on device" in first and "keeps the checkpoint of epoch 1" in first, first
    assert (f"rank 1: stopped with rank 0, which could not write the run folder {run} after epoch 2; rank 0's "
            "error says why and how to continue." in second), second
    assert "epoch 3" not in second and "Traceback" not in second, second
    assert torch.load(run / "last.pt", weights_only=True)["epoch"] == 1


def test_fewer_training_instances_than_ranks_are_refused_on_every_rank(tmp_path):
    """Finding 3. Two instances on three ranks: every epoch used to take 0 steps and report loss 0.0."""
    data = tmp_path / "tiny2.csv"
    data.write_text("1,1,0.9,0.1\n0,2,0.1,0.2\n")
    run = tmp_path / "run"
    procs = _start_ranks([["-m", "wsi_milssl", *_train(str(data), "--out", str(run), "--epochs", "2")]] * 3)
    _ended_at(procs)
    outputs = [p.communicate()[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 1, out
        assert (f"{data}: 2 training instances cannot be shared by 3 ranks: each rank needs at least 1 per step, "
                "so no step would be taken. Fix: fewer ranks (at most 2: torchrun's nodes x --nproc-per-node), or more "
                "training instances." in out), (rank, out)
        assert "Traceback" not in out
    assert not (run / "last.pt").exists() and not (run / "metrics.jsonl").exists()


class _Set:
    """What the check reads of an InstanceSet: its length and where it came from."""

    def __init__(self, n: int) -> None:
        self.n, self.source = n, "toy.csv"

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("batchnorm", [False, True])
def test_the_refusal_is_exactly_the_sizes_whose_epochs_give_a_rank_no_step(batchnorm):
    """Finding 3: the refusal matches the real split (without_lone_last, then rank_share): it refuses a
    size when, and only when, some rank would get no instance (BatchNorm: no batch of two)."""
    from wsi_milssl.mil.ranks import _check_shareable

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), *([torch.nn.BatchNorm1d(2)] if batchnorm else []))
    for world in (2, 3, 4):
        for n in range(1, 4 * world):
            for batch in (1, 2, 8):
                order = torch.randperm(n)
                if batchnorm:
                    order = without_lone_last(order, batch_size=batch, world_size=world)
                shares = [rank_share(order, batch_size=batch, ctx=DistContext(rank=r, world_size=world,
                                                                              backend="gloo"))
                          for r in range(world)]
                idle = any(s.numel() < (2 if batchnorm else 1) for s in shares)
                ctx = DistContext(rank=0, world_size=world, backend="gloo")
                if idle:
                    with pytest.raises(ConfigError, match=rf"{n} training instances cannot be shared by {world} ranks"):
                        _check_shareable(_Set(n), model, ctx)
                else:
                    _check_shareable(_Set(n), model, ctx)
    message = ""
    try:
        _check_shareable(_Set(3), model, DistContext(rank=0, world_size=2, backend="gloo"))
    except ConfigError as exc:
        message = str(exc)
    if batchnorm:
        assert "BatchNorm" in message and "train with one process (without torchrun)" in message, message
    else:
        assert message == ""


def test_a_resume_on_another_number_of_ranks_warns_that_the_global_batch_changes(tmp_path, mil_csv, monkeypatch,
                                                                                  capsys):
    """Finding 6. A run of 2 ranks (global batch 16) resumed by one process (8): it went on without a word,
    and config.json then said world size 1. The resume warns naming both, and every metrics.jsonl row
    keeps its epoch's world size."""
    run = tmp_path / "run"
    procs = _start_ranks([["-m", "wsi_milssl", *_train(str(mil_csv), "--out", str(run), "--epochs", "1")]] * 2)
    _ended_at(procs)
    outputs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", "--resume", str(run), "--epochs", "2", *COMMON]) == 0
    err = capsys.readouterr().err
    assert (f"{run / 'last.pt'}: epochs up to 1 ran on 2 rank(s) with a global batch of 16 (--batch-size 8 x 2), "
            "this resume runs on 1 with a global batch of 8, so the steps per epoch change from epoch 2 on. Fix: to "
            "keep the global batch, resume with 2 rank(s)" in err), err
    history = _history(run)
    assert [(h["epoch"], h["world_size"]) for h in history] == [(1, 2), (2, 1)]
    n = sum(1 for _ in mil_csv.open())
    two_ranks = n // 16 + (n % 16 >= 2)  # a last global batch of one instance cannot be shared by two ranks
    assert [history[0]["step"], history[1]["step"] - history[0]["step"]] == [two_ranks, int(np.ceil(n / 8))]
