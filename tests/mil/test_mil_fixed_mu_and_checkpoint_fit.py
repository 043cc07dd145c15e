"""Review EA (mutation test): ``fixed_mu`` held μ from the first epoch in no test (dropping it ramped μ from 0.5
silently), and a checkpoint missing weights loaded with ``strict=False`` went unnoticed."""

from __future__ import annotations

import re

import pytest
import torch

from wsi_milssl.config.train import TrainConfig
from wsi_milssl.errors import CheckpointError
from wsi_milssl.mil import fit, load_model, read_mil_csv


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{**dict(mode="features", epochs=3, batch_size=64, mu=0.2, mu_ramp_epochs=5, plots=False,
                                 threads=1), **kw})


@pytest.mark.parametrize("fixed, expected", [(True, [0.2, 0.2, 0.2]), (False, [0.5, 0.44, 0.38])])
def test_fixed_mu_holds_mu_from_the_first_epoch_and_the_ramp_starts_at_one_half(tmp_path, mil_csv, fixed, expected):
    result = fit(read_mil_csv(mil_csv), config=_config(fixed_mu=fixed), out_dir=tmp_path / "run")
    assert [round(row["mu_t"], 6) for row in result.history] == expected


def test_a_checkpoint_missing_a_weight_is_refused_naming_the_weight(tmp_path, mil_csv):
    fit(read_mil_csv(mil_csv), config=_config(epochs=1), out_dir=tmp_path / "run")
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    dropped = sorted(ckpt["model"])[-1]
    del ckpt["model"][dropped]
    torch.save(ckpt, tmp_path / "damaged.pt")
    with pytest.raises(CheckpointError, match=rf"(?s)damaged\.pt: weights do not fit model 'mlp' .*Missing key.*{re.escape(dropped)}"):
        load_model(tmp_path / "damaged.pt")
