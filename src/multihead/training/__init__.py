"""Training only: the LightningModule and its fused loss
(:func:`~multihead.training.loss.linear_cross_entropy`), the learning-rate schedule, the
callbacks that run during ``fit``, and :func:`~multihead.training.run.train`, which wires
them from a config.

What happens to a checkpoint after training lives in :mod:`multihead.checkpoints`;
translating and scoring in :mod:`multihead.evaluation`; reports about finished runs in
:mod:`multihead.analysis`.
"""

from multihead.training.callbacks import RecentCheckpoints, TokenThroughput, WallClock
from multihead.training.module import TranslationModule
from multihead.training.schedules import InverseSqrtWarmup

__all__ = [
    "InverseSqrtWarmup",
    "RecentCheckpoints",
    "TokenThroughput",
    "TranslationModule",
    "WallClock",
]
