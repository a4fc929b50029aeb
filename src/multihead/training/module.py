"""The LightningModule: loss, optimisation, validation BLEU. The network is passed in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn

from multihead.model import beam_search, greedy_decode
from multihead.training.metrics import corpus_scores


class TranslationModule(pl.LightningModule):
    """Trains a :class:`multihead.model.Transformer` on batches from the data module.

    Args:
        model: the encoder-decoder network.
        tokenizer: the joint tokenizer (decodes hypotheses for BLEU).
        optimizer: a partial optimiser, called with the parameters.
        scheduler: a partial LR scheduler, called with the optimiser; stepped every update.
        label_smoothing: epsilon of label-smoothed cross-entropy (padding is ignored).
        beam_size: 1 = greedy; used for validation and test BLEU.
        length_penalty, max_len_a, max_len_b: decoding settings (see
            :func:`multihead.model.beam_search`); outputs are at most ``a * src_len + b``.
        bleu_every_n_val: compute BLEU on every n-th validation run (loss on all of them).
        seed: dropout is seeded with ``(seed, step)`` at every step, so a resumed run draws
            the same masks as an uninterrupted one whatever else used the RNG meanwhile.
        run_config: the resolved run configuration, stored in checkpoints so that a
            checkpoint alone is enough to rebuild the model and translate.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        *,
        label_smoothing: float = 0.1,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        max_len_a: float = 1.2,
        max_len_b: int = 10,
        bleu_every_n_val: int = 1,
        seed: int = 0,
        run_config: dict | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.label_smoothing = label_smoothing
        self.decode_settings = dict(
            beam_size=beam_size,
            length_penalty=length_penalty,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
        )
        self.bleu_every_n_val = bleu_every_n_val
        self.seed = seed
        self.run_config = run_config
        self._val_runs = 0
        self._signatures_logged = False
        self._outputs: list[tuple[Tensor, list[str], list[str]]] = []

    # ------------------------------------------------------------------ training
    def loss(self, batch: dict) -> tuple[Tensor, int]:
        """Label-smoothed cross-entropy per real target token, and that token count."""
        src, tgt = batch["src"], batch["tgt"]
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # teacher forcing: predict the next token
        logits = self.model(src, tgt_in)  # (B, T, V)
        pad = self.tokenizer.pad_id
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt_out.reshape(-1),
            ignore_index=pad,
            label_smoothing=self.label_smoothing,
        )
        return loss, int((tgt_out != pad).sum())

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        torch.manual_seed(self.seed * 1_000_003 + self.global_step)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss, ntokens = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=ntokens)
        if "real_token_fraction" in batch:
            self.log("train/padding_fraction", 1.0 - float(batch["real_token_fraction"]))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Before clipping; under AMP Lightning has already unscaled the gradients here.
        norms = grad_norm(self.model, norm_type=2)
        self.log("train/grad_norm", norms["grad_2.0_norm_total"])

    def configure_optimizers(self) -> dict:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    # ------------------------------------------------------------------ evaluation
    def translate_ids(self, src: Tensor) -> list[list[int]]:
        """Decode a padded source batch with the configured search."""
        s = self.decode_settings
        common = dict(
            bos_id=self.tokenizer.bos_id,
            eos_id=self.tokenizer.eos_id,
            max_len_a=s["max_len_a"],
            max_len_b=s["max_len_b"],
        )
        if s["beam_size"] == 1:
            return greedy_decode(self.model, src, **common)
        return beam_search(
            self.model,
            src,
            beam_size=s["beam_size"],
            length_penalty=s["length_penalty"],
            **common,
        )

    def _eval_step(self, batch: dict, stage: str, with_bleu: bool) -> None:
        loss, ntokens = self.loss(batch)
        self.log(f"{stage}/loss", loss, batch_size=ntokens, sync_dist=True)
        if with_bleu:
            hyps = self.tokenizer.decode_batch(self.translate_ids(batch["src"]))
            self._outputs.append((batch["index"].cpu(), hyps, list(batch["tgt_text"])))

    def _eval_epoch_end(self, stage: str) -> None:
        loss = self.trainer.callback_metrics.get(f"{stage}/loss")
        if loss is not None:
            self.log(f"{stage}/ppl", torch.exp(loss), sync_dist=True)
        if not self._outputs:
            return
        hyps = [h for _, hs, _ in self._outputs for h in hs]
        refs = [r for _, _, rs in self._outputs for r in rs]
        self._outputs.clear()
        scores = corpus_scores(hyps, refs)
        self.log(f"{stage}/bleu", scores.bleu, sync_dist=True)
        self.log(f"{stage}/chrf", scores.chrf, sync_dist=True)
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            self.print(f"{stage} BLEU {scores.bleu:.2f} ({scores.bleu_signature})")
            if not self._signatures_logged:  # how the scores were made, once per run
                for logger in self.loggers:
                    logger.log_hyperparams(
                        {
                            "sacrebleu/bleu_signature": scores.bleu_signature,
                            "sacrebleu/chrf_signature": scores.chrf_signature,
                        }
                    )
                self._signatures_logged = True

    def on_validation_epoch_start(self) -> None:
        self._outputs.clear()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        with_bleu = self._val_runs % self.bleu_every_n_val == 0
        self._eval_step(batch, "val", with_bleu)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")
        if not self.trainer.sanity_checking:
            self._val_runs += 1

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test", with_bleu=True)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # A checkpoint is self-contained: config + tokenizer rebuild the model anywhere.
        checkpoint["multihead"] = {
            "config": self.run_config,
            "tokenizer": self.tokenizer.to_str(),
            "val_runs": self._val_runs,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._val_runs = checkpoint.get("multihead", {}).get("val_runs", 0)
