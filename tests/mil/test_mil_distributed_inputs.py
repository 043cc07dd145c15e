"""Two gloo ranks started by hand (RANK/WORLD_SIZE as torchrun sets them), so each rank can be given its
own command: ranks given different settings or data stop at the start with one error naming what
differs, and a rank lost in any collective of an epoch (refresh, validation, the agreement check) is
the one 'lost the other ranks' error, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from processes import free_port

COMMON = ["--threads", "1", "--workers", "0", "--device", "cpu", "--no-plots", "--batch-size", "16"]

# rank 1 of the lost-peer tests: the train command whose selftrain.<name> kills the process when called
DYING_RANK = """
import os, sys
from wsi_milssl.mil import selftrain
setattr(selftrain, sys.argv[1], lambda *a, **k: os._exit(3))
from wsi_milssl.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def _two_ranks(rank_argv: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run ``python <argv>`` as rank 0 and rank 1 of one gloo group; their results."""
    port = free_port()
    procs = []
    for rank, argv in enumerate(rank_argv):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outputs)]


def _train(*args: str) -> list[str]:
    return ["-m", "wsi_milssl", "train", *args, *COMMON]


def test_ranks_with_different_settings_stop_at_the_start_naming_the_setting(tmp_path, mil_csv):
    out = tmp_path / "run"
    done = _two_ranks([_train(str(mil_csv), "--out", str(out), "--epochs", "1"),
                       _train(str(mil_csv), "--out", str(out), "--epochs", "3")])
    for rank in done:
        assert rank.returncode != 0, rank.stdout
        assert "rank 1's settings or data differ from rank 0's: epochs 3 vs 1" in rank.stdout, rank.stdout
        assert "same command" in rank.stdout and "Traceback" not in rank.stdout
    assert not (out / "last.pt").exists()


def test_ranks_given_different_data_stop_at_the_start(tmp_path, mil_csv, mil_csv_val):
    out = tmp_path / "run"
    done = _two_ranks([_train(str(mil_csv), "--out", str(out), "--epochs", "1"),
                       _train(str(mil_csv_val), "--out", str(out), "--epochs", "1")])
    for rank in done:
        assert rank.returncode != 0, rank.stdout
        assert "differ from rank 0's: training data" in rank.stdout, rank.stdout
        assert "Traceback" not in rank.stdout


# the three collectives share one error path (mil/ranks.py): the default run loses the rank in the first
@pytest.mark.parametrize("dies_in", ["refresh_pseudo_labels", pytest.param("evaluate", marks=pytest.mark.slow),
                                     pytest.param("_ranks_agree", marks=pytest.mark.slow)])
def test_a_rank_lost_in_any_collective_of_an_epoch_is_one_clear_error(tmp_path, mil_csv, mil_csv_val, dies_in):
    script = tmp_path / "dying_rank.py"
    script.write_text(DYING_RANK)
    out = tmp_path / "run"
    args = [str(mil_csv), "--val", str(mil_csv_val), "--out", str(out), "--epochs", "2"]
    first, second = _two_ranks([_train(*args), [str(script), dies_in, "train", *args, *COMMON]])
    assert second.returncode == 3, second.stdout
    assert first.returncode != 0, first.stdout
    assert "rank 0: lost the other ranks during epoch 1" in first.stdout, first.stdout
    assert "Traceback" not in first.stdout
    # nothing of the run was saved: the fix is to start it again, not --resume
    assert "start the run again" in first.stdout and "--resume" not in first.stdout, first.stdout


def test_resume_of_a_run_that_saved_no_epoch_says_last_pt_is_missing(tmp_path, mil_csv):
    from wsi_milssl.errors import CheckpointError
    from wsi_milssl.mil.run_folder import missing_checkpoint_error

    (tmp_path / "config.json").write_text("{}\n")
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    message = str(missing_checkpoint_error(tmp_path))
    assert isinstance(missing_checkpoint_error(tmp_path), CheckpointError)
    assert "last.pt is missing" in message and "never finished" in message and "same --out" in message
    assert "no last.pt/config.json" not in message
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no last.pt to resume from" in str(missing_checkpoint_error(empty))


def test_the_start_check_compares_a_weights_file_not_how_each_node_spells_its_path(tmp_path, mil_csv, monkeypatch):
    from types import SimpleNamespace

    import torch.distributed as tdist

    from wsi_milssl.config import TrainConfig
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.mil.data import read_mil_csv
    from wsi_milssl.mil.ranks import _same_inputs

    data = read_mil_csv(mil_csv)
    (tmp_path / "w.pth").write_bytes(b"weights")
    (tmp_path / "other.pth").write_bytes(b"other weights")
    dist = SimpleNamespace(enabled=True, world_size=2, rank=0)

    def gathered(rank0_path, rank1_path):
        sent = {}
        def keep(out, obj):  # rank 1's own call: what it sends
            sent["x"] = obj
            out[:] = [obj, obj]

        monkeypatch.setattr(tdist, "all_gather_object", keep)
        _same_inputs(TrainConfig(mode="features", weights_path=str(rank1_path)), data, None, resume=False,
                     eval_at=None, dist=dist)
        theirs = sent["x"]
        monkeypatch.setattr(tdist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, theirs]))
        _same_inputs(TrainConfig(mode="features", weights_path=str(rank0_path)), data, None, resume=False,
                     eval_at=None, dist=dist)

    monkeypatch.chdir(tmp_path)
    gathered(tmp_path / "w.pth", "w.pth")  # one file, two spellings: no error
    with pytest.raises(ConfigError, match="weights_path"):
        gathered(tmp_path / "w.pth", tmp_path / "other.pth")
