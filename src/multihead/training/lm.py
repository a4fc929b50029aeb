"""The LightningModule of a causal language model: next-token loss, held-out perplexity by
position, and recall accuracy for labelled batches (MQAR).

Two kinds of network train here: the project's :class:`~multihead.model.lm.DecoderLM`,
called as ``model(ids)`` returning logits, and any Hugging Face ``*ForCausalLM`` (the
conversion studies' Llama), called ``model(input_ids=ids, use_cache=False).logits``, so
that this module never imports ``transformers``. Two kinds of batch:

* a ``(B, T)`` long tensor of text: every position predicts the next token;
* ``{"input_ids": (B, T), "labels": (B, T)}`` (MQAR): position ``t`` predicts
  ``labels[:, t]`` where it is not ``-100``; only those positions are projected to logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.model.lm import DecoderLM
from multihead.training.checkpoint_io import multihead_record
from multihead.training.loss import distillation_kl

IGNORE = -100


def next_token_logits(model: nn.Module, input_ids: Tensor) -> Tensor:
    """``(B, T, V)`` logits of a :class:`DecoderLM` or of a Hugging Face causal LM."""
    if isinstance(model, DecoderLM):
        return model(input_ids)
    return model(input_ids=input_ids, use_cache=False).logits


def position_losses(logits: Tensor, input_ids: Tensor) -> Tensor:
    """``(B, T - 1)``: the loss of predicting token ``t`` (``t = 1 .. T-1``) from those before
    it, in nats; column ``t - 1`` belongs to the token at position ``t``."""
    B, T, V = logits.shape
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(), reduction="none"
    )
    return losses.view(B, T - 1)


def bucket_edges(edges: Sequence[int], length: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the positions ``lo .. hi - 1`` of each bucket that a window of
    ``length`` tokens reaches, from 1 (the first predicted token) to ``length - 1``."""
    bounds = [0, *[e for e in edges if e < length], length]
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


