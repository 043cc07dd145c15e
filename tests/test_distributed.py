"""Shards of slide lists and shares of training epochs (single-process parts of wsi_milssl.distributed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsi_milssl.distributed import (
    SINGLE,
    DistContext,
    gather_values,
    parse_shard,
    rank_share,
    shard_items,
    slide_shard,
    split_evenly,
)
from wsi_milssl.errors import ConfigError


def test_parse_shard_and_its_errors():
    assert parse_shard("0/4") == (0, 4) and parse_shard("3/4") == (3, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)


def test_slide_shard_prefers_the_option_then_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert slide_shard(None) == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert slide_shard(None) == (1, 3) and slide_shard("0/2") == (0, 2)


def test_shards_cover_every_item_once():
    items = [f"s{i}" for i in range(11)]
    shards = [shard_items(items, i, 3) for i in range(3)]
    assert sorted(sum(shards, [])) == sorted(items) and [len(s) for s in shards] == [4, 4, 3]
    assert shard_items(items, 0, 1) == items


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
