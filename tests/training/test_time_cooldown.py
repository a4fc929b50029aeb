"""TimeBudgetCooldown: the learning rate anneals to zero over the last minutes of max_time."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Timer
from torch.optim.lr_scheduler import LambdaLR

from multihead.training import TimeBudgetCooldown
from multihead.training.run import train


class FakeTimer(Timer):
    def __init__(self, remaining_s: float) -> None:
        super().__init__(duration="00:01:00:00")
        self.remaining_s = remaining_s

    def time_remaining(self, stage=None) -> float:
        return self.remaining_s


def fake_fit(timer: Timer, lr: float = 0.1):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = LambdaLR(optimizer, lambda step: 1.0)
    trainer = SimpleNamespace(callbacks=[timer], optimizers=[optimizer])
    module = SimpleNamespace(logged={}, log=lambda k, v: module.logged.__setitem__(k, v))
    return trainer, module, optimizer, scheduler


def test_scales_the_rate_by_the_fraction_of_the_window_left() -> None:
    timer = FakeTimer(remaining_s=15 * 60)
    trainer, module, optimizer, scheduler = fake_fit(timer)
    cooldown = TimeBudgetCooldown(minutes=30)
    for remaining_min, expected in [(45, 0.1), (15, 0.05), (15, 0.05), (3, 0.01), (-1, 0.0)]:
        timer.remaining_s = remaining_min * 60
        cooldown.on_train_batch_start(trainer, module, None, 0)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
        assert module.logged["train/lr_cooldown_factor"] == pytest.approx(expected / 0.1)
        optimizer.step()
        scheduler.step()  # resets the rate from its base value: scaling must not compound


def test_off_by_default_and_needs_max_time_when_on() -> None:
    trainer, module, optimizer, _ = fake_fit(FakeTimer(remaining_s=0))
    TimeBudgetCooldown().on_train_batch_start(trainer, module, None, 0)
    assert optimizer.param_groups[0]["lr"] == 0.1 and module.logged == {}

    no_timer = SimpleNamespace(callbacks=[], optimizers=[optimizer])
    with pytest.raises(ValueError, match=r"minutes=30 needs trainer.max_time"):
        TimeBudgetCooldown(minutes=30).on_fit_start(no_timer, module)
    with pytest.raises(ValueError, match=r"minutes must be >= 0, got -5"):
        TimeBudgetCooldown(minutes=-5)


def test_smoke_run_logs_a_falling_factor(smoke_config, tmp_path: Path) -> None:
    """A window far longer than the budget: the factor is below 1 from the first step, falls."""
    cfg = smoke_config(
        "callbacks.time_cooldown.minutes=100000",
        "trainer.max_time=00:00:30:00",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=1",
        "test=false",
        "summary.decode_speed=false",
    )
    train(cfg)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    factors = [float(r["train/lr_cooldown_factor"]) for r in rows if r["train/lr_cooldown_factor"]]
    assert len(factors) >= 5
    assert all(0 < f < 30 / 100000 for f in factors)
    assert factors == sorted(factors, reverse=True)
    # The logged rate is the scaled one: below the smoke peak rate (3e-3) times the factor.
    rates = [float(r["lr-Adam"]) for r in rows if r["lr-Adam"]]
    assert rates and all(0 < lr < 3e-3 * 30 / 100000 for lr in rates)


def test_without_max_time_fails_in_one_line(smoke_config) -> None:
    cfg = smoke_config("callbacks.time_cooldown.minutes=30", "trainer.max_steps=2")
    with pytest.raises(ValueError, match=r"needs trainer.max_time"):
        train(cfg)
