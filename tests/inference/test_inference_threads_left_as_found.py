"""Review AX, A2: ``fit``, ``make_heatmaps``, ``extract_features`` and the benchmarks set torch's thread count
for the whole process (their ``threads`` setting) and left it set, so a later call in the same process (a
notebook, a pipeline) with ``threads = 0`` ("leave torch's count") trained with the count an earlier call had
set: other float sums, other weights (0.159 apart after 2 epochs), while both runs recorded ``threads: 0``.
Each now gives back the count it found (:func:`wsi_milssl.runtime.restores_torch_settings`)."""

from __future__ import annotations

import torch

from wsi_milssl.config import HeatmapConfig, TrainConfig
from wsi_milssl.inference import make_heatmaps
from wsi_milssl.mil import fit, read_mil_csv
from wsi_milssl.runtime import restores_torch_settings


def _other_count() -> int:
    """A thread count other than 1, which the calls below ask for."""
    torch.set_num_threads(2 if torch.get_num_threads() == 1 else torch.get_num_threads())
    return torch.get_num_threads()


def test_fit_gives_back_the_thread_count_it_found(tmp_path, mil_csv):
    before = _other_count()
    fit(read_mil_csv(mil_csv), config=TrainConfig(mode="features", epochs=1, threads=1, plots=False),
        out_dir=tmp_path / "run")
    assert torch.get_num_threads() == before


def test_make_heatmaps_gives_back_the_thread_count_it_found(tmp_path, tumour_slide, checkpoint_factory):
    before = _other_count()
    run = make_heatmaps([tumour_slide], checkpoint_factory(), tmp_path / "hm",
                        HeatmapConfig(thumbnail_px=128, batch_size=64, num_workers=0, threads=1))
    assert [r.status for r in run.results] == ["ok"]
    assert torch.get_num_threads() == before


def test_the_count_is_given_back_when_the_call_raises():
    before = _other_count()

    @restores_torch_settings
    def stage():
        torch.set_num_threads(1)
        raise KeyboardInterrupt

    try:
        stage()
    except KeyboardInterrupt:
        pass
    assert torch.get_num_threads() == before


def test_cudnn_flags_are_given_back_too():
    """Review DB: fit made cuDNN deterministic (and turned benchmark off) on CUDA, inference turned benchmark on, and
    both stayed so for the rest of the caller's process."""
    cudnn = torch.backends.cudnn
    before = (cudnn.benchmark, cudnn.deterministic)

    @restores_torch_settings
    def stage() -> None:
        cudnn.benchmark, cudnn.deterministic = (not before[0], not before[1])

    stage()
    assert (cudnn.benchmark, cudnn.deterministic) == before
