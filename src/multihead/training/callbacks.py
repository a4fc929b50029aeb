"""Callbacks: real-token throughput and peak memory, wall-clock marks, recent checkpoints."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes vs KiB


class TokenThroughput(pl.Callback):
    """Logs source and target tokens per second (padding excluded) and peak memory.

    Padding (the module tokenizer's ``pad_id``) is not counted as work done. Lightning's
    ``ThroughputMonitor`` counts one length per batch (``length_fn``) and assumes a fixed
    batch size; this one counts source and target tokens apart in token-bucketed batches,
    logs ``perf/*``, and keeps whole-run totals for the run summary (:meth:`summary`).
    The tokens are counted on the batch's device and read back once per window, so a step
    never waits for the count.

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
        self._tokens: torch.Tensor | None = None  # (2,) source and target tokens of the window
        self._steps = 0
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
        # The first target token (bos) is input only: count the predicted positions.
        tokens = torch.stack(
            [batch["src"].ne(self.pad_id).sum(), batch["tgt"][:, 1:].ne(self.pad_id).sum()]
        )
        self._tokens = tokens if self._tokens is None else self._tokens + tokens
        self._steps += 1
        if self._steps < self.log_every_n_steps:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        seconds = time.perf_counter() - self._start
        src, tgt = self._tokens.tolist()
        self.total_src_tokens += src
        self.total_tgt_tokens += tgt
        self.total_seconds += seconds
        self.peak_memory_mb = peak_memory_mb(pl_module.device)
        pl_module.log_dict(
            {
                "perf/src_tokens_per_s": src / seconds,
                "perf/tgt_tokens_per_s": tgt / seconds,
                "perf/tokens_per_s": (src + tgt) / seconds,
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


class RecentCheckpoints(ModelCheckpoint):
    """The newest checkpoints by step for averaging, and the one writer of ``last.ckpt``.

    Every ``every_n_train_steps`` it saves ``step{N}.ckpt`` into ``dirpath`` and keeps the
    newest ``save_top_k`` of them. At the end of ``fit``, whatever stopped it (``max_steps``,
    ``max_time``), it saves the final weights as ``step{N}.ckpt`` (the steps after the last
    multiple of N would otherwise be in no file) and as ``last.ckpt``, the file to translate
    from. Lightning's own ``save_last`` is not used: it updates ``last.ckpt`` only at steps
    where the same callback saves a top-k file, so it is either stale or a second writer.

    Args:
        dirpath: where the checkpoints go.
        every_n_train_steps: save every N optimiser steps.
        save_top_k: how many of the newest step checkpoints to keep (-1: all).
    """

    def __init__(self, dirpath: str, every_n_train_steps: int, save_top_k: int) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step{step}",
            monitor="step",
            mode="max",
            save_top_k=save_top_k,
            every_n_train_steps=every_n_train_steps,
            auto_insert_metric_name=False,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.fast_dev_run:  # Lightning saves no checkpoints in a fast_dev_run
            return
        step_path = f"{self.dirpath}/step{trainer.global_step}.ckpt"
        if not trainer.strategy.broadcast(Path(step_path).exists(), src=0):
            trainer.save_checkpoint(step_path)
        trainer.save_checkpoint(f"{self.dirpath}/last.ckpt")
