"""A NaN or infinite training loss stops the run in one line, or skips the batch, counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multihead.checkpoints import read_checkpoint
from multihead.training import TranslationModule
from multihead.training.run import train


@pytest.fixture
def nan_at_step(monkeypatch):
    """The training loss is NaN at the given optimiser steps (as a bad batch would make it)."""

    def install(*steps: int) -> None:
        loss = TranslationModule.loss

        def poisoned(self, batch):
            value, ntokens = loss(self, batch)
            if self.training and self.global_step in steps:
                value = value * float("nan")
            return value, ntokens

        monkeypatch.setattr(TranslationModule, "loss", poisoned)

    return install


def test_stops_with_the_step_and_keeps_the_checkpoints(smoke_config, tmp_path, nan_at_step):
    nan_at_step(6)
    cfg = smoke_config(
        "trainer.max_steps=10",
        "trainer.val_check_interval=3",
        "test=false",
        "summary.decode_speed=false",
    )
    with pytest.raises(ValueError, match=r"non-finite training loss \(nan\) at step 6;"):
        train(cfg)
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("step*.ckpt"))
    assert ckpts == ["step3.ckpt", "step6.ckpt"]
    for name in ckpts:  # intact: they load, and hold finite weights
        state = read_checkpoint(tmp_path / "checkpoints" / name)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert not (tmp_path / "summary.json").exists()


def test_skip_counts_the_skipped_batches(smoke_config, tmp_path: Path, nan_at_step):
    nan_at_step(2, 4)
    cfg = smoke_config(
        "module.on_non_finite_loss=skip",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "test=false",
        "summary.decode_speed=false",
    )
    summary = train(cfg)
    assert summary["train/skipped_batches"] == 2
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 6  # a skipped batch is a step without an update


def test_a_diverged_run_does_not_skip_forever(smoke_config, nan_at_step):
    nan_at_step(*range(3, 40))  # diverged from step 3 on
    cfg = smoke_config(
        "module.on_non_finite_loss=skip",
        "trainer.max_steps=40",
        "test=false",
        "summary.decode_speed=false",
    )
    with pytest.raises(ValueError, match=r"in 11 batches in a row at step 13"):
        train(cfg)
