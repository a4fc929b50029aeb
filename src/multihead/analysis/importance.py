"""Which heads matter: importance (Michel et al., 2019), roles (Voita et al., 2019), pruning.

Every score is per attention sublayer (kind of :data:`~multihead.analysis.heads.MAP_KINDS`,
layer) and query head, over (source, reference) pairs with the decoder teacher-forced:

* ``importance``: Michel's ``I_h = mean over batches of |dL/dg_h|``, ``g`` a gate of ones
  on each sublayer's heads (:attr:`MultiHeadAttention.head_mask`) and ``L`` the batch's
  mean token cross-entropy (no label smoothing), then divided by the l2 norm of its
  sublayer's ``I`` (the paper's per-layer normalisation); ``importance_raw`` before it.
* ``confidence``: Voita's, the mean over real query tokens of the head's largest weight.
* ``prev_share``, ``next_share``: the mean weight on the key one position before / after
  the query (self-attention only; NaN for cross-attention). Voita calls a head positional
  when it puts its largest weight there on most tokens.
* ``rare_share``: the mean weight on *rare* keys. Rare token types are the least frequent
  ones in the training split (its own side: source for encoder self- and cross-attention,
  target for decoder self-attention) that together make up at most ``rare_quantile`` of its
  running tokens (:func:`rare_token_ids`); ``rare_keys`` is the share of real keys that are
  rare, the weight a head spreading its attention evenly would give them.

Pruning: :func:`pruning_curve` masks the heads least important first and re-scores greedy
BLEU; :func:`prune_model` removes heads for real (:func:`~multihead.attention.convert.prune_heads`).

The weights are those of :meth:`~multihead.model.Transformer.attention_maps`: for sparse
heads an unselected head's row is zero, for talking heads the mixed weights.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import matplotlib
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.analysis.heads import KEYS, MAP_KINDS, QUERIES
from multihead.attention.convert import prune_heads

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

METRICS = (
    "importance",
    "importance_raw",
    "confidence",
    "prev_share",
    "next_share",
    "rare_share",
    "rare_keys",
)


def sublayers(model: nn.Module) -> Iterator[tuple[str, int, nn.Module]]:
    """``(kind, layer index, attention layer)`` with the kinds of :data:`MAP_KINDS`."""
    for kind, i, _, attn in model.attention_sublayers():
        yield kind.removesuffix("_attention"), i, attn


@contextmanager
def head_gates(model: nn.Module) -> Iterator[dict[tuple[str, int], Tensor]]:
    """Gates of ones that require grad, set as every sublayer's ``head_mask``, then removed.

    Yields ``{(kind, layer): (H,) gate}``; a gate's ``.grad`` after a backward pass is
    ``dL/dg``. Gates already set on the layers are put back afterwards.
    """
    before = {(kind, i): attn.head_mask for kind, i, attn in sublayers(model)}
    gates = {}
    device = next(model.parameters()).device
    try:
        for kind, i, attn in sublayers(model):
            gates[(kind, i)] = torch.ones(attn.num_heads, device=device, requires_grad=True)
            attn.head_mask = gates[(kind, i)]
        yield gates
    finally:
        for kind, i, attn in sublayers(model):
            attn.head_mask = before[(kind, i)]


def batches(tokenizer: Any, pairs: Sequence[tuple[str, str]], batch_size: int, device):
    """``(src, tgt_in, tgt_out)`` id tensors of ``pairs``, ``batch_size`` pairs at a time."""
    from multihead.data import collate

    ids = dict(pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        examples = [
            {"src_ids": tokenizer.encode(s), "tgt_ids": tokenizer.encode(t), "src": s, "tgt": t}
            for s, t in chunk
        ]
        batch = collate(examples, **ids)
        tgt = batch["tgt"].to(device)
        yield batch["src"].to(device), tgt[:, :-1], tgt[:, 1:]


def batch_loss(model: nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, pad_id: int):
    """The mean token cross-entropy of a batch, padding left out."""
    logits = model(src, tgt_in)  # (B, T, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=pad_id)


def head_importance(
    model: nn.Module, tokenizer: Any, pairs: Sequence[tuple[str, str]], batch_size: int = 50
) -> dict[str, Tensor]:
    """Michel's raw importance, ``{kind: (layers, H)}``: the mean over batches of
    ``|dL/dg|``. Runs the model in eval mode (no dropout) and restores its mode."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    totals: dict[tuple[str, int], Tensor] = {}
    count = 0
    try:
        with head_gates(model) as gates:
            for src, tgt_in, tgt_out in batches(tokenizer, pairs, batch_size, device):
                loss = batch_loss(model, src, tgt_in, tgt_out, tokenizer.pad_id)
                grads = torch.autograd.grad(loss, list(gates.values()))
                for key, grad in zip(gates, grads, strict=True):
                    totals[key] = totals.get(key, 0) + grad.abs().detach()
                count += 1
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("head_importance needs at least one (source, reference) pair, got none")
    return _stack({key: total / count for key, total in totals.items()})


