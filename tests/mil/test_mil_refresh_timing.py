"""metrics.jsonl's refresh_seconds counts the pseudo-label refreshes inside an epoch (``refresh_every``
> 0), and instances_per_second leaves them out (review AG: before, refresh_seconds was 0.0 there and
the refresh passes were counted as training time)."""

from __future__ import annotations

import json
import time

from wsi_milssl.config.train import TrainConfig
from wsi_milssl.mil import fit, read_mil_csv
from wsi_milssl.mil import selftrain

REFRESH_DELAY_S = 0.2  # each refresh is made this much slower, to tell its time from training's


def test_refresh_seconds_counts_refreshes_within_epochs(tmp_path, mil_csv, monkeypatch):
    real = selftrain.refresh_pseudo_labels
    calls = []

    def slow_refresh(*args, **kwargs):
        calls.append(1)
        time.sleep(REFRESH_DELAY_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(selftrain, "refresh_pseudo_labels", slow_refresh)
    train = read_mil_csv(mil_csv)
    steps_per_epoch = len(train) // 64
    config = TrainConfig(mode="features", epochs=3, batch_size=64, refresh_every=max(steps_per_epoch // 2, 1),
                         warmup_epochs=1, plots=False, threads=1)
    fit(train, config=config, out_dir=tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and len(calls) >= 4  # at least two refreshes in each epoch after the warm-up
    assert rows[0]["refresh_seconds"] == 0.0  # warm-up: no refresh
    assert sum(row["refresh_seconds"] for row in rows) >= len(calls) * REFRESH_DELAY_S, rows
    for row in rows[1:]:
        assert REFRESH_DELAY_S <= row["refresh_seconds"] < row["train_seconds"], row
        training_s = row["train_seconds"] - row["refresh_seconds"]
        assert abs(row["instances_per_second"] * training_s - len(train)) < 1e-6 * len(train), row


def test_the_first_epoch_after_the_warm_up_refreshes_before_its_first_step(mil_csv, monkeypatch):
    """Review BV: with refresh_every > 0 the first refresh waited for the next multiple of refresh_every steps, so
    the warm-up's all-positive labels trained on past the warm-up (up to 2.5 epochs instead of 1), and no refresh
    ran at μ of the first epoch after it."""
    real = selftrain.refresh_pseudo_labels
    steps_per_epoch = -(-len(read_mil_csv(mil_csv)) // 64)  # batches of 64, the last one partial
    refreshes: list[tuple[int, float, float]] = []  # (epoch, μ_t, mean target of positive-bag instances before)

    def recording(model, instances, state, *, mu_t, **kwargs):
        refreshes.append((len(refreshes), mu_t, float(state.targets[state.pos_index].mean())))
        return real(model, instances, state, mu_t=mu_t, **kwargs)

    monkeypatch.setattr(selftrain, "refresh_pseudo_labels", recording)
    config = TrainConfig(mode="features", epochs=3, batch_size=64, refresh_every=2 * steps_per_epoch,
                         warmup_epochs=1, mu=0.2, mu_ramp_epochs=2, plots=False, threads=1)
    fit(read_mil_csv(mil_csv), config=config)
    # the first refresh comes at the first step after the warm-up (epoch 2, μ_1 = 0.35), when every positive-bag
    # instance is still the warm-up's positive; the next at step 2 * steps_per_epoch, the first of epoch 3 (μ_2 = 0.2)
    assert [round(mu, 6) for _, mu, _ in refreshes] == [0.35, 0.2]
    assert refreshes[0][2] == 1.0 and refreshes[1][2] < 1.0
