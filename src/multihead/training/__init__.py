"""Training only: the LightningModule and its fused loss
(:func:`~multihead.training.loss.linear_cross_entropy`), the learning-rate schedule, the
``precision: auto`` setting, the callbacks that run during ``fit`` (throughput, wall clock,
recent checkpoints), and :func:`~multihead.training.run.train`, which wires
them from a config; the causal LM's module in :mod:`multihead.training.lm` (issue 56's
Llama-shaped LM). In the import order only ``multihead.cli`` and the root are above it.

Reading and writing checkpoints lives in :mod:`multihead.checkpoints` (Lightning's writes
during ``fit`` go through its atomic writer, :mod:`multihead.training.checkpoint_io`);
building the network in :mod:`multihead.model`; translating and scoring in
:mod:`multihead.evaluation`; reports about runs, and the callback that draws attention
maps during ``fit`` (:mod:`multihead.analysis.diagnostics`), in :mod:`multihead.analysis`,
above this package;
wandb's online/offline choice in :mod:`multihead.wandb_setup`.
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
