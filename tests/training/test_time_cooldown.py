"""The schedule's clock-counted cooldown: the rate anneals to zero over the last minutes."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from multihead.training import InverseSqrtWarmup
from multihead.training.run import train


def test_scales_the_rate_by_the_fraction_of_the_window_left() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    left = {"s": 45 * 60.0}
    schedule = InverseSqrtWarmup(
        optimizer, warmup_steps=1, cooldown_minutes=30, time_left=lambda: left["s"]
    )
    # After warmup (1 step) the inverse-sqrt factor of step s is 1/sqrt(s).
    for step, (remaining_min, window) in enumerate(
        [(45, 1.0), (15, 0.5), (15, 0.5), (3, 0.1), (-1, 0.0)], start=1
    ):
        left["s"] = remaining_min * 60
        optimizer.step()
        schedule.step()  # the rate for step `step`, set from the base rate: never compounds
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * step**-0.5 * window)


def test_needs_a_time_limit_and_at_most_one_cooldown() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"cooldown_minutes=30 needs a time limit"):
        InverseSqrtWarmup(optimizer, warmup_steps=1, cooldown_minutes=30, time_left=lambda: None)
    with pytest.raises(ValueError, match=r"cooldown_steps=5 and cooldown_minutes=30 are two"):
        InverseSqrtWarmup(
            optimizer, warmup_steps=1, cooldown_steps=5, total_steps=10, cooldown_minutes=30
        )


def test_smoke_run_anneals_from_the_first_step(smoke_config, tmp_path: Path) -> None:
    """A window far longer than the budget: the rate is scaled from the first step and falls."""
    cfg = smoke_config(
        "module.scheduler.cooldown_minutes=100000",
        "module.scheduler.warmup_steps=1",
        "trainer.max_time=00:00:30:00",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=1",
        "test=false",
        "summary.decode_speed=false",
    )
    train(cfg)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    rates = [float(r["lr-Adam"]) for r in rows if r["lr-Adam"]]
    # The smoke peak rate is 3e-3; at most 30 of the 100000 minutes are left.
    assert len(rates) >= 5 and all(0 < lr <= 3e-3 * 30 / 100000 for lr in rates)
    assert rates == sorted(rates, reverse=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["module.scheduler.cooldown_minutes=30"], "needs a time limit"),
        (
            [
                "module.scheduler.cooldown_minutes=30",
                "module.scheduler.cooldown_steps=5",
                "trainer.max_time=00:00:30:00",
            ],
            "two cooldowns at once",
        ),
    ],
)
def test_bad_cooldown_settings_fail_before_training(smoke_config, overrides, message) -> None:
    cfg = smoke_config(*overrides, "trainer.max_steps=2")
    with pytest.raises(ValueError, match=message):
        train(cfg)
