"""Review AB, findings 2 and 4: the subcommands under torchrun with several ranks. Those that do not split
their work between the ranks are refused once, before they start (every rank used to run all of it into
the same files); train's progress and info lines come from rank 0 alone, and the other ranks' errors and
warnings carry a ``[rank r]`` tag; a slide stage's rank names its shard in its summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from wsi_milssl.cli import main

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "wsi_milssl"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}


def _argv(command: str, tmp_path) -> list[str]:
    """A command line of ``command`` that would write into tmp_path/out."""
    out, some = str(tmp_path / "out"), str(tmp_path)
    return {
        "synth": ["synth", out, "--slides", "1", "--size-px", "1024", "1024"],
        "evaluate": ["evaluate", "--predictions", some, "--annotations", some, "--slides", some, "--labels",
                     str(tmp_path / "labels.csv"), "--out", out],
        "run": ["run", str(tmp_path / "tiny.toml"), "--out", out],
        "info": ["info", str(tmp_path / "a.tif")],
        "demo": ["demo", out],
        "prepare": ["prepare", "camelyon16", some, "--out", out],
        "features": ["features", some, "--out", out],
        "heatmap --features": ["heatmap", "--features", some, "--model", str(tmp_path / "m.pt"), "--out", out],
    }[command]


NOT_SPLIT = ["synth", "evaluate", "run", "info", "demo", "prepare"]


@pytest.mark.parametrize("command", NOT_SPLIT + ["features", "heatmap --features"])
def test_a_command_that_is_not_split_between_ranks_is_refused_before_it_starts(tmp_path, monkeypatch, capsys,
                                                                               command):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert main(_argv(command, tmp_path)) == 2
    err = capsys.readouterr().err
    # review DA: set by hand (no torchrun agent), the message does not say torchrun started them
    assert err.startswith("error: 2 ranks (RANK and WORLD_SIZE are set, without torchrun): "), err
    assert err.count("\n") == 1, err
    assert "Fix: unset RANK and WORLD_SIZE (something other than torchrun set them) and run one process" in err, err
    if command in NOT_SPLIT:
        assert f"`wsi-milssl {command}` is not split between ranks" in err
    assert not (tmp_path / "out").exists()


def test_another_rank_started_by_hand_tags_its_refusal(tmp_path, monkeypatch, capsys):
    """RANK/WORLD_SIZE set by hand (no torchrun agent to end the rank): rank 1 says so itself, tagged."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert main(_argv("synth", tmp_path)) == 2
    assert capsys.readouterr().err.startswith("[rank 1] error: 2 ranks (RANK and WORLD_SIZE are set, without "
                                              "torchrun): `wsi-milssl synth` is not split")
    assert not (tmp_path / "out").exists()


def test_one_rank_is_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["-q", *_argv("synth", tmp_path)]) == 0


