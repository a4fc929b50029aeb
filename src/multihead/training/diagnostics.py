"""Attention maps and head diversity of a Transformer, drawn after validation.

:class:`AttentionMapLogger` takes a few fixed validation sentences and, after every n-th
validation run, draws each head's attention weights (one figure per sublayer kind, layer
and sentence) and a chart of how similar the heads of each layer are. The figures go to
PNG files, and to wandb when a :class:`~lightning.pytorch.loggers.WandbLogger` is in use.

Head similarity is the mean, over pairs of heads and real (non-padding) query positions,
of the cosine similarity between two heads' outputs ``weights_h @ V_h`` (before the
output projection): near 1 means the heads compute nearly the same thing.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import matplotlib
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor, nn

from multihead.attention import MultiHeadAttention
from multihead.data import collate

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

log = logging.getLogger(__name__)

MAP_KINDS = ("encoder_self", "decoder_self", "cross")


def _attention_layers(model: nn.Module) -> dict[MultiHeadAttention, tuple[str, int]]:
    """Every attention sublayer of a :class:`~multihead.model.Transformer`: (kind, layer)."""
    layers: dict[MultiHeadAttention, tuple[str, int]] = {}
    for i, layer in enumerate(model.encoder_layers):
        layers[layer.self_attn] = ("encoder_self", i)
    for i, layer in enumerate(model.decoder_layers):
        layers[layer.self_attn] = ("decoder_self", i)
        layers[layer.cross_attn] = ("cross", i)
    return layers


def head_outputs(
    model: nn.Module, src: Tensor, tgt_in: Tensor
) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
    """Attention weights and per-head outputs of every sublayer (math path).

    The per-head output is ``weights_h @ V_h``, the head's contribution before the heads
    are concatenated and projected by ``out_proj``. ``V`` is recomputed from each
    sublayer's key/value input, captured by a forward pre-hook while
    :meth:`~multihead.model.Transformer.attention_maps` runs. Call it in eval mode under
    ``torch.no_grad()``.

    Args:
        model: a :class:`~multihead.model.Transformer`.
        src: ``(B, S)`` source ids.
        tgt_in: ``(B, T)`` bos-prefixed target ids.

    Returns:
        ``(maps, outputs)``, both ``{kind: [per layer]}`` with the kinds of
        :data:`MAP_KINDS`; maps are ``(B, H, L, S)``, outputs ``(B, H, L, D)``.
    """
    layers = _attention_layers(model)
    inputs: dict[tuple[str, int], Tensor] = {}

    def capture(module: MultiHeadAttention, args: tuple, kwargs: dict) -> None:
        key_value = args[1] if len(args) > 1 else kwargs.get("key_value")
        inputs[layers[module]] = args[0] if key_value is None else key_value

    hooks = [attn.register_forward_pre_hook(capture, with_kwargs=True) for attn in layers]
    try:
        maps = model.attention_maps(src, tgt_in)
    finally:
        for hook in hooks:
            hook.remove()

    outputs: dict[str, list[Tensor]] = {kind: [] for kind in MAP_KINDS}
    for attn, (kind, i) in layers.items():
        H, G, D, E = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.embed_dim
        w, b = attn.in_proj.weight, attn.in_proj.bias
        rows = slice(E + G * D, E + 2 * G * D)  # the V rows of the stacked projection
        kv = inputs[(kind, i)]
        v = F.linear(kv, w[rows], None if b is None else b[rows])  # (B, S, G*D)
        v = v.view(kv.shape[0], -1, G, D).transpose(1, 2)  # (B, G, S, D)
        v = v.repeat_interleave(H // G, dim=1)  # (B, H, S, D): query head h uses group h//(H/G)
        outputs[kind].append(maps[kind][i] @ v)  # (B, H, L, D)
    return maps, outputs


def head_similarity(outputs: Tensor, query_mask: Tensor | None = None) -> float:
    """Mean pairwise cosine similarity between heads' outputs, in ``[-1, 1]``.

    Args:
        outputs: ``(B, H, L, D)`` per-head outputs.
        query_mask: ``(B, L)`` bool, True = a real query position; ``None`` = all real.

    Returns:
        The mean over head pairs ``h < h'`` and real positions of
        ``cos(outputs[b, h, l], outputs[b, h', l])``; NaN with a single head.
    """
    B, H, L, _ = outputs.shape
    if H < 2:
        return float("nan")
    unit = F.normalize(outputs.float(), dim=-1)  # (B, H, L, D)
    cos = torch.einsum("bhld,bkld->blhk", unit, unit)  # (B, L, H, H)
    pairs = torch.triu_indices(H, H, offset=1, device=outputs.device)
    per_pair = cos[:, :, pairs[0], pairs[1]]  # (B, L, H*(H-1)/2)
    if query_mask is None:
        query_mask = torch.ones(B, L, dtype=torch.bool, device=outputs.device)
    return float(per_pair[query_mask].mean().clamp(-1.0, 1.0))


def token_labels(tokenizer: Any, ids: Tensor) -> list[str]:
    """One tick label per id: the decoded subword, or ``<pad>``/``<bos>``/``<eos>``."""
    special = {tokenizer.pad_id: "<pad>", tokenizer.bos_id: "<bos>", tokenizer.eos_id: "<eos>"}
    labels = []
    for i in ids.tolist():
        text = special.get(i)
        if text is None:
            # Byte-level pieces of a multi-byte character decode to U+FFFD: fine for a label.
            piece = tokenizer.decode([i])
            text = piece.strip() or repr(piece)
        labels.append(text)
    return labels


def plot_heads(
    weights: Tensor, row_labels: list[str], col_labels: list[str], title: str
) -> plt.Figure:
    """A grid of heatmaps, one per head, of ``weights`` ``(H, L, S)`` on one colour scale."""
    H = weights.shape[0]
    cols = min(H, 4)
    rows = -(-H // cols)
    size = 0.5 + 0.18 * max(len(row_labels), len(col_labels))
    fig, axes = plt.subplots(
        rows, cols, figsize=(cols * size + 1, rows * size + 0.8), squeeze=False
    )
    # One colour scale for all heads, so they compare; up to the largest weight shown.
    vmax = max(float(weights.max()), 1e-6)
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        image = ax.imshow(weights[h].numpy(), cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_title(f"head {h}", fontsize=8)
        # Every head has the same tokens: label only the outer axes (ticks are slow to draw).
        below = h + cols < H
        ax.set_xticks([] if below else range(len(col_labels)))
        ax.set_yticks(range(len(row_labels)) if h % cols == 0 else [])
        if not below:
            ax.set_xticklabels(col_labels, rotation=90, fontsize=6)
        if h % cols == 0:
            ax.set_yticklabels(row_labels, fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    return fig


def plot_similarity(similarity: dict[str, list[float]], title: str) -> plt.Figure:
    """Head similarity per layer, one line per sublayer kind."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for kind, values in similarity.items():
        ax.plot(range(len(values)), values, marker="o", label=kind)
    ax.set_xticks(range(max(map(len, similarity.values()), default=0)))
    ax.set_xlabel("layer")
    ax.set_ylabel("mean pairwise cosine of head outputs")
    ax.set_ylim(-1.05, 1.05)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


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

    def _out_dir(self, trainer: pl.Trainer) -> Path:
        if self.out_dir is not None:
            return Path(self.out_dir)
        return Path(trainer.default_root_dir or trainer.log_dir or ".") / "attention_maps"

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
        batch = collate(
            examples,
            pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
        )
        model = pl_module.model
        src = batch["src"].to(pl_module.device)
        tgt_in = batch["tgt"][:, :-1].to(pl_module.device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                maps, outputs = head_outputs(model, src, tgt_in)
        finally:
            model.train(was_training)

        real = {"src": src.ne(tokenizer.pad_id), "tgt": tgt_in.ne(tokenizer.pad_id)}
        queries = {"encoder_self": "src", "decoder_self": "tgt", "cross": "tgt"}
        keys = {"encoder_self": "src", "decoder_self": "tgt", "cross": "src"}
        similarity = {
            kind: [head_similarity(out, real[queries[kind]]) for out in outputs[kind]]
            for kind in MAP_KINDS
        }
        self.last_similarity = similarity

        step = trainer.global_step
        out_dir = self._out_dir(trainer)
        out_dir.mkdir(parents=True, exist_ok=True)
        ids = {"src": src.cpu(), "tgt": tgt_in.cpu()}
        lengths = {name: mask.sum(dim=1).tolist() for name, mask in real.items()}
        written: list[Path] = []
        images: dict[str, tuple[list[Path], list[str]]] = {}
        for kind, j in itertools.product(MAP_KINDS, range(len(examples))):
            q, k = queries[kind], keys[kind]
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
