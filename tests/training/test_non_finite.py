"""A NaN or infinite training loss stops the run in one line, or skips the batch, counted.

(Under DDP every rank stops together: ``tests/training/test_ddp.py``.)
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from multihead.checkpoints import read_checkpoint
from multihead.training import TranslationModule
from multihead.training.run import train


@pytest.fixture
def bad_loss(monkeypatch):
    """The training loss is multiplied by ``factors[step]`` (NaN or inf, as a bad batch would
    make it) at those optimiser steps."""

    def install(factors: dict[int, float]) -> None:
        loss = TranslationModule.loss

        def poisoned(self, batch):
            value, ntokens = loss(self, batch)
            if self.training and self.global_step in factors:
                value = value * factors[self.global_step]
            return value, ntokens

        monkeypatch.setattr(TranslationModule, "loss", poisoned)

    return install


def test_stops_with_the_step_and_keeps_the_checkpoints(smoke_config, tmp_path, bad_loss):
    bad_loss({6: float("inf")})
    cfg = smoke_config(
        "trainer.max_steps=10",
        "trainer.val_check_interval=3",
        "test=false",
        "summary.decode_speed=false",
    )
    with pytest.raises(ValueError, match=r"non-finite training loss \(inf\) at step 6;"):
        train(cfg)
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("step*.ckpt"))
    assert ckpts == ["step3.ckpt", "step6.ckpt"]
    for name in ckpts:  # intact: they load
        read_checkpoint(tmp_path / "checkpoints" / name)
    assert not (tmp_path / "summary.json").exists()


def test_skip_counts_the_skipped_batches(smoke_config, tmp_path: Path, bad_loss):
    """A NaN and an inf loss are skipped: no update, so the weights stay finite."""
    bad_loss({2: float("nan"), 4: float("inf")})
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
    # A bad loss that reached backward would have made every weight NaN (Adam spreads it).
    for key, value in last["state_dict"].items():
        assert torch.isfinite(value).all(), key


def test_a_diverged_run_does_not_skip_forever(smoke_config, bad_loss):
    bad_loss(dict.fromkeys(range(3, 40), float("nan")))  # diverged from step 3 on
    cfg = smoke_config(
        "module.on_non_finite_loss=skip",
        "trainer.max_steps=40",
        "test=false",
        "summary.decode_speed=false",
    )
    with pytest.raises(ValueError, match=r"in 11 batches in a row at step 13"):
        train(cfg)


def test_skip_is_refused_under_ddp() -> None:
    """A skipped step returns no loss, which DDP's gradient all-reduce cannot take."""
    module = TranslationModule(
        nn.Linear(2, 2),
        tokenizer=None,
        optimizer=torch.optim.Adam,
        beam_size=1,
        length_penalty=1.0,
        max_len_a=1.0,
        max_len_b=1.0,
        on_non_finite_loss="skip",
    )
    # Two processes, not started: the check reads only the trainer's world size.
    module.trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False
    )
    with pytest.raises(ValueError, match="skip works in one process only; this run has 2"):
        module.on_fit_start()
