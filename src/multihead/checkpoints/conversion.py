"""K/V conversion of a trained checkpoint (scripts/convert_kv_heads.py): MHA to GQA/MQA/MLA.

Each attention sublayer in scope keeps its query heads and gets either ``num_kv_heads`` K/V
heads, each the mean of a group of the trained K/V projection heads, as in the GQA paper
(Ainslie et al., 2023; :func:`~multihead.attention.convert.with_kv_heads`), or a
K/V latent of ``kv_latent_dim`` numbers per token, a truncated factorisation of its K/V
weights, by their SVD or by the PCA of their outputs on calibration batches (MHA2MLA,
TransMLA; :func:`~multihead.attention.convert.with_kv_latent`). The converted checkpoint
is then uptrained for a small fraction of the original steps (``scripts/train.py
init_from=...``, optionally distilling from the checkpoint it was converted from:
``distill_from=...``).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.nn import functional as F

from multihead.attention import MultiHeadAttention
from multihead.attention.checks import check_positive_int
from multihead.attention.convert import rotary_index, with_kv_heads, with_kv_latent
from multihead.checkpoints.io import load_trained_model, read_checkpoint, save_new, weights_only
from multihead.model.transformer import ATTENTION_SUBLAYERS, Transformer, sublayer_config

log = logging.getLogger(__name__)

# The GQA paper converts the decoder; "all" also converts the encoder self-attention.
SCOPES = {
    "decoder": ("decoder_self_attention", "cross_attention"),
    "all": ATTENTION_SUBLAYERS,
}


def resolve_scope(scope: str | Sequence[str]) -> tuple[str, ...]:
    """The attention kinds that ``scope`` names, in :data:`ATTENTION_SUBLAYERS` order.

    Args:
        scope: ``"decoder"`` (decoder self- and cross-attention), ``"all"``, one kind, or
            a list of kinds, e.g. ``["decoder_self_attention", "cross_attention"]``.
    """
    if isinstance(scope, str):
        if scope in SCOPES:
            return SCOPES[scope]
        names = [scope]
    else:
        names = [str(name) for name in scope] if isinstance(scope, Sequence) else []
    if not names or not set(names) <= set(ATTENTION_SUBLAYERS):
        accepted = f"{', '.join(SCOPES)}, or a list of {', '.join(ATTENTION_SUBLAYERS)}"
        raise ValueError(f"unknown scope {scope!r}; expected {accepted}")
    return tuple(kind for kind in ATTENTION_SUBLAYERS if kind in names)


def _target(
    kv_heads: int | None, kv_latent: int | None, budget: int | float | None,
    names: tuple[str, str, str] = ("num_kv_heads", "kv_latent_dim", "cache_budget"),
) -> dict[str, Any]:  # fmt: skip
    """The one conversion asked for, as ``{name: value}``; bad values raise, naming them."""
    given = dict(zip(names, (kv_heads, kv_latent, budget), strict=True))
    asked = {k: v for k, v in given.items() if v is not None}
    if len(asked) != 1:
        got = ", ".join(f"{k}={v}" for k, v in given.items())
        raise ValueError(f"set exactly one of {names[0]}, {names[1]} and {names[2]}, got {got}")
    ((name, value),) = asked.items()
    if name == names[2]:
        _check_budget(name, value)
        return asked
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {name}={value}")
    return asked


def _check_budget(name: str, budget: Any) -> None:
    """A cache budget is bytes (an integer) or a fraction of the cache (a float in (0, 1])."""
    what = (
        f"{name} must be a layer's KV cache bytes per token (a positive integer) or a fraction "
        f"of its cache (a float in (0, 1]), got {budget!r}"
    )
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(what)
    if not (0 < budget <= 1 if isinstance(budget, float) else budget >= 1):
        raise ValueError(what)


# What a latent's options are when not passed: an option set otherwise is refused where it
# would be ignored (pooled K/V heads; no rotary layer in scope), not dropped without a word.
LATENT_DEFAULTS = {"factorisation": None, "balance_kv": None}
ROTARY_DEFAULTS = {"rope_dim": None, "selection": "high", "rotary_key": None,
                   "freqfold": None}  # fmt: skip
# The latent's choices left unset (None): with calibration, each layer is converted with every
# combination of them and keeps the one that computes best on held-out calibration; without,
# the first (the weights' SVD, no balancing, per-group keys: nothing to measure on).
CHOICES = {"factorisation": ("svd", "pca"), "balance_kv": (False, True),
           "rotary_key": ("per_group", "shared")}  # fmt: skip
HELD_OUT = 4  # one part in 4 of the calibration (at least one batch or sequence) is held out
# A cache budget's rotary keys, per K/V group: one pair and these parts of the rotated
# features R (whole pairs), the latent the rest. On an outside Llama (D = 32) the key's width
# decided more than any other choice: +31% perplexity with 4 against +13% with 8 (issue 84);
# the LM study's grid kept 2 at 1/8.
BUDGET_ROPE_PARTS = (8, 4, 2)
NUMBER_BYTES = 4  # the cache's bytes per number, as the report counts them (fp32)


def convert_attention(
    model: nn.Module, *, kv_heads: int | None = None, kv_latent: int | None = None,
    cache_budget: int | float | None = None, rope_dim: int | None = None,
    selection: str = "high", rotary_key: str | None = None, freqfold: int | None = None,
    factorisation: str | None = None, balance_kv: bool | None = None, calibration: Any = None,
    scope: str | Sequence[str] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Convert every attention layer of ``model`` in place: to ``kv_heads`` pooled K/V heads
    (:func:`~multihead.attention.convert.with_kv_heads`), to a ``kv_latent`` K/V latent
    (:func:`~multihead.attention.convert.with_kv_latent`: ``factorisation``, ``balance_kv``;
    rotary layers keep ``rope_dim`` rotated features, ``rotary_key`` one key per K/V group
    chosen by ``selection``, or one shared key of ``freqfold``-folded components), or to a
    latent within ``cache_budget`` (below).

    ``model``: our :class:`Transformer` (the sublayers of ``scope``, default ``"decoder"``, see
    :func:`resolve_scope`; its ``attention_config`` rewritten so that it rebuilds the result),
    or any model whose layers are :class:`MultiHeadAttention` (swapped by
    ``replace_torch_attention`` or ``replace_hf_attention``: all of them; an HF model keeps
    generating, its cache holding each layer's latent). ``calibration``: the model's inputs,
    called as ``model(*calibration)`` (a tuple), ``model(**calibration)`` (a mapping) or
    ``model(calibration)``, or a list of such batches (each called in turn): our
    Transformer's ``(src, tgt_in)``, an HF model's token ids ``(B, S)`` (of any integer
    dtype: read as int64) or ``{"input_ids": .., "attention_mask": ..}``. Each layer's K/V source
    inputs on them, padding left out where the call has a ``key_padding_mask``, are the
    latent's calibration (``"pca"``), choose ``selection="norm"``'s pairs and measure the
    errors below. Bad calibration (empty, not tensors, a batch the model refuses, an
    ``attention_mask`` that is not 0/1, a layer it never reaches) is refused in one line,
    before any layer changes.

    **The latent's choices are measured, not assumed.** ``factorisation`` (``"svd"`` or
    ``"pca"``), ``balance_kv`` and, in a rotary layer, ``rotary_key`` (per-group keys of
    ``rope_dim`` each, or one shared key of ``G rope_dim``: the same cache) left ``None``
    are chosen with ``calibration``: the last quarter of its batches (of a single batch, of
    its sequences; at least one) is held out, each layer is converted with every
    combination of them fitted on the rest, and keeps the choice with the lowest score on
    the held-out part, fitted again on all the calibration (the part held out only chose;
    the layer is then what naming that choice gives): the score is the model's next-token
    cross-entropy where its output has logits
    ``(B, S, V)`` and the batches token ids (an HF causal LM's ``input_ids``, our
    Transformer's ``tgt_in``; padding left out), the layers before it converted as chosen
    and those after as they were; else the layer's output error on its held-out calls. In
    our Transformer, whose config holds one layout per sublayer kind, a kind's first layer
    chooses the layout (and a budget's split) for the others. A tie (within 1e-6) goes to
    the weights alone. A named option is used as it is: all named, no selection, every batch
    fitted. Without calibration: the SVD, no balancing, per-group keys. One log line
    (``logging``, INFO) says what each layer kept.

    **A cache budget** instead of ``kv_latent``: each layer's KV cache, bytes per token
    (an integer; fp32, as ``bytes_after``) or a fraction of its own (a float in (0, 1]).
    How to spend it is measured with the choices above: the rotary keys' width against the
    latent's, per-group keys of one pair, ``R/8``, ``R/4`` or ``R/2`` rotated features
    (whole pairs; a shared key of ``G`` times that: the same cache) and the latent the
    numbers left (at most the K/V stack's rank). A named ``rope_dim`` fixes the keys, the
    latent taking the rest; a layer without rotary positions gets a latent of all of it.
    Measuring the width needs ``calibration``.

    Returns:
        Per layer: ``layer`` (its path), ``bytes_before`` and ``bytes_after`` (KV cache bytes
        per token, fp32), with a budget ``budget_bytes`` (the bytes it allowed); for a
        latent, ``latent``, what it got, as :func:`convert_attention`'s arguments that
        rebuild it (``kv_latent``, ``factorisation``, ``balance_kv``, a rotary layer's
        ``rotary_key`` and ``rope_dim``, the width of its rotary key(s)), and where they
        were measured ``scored_by`` (``"held-out loss"`` or ``"held-out out_error"``) and
        ``candidates``, each with its ``score``; with ``calibration``:
        ``k_error`` and ``v_error``, the relative Frobenius error of K and V (per query head,
        before RoPE and without biases, which move exactly; a rotary key's part counted
        exact, being moved, not approximated), and ``out_error``, the relative error of the
        layer's output; each on the layer's own calibration inputs (all of them; not the
        converted model's), right after the conversion.
    """
    options = {"rope_dim": rope_dim, "selection": selection, "rotary_key": rotary_key,
               "freqfold": freqfold, "factorisation": factorisation,
               "balance_kv": balance_kv}  # fmt: skip
    return _convert(
        model, kv_heads, kv_latent, cache_budget, calibration=calibration, scope=scope,
        names=("kv_heads", "kv_latent", "cache_budget"), **options,
    )  # fmt: skip


