"""Learning-rate schedules."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class InverseSqrtWarmup(LambdaLR):
    """Linear warmup to the optimiser's lr, then decay with 1/sqrt(step).

    ``lr(step) = base_lr * min(step / warmup_steps, sqrt(warmup_steps / step))``, the
    schedule of "Attention Is All You Need" (there written as d_model^-0.5 * ...) with the
    peak learning rate given directly, as fairseq's ``inverse_sqrt`` does.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 4000, last_epoch: int = -1):
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.warmup_steps = warmup_steps

        def factor(step: int) -> float:
            step = max(step, 1)
            return min(step / warmup_steps, math.sqrt(warmup_steps / step))

        super().__init__(optimizer, factor, last_epoch)
