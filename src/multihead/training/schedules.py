"""The learning-rate schedule: warmup, inverse-sqrt decay and one optional cooldown."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class InverseSqrtWarmup(LambdaLR):
    """Linear warmup to the optimiser's lr, decay with 1/sqrt(step), then a cooldown.

    ``lr(step) = base_lr * min(step / warmup_steps, sqrt(warmup_steps / step)) * cooldown``,
    the schedule of "Attention Is All You Need" (there written as d_model^-0.5 * ...) with
    the peak learning rate given directly, as fairseq's ``inverse_sqrt`` does. With
    ``decay="constant"`` the rate holds at its peak between warmup and cooldown instead:
    warmup-stable-decay (WSD; Hägele et al., 2024), which keeps a short run's rate high
    where 1/sqrt(step) would have halved it.

    The cooldown scales the rate linearly down to zero at the end of the budget, so a run
    ends annealed instead of at its highest late rate. The budget is counted in one of two
    ways (at most one may be on):

    * ``cooldown_steps``: over the last ``cooldown_steps`` before ``total_steps`` (the
      trainer's ``max_steps``);
    * ``cooldown_minutes``: over the last minutes of the training time, read from
      ``time_left`` (seconds of training left; Lightning's ``Timer`` for ``max_time``). On a
      CPU the number of steps a time budget buys depends on the machine and on what else
      runs on it; the clock does not ("budgeted training", Li et al., 2020).

    Args:
        optimizer: its learning rates are the peaks.
        warmup_steps: steps of linear warmup.
        decay: after warmup, ``"inverse_sqrt"`` or ``"constant"`` (WSD with a cooldown).
        cooldown_steps: length of a step-counted cooldown; 0 = off.
        total_steps: where the step-counted cooldown ends.
        cooldown_minutes: length of a clock-counted cooldown; 0 = off.
        time_left: seconds of training left, or ``None`` when the run has no time limit.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        warmup_steps: int,
        decay: str = "inverse_sqrt",
        cooldown_steps: int = 0,
        total_steps: int | None = None,
        cooldown_minutes: float = 0,
        time_left: Callable[[], float | None] | None = None,
    ):
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        if decay not in ("inverse_sqrt", "constant"):
            raise ValueError(f"decay={decay!r}; expected inverse_sqrt or constant")
        for name, value in (
            ("cooldown_steps", cooldown_steps),
            ("cooldown_minutes", cooldown_minutes),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if cooldown_steps and cooldown_minutes:
            raise ValueError(
                f"cooldown_steps={cooldown_steps} and cooldown_minutes={cooldown_minutes} are "
                "two cooldowns at once; set one of them to 0"
            )
        if cooldown_steps and (total_steps is None or total_steps < warmup_steps + cooldown_steps):
            raise ValueError(
                f"cooldown_steps={cooldown_steps} needs total_steps >= warmup_steps + "
                f"cooldown_steps ({warmup_steps + cooldown_steps}), got total_steps={total_steps}"
            )
        if cooldown_minutes and (time_left is None or time_left() is None):
            raise ValueError(
                f"cooldown_minutes={cooldown_minutes} needs a time limit to end at "
                "(trainer.max_time), got none"
            )
        self.warmup_steps = warmup_steps

        def factor(step: int) -> float:
            step = max(step, 1)
            if decay == "constant":
                scale = min(step / warmup_steps, 1.0)
            else:
                scale = min(step / warmup_steps, math.sqrt(warmup_steps / step))
            if cooldown_steps:
                scale *= min(1.0, max(0.0, (total_steps - step) / cooldown_steps))
            if cooldown_minutes:
                scale *= min(1.0, max(0.0, time_left() / (60 * cooldown_minutes)))
            return scale

        super().__init__(optimizer, factor)
