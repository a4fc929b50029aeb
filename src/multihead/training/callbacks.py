"""Callbacks that log what the trainer does not: real-token throughput and peak memory."""

from __future__ import annotations

import resource
import sys
import time

import lightning.pytorch as pl
import torch


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
