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

from multihead.training.loss import distillation_kl


class LanguageModelModule(pl.LightningModule):
    """Trains a causal LM on ``(B, T)`` token blocks and logs ``val/loss`` and ``val/ppl``.

    Args:
        model: a causal LM called as ``model(input_ids=x, labels=x, use_cache=False).loss``.
        optimizer: a partial optimiser, called with the parameters.
        scheduler: a partial :class:`~multihead.training.InverseSqrtWarmup`, called with the
            optimiser; stepped every update. ``None``: a constant learning rate.
        teacher: a frozen causal LM to distil from (uptraining a converted model from the
            one it was converted from, ``scripts/convert_lm.py --distill``): the training
            loss becomes ``CE + distill_weight * KL(teacher || student)`` over the predicted
            positions (temperature 1), logged as ``train/kl``. It stays in eval mode, takes
            no gradient, and is no part of the module (not optimised, not in checkpoints).
        distill_weight: the KL's weight, 1 if ``None``; refused without a teacher.

    ``val/ppl`` is ``exp`` of the mean loss over every predicted token of the validation
    blocks (all blocks have the same length, so the mean of the block means is that mean).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        *,
        teacher: nn.Module | None = None,
        distill_weight: float | None = None,
    ) -> None:
        super().__init__()
        if distill_weight is not None and teacher is None:
            raise ValueError(
                f"distill_weight={distill_weight} weighs the distillation term, and there "
                "is no teacher to distil from (distill_from=CKPT)"
            )
        distill_weight = 1.0 if distill_weight is None else distill_weight
        if not distill_weight > 0:
            raise ValueError(f"distill_weight must be > 0, got {distill_weight}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.distill_weight = distill_weight
        # A tuple, not a submodule: the teacher's parameters are neither optimised nor saved
        # with the student's, and Lightning's train() leaves it in eval mode.
        self._teacher = () if teacher is None else (teacher.eval().requires_grad_(False),)
        self._val_losses: list[tuple[Tensor, int]] = []  # (loss sum, blocks) per batch

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        out = self.model(input_ids=batch, labels=batch, use_cache=False)
        self.log("train/loss", out.loss, prog_bar=True)
        if not self._teacher:
            return out.loss
        (teacher,) = self._teacher
        with torch.no_grad():
            taught = teacher(input_ids=batch, use_cache=False).logits  # (B, T, V)
        # The positions the loss predicts from: all but the last (its next token is unknown).
        kl = distillation_kl(out.logits[:, :-1].flatten(0, 1), taught[:, :-1].flatten(0, 1))
        self.log("train/kl", kl)
        return out.loss + self.distill_weight * kl

    def on_fit_start(self) -> None:
        for teacher in self._teacher:  # not a submodule: moved here, beside the student
            teacher.to(self.device)

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
