"""Equal terms: what a design costs besides its cache, counted from the built model.

A comparison of head designs changes more than the cache when the designs differ in
parameters, in arithmetic, or in what their scores can see (issue 83): MLA's score is
``qk_head_dim + d_R`` features wide, ``d_R`` of them rotary, where MHA's is ``D``, all
rotary. :func:`describe` counts, from a model's modules (never from its config's words):

* parameters, all and those of the attention layers (a tied embedding counted once);
* multiply-adds per token of a full causal pass over ``context`` tokens: every
  ``nn.Linear`` once per token (``in * out``), every convolution once per token (its
  weights), and each attention layer's products ``Q K^T`` and ``weights V`` over the keys a
  query sees: ``(context + 1) / 2`` on average in causal self-attention, ``context``
  otherwise (an encoder's self-attention, cross-attention at equal source and target
  length), ``H * (score width + value width)`` per key, times the fraction of heads a
  sparse design computes. The design's own widths: MLA's kernel pads V to the score width,
  and that padding is not counted. Norms, softmax, rotations and embedding lookups are
  left out (no matrix products), and so are the products of a design's own parameters
  outside linear maps (talking heads' mixes, a group MLP's), which a note then counts. For
  an encoder-decoder a token is one source and one target token;
* each attention sublayer's score width per head and how many of those features carry
  positions (rotated), and the positional mechanism (``rotary``, ``score bias`` for ALiBi,
  ``none``);
* KV-cache bytes per decoded token (fp32): the causal self-attention layers' caches, as
  they hold them (a translation model's cross-attention cache holds the source instead).

:func:`describe_run` builds a finished run's model from its saved config on the meta
device (no memory, no data) and describes it; a run whose config today's code cannot build
is described by the figures its summary recorded, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.errors import HydraException
from torch import nn

from multihead.analysis.runs import RunResult, number
from multihead.attention import MultiHeadAttention

CAUSAL_SUBLAYERS = ("decoder_self_attention",)


@dataclass(frozen=True)
class Scores:
    """One attention sublayer's heads: how wide each head's score is and what places it."""

    sublayer: str
    heads: int
    width: int  # features in one head's q . k
    positional: int  # of them, rotated by position
    positions: str  # "rotary", "score bias", "rotary key" (MLA's decoupled one), "none"

    def __str__(self) -> str:
        if self.positions == "score bias":
            return f"{self.width} (0 rotary; ALiBi score bias)"
        return f"{self.width} ({self.positional} rotary)"


@dataclass(frozen=True)
class Description:
    """A model's equal terms (see the module)."""

    params: int
    attention_params: int
    macs_per_token: float
    context: int
    kv_bytes_per_token: int
    scores: tuple[Scores, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def score_cell(self) -> str:
        """The score widths, one per kind of sublayer (``16 (16 rotary)``)."""
        if len({(s.width, s.positional, s.positions) for s in self.scores}) <= 1:
            return str(self.scores[0]) if self.scores else ""
        return "; ".join(f"{s.sublayer}: {s}" for s in self.scores)


def attention_layers(model: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """``(sublayer, layer)`` of every attention layer: the model's own
    ``attention_sublayers()`` where it has one, else every layer (taken as causal
    self-attention)."""
    if hasattr(model, "attention_sublayers"):
        return [(sublayer, layer) for sublayer, _, _, layer in model.attention_sublayers()]
    found = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    return [(CAUSAL_SUBLAYERS[0], layer) for layer in found]


def score_features(layer: MultiHeadAttention) -> tuple[int, int, str]:
    """``(width, rotated, mechanism)`` of one head's score: a design's own where it says
    (``score_features``: MLA's latent and rotary key), else the Q projection's head width
    with the layer's positional part."""
    own = getattr(layer.design, "score_features", None)
    if own is not None:
        width, rotated = own
        return width, rotated, "rotary key" if rotated else "none"
    width = layer.in_proj.head_dim
    positions = layer.positions
    if positions is None:
        return width, 0, "none"
    if positions.seam == "score_bias":
        return width, 0, "score bias"
    return width, positions.rotary_dim, "rotary"


def linear_macs(model: nn.Module) -> int:
    """Multiply-adds per token of every linear map and convolution of ``model``."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.in_features * module.out_features
        elif isinstance(module, nn.Conv1d):
            total += module.weight.numel()  # per output position: out * in / groups * K
    return total


def describe(model: nn.Module, context: int) -> Description:
    """``model``'s equal terms at ``context`` tokens (see the module)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r}: expected a positive number of tokens")
    layers = attention_layers(model)
    macs = float(linear_macs(model))
    scores: dict[str, Scores] = {}
    for sublayer, layer in layers:
        width, rotated, mechanism = score_features(layer)
        value_width = layer.out_proj.in_features // layer.num_heads
        keys = (context + 1) / 2 if sublayer in CAUSAL_SUBLAYERS else context
        heads = layer.num_heads * layer.active_head_fraction
        macs += heads * (width + value_width) * keys
        scores.setdefault(sublayer, Scores(sublayer, layer.num_heads, width, rotated, mechanism))
    attention = {p for _, layer in layers for p in layer.parameters()}
    counted = (nn.Linear, nn.Conv1d, nn.LayerNorm, nn.RMSNorm)
    uncounted = sum(
        p.numel()
        for _, layer in layers
        for module in layer.modules()
        if not isinstance(module, counted)
        for p in module.parameters(recurse=False)
    )
    notes = () if not uncounted else (
        f"{uncounted:,} attention parameters outside linear maps (a design's own mixing): "
        "their multiply-adds are not counted",
    )  # fmt: skip
    kv = sum(layer.kv_cache_bytes_per_token(torch.float32)
             for sublayer, layer in layers if sublayer in CAUSAL_SUBLAYERS)  # fmt: skip
    return Description(
        params=sum(p.numel() for p in model.parameters()),
        attention_params=sum(p.numel() for p in attention),
        macs_per_token=macs,
        context=context,
        kv_bytes_per_token=kv,
        scores=tuple(scores.values()),
        notes=notes,
    )


# ---------------------------------------------------------------------------------------
# A finished run


def trained_context(config: dict[str, Any]) -> int | None:
    """The context a run trained at: its data's ``context`` (the LM), the longest MQAR
    sequence, else its model's ``max_positions``."""
    data, model = config.get("data") or {}, config.get("model") or {}
    if isinstance(data.get("context"), int):
        return data["context"]
    if data.get("train_settings"):
        return max(int(seq) for seq, _ in data["train_settings"])
    found = model.get("max_positions")
    return found if isinstance(found, int) else None


def build_from_config(config: dict[str, Any], vocab_size: int | None = None) -> nn.Module:
    """The network of a run's saved config, on the meta device, with ``vocab_size`` (``None``:
    its data's). A format-2 config (before ``design_options``) is read as checkpoints of
    that format are (:func:`~multihead.checkpoints.io.upgrade_config`)."""
    from omegaconf import OmegaConf

    from multihead.checkpoints.io import upgrade_config
    from multihead.model.factory import build_model

    cfg = OmegaConf.create(config)
    vocab = OmegaConf.select(cfg, "data.vocab_size") if vocab_size is None else vocab_size
    if not isinstance(vocab, int):
        raise ValueError("its config has no data.vocab_size")
    with torch.device("meta"):
        try:
            return build_model(cfg, vocab_size=vocab, pad_id=0)
        except HydraException:
            if "design_options" in (config.get("attention") or {}):
                raise
            upgraded = OmegaConf.create(upgrade_config(OmegaConf.to_container(cfg)))
            return build_model(upgraded, vocab_size=vocab, pad_id=0)


def _solved_vocabulary(config: dict[str, Any], recorded: float) -> int | None:
    """The vocabulary that gives the model the parameters its run recorded (the tokenizer's
    own size, which a translation config does not state): parameters are affine in it."""
    base = config["data"]["vocab_size"]
    one, two = (sum(p.numel() for p in build_from_config(config, v).parameters())
                for v in (base, base + 1))  # fmt: skip
    if two == one:
        return None
    solved = base + (recorded - one) / (two - one)
    return int(solved) if solved == int(solved) and solved > 0 else None


def describe_run(run: RunResult) -> Description:
    """``run``'s equal terms from the model its saved config builds, checked against the
    parameters its summary recorded; where the config cannot be built (an older schema),
    the summary's own parameters and cache, with a note naming why."""
    config = run.config or {}
    context = trained_context(config)
    try:
        if context is None:
            raise ValueError("its config names no context (data.context, model.max_positions)")
        model = build_from_config(config)
    except (ValueError, TypeError, KeyError, AttributeError, HydraException) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        cause = getattr(err, "__cause__", None)
        if cause is not None and str(cause):
            why = str(cause).splitlines()[0]
        recorded = [number(run.get(k)) for k in ("params/total", "params/attention")]
        return Description(
            params=int(recorded[0] or 0),
            attention_params=int(recorded[1] or 0),
            macs_per_token=float("nan"),
            context=context or 0,
            kv_bytes_per_token=int(number(run.get("kv_cache/bytes_per_token")) or 0),
            notes=(f"not built from its config ({why[:160]}); parameters and cache as recorded",),
        )
    found = describe(model, context)
    recorded = number(run.get("params/total"))
    if recorded is None or recorded == found.params:
        return found
    vocab = _solved_vocabulary(config, recorded)
    if vocab is not None:
        found = describe(build_from_config(config, vocab), context)
        note = (
            f"vocabulary {vocab:,} (the tokenizer's, solved from the {recorded:,.0f} "
            f"parameters the run recorded; the config asks for {config['data']['vocab_size']:,})"
        )
    else:
        note = (
            f"the model its config builds has {found.params:,} parameters; the run recorded "
            f"{recorded:,.0f}"
        )
    return Description(**{**found.__dict__, "notes": (*found.notes, note)})
