"""Training: the LightningModule, schedules, callbacks, metrics and checkpoints."""

from multihead.training.callbacks import (
    FinalCheckpoint,
    ThroughputMonitor,
    TimeBudgetCooldown,
    WallClock,
)
from multihead.training.config import register_resolvers
from multihead.training.module import TranslationModule
from multihead.training.schedules import InverseSqrtWarmup

register_resolvers()

__all__ = [
    "FinalCheckpoint",
    "InverseSqrtWarmup",
    "ThroughputMonitor",
    "TranslationModule",
    "TimeBudgetCooldown",
    "WallClock",
    "register_resolvers",
]
