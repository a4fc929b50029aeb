"""Callbacks: real-token throughput and peak memory, wall-clock marks, a time-budget cooldown."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Timer


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes vs KiB


class ThroughputMonitor(pl.Callback):
    """Logs source and target tokens per second (padding excluded) and peak memory.

    Padding (the module tokenizer's ``pad_id``) is not counted as work done.

    Args:
        log_every_n_steps: averaging window, in optimiser steps.
    """

    def __init__(self, log_every_n_steps: int = 50) -> None:
        self.pad_id = 0
        self.log_every_n_steps = log_every_n_steps
        self._reset()
        self.total_tgt_tokens = self.total_src_tokens = 0
        self.total_seconds = 0.0
        self.peak_memory_mb = 0.0

    def _reset(self) -> None:
        self._src = self._tgt = self._steps = 0
        self._start: float | None = None

    def summary(self) -> dict[str, float]:
        """Throughput over all logged windows of the run, and peak memory."""
        if self.total_seconds == 0:
            return {}
        return {
            "perf/train_tgt_tokens_per_s": self.total_tgt_tokens / self.total_seconds,
            "perf/train_tokens_per_s": (self.total_src_tokens + self.total_tgt_tokens)
            / self.total_seconds,
            "perf/peak_memory_mb": self.peak_memory_mb,
        }

    def on_train_start(self, trainer, pl_module) -> None:
        self.pad_id = pl_module.tokenizer.pad_id

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._src += int((batch["src"] != self.pad_id).sum())
        # The first target token (bos) is input only: count the predicted positions.
        self._tgt += int((batch["tgt"][:, 1:] != self.pad_id).sum())
        self._steps += 1
        if self._steps < self.log_every_n_steps:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        seconds = time.perf_counter() - self._start
        self.total_src_tokens += self._src
        self.total_tgt_tokens += self._tgt
        self.total_seconds += seconds
        self.peak_memory_mb = peak_memory_mb(pl_module.device)
        pl_module.log_dict(
            {
                "perf/src_tokens_per_s": self._src / seconds,
                "perf/tgt_tokens_per_s": self._tgt / seconds,
                "perf/tokens_per_s": (self._src + self._tgt) / seconds,
                "perf/peak_memory_mb": self.peak_memory_mb,
            }
        )
        self._reset()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._reset()  # validation time is not training throughput


class WallClock(pl.Callback):
    """Logs the run's wall-clock minutes at every validation, and checkpoints at set minutes.

    ``time/elapsed_min`` beside ``val/bleu`` gives a learning curve against wall-clock time,
    the budget that matters on a CPU. The clock starts when the callback is built, i.e. before
    data preparation, so the minutes are a conservative count of the run's cost. Checkpoints
    carry the minutes and the marks still ahead, so a resumed run goes on counting from there.
    Under DDP rank 0's clock decides when a mark has passed, so all ranks save together.

    Args:
        save_at_minutes: after each of these marks, the next optimiser step writes
            ``minute{MARK}-step{STEP}.ckpt`` into ``dirpath`` (e.g. ``[60]`` for the model
            an hour of training buys).
        dirpath: where those checkpoints go (required if ``save_at_minutes`` is not empty).
    """

    def __init__(self, save_at_minutes: list[float] | None = None, dirpath: str | None = None):
        marks = sorted(save_at_minutes or [])
        if any(m <= 0 for m in marks):
            raise ValueError(f"WallClock save_at_minutes must be minutes > 0, got {marks}")
        if marks and dirpath is None:
            raise ValueError("WallClock(save_at_minutes=...) needs a dirpath for the checkpoints")
        self.marks = marks
        self.dirpath = dirpath
        self.start = time.monotonic()

    def elapsed_min(self) -> float:
        return (time.monotonic() - self.start) / 60

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            pl_module.log("time/elapsed_min", self.elapsed_min())

    def state_dict(self) -> dict:
        return {"elapsed_min": self.elapsed_min(), "marks": list(self.marks)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.start = time.monotonic() - 60 * state_dict["elapsed_min"]
        self.marks = list(state_dict["marks"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.marks:
            return
        # Marks are sorted; one slow step may pass several: save once, for the first of them.
        passed = sum(mark <= self.elapsed_min() for mark in self.marks)
        if trainer.world_size > 1:
            # Saving a checkpoint is collective under DDP and the ranks' clocks differ
            # slightly, so rank 0 decides (one small broadcast per step while marks remain).
            passed = trainer.strategy.broadcast(passed, src=0)
        if not passed:
            return
        mark = self.marks[0]
        del self.marks[:passed]
        trainer.save_checkpoint(f"{self.dirpath}/minute{mark:03g}-step{trainer.global_step}.ckpt")


class TimeBudgetCooldown(pl.Callback):
    """Anneals the learning rate linearly to zero over the last minutes of ``trainer.max_time``.

    A step-based cooldown needs to know how many steps the budget buys, which on a CPU
    depends on the machine and on what else runs on it. This one reads the clock instead: in
    the last ``minutes`` of the training time the scheduler's rate is multiplied by the
    fraction of that window still left, so a time-limited run ends annealed whatever its step
    count ("budgeted training", Li et al., 2020). The clock is Lightning's ``Timer`` (the one
    ``max_time`` adds), whose state a resumed run restores.

    Args:
        minutes: length of the cooldown window; 0 turns the callback off.
    """

    def __init__(self, minutes: float = 0) -> None:
        if minutes < 0:
            raise ValueError(f"TimeBudgetCooldown minutes must be >= 0, got {minutes}")
        self.minutes = minutes

    def _timer(self, trainer) -> Timer:
        for callback in trainer.callbacks:
            if isinstance(callback, Timer):
                return callback
        raise ValueError(
            f"callbacks.time_cooldown.minutes={self.minutes} needs trainer.max_time "
            "(the budget the cooldown ends at), got max_time=null"
        )

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.minutes:
            self._timer(trainer)  # fail before training, not at the first step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.minutes:
            return
        remaining = self._timer(trainer).time_remaining()  # training seconds left
        factor = min(1.0, max(0.0, remaining / (60 * self.minutes)))
        if factor < 1.0:
            # The scheduler sets each group's lr from its base value at every step (LambdaLR
            # is not chained), so scaling here does not compound across steps.
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= factor
        pl_module.log("train/lr_cooldown_factor", factor)


class FinalCheckpoint(pl.Callback):
    """Saves the weights training ended with as ``step{N}.ckpt`` and ``last.ckpt`` in ``dirpath``.

    Lightning (2.6) writes a ModelCheckpoint's ``last.ckpt`` only at steps where that callback
    also saved a top-k checkpoint: with ``save_top_k=1`` on validation BLEU it was a copy of
    the best checkpoint, not the last. And every-N-steps checkpoints miss the steps after the
    last multiple of N, which a run stopped by ``max_time`` always has. So at the end of
    ``fit``, whatever stopped it, this writes the final state under both names: ``last.ckpt``
    is the file to resume or translate from, and ``step{N}.ckpt`` is the newest file that
    ``scripts/average_checkpoints.py ckpt_dir=... last=K`` averages.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run:  # Lightning saves no checkpoints in a fast_dev_run
            return
        step_path = f"{self.dirpath}/step{trainer.global_step}.ckpt"
        if not trainer.strategy.broadcast(Path(step_path).exists(), src=0):
            trainer.save_checkpoint(step_path)
        trainer.save_checkpoint(f"{self.dirpath}/last.ckpt")
