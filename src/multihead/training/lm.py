"""The LightningModule of a causal language model: next-token loss, validation perplexity.

The network is passed in and called the Hugging Face way,
``model(input_ids=x, labels=x, use_cache=False)`` returning an object with ``.loss`` (the mean
next-token cross-entropy; the model shifts the labels itself; a full pass needs no KV cache),
so that any ``*ForCausalLM`` trains here without this module importing
``transformers``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch import Tensor, nn


class LanguageModelModule(pl.LightningModule):
    """Trains a causal LM on ``(B, T)`` token blocks and logs ``val/loss`` and ``val/ppl``.

    Args:
        model: a causal LM called as ``model(input_ids=x, labels=x, use_cache=False).loss``.
        optimizer: a partial optimiser, called with the parameters.
        scheduler: a partial :class:`~multihead.training.InverseSqrtWarmup`, called with the
            optimiser; stepped every update. ``None``: a constant learning rate.

    ``val/ppl`` is ``exp`` of the mean loss over every predicted token of the validation
    blocks (all blocks have the same length, so the mean of the block means is that mean).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._val_losses: list[tuple[Tensor, int]] = []  # (loss sum, blocks) per batch

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self._val_losses.append((loss.detach() * len(batch), len(batch)))

    def on_validation_epoch_end(self) -> None:
        sums, blocks = zip(*self._val_losses, strict=True)
        loss = torch.stack(sums).sum().item() / sum(blocks)
        self._val_losses.clear()
        self.log("val/loss", loss)
        self.log("val/ppl", math.exp(loss), prog_bar=True)

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