def _convert(
    model: nn.Module, kv_heads: int | None, kv_latent: int | Mapping[str, int] | None,
    budget: int | float | None, *, calibration: Any, scope: str | Sequence[str] | None,
    names: tuple[str, str, str], **options,
) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`convert_attention`, its refusals naming the arguments ``names`` (the public
    function's ``kv_heads``, ``kv_latent``, ``cache_budget``; :func:`convert_checkpoint`'s
    own); ``kv_latent`` may give each sublayer kind of our Transformer its own ``r``
    (checked by the caller)."""
    per_kind = isinstance(kv_latent, Mapping)
    if not per_kind:
        _target(kv_heads, kv_latent, budget, names)
    given = zip(names, (kv_heads, kv_latent, budget), strict=True)
    asked = next(f"{name}={value}" for name, value in given if value is not None)
    transformer = isinstance(model, Transformer)
    if transformer:
        kinds = resolve_scope("decoder" if scope is None else scope)
        layers = [(p, a, k) for k, _, p, a in model.attention_sublayers() if k in kinds]
    elif scope is not None:  # another model's layers have no kinds to choose from
        raise ValueError(
            f"scope={scope!r} is for our Transformer; in a {type(model).__name__} every "
            "MultiHeadAttention is converted (leave scope unset)"
        )
    else:
        layers = [
            (p, m, None) for p, m in model.named_modules() if isinstance(m, MultiHeadAttention)
        ]
        if not layers:  # an HF or torch model never swapped: returning [] hid it
            raise ValueError(
                f"{type(model).__name__} has no MultiHeadAttention to convert; swap its "
                "attention first (replace_hf_attention for a Hugging Face model, "
                "replace_torch_attention for torch.nn.MultiheadAttention)"
            )
    what = "with_kv_heads" if kv_heads is not None else "with_kv_latent"
    for path, attn, _ in layers:
        if attn.design is not None and what not in attn.design.conversions:
            has = (
                "already has a K/V latent"
                if "expand_latent" in attn.design.conversions
                else "has a head design"
            )
            raise ValueError(
                f"{path} {has} ({attn.head_tag!r}), which {asked} does not convert; "
                "it converts MHA/GQA/MQA layers"
            )
        if kv_heads is not None and attn.num_kv_heads == kv_heads:
            raise ValueError(
                f"{asked} would leave {path} as it is: it has {kv_heads} K/V heads already"
            )
    # The options a conversion would drop, refused by name (an option at its default
    # cannot be told from one not passed).
    rotary = {k: options[k] for k in ROTARY_DEFAULTS}
    latent = {k: options[k] for k in LATENT_DEFAULTS}
    defaults = ROTARY_DEFAULTS | LATENT_DEFAULTS
    if kv_heads is not None:
        ignored, why = {**rotary, **latent}, f"{asked} pools K/V heads, and they shape a K/V latent"
    elif all(attn.positions is None for _, attn, _ in layers):
        ignored, why = rotary, "they choose rotary features, and no layer in scope has positions"
    else:
        ignored, why = {}, ""
    ignored = [f"{k}={v!r}" for k, v in ignored.items() if v != defaults[k]]
    if ignored:
        raise ValueError(f"{' and '.join(ignored)} would be ignored: {why}")
    if options["balance_kv"] is not None and not isinstance(options["balance_kv"], bool):
        raise TypeError(f"balance_kv must be a bool or None, got {options['balance_kv']!r}")
    rotary = any(a.positions is not None for _, a, _ in layers)
    # A budget's split: the numbers per token it allows each layer, checked before any work.
    allowed = {} if budget is None else {
        path: budget_numbers(attn, budget, path=path, name=names[2], options=options)
        for path, attn, _ in layers
    }  # fmt: skip
    widths = budget is not None and options["rope_dim"] is None and rotary  # measured
    if widths and options["freqfold"] is not None:
        raise ValueError(
            f"freqfold={options['freqfold']!r} folds one width of shared key, and "
            f"{names[2]}={budget!r} tries several: name rope_dim too, or leave freqfold unset"
        )
    if widths and calibration is None:
        raise ValueError(
            f"{names[2]}={budget!r} measures the rotary keys' width against the latent's on "
            "calibration: pass calibration (the model's inputs), or name rope_dim (the latent "
            "then takes the rest)"
        )
    # The options whose None is measured: naming them all leaves nothing to measure.
    unset = [k for k in CHOICES if options[k] is None and (k != "rotary_key" or rotary)]
    unset += ["rope_dim"] if widths else []
    measure = kv_heads is None and calibration is not None and bool(unset)
    batches = None if calibration is None else _batches(model, calibration, widths)
    fit, held, held_words = _split(batches, unset) if measure else (batches, None, "")
    whole = batches[0] if measure and len(batches) == 1 else None  # its sequences split
    calls = {} if calibration is None else _layer_calls(model, layers, fit, whole)
    held_calls = {} if held is None else _layer_calls(model, layers, held, whole)
    fit_rows = {path: _source_rows(found) for path, found in calls.items()}  # (1, N, E) each
    if whole is not None:  # the report's errors and the last fit on the whole batch, run
        calls = _layer_calls(model, layers, batches)  # whole: the same bits as a named choice
    else:
        for path, found in held_calls.items():
            calls[path] = calls[path] + found  # the report's errors: on all the calibration
    sources = {path: _source_rows(found) for path, found in calls.items()}
    converted, report_choices = {}, {}  # every layer first: a refusal leaves the model as it was
    originals = {path: attn for path, attn, _ in layers}
    mode = model.training
    try:
        scorer = _loss_scorer(model.eval(), held) if measure else None
        # Our Transformer: a sublayer kind's layout and split, its first layer's (one config).
        kept: dict[str, dict[str, Any]] = {}
        for path, attn, kind in layers:
            if kv_heads is not None:
                converted[path] = with_kv_heads(attn, kv_heads)
                continue
            r = kv_latent[kind] if per_kind else kv_latent
            fixed = {k: options[k] for k in CHOICES if options[k] is not None}
            fixed |= kept.get(kind, {})
            candidates = _candidates(attn, fixed, measure, options, r, allowed.get(path))
            if len(candidates) == 1:  # named, or nothing to measure on: every batch fitted
                converted[path] = _with_latent(attn, candidates[0], options, sources.get(path))
                report_choices[path] = {"latent": candidates[0]}
                continue
            scored = []
            for choice in candidates:
                new = _with_latent(attn, choice, options, fit_rows[path])
                if scorer is None:
                    score = _out_error(attn, new, held_calls[path])
                else:
                    model.set_submodule(path, new)
                    score = scorer()
                scored.append((score, choice, new))
            # The lowest score; a tie (within 1e-6: exact conversions, fp32 rounding apart)
            # goes to the first in CHOICES' order, the weights alone before the data.
            tie = min(score for score, _, _ in scored) * (1 + 1e-6) + 1e-6
            choice = next(c for score, c, _ in scored if score <= tie)
            # Chosen, the held-out part is not needed apart: fit on all of it, as a named
            # choice is (measured on the LM study at 1/8: fitted on 3/4 only, 0.37% higher
            # perplexity right after conversion than the same choice named).
            new = _with_latent(attn, choice, options, sources[path])
            if scorer is not None:  # the next layers are scored with this one converted
                model.set_submodule(path, new)
            converted[path] = new
            if transformer:
                kept[kind] = {k: choice[k] for k in ("kv_latent", "rotary_key", "rope_dim")
                              if k in choice}  # fmt: skip
            report_choices[path] = {
                "latent": choice,
                "scored_by": "held-out out_error" if scorer is None else "held-out loss",
                "candidates": [{**c, "score": s} for s, c, _ in scored],
            }
    finally:
        for path, attn in originals.items():
            model.set_submodule(path, attn)
        model.train(mode)
    if transformer:  # one set of options per sublayer kind in its config
        options = {kind: _shared_options(kind, [converted[p] for p, _, k in layers if k == kind])
                   for kind in kinds}  # fmt: skip
    report = []
    for path, attn, _ in layers:
        new = converted[path]
        row = {"layer": path, "bytes_before": attn.kv_cache_bytes_per_token(),
               "bytes_after": new.kv_cache_bytes_per_token(),
               **({"budget_bytes": allowed[path] * NUMBER_BYTES} if allowed else {}),
               **report_choices.get(path, {})}  # fmt: skip
        if path in calls:
            row |= _kv_errors(attn, new, sources[path])
            row["out_error"] = _out_error(attn, new, calls[path])
        model.set_submodule(path, new)
        report.append(row)
    if transformer:
        for kind in kinds:
            model.attention_config[kind].update(options[kind])
    measured = [row for row in report if "candidates" in row]
    if measured:
        log.info(
            "convert_attention kept, by the %s on %s of the calibration held out: %s",
            measured[0]["scored_by"].removeprefix("held-out "),
            held_words,
            "; ".join(_summary(row) for row in measured),
        )
    return report


def budget_numbers(
    attn: MultiHeadAttention, budget: int | float, *, path: str = "the layer",
    name: str = "cache_budget", options: Mapping[str, Any] = ROTARY_DEFAULTS,
) -> int:  # fmt: skip
    """The numbers per token a cache ``budget`` (see :func:`convert_attention`) allows
    ``attn``, whose rotary ``options`` are ``convert_attention``'s; a budget above its cache,
    or too small for any split, refused in one line naming ``path``."""
    _check_budget(name, budget)
    before = attn.kv_cache_bytes_per_token()
    allowed = int(budget * before) if isinstance(budget, float) else budget  # bytes
    if allowed > before:
        raise ValueError(
            f"{name}={budget!r} is more than the KV cache of {path}, {before} bytes per token: "
            "a budget cuts the cache"
        )
    numbers = allowed // NUMBER_BYTES
    layouts = [options["rotary_key"]] if options["rotary_key"] else CHOICES["rotary_key"]
    if attn.positions is None:
        layouts = [None]
    if any(_splits(attn, layout, options, None, numbers) for layout in layouts):
        return numbers
    keys = min(
        cached for layout in layouts for _, cached in _key_widths(attn, layout, options, True)
    )
    keys = f"its narrowest rotary keys take {keys * NUMBER_BYTES} bytes, and " if keys else ""
    raise ValueError(
        f"{name}={budget!r} allows {path} {allowed} bytes per token, too few for any split: "
        f"{keys}a latent needs at least {NUMBER_BYTES}{' more' if keys else ''}"
    )


def _key_widths(
    attn: MultiHeadAttention, layout: str | None, options: dict[str, Any], budget: bool
) -> list[tuple[int, int]]:
    """``(rope_dim, numbers cached)`` of ``attn``'s rotary key(s) with ``layout`` (``None``:
    none): a named ``rope_dim`` (``None``: all ``R``), else with a ``budget`` one pair and
    each part of :data:`BUDGET_ROPE_PARTS` of ``R`` per K/V group; with the layout measured,
    a shared key has the ``G`` groups' numbers (the same cache), a named one ``rope_dim``."""
    if layout is None:
        return [(0, 0)]
    R, G = getattr(attn.positions, "rotary_dim", None), attn.num_kv_heads
    if R is None:  # other positions (ALiBi): with_kv_latent refuses them by name
        return [(0, 0)]
    if options["rope_dim"] is not None or not budget:
        per_group = [R if options["rope_dim"] is None else options["rope_dim"]]
        own = options["rotary_key"] is not None  # a named layout: rope_dim is its key's width
    else:
        parts = {max(2, R // part // 2 * 2) for part in BUDGET_ROPE_PARTS}  # whole pairs
        per_group, own = sorted({2} | parts), False
    widths = [d if own or layout == "per_group" else G * d for d in per_group]
    return [(w, G * w if layout == "per_group" else w) for w in widths]


def _splits(
    attn: MultiHeadAttention, layout: str | None, options: dict[str, Any], r: int | None,
    numbers: int | None,
) -> list[dict[str, int]]:  # fmt: skip
    """``attn``'s latent and rotary key widths (``kv_latent``, ``rope_dim``; ``None`` layout:
    no rotary key) to build: ``r`` beside the key asked for, or within a budget of
    ``numbers`` per token, the latent the numbers each key width leaves (at least 1, at most
    the K/V stack's rank, beyond which its numbers are always zero)."""
    E, G, D = attn.embed_dim, attn.num_kv_heads, attn.head_dim
    found = []
    for width, cached in _key_widths(attn, layout, options, numbers is not None):
        key = {} if layout is None else {"rope_dim": width}
        if numbers is None:
            found.append({"kv_latent": r, **key})
        elif numbers - cached >= 1:
            rank = min(E, 2 * G * D - width if layout == "shared" else G * (2 * D - width))
            found.append({"kv_latent": min(numbers - cached, rank), **key})
    return found


def _candidates(
    attn: MultiHeadAttention, fixed: dict[str, Any], measure: bool, options: dict[str, Any],
    r: int | None, numbers: int | None,
) -> list[dict]:  # fmt: skip
    """The latents to build for ``attn``, each as :func:`convert_attention`'s arguments that
    build it: the ``fixed`` ones as they are, every value of each other one of
    :data:`CHOICES` where ``measure``, else its first, each with its splits (:func:`_splits`)."""
    names = [k for k in CHOICES if k != "rotary_key" or attn.positions is not None]
    values = [
        [fixed[k]] if k in fixed else list(CHOICES[k] if measure else CHOICES[k][:1]) for k in names
    ]
    found = []
    for combination in itertools.product(*values):
        choice = dict(zip(names, combination, strict=True))
        for split in _splits(attn, choice.get("rotary_key"), options, r, numbers):
            candidate = {"kv_latent": split["kv_latent"], **choice, **split}
            if all(candidate.get(k, v) == v for k, v in fixed.items()):  # rotary ones: if any
                found.append(candidate)
    return found


def _with_latent(
    attn: MultiHeadAttention, choice: dict[str, Any], options: dict[str, Any],
    rows: Tensor | None,
) -> MultiHeadAttention:  # fmt: skip
    """``attn`` with the latent ``choice`` (:func:`_candidates`), the other rotary
    ``options`` where they apply: a layout left to measure (``options["rotary_key"]`` None)
    gives its per-group keys ``selection``, its shared key ``freqfold``; calibration
    ``rows`` passed where the choice reads them."""
    own = {k: v for k, v in choice.items() if k != "kv_latent"}
    if attn.positions is not None:
        rotary = {k: options[k] for k in ("selection", "freqfold")}
        if options["rotary_key"] is None:  # the layout measured: each its own option
            rotary.pop("selection" if choice["rotary_key"] == "shared" else "freqfold")
        own |= {k: v for k, v in rotary.items() if v != ROTARY_DEFAULTS[k]}
    reads = own["factorisation"] == "pca" or own.get("selection") == "norm"
    return with_kv_latent(attn, choice["kv_latent"], calibration=rows if reads else None, **own)


def _label(choice: dict[str, Any]) -> str:
    """A latent choice in a few words: ``pca+bkv, r=6, a shared key of 4``."""
    bkv = "+bkv" if choice["balance_kv"] else ""
    keys = {None: "", "per_group": ", per-group keys of", "shared": ", a shared key of"}
    key = keys[choice.get("rotary_key")]
    width = f" {choice['rope_dim']}" if key else ""
    return f"{choice['factorisation']}{bkv}, r={choice['kv_latent']}{key}{width}"


def _summary(row: dict[str, Any]) -> str:
    """A measured layer's choice and its score against the candidates' range."""
    scores = [c["score"] for c in row["candidates"]]
    return (
        f"{row['layer']} {_label(row['latent'])} ({min(scores):.4g}; the "
        f"{len(scores)} candidates {min(scores):.4g}-{max(scores):.4g})"
    )


def _split(batches: list, unset: list[str]) -> tuple[list, list, str]:
    """The calibration ``batches`` as a fitting and a held-out list, and the held-out part in
    words: the last quarter of the batches, or of a single batch's sequences (each tensor's
    rows), at least one; ``unset``: the options measured (named, none is)."""
    if len(batches) != 1:
        n = max(1, len(batches) // HELD_OUT)
        return batches[:-n], batches[-n:], f"{n} of {len(batches)} batches"
    (batch,) = batches
    sizes = [len(x) for x in _parts(batch) if isinstance(x, Tensor) and x.dim()]
    if sizes[0] < 2:
        named = f"{', '.join(unset[:-1])} and {unset[-1]}" if len(unset) > 1 else unset[0]
        raise ValueError(
            f"calibration {_describe(batch)} is one sequence, which cannot be split into a part "
            f"to fit and a part to score the latent's choices on: pass two or more, or name "
            f"{named}"
        )
    B = sizes[0]
    cut = B - max(1, B // HELD_OUT)

    def rows(part: slice) -> Any:
        take = lambda x: x[part] if isinstance(x, Tensor) and x.dim() and len(x) == B else x  # noqa: E731
        if isinstance(batch, Mapping):
            return {k: take(v) for k, v in batch.items()}
        return tuple(take(x) for x in batch) if isinstance(batch, tuple) else take(batch)

    return [rows(slice(0, cut))], [rows(slice(cut, B))], f"{B - cut} of {B} sequences"


def _token_targets(model: nn.Module, batch: Any) -> tuple[Tensor, Tensor] | None:
    """The token ids ``(B, S)`` a batch's logits predict and which of them count (not
    padding): our Transformer's ``tgt_in``, an HF model's ``input_ids`` (its
    ``attention_mask``); ``None`` where the batch holds none."""
    if isinstance(model, Transformer) and isinstance(batch, tuple) and len(batch) == 2:
        ids = batch[1]
        return ids, ids != model.pad_id
    arguments = _arguments(model, batch)  # a tuple's (ids, mask) too, as forward takes them
    ids = arguments.get("input_ids", batch if isinstance(batch, Tensor) else None)
    mask = arguments.get("attention_mask")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return None
    counted = mask.bool() if isinstance(mask, Tensor) and mask.shape == ids.shape else None
    return ids, (torch.ones_like(ids, dtype=torch.bool) if counted is None else counted)


def _loss_scorer(model: nn.Module, batches: list) -> Any:
    """A function giving ``model``'s next-token cross-entropy (mean over the counted tokens)
    on ``batches`` as the model is when called, or ``None`` where the batches hold no token
    ids or the model's output no logits ``(B, S, V)`` for them."""
    targets = [_token_targets(model, batch) for batch in batches]
    if any(t is None for t in targets):
        return None

    def loss() -> float | None:
        total, count = 0.0, 0
        with torch.no_grad():
            for batch, (ids, counted) in zip(batches, targets, strict=True):
                out = _run(model, batch)
                logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
                if not (isinstance(logits, Tensor) and logits.dim() == 3
                        and logits.shape[:2] == ids.shape):  # fmt: skip
                    return None
                keep = counted[:, 1:]  # the token predicted counts
                ce = F.cross_entropy(
                    logits[:, :-1][keep].double(), ids[:, 1:][keep], reduction="sum"
                )
                total, count = total + ce.item(), count + int(keep.sum())
        return total / count if count else None

    return loss if loss() is not None else None


def _arguments(model: nn.Module, batch: Any) -> dict[str, Any]:
    """A calibration batch by the names of ``model.forward``'s parameters, as :func:`_run`
    passes it (none where it does not bind: the model says why when it runs)."""
    if isinstance(batch, Mapping):
        args, kwargs = (), dict(batch)
    else:
        args, kwargs = (batch if isinstance(batch, tuple) else (batch,)), {}
    try:
        return dict(inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def _run(model: nn.Module, batch: Any) -> Any:
    """``model`` called on one calibration batch: a tuple spread, a mapping by keyword."""
    if isinstance(batch, tuple):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


def _shared_options(kind: str, layers: list[MultiHeadAttention]) -> dict[str, Any]:
    """The attention options of ``kind``'s converted ``layers``, which they must share (a
    config has one set per sublayer kind)."""
    found = [sublayer_config(attn) for attn in layers]
    if any(options != found[0] for options in found):
        raise ValueError(
            f"the {kind} layers would get different options (selection='norm' chose other "
            "pairs in some), which one model config cannot hold; use selection='high' or "
            "'uniform'"
        )
    return found[0]


def _batches(model: nn.Module, calibration: Any, required: bool) -> list:
    """``calibration`` (one batch or a list of them) as a list of batches; empty or unusable
    calibration and an ``attention_mask`` that is not 0/1 refused in one line, with what to
    pass (``required``: calibration is, else ``None`` is an answer)."""
    fix = "pass the model's inputs (an HF model's token ids (B, S), our Transformer's (src, " + (
        "tgt_in))" if required else "tgt_in)), or calibration=None: the weights alone"
    )
    batches = calibration if isinstance(calibration, list) else [calibration]
    for batch in batches or [[]]:
        if not isinstance(batch, Tensor | tuple | Mapping):
            if hasattr(batch, "__len__") and len(batch) == 0:
                raise ValueError(f"calibration {calibration!r} is empty: {fix}")
            raise TypeError(
                f"calibration holds a {type(batch).__name__} where the model's inputs go: pass "
                "torch tensors (torch.as_tensor(x) for an array), a tuple or a mapping of them, "
                "or a list of such batches"
            )
        tensors = [x for x in _parts(batch) if isinstance(x, Tensor)]
        if not tensors or any(x.numel() == 0 for x in tensors):
            raise ValueError(f"calibration {_describe(batch)} is empty: {fix}")
        if all(x.dim() == 0 for x in tensors):
            raise ValueError(
                f"calibration {_describe(batch)} is one number, not a batch of sequences: {fix}"
            )
        _check_mask(model, batch)
    return [_long_integers(batch) for batch in batches]


def _long_integers(batch: Any) -> Any:
    """``batch`` with its integer tensors (token ids, masks) as int64: ids of any integer
    dtype read alike (torch's embedding takes int32 and int64 only, the loss int64)."""

    def widen(x: Any) -> Any:
        integer = isinstance(x, Tensor) and x.dtype != torch.bool and not x.is_floating_point()
        return x.long() if integer and not x.is_complex() else x

    if isinstance(batch, Mapping):
        return {k: widen(v) for k, v in batch.items()}
    return tuple(map(widen, batch)) if isinstance(batch, tuple) else widen(batch)


def _check_mask(model: nn.Module, batch: Any) -> None:
    """The ``attention_mask`` a calibration batch gives ``model`` (a 2-D one), if any, holds
    0 and 1 only: ``(ids, ids)``, spread over HF's ``forward(input_ids, attention_mask, ..)``,
    made the ids a mask in silence."""
    mask = _arguments(model, batch).get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and not ((mask == 0) | (mask == 1)).all():
        raise ValueError(
            f"calibration {_describe(batch)} gives {type(model).__name__}'s attention_mask "
            f"values other than 0 and 1 ({mask.min().item()} to {mask.max().item()}): a "
            "tuple goes to forward's arguments in order; pass the token ids alone, or "
            "{'input_ids': ids, 'attention_mask': mask}"
        )


def _parts(batch: Any) -> tuple:
    """A calibration batch's values: a mapping's, a tuple's items, or the batch itself."""
    if isinstance(batch, Mapping):
        return tuple(batch.values())
    return batch if isinstance(batch, tuple) else (batch,)


def _layer_calls(
    model: nn.Module, layers: list[tuple[str, MultiHeadAttention, Any]], batches: list,
    whole: Any = None,
) -> dict[str, list[tuple[tuple, dict]]]:  # fmt: skip
    """``{path: [(args, kwargs), ...]}``: every call of each layer on the calibration
    ``batches``; bad calibration refused in one line, naming the batch (``whole`` where the
    batches are the parts of one)."""
    seen: dict[str, list[tuple[tuple, dict]]] = {p: [] for p, _, _ in layers}
    running = [None]  # the batch being run, for the refusals' words

    def embedding(path: str):
        def check(module, args):
            if args and isinstance(args[0], Tensor) and args[0].is_floating_point():
                raise _Refused(
                    f"calibration {_describe(running[0])} gives {path} (an embedding) floats "
                    "where it reads token ids: pass the token ids (integers), not floats"
                )

        return check

    def hook(path: str):
        def record(module, args, kwargs):
            query = args[0] if args else kwargs["query"]
            key_value = args[1] if len(args) > 1 else kwargs.get("key_value")
            # Refused here, named, before the layer fails on it with a bare matmul error.
            for x in (query, key_value):
                if x is not None and (x.dim() != 3 or x.shape[-1] != module.embed_dim):
                    raise _Refused(
                        f"calibration {_describe(running[0])} gives {path} an input of shape "
                        f"{tuple(x.shape)}, where it reads (B, S, {module.embed_dim}): pass the "
                        "model's own inputs"
                    )
            seen[path].append((args, kwargs))

        return record

    handles = [a.register_forward_pre_hook(hook(p), with_kwargs=True) for p, a, _ in layers]
    handles += [
        m.register_forward_pre_hook(embedding(p))
        for p, m in model.named_modules()
        if isinstance(m, nn.Embedding)
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                running[0] = batch if whole is None else whole
                try:
                    _run(model, batch)
                except _Refused as refused:  # the class is ours: the user gets a ValueError
                    raise ValueError(str(refused)) from None
                except (TypeError, ValueError, RuntimeError, IndexError) as error:  # the model's
                    raise ValueError(
                        f"calibration {_describe(running[0])} does not run "
                        f"{type(model).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                    ) from error
    finally:
        for handle in handles:
            handle.remove()
    missed = [path for path, found in seen.items() if not found]
    if missed:
        raise ValueError(f"calibration never reaches {', '.join(missed)}: pass the model's inputs")
    return seen


class _Refused(Exception):
    """A calibration input refused by a hook, raised again as a ``ValueError``."""


def _describe(batch: Any) -> str:
    """A calibration batch in a few words: its tensors' shapes and dtypes."""

    def one(x: Any) -> str:
        return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__

    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {one(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, tuple):
        return "(" + ", ".join(one(x) for x in batch) + ")"
    return one(batch)


def _source_rows(calls: list[tuple[tuple, dict]]) -> Tensor:
    """The K/V source inputs of ``calls``, one row per token, padding (``key_padding_mask``,
    True = padding) left out: ``(1, N, E)``."""
    rows = []
    for args, kwargs in calls:
        query = args[0] if args else kwargs["query"]
        key_value = args[1] if len(args) > 1 else kwargs.get("key_value")
        source = query if key_value is None else key_value  # (B, S, E)
        pad = kwargs.get("key_padding_mask")
        if isinstance(pad, Tensor) and pad.dtype == torch.bool and pad.shape == source.shape[:2]:
            rows.append(source[~pad])  # (real tokens, E)
        else:
            rows.append(source.reshape(-1, source.shape[-1]))
    return torch.cat(rows)[None]


def _kv_errors(old: MultiHeadAttention, new: MultiHeadAttention, x: Tensor) -> dict[str, float]:
    """The relative Frobenius error of ``new``'s K and V against ``old``'s on ``x``, per query
    head ``(B, H, S, D)``, before RoPE and without biases, right after the conversion.

    A rotary key is exact (moved, not approximated), so K's error is the latent's. Per-group
    keys take their features out of the latent's (``qk_head_dim < D``, placed back by their
    frequencies): the error is on the other features. A shared key leaves the latent every
    feature and moves a mix of them, orthogonal to what the latent carries:
    ``|K - K_lat|^2 - |kept|^2``, with ``|kept|^2`` the key's energy, ``H / G`` times its
    output's (exact to about 1e-8 of ``|K|``, the rounding of that difference)."""
    H, D, G = old.num_heads, old.head_dim, old.num_kv_heads

    def per_head(t: Tensor, heads: int) -> Tensor:  # (B, S, heads*w) -> (B, H, S, w)
        return t.unflatten(-1, (heads, -1)).transpose(1, 2).repeat_interleave(H // heads, 1)

    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    with torch.no_grad():
        x = x.to(old.out_proj.weight)
        _, w_k, w_v = old.in_proj.blocks()
        k, v = per_head(x @ w_k.T, G), per_head(x @ w_v.T, G)  # (B, H, S, D)
        latent = new.design
        if latent is None:  # pooled K/V heads
            _, w_k2, w_v2 = new.in_proj.blocks()
            k2, v2 = per_head(x @ w_k2.T, new.num_kv_heads), per_head(x @ w_v2.T, new.num_kv_heads)
            return {"k_error": rel(k2, k), "v_error": rel(v2, v)}
        k2, v2, k_rope = latent.linear_kv(x)  # (B, H, S, Dq), (B, H, S, D), (B, G_R, S, d_R)
        total, kept = k.square().sum(), torch.zeros((), dtype=k.dtype, device=k.device)
        if k2.shape[-1] < D:  # per-group keys: the latent's features among old's
            groups = k_rope.shape[1]
            # The kept pairs, found by their frequencies among the source's (all differ).
            source = old.positions.frequencies(x.device, torch.float64)  # (R/2,)
            kept_freqs = torch.tensor(  # (G, d_R/2): the frequencies the conversion set
                latent.options["rope_inv_freq"], dtype=source.dtype, device=x.device
            )
            pairs = (kept_freqs[..., None] == source).int().argmax(-1)  # (G, d_R/2)
            rope_index = rotary_index(old.positions, pairs)  # (G, d_R)
            rest = torch.ones(groups, D, dtype=torch.bool, device=x.device)
            rest[torch.arange(groups, device=x.device)[:, None], rope_index] = False
            order = rest.nonzero()[:, 1].view(groups, -1).repeat_interleave(H // groups, 0)
            order = order[None, :, None].expand_as(k2)  # (B, H, S, Dq): each feature's place
            k = k.gather(-1, order)  # (B, H, S, Dq): the features the latent carries
        elif k_rope is not None:  # a shared key
            kept = k_rope.square().sum() * H / G
        error = ((k2 - k).square().sum() - kept).clamp_min(0).sqrt()
        k_error = (error / total.sqrt()).item()
    return {"k_error": k_error, "v_error": rel(v2, v)}


def _out_error(
    old: MultiHeadAttention, new: MultiHeadAttention, calls: list[tuple[tuple, dict]]
) -> float:
    """The relative Frobenius error of ``new``'s outputs against ``old``'s on the recorded
    ``calls``, both in eval mode (no dropout), without a KV cache (a full pass)."""
    modes = old.training, new.training
    old.eval(), new.eval()
    diff = ref = 0.0
    try:
        with torch.no_grad():
            for args, kwargs in calls:
                kwargs = {**kwargs, "kv_cache": None}
                want = old(*args, **kwargs)
                diff += (new(*args, **kwargs) - want).double().square().sum().item()
                ref += want.double().square().sum().item()
    finally:
        old.train(modes[0]), new.train(modes[1])
    return (diff / ref) ** 0.5 if ref else float("nan")


def training_batches(
    ckpt: Mapping[str, Any], num_batches: int, local_dir: str | None = None
) -> list[tuple[Tensor, Tensor]]:
    """The first ``num_batches`` training batches of the run that wrote ``ckpt`` (its data
    settings, tokenizer and seed: the batches its first steps trained on), as ``(src,
    tgt_in)``, for a conversion's calibration; ``local_dir``: the data's directory here."""
    from multihead.data.datamodule import TranslationDataModule  # Lightning: only when asked

    check_positive_int("calibration_batches", num_batches)
    data = dict(ckpt["multihead"]["config"]["data"])
    target = str(data.pop("_target_", ""))
    if not target.endswith("TranslationDataModule"):
        raise ValueError(
            f"calibration batches come from translation data; this run's is {target!r}"
        )
    if local_dir is not None:
        data["local_dir"] = local_dir
    datamodule = TranslationDataModule(**data)
    datamodule.setup("fit")
    if datamodule.tokenizer.to_str() != ckpt["multihead"]["tokenizer"]:
        raise ValueError(
            "the data settings give another tokenizer than the checkpoint's; calibration "
            "batches must be the run's own (same data, languages and vocab_size)"
        )
    batches = list(itertools.islice(datamodule.train_dataloader(), num_batches))
    return [(batch["src"], batch["tgt"][:, :-1]) for batch in batches]  # teacher forcing


def convert_checkpoint(
    path: str | Path,
    num_kv_heads: int | None = None,
    scope: str | Sequence[str] = "decoder",
    *,
    kv_latent_dim: int | Mapping[str, int] | None = None,
    cache_budget: int | float | None = None,
    rope_dim: int | None = None,
    selection: str = "high",
    rotary_key: str | None = None,
    freqfold: int | None = None,
    factorisation: str | None = None,
    balance_kv: bool | None = None,
    calibration_batches: int = 0,
    local_dir: str | None = None,
) -> dict[str, Any]:
    """A checkpoint whose attention sublayers in ``scope`` have ``num_kv_heads`` K/V heads,
    a ``kv_latent_dim`` K/V latent or one within ``cache_budget``.

    The result loads with :func:`~multihead.checkpoints.load_trained_model` and can
    initialise a new run; it keeps no optimiser, scheduler, loop or callback state, so it
    cannot resume one. ``ckpt["multihead"]["converted_from"]`` records the conversion.

    Args:
        path: a ``.ckpt`` written by ``scripts/train.py``.
        num_kv_heads: ``G``; must divide the current K/V heads of every converted sublayer.
        scope: see :func:`resolve_scope`.
        kv_latent_dim: ``r``, instead of ``num_kv_heads``, or ``{kind: r}`` for every kind
            in ``scope`` (e.g. a rotary self-attention's latent beside its rotary keys, and
            a wider one in cross-attention, for the same cache).
        cache_budget: instead, each converted sublayer's KV cache bytes per token (an
            integer) or a fraction of its own (a float in (0, 1]); the rotary keys' width
            against the latent's measured on the calibration batches (see
            :func:`convert_attention`).
        rope_dim, selection, rotary_key, freqfold, factorisation, balance_kv: see
            :func:`convert_attention` (the rotary ones for the kinds with rotary layers;
            ``None``: measured on the calibration batches, whose loss scores each choice).
        calibration_batches: calibrate on this many of the run's own first training
            batches (:func:`training_batches`; ``0``: none, the weights alone).
        local_dir: the data's directory here, for the calibration batches.
    """
    kinds = resolve_scope(scope)
    per_kind = dict(kv_latent_dim) if isinstance(kv_latent_dim, Mapping) else None
    if per_kind is None:
        target = _target(num_kv_heads, kv_latent_dim, cache_budget)
    elif num_kv_heads is not None or cache_budget is not None or set(per_kind) != set(kinds):
        raise ValueError(
            f"kv_latent_dim={per_kind} must give one r for each of {list(kinds)}, without "
            f"num_kv_heads or cache_budget (got {num_kv_heads}, {cache_budget})"
        )
    else:
        target = {"kv_latent_dim": per_kind}
    if calibration_batches != 0:
        check_positive_int("calibration_batches", calibration_batches)
        if num_kv_heads is not None:  # it would only measure errors, which are not reported here
            raise ValueError(
                f"calibration_batches={calibration_batches} would be ignored: num_kv_heads="
                f"{num_kv_heads} pools K/V heads, and calibration shapes a K/V latent"
            )
    ckpt = read_checkpoint(path)
    model = load_trained_model(path).model
    before = {kind: cfg["num_kv_heads"] for kind, cfg in model.head_config.items()}
    options = copy.deepcopy(model.attention_config)
    latent = {"rope_dim": rope_dim, "selection": selection, "rotary_key": rotary_key,
              "freqfold": freqfold, "factorisation": factorisation,
              "balance_kv": balance_kv}  # fmt: skip
    calibration = None
    if calibration_batches:
        calibration = training_batches(ckpt, calibration_batches, local_dir)
    report = _convert(
        model, num_kv_heads, kv_latent_dim if per_kind is None else per_kind, cache_budget,
        calibration=calibration, scope=kinds,
        names=("num_kv_heads", "kv_latent_dim", "cache_budget"), **latent,
    )  # fmt: skip

    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    old_keys = {k for k in ckpt["state_dict"] if k.startswith("model.")}
    if num_kv_heads is not None and set(state) != old_keys:  # pooling changes shapes only
        raise RuntimeError(f"conversion changed the parameter names: {set(state) ^ old_keys}")
    converted = weights_only(ckpt)
    converted["state_dict"] = {
        **{k: v for k, v in ckpt["state_dict"].items() if not k.startswith("model.")},
        **state,
    }
    extra = dict(ckpt["multihead"])
    # The run config with the K/V settings of kinds, so that it rebuilds the result.
    extra["config"] = config = copy.deepcopy(extra["config"])
    attention = config["attention"]  # the one place heads are set
    # A parameter-matched control's FFN keeps the width it was trained at: matched again to
    # the converted heads, it would be another width than the weights'.
    frozen = {}
    if attention.get("match_parameters") is not None:
        frozen = {"ffn_dim": model.ffn_dim}
        config["model"]["ffn_dim"], attention["match_parameters"] = model.ffn_dim, None
    changed: dict[str, list[str]] = {}
    for kind in kinds:
        now = model.attention_config[kind]  # the keys set, and those a rotary latent changed
        kv = {k: v for k, v in now.items() if k == "num_kv_heads" or v != options[kind][k]}
        attention[kind] = {**(attention.get(kind) or {}), **kv}
        # Beyond the K/V heads or the latent asked for: the rotary key's options.
        was = options[kind]["design_options"] if now["design"] == options[kind]["design"] else {}
        own = {k for k, v in now["design_options"].items() if k not in was or v != was[k]}
        layer = set(kv) - {"num_kv_heads", "design", "design_options"}
        changed[kind] = sorted((layer | own) - set(target))
    if set(kinds) == set(ATTENTION_SUBLAYERS) and num_kv_heads is not None:
        attention["num_kv_heads"] = num_kv_heads
    extra["converted_from"] = {
        "path": str(path),
        **target,
        "scope": list(kinds),
        "previous_num_kv_heads": {kind: before[kind] for kind in kinds},
        **frozen,
        # The options that shaped the result: the rotary ones where a rotary latent changed
        # keys, the latent's (and its calibration) for a latent.
        **({k: latent[k] for k in ROTARY_DEFAULTS} if any(changed.values()) else {}),
        **(
            {**{k: latent[k] for k in LATENT_DEFAULTS}, "calibration_batches": calibration_batches}
            if num_kv_heads is None
            else {}
        ),
        **({"changed_keys": changed} if any(changed.values()) else {}),
        # What the measurement chose, per layer, where it chose.
        **(
            {"chosen": {row["layer"]: row["latent"] for row in report if "candidates" in row}}
            if any("candidates" in row for row in report)
            else {}
        ),
    }
    converted["multihead"] = extra
    return converted


def uptrain_overrides(ckpt_path: str | Path, out: str | Path, converted: dict) -> list[str]:
    """The ``scripts/train.py`` overrides that rebuild ``converted`` and start from ``out``.

    The original run's own overrides (:func:`recorded_overrides`), less the head options
    set here.
    """
    info = converted["multihead"]["converted_from"]
    kinds, attention = info["scope"], converted["multihead"]["config"]["attention"]
    heads: list[str] = []
    if set(kinds) == set(ATTENTION_SUBLAYERS) and "num_kv_heads" in info:
        heads.append(f"attention.num_kv_heads={info['num_kv_heads']}")
    for kind in kinds:
        sublayer = attention[kind]
        own = sublayer.get("design_options") or {}
        heads += [
            f"attention.{kind}.{key}={sublayer[key]}"
            for key in ("num_kv_heads", "design")
            if sublayer.get(key) is not None
        ]
        if "kv_latent_dim" in info:  # the sublayer's section lists no design option: ++
            heads.append(f"++attention.{kind}.design_options.kv_latent_dim={own['kv_latent_dim']}")
        # What a rotary latent adds (rotary_dim, frequencies, ...): keys the config may lack.
        for key in info.get("changed_keys", {}).get(kind, ()):
            where, value = ("design_options.", own[key]) if key in own else ("", sublayer[key])
            heads.append(f"++attention.{kind}.{where}{key}={json.dumps(value)}")
    if "ffn_dim" in info:  # a parameter-matched control's FFN, kept at its trained width
        heads += ["attention.match_parameters=null", f"model.ffn_dim={info['ffn_dim']}"]
    ours = {h.lstrip("+").split("=", 1)[0] for h in heads}
    return [*recorded_overrides(ckpt_path, ours), f"init_from={out}", *heads]


def recorded_overrides(ckpt_path: str | Path, drop: Collection[str] = ()) -> list[str]:
    """The overrides of the run that wrote ``ckpt_path``, from ``<run dir>/.hydra/
    overrides.yaml`` (the checkpoint in ``<run dir>/checkpoints/`` or, averaged, in
    ``<run dir>/``; none when neither has the file), less ``hydra.*``, resuming
    (``ckpt_path``), ``init_from``, the old run directory (``paths.output_dir``) and the
    keys in ``drop``."""
    drop = {*drop, "ckpt_path", "init_from", "paths.output_dir"}
    here = Path(ckpt_path).resolve().parent
    for run_dir in (here.parent, here):
        recorded = run_dir / ".hydra" / "overrides.yaml"
        if recorded.is_file():
            overrides = [str(o) for o in OmegaConf.load(recorded)]
            keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
            return [o for o, k in zip(overrides, keys, strict=True)
                    if k not in drop and not k.startswith("hydra.")]  # fmt: skip
    return []


def convert_kv_heads(
    ckpt: str | Path,
    num_kv_heads: int | None,
    out: str | Path,
    scope: str | Sequence[str] = "decoder",
    *,
    kv_latent_dim: int | Mapping[str, int] | None = None,
    **options: Any,
) -> tuple[Path, list[str]]:
    """Convert ``ckpt`` and save it to ``out`` (never overwritten); ``options``: those of
    :func:`convert_checkpoint` (``rope_dim``, ``rotary_key``, ``calibration_batches``, ...).

    Returns:
        ``(out, overrides)``: the path written and the ``scripts/train.py`` overrides
        that uptrain from it (see :func:`uptrain_overrides`).

    Raises:
        FileExistsError: ``out`` exists.
    """
    if Path(out).exists():  # before the work; save_new checks again when writing
        raise FileExistsError(f"{out} already exists; choose a new out= path")
    converted = convert_checkpoint(
        ckpt, num_kv_heads, scope, kv_latent_dim=kv_latent_dim, **options
    )
    written = save_new(converted, out)
    return written, uptrain_overrides(ckpt, written, converted)
