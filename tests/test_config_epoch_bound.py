"""Epoch counts are bounded: ``epochs = 10**30`` was accepted and the run trained until killed (review ES)."""
import pytest

from wsi_milssl.config.train import MAX_EPOCHS, TrainConfig
from wsi_milssl.errors import ConfigError


@pytest.mark.parametrize("field", ["epochs", "mu_ramp_epochs", "warmup_epochs"])
def test_an_epoch_count_past_the_bound_is_one_config_error(field):
    with pytest.raises(ConfigError, match=rf"TrainConfig\.{field} must satisfy value <= {MAX_EPOCHS}; got 10{{30}}\.$"):
        TrainConfig(mode="features", **{field: 10**30})


def test_the_bound_itself_is_accepted():
    config = TrainConfig(mode="features", epochs=MAX_EPOCHS, mu_ramp_epochs=MAX_EPOCHS, warmup_epochs=MAX_EPOCHS - 1)
    assert config.epochs == MAX_EPOCHS
