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

    With ``cooldown_steps`` the rate is also scaled linearly down to zero over the last
    ``cooldown_steps`` before ``total_steps`` (a run with a known budget ends annealed
    instead of at its highest late rate). Set ``total_steps`` to the trainer's ``max_steps``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int = 4000,
        cooldown_steps: int = 0,
        total_steps: int | None = None,
        last_epoch: int = -1,
    ):
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        if cooldown_steps < 0:
            raise ValueError(f"cooldown_steps must be >= 0, got {cooldown_steps}")
        if cooldown_steps and (total_steps is None or total_steps < warmup_steps + cooldown_steps):
            raise ValueError(
                f"cooldown_steps={cooldown_steps} needs total_steps >= warmup_steps + "
                f"cooldown_steps ({warmup_steps + cooldown_steps}), got total_steps={total_steps}"
            )
        self.warmup_steps = warmup_steps

        def factor(step: int) -> float:
            step = max(step, 1)
            scale = min(step / warmup_steps, math.sqrt(warmup_steps / step))
            if cooldown_steps:
                scale *= min(1.0, max(0.0, (total_steps - step) / cooldown_steps))
            return scale

        super().__init__(optimizer, factor, last_epoch)