class LanguageModelModule(pl.LightningModule):
    """Trains a causal LM and logs ``val/loss``, ``val/ppl``, the loss by position bucket
    (``val/loss@LO-HI``: predicted tokens with ``LO .. HI`` tokens of context before them),
    and for labelled batches ``val/acc@NAME`` per held-out set.

    Each validation loader is a set the datamodule names in ``val_sets``, ``(split, name)``:
    split ``val`` is the scored held-out data, ``select`` the data a learning rate is chosen
    on (never scored); a text set's name is a part of the split (a source package), logged
    as ``val/loss/NAME`` beside the split's whole, a labelled set's its setting
    (``val/acc@NAME``, ``val/loss@NAME``, and ``val/acc``, their mean). A datamodule without
    ``val_sets`` has one scored set.

    Args:
        model: a :class:`DecoderLM` or a Hugging Face causal LM.
        optimizer: a partial optimiser, called with the parameters.
        scheduler: a partial scheduler, called with the optimiser; stepped every update.
            ``None``: a constant learning rate.
        position_buckets: the buckets' lower edges after 0, e.g. ``[64, 256, 1024]``.
        aux_loss_weight: the weight of a sparse design's load-balancing loss.
        teacher: a frozen causal LM to distil from (``scripts/convert_lm.py --distill``):
            the loss becomes ``CE + distill_weight * KL(teacher || student)`` over the
            predicted positions, logged as ``train/kl``. It stays in eval mode, takes no
            gradient, and is no part of the module (not optimised, not in checkpoints).
        distill_weight: the KL's weight, 1 if ``None``; refused without a teacher.
        tokenizer: saved in checkpoints (``None``: MQAR, whose tokens are their ids).

    ``val/ppl`` is ``exp`` of the mean loss over every predicted token of the held-out windows.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        *,
        position_buckets: Sequence[int] = (64, 256, 1024),
        aux_loss_weight: float = 0.01,
        teacher: nn.Module | None = None,
        distill_weight: float | None = None,
        tokenizer=None,
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
        edges = list(position_buckets)
        if any(
            isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in edges
        ) or edges != sorted(set(edges)):
            raise ValueError(
                f"module.position_buckets must be increasing positive ints, got {edges}"
            )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.position_buckets = edges
        self.aux_loss_weight = aux_loss_weight
        self.distill_weight = distill_weight
        self.tokenizer = tokenizer
        self.run_config: dict | None = None  # set by the run: saved in checkpoints
        # A tuple, not a submodule: the teacher's parameters are neither optimised nor saved
        # with the student's, and Lightning's train() leaves it in eval mode.
        self._teacher = () if teacher is None else (teacher.eval().requires_grad_(False),)
        self._val: dict[str, list[Tensor]] = {}  # metric -> [sum, count] accumulated

    # ------------------------------------------------------------------ losses
    def _recall(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``(mean loss, correct)`` over the labelled positions of an MQAR batch."""
        labels = batch["labels"]
        asked = labels.ne(IGNORE)  # (B, T)
        states = self.model.states(batch["input_ids"])  # (B, T, E)
        logits = self.model.output_projection(states[asked])  # (N, V): the queries only
        target = labels[asked]
        return F.cross_entropy(logits.float(), target), logits.argmax(-1).eq(target)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        if isinstance(batch, dict):
            loss, _ = self._recall(batch)
        else:
            logits = next_token_logits(self.model, batch)
            loss = position_losses(logits, batch).mean()
        self.log("train/loss", loss, prog_bar=True)
        aux = self.model.aux_loss() if isinstance(self.model, DecoderLM) else None
        if aux is not None:
            self.log("train/aux_loss", aux)
            loss = loss + self.aux_loss_weight * aux
        if not self._teacher:
            return loss
        (teacher,) = self._teacher
        with torch.no_grad():
            taught = next_token_logits(teacher, batch)  # (B, T, V)
        # The positions the loss predicts from: all but the last (its next token is unknown).
        kl = distillation_kl(logits[:, :-1].flatten(0, 1), taught[:, :-1].flatten(0, 1))
        self.log("train/kl", kl)
        return loss + self.distill_weight * kl

    def on_fit_start(self) -> None:
        for teacher in self._teacher:  # not a submodule: moved here, beside the student
            teacher.to(self.device)

    # ------------------------------------------------------------------ validation
    def _add(self, name: str, total: Tensor, count: int | Tensor) -> None:
        acc = self._val.setdefault(name, [torch.zeros((), dtype=torch.float64), 0])
        acc[0] = acc[0] + total.detach().double().cpu()
        acc[1] = acc[1] + int(count)

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        sets = getattr(self.trainer.datamodule, "val_sets", None)
        split, name = ("val", None) if sets is None else sets[dataloader_idx]
        if isinstance(batch, dict):
            loss, correct = self._recall(batch)
            n = correct.numel()
            self._add(f"{split}/acc@{name}", correct.sum(), n)
            self._add(f"{split}/loss@{name}", loss * n, n)
            self._add(f"{split}/loss", loss * n, n)  # over every query of every setting
            return
        losses = position_losses(next_token_logits(self.model, batch), batch)  # (B, T-1)
        self._add(f"{split}/loss", losses.sum(), losses.numel())
        if name is not None:
            self._add(f"{split}/loss/{name}", losses.sum(), losses.numel())
        for lo, hi in bucket_edges(self.position_buckets, batch.shape[1]):
            # Column t - 1 holds the token at position t: positions lo .. hi - 1 (from 1).
            part = losses[:, max(lo, 1) - 1 : hi - 1]
            self._add(f"{split}/loss@{lo}-{hi - 1}", part.sum(), part.numel())

    def on_validation_epoch_end(self) -> None:
        results = {name: (s / n).item() for name, (s, n) in self._val.items() if n}
        self._val.clear()
        for split in {name.split("/")[0] for name in results}:
            accs = [v for k, v in results.items() if k.startswith(f"{split}/acc@")]
            if accs:
                results[f"{split}/acc"] = sum(accs) / len(accs)
            else:  # text: its perplexity
                results[f"{split}/ppl"] = math.exp(results[f"{split}/loss"])
        for name, value in sorted(results.items()):
            self.log(name, value, add_dataloader_idx=False, prog_bar=name in ("val/ppl", "val/acc"))

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # A checkpoint is self-contained: config (+ tokenizer) rebuild the model anywhere.
        checkpoint["multihead"] = multihead_record(self, self.tokenizer)
