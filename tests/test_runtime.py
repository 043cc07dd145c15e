"""wsi_milssl.runtime: the device and precision rules training and inference share."""

from __future__ import annotations

import pytest
import torch

from wsi_milssl import runtime
from wsi_milssl.errors import ConfigError


def test_device_choice_and_the_error_for_a_missing_gpu():
    assert runtime.pick_device("cpu", owner="X").type == "cpu"
    if torch.cuda.is_available():
        assert runtime.pick_device("cuda", owner="X").type == "cuda"
        assert runtime.pick_device("auto", owner="X").type == "cuda"
    else:
        assert runtime.pick_device("auto", owner="X").type == "cpu"
        with pytest.raises(ConfigError, match=r"TrainConfig\.device is 'cuda' but no CUDA device"):
            runtime.pick_device("cuda", owner="TrainConfig")


def test_precision_rules_and_description():
    cpu = torch.device("cpu")
    assert runtime.pick_amp_dtype("auto", cpu) is torch.bfloat16
    assert runtime.pick_amp_dtype("auto", cpu, cpu_auto="off") is None
    assert runtime.pick_amp_dtype("fp16", cpu) is torch.float16 and runtime.pick_amp_dtype("off", cpu) is None
    with runtime.autocast(cpu, torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    with runtime.autocast(cpu, None):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32
    assert runtime.describe(cpu, None, workers=2) == "cpu amp=off workers=2"
    assert runtime.describe(cpu, torch.bfloat16, channels_last=True) == "cpu amp=bfloat16 channels_last=True"


def test_inference_batch_size_auto_is_larger_on_a_gpu_and_an_explicit_size_is_kept():
    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.config.features import FeaturesConfig

    assert HeatmapConfig().batch_size == 0 and FeaturesConfig().batch_size == 0  # auto by default
    assert runtime.inference_batch_size(0, torch.device("cuda")) == 256
    assert runtime.inference_batch_size(0, torch.device("cpu")) == 64
    assert runtime.inference_batch_size(32, torch.device("cuda")) == 32
    with pytest.raises(ConfigError, match=r"HeatmapConfig\.batch_size"):
        HeatmapConfig(batch_size=-1)
