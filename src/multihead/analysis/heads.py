"""Attention maps and head diversity of a Transformer: per-head outputs, similarity, figures.

The training callback :class:`~multihead.analysis.diagnostics.AttentionMapLogger` draws
these after validation; they work on any trained model.

Head similarity is the mean, over pairs of heads and real (non-padding) query positions,
of the cosine similarity between two heads' outputs ``weights_h @ V_h`` (before the
output projection): near 1 means the heads compute nearly the same thing.
"""

from __future__ import annotations

from typing import Any

import matplotlib
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import MultiHeadAttention

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

MAP_KINDS = ("encoder_self", "decoder_self", "cross")


def head_outputs(
    model: nn.Module, src: Tensor, tgt_in: Tensor
) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
    """Attention weights and per-head outputs of every sublayer (math path).

    The per-head output is ``weights_h @ V_h``, the head's contribution before the heads
    are concatenated and projected by ``out_proj``, as each head design gives it
    (:meth:`~multihead.attention.MultiHeadAttention.head_outputs`: for the ``group_mlp`` and
    ``head_attention`` mixings after the mixing; a design without it is refused by name).
    ``V`` is recomputed from each
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
    layers = {  # every attention sublayer: (kind of MAP_KINDS, layer index)
        attn: (kind.removesuffix("_attention"), i)
        for kind, i, _, attn in model.attention_sublayers()
    }
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
    for attn, (kind, i) in layers.items():  # each design's own per-head outputs (or refusal)
        outputs[kind].append(attn.head_outputs(maps[kind][i], inputs[(kind, i)]))  # (B,H,L,D)
    return maps, outputs


def head_similarity_matrix(outputs: Tensor, query_mask: Tensor | None = None) -> Tensor:
    """``(H, H)`` pairwise cosine similarities of heads' outputs, averaged over positions.

    Entry ``(h, h')`` is the mean over real query positions ``(b, l)`` of
    ``cos(outputs[b, h, l], outputs[b, h', l])``. A head whose output is zero at a position
    (a sparse head that was not selected there) counts as orthogonal to the others there.

    Args:
        outputs: ``(B, H, L, D)`` per-head outputs.
        query_mask: ``(B, L)`` bool, True = a real query position; ``None`` = all real.
    """
    B, H, L, _ = outputs.shape
    unit = F.normalize(outputs.float(), dim=-1)  # (B, H, L, D); zero rows stay zero
    cos = torch.einsum("bhld,bkld->blhk", unit, unit)  # (B, L, H, H)
    if query_mask is None:
        query_mask = torch.ones(B, L, dtype=torch.bool, device=outputs.device)
    return cos[query_mask].mean(dim=0).clamp(-1.0, 1.0)  # (H, H)


def head_similarity(outputs: Tensor, query_mask: Tensor | None = None) -> float:
    """Mean pairwise cosine similarity between heads' outputs, in ``[-1, 1]``.

    The mean of :func:`head_similarity_matrix` over head pairs ``h < h'``; NaN with a
    single head.
    """
    H = outputs.shape[1]
    if H < 2:
        return float("nan")
    pairs = torch.triu_indices(H, H, offset=1)
    return float(head_similarity_matrix(outputs, query_mask)[pairs[0], pairs[1]].mean())


def token_labels(tokenizer: Any, ids: Tensor) -> list[str]:
    """One tick label per id: the decoded subword, or ``<pad>``/``<bos>``/``<eos>``."""
    special = {tokenizer.pad_id: "<pad>", tokenizer.bos_id: "<bos>", tokenizer.eos_id: "<eos>"}
    # Byte-level pieces of a multi-byte character decode to U+FFFD: fine for a label.
    pieces = {i: tokenizer.decode([i]) for i in ids.tolist() if i not in special}
    return [special.get(i) or pieces[i].strip() or repr(pieces[i]) for i in ids.tolist()]


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


# Which sequence holds each sublayer kind's queries and keys.
QUERIES = {"encoder_self": "src", "decoder_self": "tgt", "cross": "tgt"}
KEYS = {"encoder_self": "src", "decoder_self": "tgt", "cross": "src"}


def teacher_forced(model: nn.Module, tokenizer: Any, examples: list[dict]) -> dict[str, Any]:
    """Attention maps and per-head outputs of ``examples``, the decoder fed the references.

    ``examples`` are tokenized pairs (``src_ids``, ``tgt_ids``, ``src``, ``tgt``). Returns
    ``src`` ``(B, S)`` and ``tgt_in`` ``(B, T)`` ids, ``real`` (``{"src", "tgt"}``: True at
    non-padding positions) and ``maps``/``outputs`` of :func:`head_outputs`. Runs the model
    in eval mode without gradients and restores its mode.
    """
    from multihead.data import collate

    ids = dict(pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    batch = collate(examples, **ids)
    device = next(model.parameters()).device
    src, tgt_in = batch["src"].to(device), batch["tgt"][:, :-1].to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            maps, outputs = head_outputs(model, src, tgt_in)
    finally:
        model.train(was_training)
    real = {"src": src.ne(tokenizer.pad_id), "tgt": tgt_in.ne(tokenizer.pad_id)}
    return {"src": src, "tgt_in": tgt_in, "real": real, "maps": maps, "outputs": outputs}


def similarity_matrices(
    model: nn.Module, tokenizer: Any, pairs: list[tuple[str, str]], batch_size: int = 50
) -> dict[str, list[Tensor]]:
    """:func:`head_similarity_matrix` of every sublayer over (source, reference) ``pairs``.

    The decoder is teacher-forced on the references. Each matrix averages over all real
    query positions of all pairs (batches weighted by their positions).

    Returns:
        ``{kind: [(H, H) per layer]}`` with the kinds of :data:`MAP_KINDS`.
    """
    sums: dict[str, list[Tensor]] = {}
    counts: dict[str, int] = {}  # real query positions, the same for every layer of a kind
    for start in range(0, len(pairs), batch_size):
        examples = [
            {"src_ids": tokenizer.encode(s), "tgt_ids": tokenizer.encode(t), "src": s, "tgt": t}
            for s, t in pairs[start : start + batch_size]
        ]
        run = teacher_forced(model, tokenizer, examples)
        for kind, layers in run["outputs"].items():
            mask = run["real"][QUERIES[kind]]
            n = int(mask.sum())
            weighted = [head_similarity_matrix(out, mask) * n for out in layers]
            if kind in sums:
                weighted = [total + w for total, w in zip(sums[kind], weighted, strict=True)]
            sums[kind], counts[kind] = weighted, counts.get(kind, 0) + n
    return {kind: [m / counts[kind] for m in sums[kind]] for kind in sums}


def mean_off_diagonal(matrix: Tensor) -> float:
    """The mean of an ``(H, H)`` similarity matrix over pairs of different heads."""
    H = matrix.shape[0]
    return float((matrix.sum() - matrix.trace()) / max(H * (H - 1), 1))


def diversity_markdown(per_model: dict[str, dict[str, list[Tensor]]]) -> str:
    """A table of :func:`mean_off_diagonal` per model, sublayer kind and layer."""
    layers = max(len(m) for matrices in per_model.values() for m in matrices.values())
    lines = ["| model | sublayer | " + " | ".join(f"layer {i}" for i in range(layers)) + " |"]
    lines.append("|---|---|" + "---:|" * layers)
    for label, matrices in per_model.items():
        for kind, per_layer in matrices.items():
            cells = " | ".join(f"{mean_off_diagonal(m):.3f}" for m in per_layer)
            lines.append(f"| {label} | {kind} | {cells} |")
    return "\n".join(lines) + "\n"


def plot_similarity_matrices(matrices: dict[str, list[Tensor]], title: str) -> plt.Figure:
    """One ``(H, H)`` heatmap per sublayer: rows are kinds, columns layers, scale [-1, 1]."""
    kinds = list(matrices)
    layers = max(len(m) for m in matrices.values())
    fig, axes = plt.subplots(
        len(kinds), layers, figsize=(2.2 * layers + 1, 2.1 * len(kinds) + 0.6), squeeze=False
    )
    for row, kind in enumerate(kinds):
        for col, ax in enumerate(axes[row]):
            if col >= len(matrices[kind]):
                ax.axis("off")
                continue
            matrix = matrices[kind][col]
            image = ax.imshow(matrix.numpy(), cmap="RdBu_r", vmin=-1.0, vmax=1.0)
            H = matrix.shape[0]
            off = mean_off_diagonal(matrix)
            ax.set_title(f"{kind} layer {col}\nmean off-diag {off:.2f}", fontsize=7)
            ax.set_xticks(range(H))
            ax.set_yticks(range(H))
            ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6)
    return fig
