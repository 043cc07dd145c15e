"""Review AM, finding 4: under torchrun every rank picked the automatic reader count (--workers -1) as if it had
the machine to itself, so N ranks started N x (CPUs - 2) readers. The automatic count is now divided by the
ranks on the machine (torchrun's LOCAL_WORLD_SIZE), at least the rule's minimum; an explicit count is kept."""

from __future__ import annotations

import os

import pytest

from wsi_milssl.config import HeatmapConfig, TrainConfig
from wsi_milssl.inference import resolve_runtime as inference_runtime
from wsi_milssl.mil.selftrain import resolve_runtime as train_runtime


@pytest.mark.parametrize("ranks, readers", [(None, 4), ("1", 4), ("2", 2), ("3", 1), ("8", 0)])
def test_train_auto_readers_are_shared_by_the_ranks_of_a_machine(monkeypatch, ranks, readers):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # a machine of 8 CPUs: min(4, 8 - 1) = 4 readers for one process
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    config = TrainConfig(mode="images", model="resnet18", device="cpu")
    assert train_runtime(config).num_workers == readers
    assert train_runtime(TrainConfig(mode="images", model="resnet18", device="cpu", num_workers=3)).num_workers == 3


@pytest.mark.parametrize("ranks, readers", [(None, 4), ("2", 2), ("3", 1), ("16", 1)])
def test_heatmap_auto_readers_are_shared_by_the_ranks_of_a_machine(monkeypatch, ranks, readers):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # min(4, max(2, 8)) = 4 readers for one process
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert inference_runtime(HeatmapConfig(device="cpu")).num_workers == readers
    assert inference_runtime(HeatmapConfig(device="cpu", num_workers=3)).num_workers == 3


def test_a_malformed_local_world_size_counts_as_one_rank(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    assert inference_runtime(HeatmapConfig(device="cpu")).num_workers == 4
