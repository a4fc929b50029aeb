"""Training: the LightningModule, schedules, callbacks, metrics and checkpoints."""

from multihead.training.callbacks import ThroughputMonitor, TimeBudgetCooldown, WallClock
from multihead.training.config import register_resolvers
from multihead.training.module import TranslationModule
from multihead.training.schedules import InverseSqrtWarmup

register_resolvers()

__all__ = [
    "InverseSqrtWarmup",
    "ThroughputMonitor",
    "TranslationModule",
    "TimeBudgetCooldown",
    "WallClock",
    "register_resolvers",
]
