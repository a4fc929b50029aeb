"""The LightningModule: loss, optimisation, validation BLEU. The network is passed in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Timer
from torch import Tensor, nn

from multihead.evaluation import corpus_scores
from multihead.model import decode
from multihead.training.checkpoint_io import multihead_record
from multihead.training.loss import distillation_kl, linear_cross_entropy

# With on_non_finite_loss=skip, this many bad batches in a row stop the run all the same.
MAX_SKIPPED_IN_A_ROW = 10
# The batch key of the real target tokens, counted on the host before the batch moves.
NUM_TARGETS = "num_targets"


class NonFiniteLossError(ValueError):
    """The training loss became NaN or infinite (a user-facing, one-line error)."""


class TranslationModule(pl.LightningModule):
    """Trains a :class:`multihead.model.Transformer` on batches from the data module.

    Args:
        model: the encoder-decoder network.
        tokenizer: the joint tokenizer (decodes hypotheses for BLEU).
        optimizer: a partial optimiser, called with the parameters.
        scheduler: a partial :class:`~multihead.training.InverseSqrtWarmup`, called with
            the optimiser and ``time_left`` (seconds of training left under
            ``trainer.max_time``); stepped every update.
        label_smoothing: epsilon of label-smoothed cross-entropy (padding is ignored).
            Validation and test losses are fp32 under every ``trainer.precision`` (the loss
            turns autocast off when it takes no gradient), so they compare across runs.
        beam_size: 1 = greedy; the search for validation BLEU.
        test_beam_size: the search for test BLEU; ``None`` = ``beam_size``.
        length_penalty, max_len_a, max_len_b: decoding settings (see
            :func:`multihead.model.decode`); outputs are at most ``a * src_len + b``.
        bleu_every_n_val: compute BLEU on every n-th validation run (loss on all of them).
        seed: dropout is seeded with ``(seed, step)`` at every step, so a resumed run draws
            the same masks as an uninterrupted one whatever else used the RNG meanwhile.
        on_non_finite_loss: ``"stop"`` the run with a one-line error naming the step when
            the training loss is NaN or infinite, or ``"skip"`` the batch: a step without an
            update, counted in ``skipped_batches`` and in the run summary (single process
            only; more than 10 in a row stop the run).
        aux_loss_weight: weight of the model's auxiliary loss (the load-balancing loss of
            sparse heads, :meth:`~multihead.model.Transformer.aux_loss`) in the training loss.
        teacher: a frozen network to distil from (``scripts/train.py distill_from=CKPT``:
            uptraining a converted checkpoint from the one it was converted from). The
            training loss becomes ``CE + distill_weight * KL(teacher || student)``, the KL of
            the next-token distributions (temperature 1, X-EcoMLA) averaged over the real
            target tokens, logged as ``train/kl``. The teacher stays in eval mode, takes no
            gradient, and is no part of the module: not optimised, not in its checkpoints.
        distill_weight: the KL's weight, 1 if ``None``; refused without a teacher.

    ``run_config`` (set by :func:`multihead.training.run.train`) is the resolved run
    configuration, stored in checkpoints so that a checkpoint alone rebuilds the model.

    The module's part of a training step waits for the device once, to learn whether the
    loss is finite (in fp16 the loss scaler's inf check is a second wait). Metrics are
    logged as tensors, the gradient norm is computed on the device, and the real target
    tokens are counted on the host before the batch moves (:meth:`transfer_batch_to_device`).
    ``tests/fake_cuda`` and ``tests/training/test_step_syncs.py`` count these waits.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        *,
        label_smoothing: float = 0.1,
        beam_size: int,
        test_beam_size: int | None = None,
        length_penalty: float,
        max_len_a: float,
        max_len_b: float,
        bleu_every_n_val: int = 1,
        seed: int = 0,
        aux_loss_weight: float = 0.0,
        on_non_finite_loss: str = "stop",
        teacher: nn.Module | None = None,
        distill_weight: float | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        for name, value in (("beam_size", beam_size), ("test_beam_size", test_beam_size)):
            if value is not None and value < 1:
                raise ValueError(f"module.{name} must be >= 1, got {value}")
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.label_smoothing = label_smoothing
        self.decode_settings = dict(
            length_penalty=length_penalty, max_len_a=max_len_a, max_len_b=max_len_b
        )
        self.beam_sizes = {"val": beam_size, "test": test_beam_size or beam_size}
        if aux_loss_weight < 0:
            raise ValueError(f"module.aux_loss_weight must be >= 0, got {aux_loss_weight}")
        if on_non_finite_loss not in ("stop", "skip"):
            raise ValueError(
                f"module.on_non_finite_loss={on_non_finite_loss!r}; expected 'stop' or 'skip'"
            )
        self.on_non_finite_loss = on_non_finite_loss
        if distill_weight is not None and teacher is None:
            raise ValueError(
                f"module.distill_weight={distill_weight} weighs the distillation term, and there "
                "is no teacher to distil from (distill_from=CKPT)"
            )
        distill_weight = 1.0 if distill_weight is None else distill_weight
        if not distill_weight > 0:
            raise ValueError(f"module.distill_weight must be > 0, got {distill_weight}")
        self.distill_weight = distill_weight
        # A tuple, not a submodule: the teacher's parameters are neither optimised nor saved
        # with the student's, and Lightning's train() leaves it in eval mode.
        self._teacher = () if teacher is None else (teacher.eval().requires_grad_(False),)
        self.skipped_batches = 0
        self._skipped_in_a_row = 0
        self.bleu_every_n_val = bleu_every_n_val
        self.aux_loss_weight = aux_loss_weight
        self.seed = seed
        self.run_config: dict | None = None
        self._val_runs = 0
        self._signatures_logged = False
        self._hyps: list[str] = []
        self._refs: list[str] = []
        self._rows: list[int] = []
        # The last BLEU evaluation's outputs per stage, in the split's order.
        self.hypotheses: dict[str, list[str]] = {}

    # ------------------------------------------------------------------ training
    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        # The last moment the batch is on the host: count its real target tokens here, so
        # that neither the loss nor the logs wait for the device to count them.
        if isinstance(batch, dict) and "tgt" in batch:
            batch = {**batch, NUM_TARGETS: self._count_targets(batch["tgt"])}
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _count_targets(self, tgt: Tensor) -> int:
        """Real tokens of a ``(B, T)`` target batch that are predicted (all but bos)."""
        return int(tgt[:, 1:].ne(self.pad_id).sum())

    def _losses(self, batch: dict, states: Tensor | None = None) -> tuple[Tensor, Tensor, int]:
        """Teacher-forced label-smoothed loss and NLL per real target token, and that count;
        ``states``: the decoder's ``(B, T, E)`` on the batch, when already computed.

        The output projection runs inside the loss, chunk by chunk (see
        :func:`~multihead.training.loss.linear_cross_entropy`): the same numbers as
        ``F.cross_entropy`` on the model's logits, without the ``(B, T, V)`` logits.
        """
        src, tgt = batch["src"], batch["tgt"]
        ntokens = batch.get(NUM_TARGETS)
        if ntokens is None:  # a batch that did not come through the trainer
            ntokens = self._count_targets(tgt)
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # teacher forcing: predict the next token
        if states is None:
            states = self.model.decoder_states(src, tgt_in)  # (B, T, E)
        loss, nll = linear_cross_entropy(
            states,
            self.model.output_projection.weight,  # (V, E), bias-free
            tgt_out,
            ignore_index=self.pad_id,
            label_smoothing=self.label_smoothing,
            num_targets=ntokens,
        )
        return loss, nll, ntokens

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    def loss(self, batch: dict) -> tuple[Tensor, int]:
        """Label-smoothed cross-entropy per real target token, and that token count."""
        loss, _, ntokens = self._losses(batch)
        return loss, ntokens

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        torch.manual_seed(self.seed * 1_000_003 + self.global_step)

    def distillation(self, batch: dict, states: Tensor) -> Tensor:
        """``KL(teacher || student)`` of the next-token distributions, averaged over the
        batch's real target tokens; ``states``: the student decoder's ``(B, T, E)``.

        Unlike the cross-entropy this needs the ``(N, V)`` logits of both models (N real
        target tokens): about 2 x 120 MB in fp32 for a 4,096-token batch of 8,000 types.
        """
        (teacher,) = self._teacher
        src, tgt_in = batch["src"], batch["tgt"][:, :-1]
        real = batch["tgt"][:, 1:].ne(self.pad_id)  # (B, T): the tokens the loss counts
        student = states[real] @ self.model.output_projection.weight.T  # (N, V)
        with torch.no_grad():
            taught = teacher.decoder_states(src, tgt_in)[real]  # (N, E)
            taught = taught @ teacher.output_projection.weight.T  # (N, V)
        return distillation_kl(student, taught)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor | None:
        if self._teacher:
            states = self.model.decoder_states(batch["src"], batch["tgt"][:, :-1])  # (B, T, E)
            loss, _, ntokens = self._losses(batch, states)
            kl = self.distillation(batch, states)
            self.log("train/kl", kl, batch_size=ntokens)
            cross_entropy, loss = loss, loss + self.distill_weight * kl
        else:
            loss, ntokens = self.loss(batch)
            cross_entropy = loss
        aux = self.model.aux_loss()
        if aux is not None:  # sparse heads: keep the router's load balanced
            self.log("train/aux_loss", aux, batch_size=ntokens)
            loss = loss + self.aux_loss_weight * aux
        bad = torch.isfinite(loss.detach()).logical_not()  # (), on the device
        if self.trainer.world_size > 1:
            # One all-reduce: whether any rank's loss is bad (every rank must take the same
            # decision, or the others wait for it forever), and the step's tokens.
            counts = torch.stack([bad.float(), bad.new_tensor(float(ntokens), dtype=torch.float)])
            counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
            bad, all_tokens = counts[0] > 0, counts[1]
        if bad:  # the step's one wait for the device
            return self._non_finite(loss)
        self._skipped_in_a_row = 0
        self.log("train/loss", cross_entropy, prog_bar=True, batch_size=ntokens)
        if "real_token_fraction" in batch:
            self.log("train/padding_fraction", 1.0 - float(batch["real_token_fraction"]))
        if self.trainer.world_size > 1:
            # DDP averages the ranks' gradients. Weighting each rank's per-token mean by its
            # share of the step's tokens makes that average the mean over all tokens: the
            # gradient one process computes from the whole (global) batch.
            loss = loss * (ntokens * self.trainer.world_size / all_tokens)
        return loss

    def _non_finite(self, loss: Tensor) -> None:
        """Stop with a one-line error naming the step, or skip the batch and count it."""
        if self.on_non_finite_loss == "stop":
            raise NonFiniteLossError(
                f"non-finite training loss ({loss.item()}) at step {self.global_step}; the "
                "checkpoints written before it are intact. Lower module.optimizer.lr, or set "
                "module.on_non_finite_loss=skip to skip such batches"
            )
        self.skipped_batches += 1
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row > MAX_SKIPPED_IN_A_ROW:
            # A diverged run would otherwise skip every batch until max_steps.
            raise NonFiniteLossError(
                f"non-finite training loss in {self._skipped_in_a_row} batches in a row at step "
                f"{self.global_step}; the run has diverged. Lower module.optimizer.lr"
            )
        self.print(f"skipped batch at step {self.global_step}: non-finite training loss")
        return None  # Lightning skips backward: a step without an update

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Before clipping; under AMP Lightning has already unscaled the gradients here.
        # Computed on the device (Lightning's grad_norm reads every parameter's norm back).
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:  # none after a skipped batch
            self.log("train/grad_norm", torch.nn.utils.get_total_norm(grads, norm_type=2.0))

    def on_fit_start(self) -> None:
        for teacher in self._teacher:  # not a submodule: moved here, beside the student
            teacher.to(self.device)
        if self.on_non_finite_loss == "skip" and self.trainer.world_size > 1:
            # A skipped step returns no loss, which DDP's gradient all-reduce cannot take.
            raise ValueError(
                "module.on_non_finite_loss=skip works in one process only; "
                f"this run has {self.trainer.world_size}. Use stop"
            )

    def configure_optimizers(self) -> dict:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler_factory(optimizer, time_left=self._training_seconds_left)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def _training_seconds_left(self) -> float | None:
        """Seconds left under ``trainer.max_time`` (Lightning's Timer), None without one."""
        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        return None if timer is None else timer.time_remaining()

    # ------------------------------------------------------------------ evaluation
    def translate_ids(self, src: Tensor, stage: str = "val") -> list[list[int]]:
        """Decode a padded source batch with the search configured for ``stage``."""
        return decode(
            self.model,
            src,
            bos_id=self.tokenizer.bos_id,
            eos_id=self.tokenizer.eos_id,
            beam_size=self.beam_sizes[stage],
            **self.decode_settings,
        )

    def _eval_step(self, batch: dict, stage: str, with_bleu: bool) -> None:
        # Perplexity is exp of the plain NLL; the smoothed loss would overstate it.
        loss, nll, ntokens = self._losses(batch)
        self.log(f"{stage}/loss", loss, batch_size=ntokens, sync_dist=True)
        self.log(f"{stage}/nll", nll, batch_size=ntokens, sync_dist=True)
        if with_bleu:
            self._hyps += self.tokenizer.decode_batch(self.translate_ids(batch["src"], stage))
            self._refs += list(batch["tgt_text"])
            self._rows += batch.get("index", [])

    def _gathered(self) -> tuple[list[str], list[str]]:
        """Every rank's hypotheses and references (all of them on every rank), in the
        split's order when the batches carried their rows (the datamodule's do)."""
        outputs = (self._hyps, self._refs, self._rows)
        self._hyps, self._refs, self._rows = [], [], []
        datamodule = self.trainer.datamodule
        if self.trainer.world_size > 1 and getattr(datamodule, "shard_eval", True):
            # Corpus BLEU is not a mean of per-rank BLEUs: score the union of the ranks' outputs.
            gathered: list = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, outputs)
            outputs = tuple([x for part in gathered for x in part[i]] for i in range(3))
        hyps, refs, rows = outputs
        if len(rows) == len(hyps):  # batches decode longest first: back to the split's order
            order = sorted(range(len(rows)), key=rows.__getitem__)
            hyps, refs = [hyps[i] for i in order], [refs[i] for i in order]
        return hyps, refs

    def _eval_epoch_end(self, stage: str) -> None:
        nll = self.trainer.callback_metrics.get(f"{stage}/nll")
        if nll is not None:
            self.log(f"{stage}/ppl", torch.exp(nll))
        if not self._hyps and self.trainer.world_size == 1:
            return  # no BLEU this validation run
        hyps, refs = self._gathered()
        if not hyps:
            return
        self.hypotheses[stage] = hyps
        scores = corpus_scores(hyps, refs)
        # Every rank scored the same gathered corpus: nothing to reduce.
        self.log(f"{stage}/bleu", scores.bleu)
        self.log(f"{stage}/chrf", scores.chrf)
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
        self._hyps, self._refs, self._rows = [], [], []

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
            **multihead_record(self, self.tokenizer),
            "val_runs": self._val_runs,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._val_runs = checkpoint.get("multihead", {}).get("val_runs", 0)
