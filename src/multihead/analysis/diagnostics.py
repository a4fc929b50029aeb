"""A training callback, :class:`AttentionMapLogger`, that draws attention maps and head
similarity (:mod:`multihead.analysis.heads`) after validation. It sits with the analysis it
draws, above :mod:`multihead.training`, which imports nothing from here."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import lightning.pytorch as pl
import matplotlib.pyplot as plt
from lightning.pytorch.loggers import WandbLogger

from multihead.analysis.heads import (
    KEYS,
    MAP_KINDS,
    QUERIES,
    head_similarity,
    plot_heads,
    plot_similarity,
    teacher_forced,
    token_labels,
)

log = logging.getLogger(__name__)


class AttentionMapLogger(pl.Callback):
    """Draws attention maps and head similarity of fixed validation sentences.

    After every ``every_n_val``-th validation run (not the sanity check) the module's
    model is run in eval mode on the first ``num_sentences`` sentences of the validation
    split. For each sentence, sublayer kind (``encoder_self``, ``decoder_self``,
    ``cross``) and layer one figure with a heatmap per head is written to
    ``out_dir/step{step}_{kind}_layer{i}_sent{j}.png``, and the head similarity of every
    layer to ``out_dir/step{step}_head_similarity.png``. The similarities are logged to
    every logger as ``diagnostics/head_similarity/<kind>/layer<i>``; a WandbLogger also
    receives the images.

    Args:
        num_sentences: validation sentences drawn (the first N of the split).
        every_n_val: draw on every n-th validation run.
        max_tokens_shown: crop the maps to the first N query and key tokens.
        out_dir: where PNGs go; default ``<trainer.default_root_dir>/attention_maps``.
    """

    def __init__(
        self,
        num_sentences: int = 2,
        every_n_val: int = 1,
        max_tokens_shown: int = 30,
        out_dir: str | None = None,
    ) -> None:
        for name, value in (
            ("num_sentences", num_sentences),
            ("every_n_val", every_n_val),
            ("max_tokens_shown", max_tokens_shown),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_sentences = num_sentences
        self.every_n_val = every_n_val
        self.max_tokens_shown = max_tokens_shown
        self.out_dir = out_dir
        self.last_similarity: dict[str, list[float]] = {}
        self._val_runs = 0

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        run = self._val_runs
        self._val_runs += 1
        if run % self.every_n_val != 0 or not trainer.is_global_zero:
            return
        examples = trainer.datamodule.tokenized["validation"]
        examples = [examples[i] for i in range(min(self.num_sentences, len(examples)))]
        self.draw(trainer, pl_module, examples)

    def draw(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, examples: list[dict]
    ) -> list[Path]:
        """Compute, write and log the figures for ``examples``; returns the PNG paths."""
        tokenizer = pl_module.tokenizer
        run = teacher_forced(pl_module.model, tokenizer, examples)
        src, tgt_in, real, maps = run["src"], run["tgt_in"], run["real"], run["maps"]
        similarity = {
            kind: [head_similarity(out, real[QUERIES[kind]]) for out in run["outputs"][kind]]
            for kind in MAP_KINDS
        }
        self.last_similarity = similarity

        step = trainer.global_step
        root = Path(trainer.default_root_dir or trainer.log_dir or ".")
        out_dir = root / "attention_maps" if self.out_dir is None else Path(self.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        ids = {"src": src.cpu(), "tgt": tgt_in.cpu()}
        lengths = {name: mask.sum(dim=1).tolist() for name, mask in real.items()}
        written: list[Path] = []
        images: dict[str, tuple[list[Path], list[str]]] = {}
        for kind, j in itertools.product(MAP_KINDS, range(len(examples))):
            q, k = QUERIES[kind], KEYS[kind]
            n_q = min(lengths[q][j], self.max_tokens_shown)
            n_k = min(lengths[k][j], self.max_tokens_shown)
            row_labels = token_labels(tokenizer, ids[q][j, :n_q])
            col_labels = token_labels(tokenizer, ids[k][j, :n_k])
            for i, layer_maps in enumerate(maps[kind]):
                weights = layer_maps[j, :, :n_q, :n_k].float().cpu()  # (H, n_q, n_k)
                title = f"{kind} layer {i}, sentence {j}, step {step}"
                fig = plot_heads(weights, row_labels, col_labels, title)
                path = out_dir / f"step{step}_{kind}_layer{i}_sent{j}.png"
                fig.savefig(path, dpi=100)
                plt.close(fig)
                written.append(path)
                paths, captions = images.setdefault(f"attention_maps/{kind}/layer{i}", ([], []))
                paths.append(path)
                captions.append(examples[j]["src"])

        fig = plot_similarity(similarity, f"head similarity, step {step}")
        path = out_dir / f"step{step}_head_similarity.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
        images["diagnostics/head_similarity"] = ([path], [f"step {step}"])

        metrics = {
            f"diagnostics/head_similarity/{kind}/layer{i}": value
            for kind, values in similarity.items()
            for i, value in enumerate(values)
            if value == value  # NaN for single-head layers: nothing to compare
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, WandbLogger):
                for key, (paths, captions) in images.items():
                    logger.log_image(
                        key=key, images=[str(p) for p in paths], step=step, caption=captions
                    )
        log.info("attention maps written to %s", out_dir)
        return written