def test_synth_under_torchrun_is_refused_once_and_writes_nothing(tmp_path):
    """The reviewer's repro: every rank ran synth into one folder, one stopped on the other's lock and
    torchrun killed the other mid-write, leaving the lock. Now rank 0 refuses once (exit 2) and rank 1
    says nothing (torchrun ends it when rank 0 exits)."""
    out = tmp_path / "syn_tr"
    proc = subprocess.run([*TORCHRUN, "synth", str(out), "--slides", "1", "--size-px", "1024", "1024"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error: " in line and "torchrun's 2 ranks" in line]
    assert errors == ["error: torchrun's 2 ranks: `wsi-milssl synth` is not split between ranks (every rank "
                      "would run all of it, into the same files). Fix: run one process without torchrun; only "
                      "train, tile, label and heatmap run under torchrun."], proc.stderr
    assert "another wsi-milssl run" not in proc.stderr
    assert not out.exists()


def test_train_reports_once_under_torchrun(tmp_path, mil_csv):
    """The reviewer's second repro: 'training mlp on cpu ...' and each 'epoch k/2 loss ...' line came
    twice, once per rank, untagged, in the log file and on stderr. They come from rank 0 alone."""
    log = tmp_path / "lf.log"
    proc = subprocess.run([*TORCHRUN, "--log-file", str(log), "-v", "train", str(mil_csv), "--out",
                           str(tmp_path / "run"), "--epochs", "2", "--batch-size", "8", "--device", "cpu"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = log.read_text()
    for printed in (text, proc.stderr):
        assert len(re.findall(r"INFO wsi_milssl\.mil\.selftrain: training mlp on ", printed)) == 1, printed
        assert len(re.findall(r"INFO wsi_milssl\.mil\.selftrain: epoch 1/2 loss ", printed)) == 1, printed
        assert len(re.findall(r"INFO wsi_milssl\.mil\.selftrain: epoch 2/2 loss ", printed)) == 1, printed
    assert "[rank 1]" not in text


def test_an_error_of_another_train_rank_is_tagged(tmp_path, monkeypatch, capsys):
    """An error raised on rank 1 before the ranks meet (here --resume of a folder without last.pt) names
    its rank, on stderr and in the log file."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "run").mkdir()
    log = tmp_path / "lf.log"
    assert main(["--log-file", str(log), "train", "--resume", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("[rank 1] error: ") and "last.pt" in err, err
    assert re.search(r"^\S+ \S+ \[rank 1\] ERROR wsi_milssl\.cli: error: .*last\.pt", log.read_text(), re.M)


def test_a_label_shard_names_its_shard(four_slides, tmp_path, capsys):
    """Each rank (or --shard task) of a slide stage prints its own summary; label's names the shard, as
    tile's does (``tiled 2 slide(s) (shard 1/2): ...``)."""
    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import find_slides, tile_slides

    slides, annotations = four_slides
    stores = tmp_path / "stores"
    assert tile_slides(find_slides([slides])[:1], stores, TileConfig(magnification=5, patch_size_px=256,
                                                                     pixels="none", threads=1)).ok
    assert main(["label", str(stores), "--annotations", str(annotations), "--out", str(tmp_path / "labels"),
                 "--shard", "0/2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^labels of \d store\(s\) \(shard 0/2\):$", out, re.M), out
    assert main(["label", str(stores), "--annotations", str(annotations), "--out", str(tmp_path / "labels")]) == 0
    assert "(shard" not in capsys.readouterr().out


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_usage_error_under_torchrun_is_printed_by_rank_0_alone(monkeypatch, capsys, rank):
    """Review DA: every rank parses the same command line, so a misspelt option printed its usage error once per
    rank (8 copies on 8 GPUs), the others untagged. The others wait for torchrun's agent to end them (as it does
    once rank 0 exits), and say it themselves after the wait (review DU: a node without rank 0 said nothing)."""
    import wsi_milssl.cli as cli

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    waits = []

    def ended_by_the_agent(seconds):  # torchrun's agent ends the rank while it waits
        waits.append(seconds)
        raise SystemExit(-15)

    monkeypatch.setattr(cli.time, "sleep", ended_by_the_agent)
    with pytest.raises(SystemExit) as stop:
        main(["train", "x.csv", "--out", "o", "--epochz", "3"])
    assert stop.value.code == (2 if rank == "0" else -15) and waits == ([] if rank == "0" else [cli.RANK0_WAIT_S])
    err = capsys.readouterr().err
    assert ("unrecognized arguments: --epochz 3" in err) == (rank == "0"), err
    if rank == "1":  # not ended (another node's agent): said after the wait
        monkeypatch.setattr(cli.time, "sleep", waits.append)
        with pytest.raises(SystemExit) as stop:
            main(["train", "x.csv", "--out", "o", "--epochz", "3"])
        assert stop.value.code == 2 and "unrecognized arguments: --epochz 3" in capsys.readouterr().err