def normalise_per_layer(importance: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each sublayer's importances divided by their l2 norm (Michel et al., 2019)."""
    return {
        kind: per_layer / per_layer.norm(dim=-1, keepdim=True).clamp_min(1e-20)
        for kind, per_layer in importance.items()
    }


def _stack(values: dict[tuple[str, int], Tensor]) -> dict[str, Tensor]:
    kinds = [kind for kind in MAP_KINDS if any(k == kind for k, _ in values)]
    return {
        kind: torch.stack([values[(kind, i)] for i in range(sum(k == kind for k, _ in values))])
        for kind in kinds
    }


def token_counts(tokenizer: Any, sentences: Sequence[str]) -> Tensor:
    """``(V,)`` how often each token id occurs in ``sentences`` (eos included)."""
    counts = torch.zeros(tokenizer.vocab_size, dtype=torch.long)
    for ids in tokenizer.encode_batch(list(sentences)):
        counts += torch.bincount(torch.tensor(ids + [tokenizer.eos_id]), minlength=len(counts))
    return counts


def rare_token_ids(counts: Tensor, rare_quantile: float) -> Tensor:
    """``(V,)`` bool: the least frequent types that together make up at most
    ``rare_quantile`` of the running tokens counted in ``counts`` (unseen types included)."""
    if not 0.0 < rare_quantile < 1.0:
        raise ValueError(f"rare_quantile must be in (0, 1), got {rare_quantile}")
    order = counts.argsort(stable=True)  # rarest first
    within = counts[order].cumsum(0) <= rare_quantile * counts.sum()
    rare = torch.zeros_like(counts, dtype=torch.bool)
    rare[order[within]] = True
    return rare


def head_roles(
    model: nn.Module,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    rare: dict[str, Tensor],
    batch_size: int = 50,
) -> dict[str, dict[str, Tensor]]:
    """Confidence, positional and rare-token shares, ``{metric: {kind: (layers, H)}}``.

    ``rare`` is ``{"src": (V,) bool, "tgt": (V,) bool}`` from :func:`rare_token_ids`.
    Each is a mean over all real query tokens of all pairs.
    """
    device = next(model.parameters()).device
    sums: dict[str, dict[tuple[str, int], Tensor]] = {m: {} for m in METRICS[2:]}
    queries = {kind: 0 for kind in MAP_KINDS}
    was_training = model.training
    model.eval()
    try:
        for src, tgt_in, tgt_out in batches(tokenizer, pairs, batch_size, device):
            with torch.no_grad():
                maps = model.attention_maps(src, tgt_in)
            ids = {"src": src, "tgt": tgt_in}
            # A target position is real when it predicts a token: tgt_in of a shorter
            # sentence ends in eos, which predicts padding.
            real = {"src": src.ne(tokenizer.pad_id), "tgt": tgt_out.ne(tokenizer.pad_id)}
            for kind, per_layer in maps.items():
                real_q = real[QUERIES[kind]]  # (B, L)
                keys = ids[KEYS[kind]]  # (B, S)
                real_k = real[KEYS[kind]]
                rare_k = rare[KEYS[kind]].to(device)[keys] & real_k  # (B, S)
                queries[kind] += int(real_q.sum())
                for i, w in enumerate(per_layer):  # (B, H, L, S)
                    w = w.float()
                    scores = {
                        "confidence": w.amax(dim=-1),
                        "rare_share": (w * rare_k[:, None, None, :]).sum(dim=-1),
                        # the same for every head: the share of a query's real keys that are rare
                        "rare_keys": (rare_k.sum(-1) / real_k.sum(-1).clamp_min(1))[
                            :, None, None
                        ].expand_as(w[..., 0]),
                    }
                    if kind == "cross":
                        nan = torch.full_like(w[..., 0], float("nan"))
                        scores["prev_share"] = scores["next_share"] = nan
                    else:
                        scores["prev_share"] = F.pad(w.diagonal(-1, -2, -1), (1, 0))  # w[l, l-1]
                        scores["next_share"] = F.pad(w.diagonal(1, -2, -1), (0, 1))  # w[l, l+1]
                    for metric, value in scores.items():  # (B, H, L) -> (H,) over real queries
                        summed = (value * real_q[:, None, :]).sum(dim=(0, 2))
                        sums[metric][(kind, i)] = sums[metric].get((kind, i), 0) + summed
    finally:
        model.train(was_training)
    return {
        metric: _stack({key: total / queries[key[0]] for key, total in per_key.items()})
        for metric, per_key in sums.items()
    }


def max_similarity(matrices: dict[str, list[Tensor]]) -> dict[str, Tensor]:
    """``{kind: (layers, H)}``: each head's largest cosine similarity with another head of
    its sublayer, read from the ``(H, H)`` matrices of
    :func:`~multihead.analysis.heads.similarity_matrices` (``head_diversity.py``'s ρ).

    Beside the importance it tells a redundant head (its output nearly another head's) from
    one that is different but little used. NaN with a single head.
    """
    out = {}
    for kind, per_layer in matrices.items():
        rows = []
        for matrix in per_layer:
            others = matrix.clone().fill_diagonal_(float("-inf"))  # (H, H), self excluded
            best = others.amax(dim=1)  # (H,)
            rows.append(best.masked_fill(best.isinf(), float("nan")))
        out[kind] = torch.stack(rows)  # (layers, H)
    return out


def importance_rows(scores: dict[str, dict[str, Tensor]]) -> list[dict[str, Any]]:
    """One row per (kind, layer, head) with every metric of ``scores`` (``{metric: {kind:
    (layers, H)}}``), for a CSV."""
    first = next(iter(scores.values()))
    rows = []
    for kind, per_layer in first.items():
        for layer in range(per_layer.shape[0]):
            for head in range(per_layer.shape[1]):
                row: dict[str, Any] = {"sublayer": kind, "layer": layer, "head": head}
                for metric, per_kind in scores.items():
                    row[metric] = float(per_kind[kind][layer, head])
                rows.append(row)
    return rows


def plot_heatmaps(per_kind: dict[str, Tensor], title: str, label: str) -> plt.Figure:
    """Layers x heads heatmaps, one panel per sublayer kind, on one colour scale."""
    kinds = list(per_kind)
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds) + 1, 3.0), squeeze=False)
    finite = torch.cat([v.flatten() for v in per_kind.values()])
    finite = finite[finite.isfinite()]
    vmax = float(finite.max()) if len(finite) else 1.0
    for ax, kind in zip(axes[0], kinds, strict=True):
        values = per_kind[kind]
        image = ax.imshow(values.numpy(), cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(values.shape[1]))
        ax.set_yticks(range(values.shape[0]))
        for (layer, head), value in zip(
            torch.cartesian_prod(torch.arange(values.shape[0]), torch.arange(values.shape[1])),
            values.flatten(),
            strict=True,
        ):
            ax.text(int(head), int(layer), f"{float(value):.2f}", ha="center", va="center",
                    fontsize=6, color="white")  # fmt: skip
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label=label)
    return fig


