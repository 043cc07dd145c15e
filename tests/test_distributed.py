"""Shards of slide lists and shares of training epochs (single-process parts of wsi_milssl.distributed)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from wsi_milssl.distributed import (
    SINGLE,
    Shard,
    DistContext,
    gather_values,
    parse_shard,
    rank_share,
    shard_items,
    shard_of,
    slide_shard,
    split_evenly,
)
from wsi_milssl.errors import ConfigError


def test_parse_shard_and_its_errors():
    assert parse_shard("0/4") == (0, 4) and parse_shard("3/4") == (3, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)


def test_slide_shard_is_the_option_else_torchrun(monkeypatch):
    """--shard splits by hash, torchrun's rank by position; --shard under torchrun with several ranks
    (the two would split the slides differently) is refused."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert slide_shard(None) == Shard(0, 1) and slide_shard("1/2") == Shard(1, 2, "hash")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as torchrun sets it
    assert slide_shard(None) == Shard(1, 3, "position")
    with pytest.raises(ConfigError, match=r"--shard 0/2 under torchrun \(RANK=1, WORLD_SIZE=3\).*Fix: drop --shard"):
        slide_shard("0/2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank: --shard is the only split
    assert slide_shard("1/2") == Shard(1, 2, "hash")


def test_rank_variables_without_a_launcher_are_refused_before_any_work(monkeypatch):
    """Review BJ: RANK and WORLD_SIZE left by another launcher or an outer job (no torchrun, no MASTER_ADDR): tile
    and heatmap did 1/N of the slides and then failed with torch's traceback at their end, train at its start."""
    from wsi_milssl.distributed import init_group

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = (r"^RANK=0 and WORLD_SIZE=2 are set, but not by torchrun, and MASTER_ADDR and MASTER_PORT are not: the "
               r"2 processes could not meet, and this one would do its 1/2 of the work alone\. Fix: launch with "
               r"torchrun, set MASTER_ADDR and MASTER_PORT for ranks started by hand, or unset RANK and WORLD_SIZE")
    with pytest.raises(ConfigError, match=message):
        slide_shard(None)
    with pytest.raises(ConfigError, match=message):
        init_group("cpu")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # ranks started by hand, as the README's other launchers do
    with pytest.raises(ConfigError, match=r"and MASTER_PORT is not: "):
        slide_shard(None)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert slide_shard(None) == Shard(0, 2, "position")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank meets no one
    monkeypatch.delenv("MASTER_ADDR")
    assert slide_shard(None) == Shard(0, 1, "position")


def _no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_shards_cover_every_item_once(monkeypatch):
    _no_torchrun(monkeypatch)
    items = [f"s{i}" for i in range(11)]
    shards = [shard_items(items, i, 3, name=str) for i in range(3)]
    assert sorted(sum(shards, [])) == sorted(items)
    assert all(shard == [s for s in items if shard_of(s, 3) == i] for i, shard in enumerate(shards))  # list order
    assert shard_items(items, 0, 1, name=str) == items


def test_an_items_shard_is_its_names_hash_on_any_list(monkeypatch):
    """Separate shards (--shard I/N) given different lists (an array task started after a slide was
    added, another after one was removed, in another order): every item is in the same shard on every
    list, so no item is done by two shards, and every item on all the lists is done once."""
    _no_torchrun(monkeypatch)
    assert [shard_of(f"Tumor_{k:03d}", 8) for k in range(1, 9)] == [0, 0, 6, 6, 3, 3, 0, 3]  # never changes
    a = [f"Tumor_{k:03d}" for k in range(1, 41)]
    b = sorted([*a[5:], "Tumor_001x", "Normal_001"], reverse=True)
    common = set(a) & set(b)
    done = sum((shard_items(a if i % 2 else b, i, 4, name=str) for i in range(4)), [])  # shards 0, 2 on b
    assert len(done) == len(set(done)) and common <= set(done)  # none twice, every item of both lists once
    for i in range(4):
        assert common & set(shard_items(a, i, 4, name=str)) == common & set(shard_items(b, i, 4, name=str))


def test_torchrun_ranks_split_one_list_by_position(monkeypatch):
    """Ranks of one torchrun job start together on one list: every N-th item from the I-th (equal
    shares). How a shard splits is its own (Shard.by), whatever the environment says: a pair (I, N)
    splits by name, also in a process whose rank and world size are (I, N)."""
    items = [f"s{i}" for i in range(11)]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    assert shard_items(items, *slide_shard(None), name=str) == ["s1", "s4", "s7", "s10"]
    assert shard_items(items, *Shard(1, 3, "position"), name=str) == ["s1", "s4", "s7", "s10"]
    by_hash = [s for s in items if shard_of(s, 3) == 1]
    assert by_hash != ["s1", "s4", "s7", "s10"]
    assert shard_items(items, 1, 3, name=str) == shard_items(items, *Shard(1, 3), name=str) == by_hash
    _no_torchrun(monkeypatch)
    assert shard_items(items, *Shard(1, 3, "position"), name=str) == ["s1", "s4", "s7", "s10"]


def test_the_end_of_a_plain_or_a_shard_run_does_not_import_torch():
    """Without torchrun, a slide stage's end (failed_exit) waits for no rank and imports no torch (tile and
    label run without it)."""
    code = ("import sys\n"
            "from wsi_milssl.cli.sharding import failed_exit\n"
            "from argparse import Namespace\n"
            "from wsi_milssl.distributed import Shard\n"
            "assert failed_exit(Namespace(shard=None), Shard(0, 1), 0, status_csv='s.csv') == 0\n"
            "assert failed_exit(Namespace(shard='1/2'), Shard(1, 2), 1, status_csv='s.csv') == 1\n"
            "print('torch' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "False\n"
    assert proc.stderr == "error: 1 slide(s) failed (shard 1/2); see s.csv\n"


@pytest.mark.parametrize("n", [64, 70, 257])
def test_rank_shares_are_the_global_batches_cut_in_pieces(n):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    shares = [rank_share(order, batch_size=16, ctx=DistContext(rank=r, world_size=2)) for r in range(2)]
    steps = [(len(s) + 15) // 16 for s in shares]
    assert steps[0] == steps[1]  # every rank takes the same number of steps
    for k in range(n // 32):  # global batch k = rank 0's batch k then rank 1's
        glob = torch.cat([s[16 * k:16 * (k + 1)] for s in shares])
        assert torch.equal(glob, order[32 * k:32 * (k + 1)])
    seen = torch.cat(shares)
    assert len(set(seen.tolist())) == len(seen)
    tail = n % 32
    assert len(seen) == n - (tail if tail < 2 else 0)
    assert torch.equal(rank_share(order, batch_size=16, ctx=SINGLE), order)


def test_split_and_gather_on_one_process():
    idx = np.arange(10)
    assert np.array_equal(split_evenly(idx, SINGLE), idx)
    assert [len(split_evenly(idx, DistContext(rank=r, world_size=3))) for r in range(3)] == [4, 3, 3]
    out = gather_values([0.5, 0.25], [3, 1], size=5, ctx=SINGLE)
    assert out.dtype == np.float32 and out[3] == 0.5 and out[1] == 0.25 and np.isnan(out[[0, 2, 4]]).all()


def test_a_ranks_own_error_is_raised_without_waiting_for_rank0(monkeypatch):
    """Review BJ: a patch only rank 1 reads made it wait 60 s for rank 0 to report the 'same' error first (72 s
    against 9 s in one process). Errors every rank shares still wait; the rank's own are raised at once."""
    import wsi_milssl.distributed as distributed
    from wsi_milssl.distributed import reported_by_rank0
    from wsi_milssl.errors import ReaderLostError, StoreError, StoreReadError

    waits = []
    monkeypatch.setattr(distributed.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    own = (StoreReadError, ReaderLostError)
    for error in (StoreReadError("store.h5: cannot read patch 50"), ReaderLostError("a reader process stopped")):
        with pytest.raises(type(error)):
            with reported_by_rank0(wait_s=60, own_errors=own):
                raise error
    assert waits == []
    for shared in (ConfigError("a training set too small for 2 ranks"),
                   StoreError("the model gives NaN or infinite probabilities for 1 of the 4 bags")):  # review BL
        with pytest.raises(type(shared)):
            with reported_by_rank0(wait_s=60, own_errors=own):
                raise shared
    assert waits == [60, 60]
    with pytest.raises(StoreError):  # without own_errors: every error waits, as before
        with reported_by_rank0(wait_s=60):
            raise StoreReadError("store.h5: cannot read patch 50")
    assert waits == [60, 60, 60]