def pruning_order(importance: dict[str, Tensor], group_size: int = 1) -> list[tuple[str, int, int]]:
    """Every ``(kind, layer, head)``, least important first (ties in model order).

    With ``group_size`` > 1 the units are groups of that many consecutive heads, the query
    heads of GQA that share a K/V head (heads ``g*k .. g*k+k-1`` read K/V head ``g``), ranked
    by the sum of their heads' importance, so that masking a prefix of the order in whole
    groups masks what :func:`~multihead.attention.convert.prune_heads` can remove.
    """
    units = []
    for kind, per_layer in importance.items():
        layers, heads = per_layer.shape
        if heads % group_size:
            raise ValueError(f"group_size={group_size} does not divide the {heads} heads of {kind}")
        for layer in range(layers):
            for start in range(0, heads, group_size):
                score = float(per_layer[layer, start : start + group_size].sum())
                units.append((score, [(kind, layer, h) for h in range(start, start + group_size)]))
    return [head for _, group in sorted(units, key=lambda u: u[0]) for head in group]


def kv_group_size(model: nn.Module) -> int:
    """How many query heads share a K/V head, the same in every attention sublayer (1 for
    MHA, all of them for MQA): the unit :func:`pruning_order` ranks by groups."""
    sizes = {attn.num_heads // attn.num_kv_heads for _, _, attn in sublayers(model)}
    if len(sizes) != 1:
        raise ValueError(
            f"query heads per K/V head differ between sublayers ({sorted(sizes)}); "
            "expected one group size to prune by groups"
        )
    return sizes.pop()


@contextmanager
def masked_heads(model: nn.Module, heads: Sequence[tuple[str, int, int]]) -> Iterator[None]:
    """Every sublayer's ``head_mask`` zero at ``heads`` (``(kind, layer, head)``), one
    elsewhere; the gates set before are put back afterwards."""
    before = {(kind, i): attn.head_mask for kind, i, attn in sublayers(model)}
    device = next(model.parameters()).device
    try:
        for kind, i, attn in sublayers(model):
            mask = torch.ones(attn.num_heads, device=device)
            for k, layer, head in heads:
                if (k, layer) == (kind, i):
                    mask[head] = 0.0
            attn.head_mask = mask
        yield
    finally:
        for kind, i, attn in sublayers(model):
            attn.head_mask = before[(kind, i)]


def prune_model(model: nn.Module, heads: Sequence[tuple[str, int, int]]) -> nn.Module:
    """A copy of ``model`` without ``heads`` (``(kind, layer, head)``): each sublayer with
    heads to remove replaced by :func:`~multihead.attention.convert.prune_heads` (GQA: whole
    groups).

    It computes what ``model`` does with those heads masked (:func:`masked_heads`), with
    fewer parameters. Its sublayers have ``num_heads * head_dim < embed_dim``, so it is not
    rebuilt by :func:`~multihead.model.build_model` from a config: use it in memory.
    """
    import copy

    pruned = copy.deepcopy(model)
    by_layer: dict[tuple[str, int], list[int]] = {}
    for kind, layer, head in heads:
        by_layer.setdefault((kind, layer), []).append(head)
    paths = {(k.removesuffix("_attention"), i): p for k, i, p, _ in model.attention_sublayers()}
    unknown = sorted(set(by_layer) - set(paths))
    if unknown:
        raise ValueError(
            f"no attention sublayers {unknown}; expected (kind, layer) of {list(paths)}"
        )
    for key, indices in by_layer.items():
        layer = pruned.get_submodule(paths[key])
        pruned.set_submodule(paths[key], prune_heads(layer, indices))
    return pruned


def pruning_curve(
    model: nn.Module,
    tokenizer: Any,
    sources: Sequence[str],
    references: Sequence[str],
    order: Sequence[tuple[str, int, int]],
    fractions: Sequence[float],
    search: dict[str, float],
    batch_size: int = 128,
    speed_repeats: int = 1,
    unit: int = 1,
) -> list[dict[str, Any]]:
    """Greedy BLEU with the first ``round(f * N)`` heads of ``order`` masked, for each
    fraction ``f`` of the ``N`` heads, and the same heads pruned for real (:func:`prune_model`).
    With ``unit`` > 1 the count is rounded to a multiple of it: whole groups of an order by
    groups (:func:`pruning_order` with ``group_size=unit``).

    Rows of ``fraction_masked``, ``heads_masked``, ``heads_kept``, ``bleu`` and
    ``sent_per_s`` (the masked model: all parameters), then ``params_pruned``,
    ``bleu_pruned``, ``sent_per_s_pruned``, ``speedup_pruned`` (pruned over masked
    sentences/s) and ``same_as_masked`` (hypotheses identical to the masked model's) for the
    pruned copy; those five are ``None`` where pruning refuses: every head of a sublayer, or
    GQA heads that are not a whole group. Where both exist, the masked and the pruned model
    are timed alternately ``speed_repeats`` times and each keeps its fastest pass (one pass
    scatters by about ±15% on a shared 2-core host); elsewhere the masked model is timed
    once. ``search`` is :func:`multihead.checkpoints.search_settings`.
    """
    from multihead.evaluation.metrics import corpus_scores
    from multihead.evaluation.translate import translate

    if any(not 0.0 <= f < 1.0 for f in fractions):
        raise ValueError(f"fractions must be in [0, 1), got {list(fractions)}")
    if speed_repeats < 1:
        raise ValueError(f"speed_repeats={speed_repeats}; expected a positive number of passes")

    def timed_translate(net: nn.Module, heads: Sequence[tuple[str, int, int]] | None = None):
        gates = nullcontext() if heads is None else masked_heads(net, heads)
        with gates, torch.inference_mode():
            start = time.perf_counter()
            hypotheses = translate(
                net, tokenizer, list(sources), beam_size=1, batch_size=batch_size, **search
            )
            return hypotheses, len(sources) / (time.perf_counter() - start)

    rows = []
    for fraction in fractions:
        masked = list(order[: unit * round(fraction * len(order) / unit)])
        hypotheses, speed = timed_translate(model, masked)
        row = {
            "fraction_masked": fraction,
            "heads_masked": len(masked),
            "heads_kept": len(order) - len(masked),
            "bleu": corpus_scores(hypotheses, list(references)).bleu,
            "sent_per_s": speed,
            "params": model.num_parameters(),
        }
        try:
            pruned = prune_model(model, masked)
        except ValueError:  # heads of a GQA group, not the whole group
            row |= dict.fromkeys(
                ("params_pruned", "bleu_pruned", "sent_per_s_pruned", "speedup_pruned")
            )
            row["same_as_masked"] = None
            rows.append(row)
            continue
        pruned_hypotheses, pruned_speed = timed_translate(pruned)
        for _ in range(speed_repeats - 1):  # alternate, so that both see the same noise
            speed = max(speed, timed_translate(model, masked)[1])
            pruned_speed = max(pruned_speed, timed_translate(pruned)[1])
        row |= {
            "sent_per_s": speed,
            "params_pruned": pruned.num_parameters(),
            "bleu_pruned": corpus_scores(pruned_hypotheses, list(references)).bleu,
            "sent_per_s_pruned": pruned_speed,
            "speedup_pruned": pruned_speed / speed,
            "same_as_masked": sum(
                a == b for a, b in zip(hypotheses, pruned_hypotheses, strict=True)
            ),
        }
        rows.append(row)
    return rows


def read_pruning_curve(directory: str | Path) -> list[dict[str, Any]]:
    """The rows of an earlier ``head_importance.py`` output's ``pruning.csv``, with the
    columns :func:`plot_pruning_curve` draws as numbers, to draw beside a new curve."""
    path = Path(directory) / "pruning.csv"
    if not path.is_file():
        raise ValueError(f"no pruning curve at {path}; expected a head_importance.py out= folder")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} has no rows; expected head_importance.py's pruning curve")
    try:
        return [
            r | {k: int(r[k]) for k in ("heads_kept", "heads_masked")} | {"bleu": float(r["bleu"])}
            for r in rows
        ]
    except (KeyError, ValueError) as err:
        raise ValueError(
            f"{path} is not a pruning curve ({err}); expected head_importance.py's"
        ) from None


def plot_pruning_curve(curves: dict[str, list[dict[str, Any]]], title: str) -> plt.Figure:
    """BLEU against the fraction of heads kept, one line per model."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, rows in curves.items():
        total = rows[0]["heads_kept"] + rows[0]["heads_masked"]
        kept = [r["heads_kept"] / total for r in rows]
        ax.plot(kept, [r["bleu"] for r in rows], marker="o", label=label)
    ax.set_xlabel("fraction of heads kept (least important masked first)")
    ax.set_ylabel("BLEU (greedy)")
    ax.invert_xaxis()
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
