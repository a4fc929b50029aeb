"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Every attention sublayer is a :class:`~multihead.attention.MultiHeadAttention`, so each of
the three sublayers (encoder self-attention, decoder self-attention, cross-attention) can be MHA,
GQA or MQA with its own kernel. The file reads top to bottom: feed-forward, the residual
wrapper, encoder layer, decoder layer, the decoder's KV caches, the output projection, the
model.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import BACKENDS, DesignBackendError, KVCache, MultiHeadAttention
from multihead.attention.alibi import ALiBi
from multihead.attention.checks import check_bool, closest_name
from multihead.model.dropout import Dropout
from multihead.model.embedding import TransformerEmbedding, make_token_embedding
from multihead.packed import PackedLinear

log = logging.getLogger(__name__)

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}
# The three attention sublayers. ("kind" means mha/gqa/mqa/mla, a layer's head_config["kind"].)
ATTENTION_SUBLAYERS = ("encoder_self_attention", "decoder_self_attention", "cross_attention")


def _attention_options() -> dict[str, Any]:
    """The layer's head options (not its sizes or dropout, which the model sets) and their
    defaults, read from its signature, so that a new option needs no second list here; its
    design's own options are one of them, ``design_options`` (a mapping, ``{}`` by default)."""
    return {
        name: {} if param.kind is param.VAR_KEYWORD else param.default
        for name, param in inspect.signature(MultiHeadAttention).parameters.items()
        if name not in ("embed_dim", "dropout", "bias", "device", "dtype")
    }


class FeedForward(nn.Module):
    """``linear2(dropout(activation(linear1(x))))``, the position-wise FFN (section 3.3)."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str, dropout: float) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}"
            )
        self.linear1 = nn.Linear(d_model, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, d_model)
        self.activation = ACTIVATIONS[activation]
        self.dropout = Dropout(dropout)
        for linear in (self.linear1, self.linear2):  # as fairseq: Xavier, zero bias
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


# A parameter-matched control (Llama 2's attention ablation, Table 18): the FFN widened, or
# narrowed, until the model has the parameters of the same model with MHA in every attention
# layer. The width stays a multiple of 8, so that the total lands within one step of width
# (ffn_layers * (2E + 1) parameters) of MHA's.
MATCHED_TO = ("mha",)
FFN_WIDTH_MULTIPLE = 8


def matched_ffn_dim(
    d_model: int, ffn_dim: int, ffn_layers: int, attention_layers: list[dict[str, Any]]
) -> int:
    """The FFN width at which a model whose attention layers take ``attention_layers`` (one
    :class:`~multihead.attention.MultiHeadAttention` argument mapping per layer) has as many
    parameters as the same model with MHA of the same heads in each, to the nearest multiple
    of :data:`FFN_WIDTH_MULTIPLE`; ``ffn_dim`` is MHA's width and ``ffn_layers`` the FFNs.
    """

    def count(layer: dict[str, Any]) -> int:
        attn = MultiHeadAttention(d_model, **layer, device="meta")  # no memory
        return sum(p.numel() for p in attn.parameters())

    short = sum(count({"num_heads": a["num_heads"]}) - count(a) for a in attention_layers)
    per_width = ffn_layers * (2 * d_model + 1)  # FeedForward: linear1 and linear2, with biases
    width = ffn_dim + FFN_WIDTH_MULTIPLE * round(short / per_width / FFN_WIDTH_MULTIPLE)
    if width < 1:
        raise ValueError(
            f"match_parameters: the attention has {-short} parameters more than MHA's, more "
            f"than an FFN of width {ffn_dim} can give up"
        )
    return width


def check_match(match_parameters: str | None) -> None:
    if match_parameters is not None and match_parameters not in MATCHED_TO:
        raise ValueError(
            f"attention.match_parameters={match_parameters!r}; expected null (the FFN as "
            f"given) or one of {', '.join(MATCHED_TO)} (the FFN widened to its parameter count)"
        )


def _sublayer_attention(
    attn: MultiHeadAttention,
    maps: dict[str, Tensor] | None,
    name: str,
    query: Tensor,
    key_value: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """Run ``attn``; when ``maps`` is given also store its weights there under ``name``."""
    if maps is None:
        return attn(query, key_value, **kwargs)
    out, maps[name] = attn(query, key_value, need_weights=True, **kwargs)
    return out


class _ResidualLayer(nn.Module):
    """Self-attention, cross-attention if ``cross_attention`` is given, then FFN, each
    wrapped as ``LN(x + dropout(f(x)))`` (post-LN) or ``x + dropout(f(LN(x)))`` (pre-LN)."""

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        self_attention: Mapping[str, Any],
        cross_attention: Mapping[str, Any] | None = None,
        *,
        activation: str,
        norm_first: bool,
        dropout: float,
        attention_dropout: float,
        activation_dropout: float,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.dropout = Dropout(dropout)
        self.self_attn = MultiHeadAttention(d_model, **self_attention, dropout=attention_dropout)
        self.self_attn_norm = nn.LayerNorm(d_model)
        if cross_attention is not None:
            self.cross_attn = MultiHeadAttention(
                d_model, **cross_attention, dropout=attention_dropout
            )
            self.cross_attn_norm = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim, activation, activation_dropout)
        self.ffn_norm = nn.LayerNorm(d_model)

    def _sublayer_input(self, x: Tensor, norm: nn.LayerNorm) -> Tensor:
        return norm(x) if self.norm_first else x

    def _sublayer_output(self, x: Tensor, out: Tensor, norm: nn.LayerNorm) -> Tensor:
        x = x + self.dropout(out)
        return x if self.norm_first else norm(x)


class EncoderLayer(_ResidualLayer):
    """Self-attention then FFN, each with residual and LayerNorm."""

    def forward(self, x: Tensor, pad_mask: Tensor, maps: dict[str, Tensor] | None = None) -> Tensor:
        """``x`` ``(B, S, E)``, ``pad_mask`` ``(B, S)`` True = padding; returns ``(B, S, E)``.

        ``maps``, if given, receives the self-attention weights under ``"self"``.
        """
        h = self._sublayer_input(x, self.self_attn_norm)
        h = _sublayer_attention(self.self_attn, maps, "self", h, key_padding_mask=pad_mask)
        x = self._sublayer_output(x, h, self.self_attn_norm)
        h = self.ffn(self._sublayer_input(x, self.ffn_norm))
        return self._sublayer_output(x, h, self.ffn_norm)


class DecoderLayer(_ResidualLayer):
    """Causal self-attention, cross-attention to the memory, FFN."""

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_pad_mask: Tensor,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        maps: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """``x`` ``(B, T, E)`` (the new positions only, with caches), ``memory`` ``(N, S, E)``
        and ``memory_pad_mask`` ``(N, S)`` as for :meth:`Transformer.decode`; ``maps``, if
        given, receives the weights under ``"self"`` and ``"cross"``."""
        # No key padding mask here: targets are right-padded, so under the causal mask a real
        # token never sees a padded one; only padded queries see padding, and their outputs
        # are ignored by the loss.
        h = self._sublayer_input(x, self.self_attn_norm)
        h = _sublayer_attention(
            self.self_attn, maps, "self", h, is_causal=True, kv_cache=self_cache
        )
        x = self._sublayer_output(x, h, self.self_attn_norm)
        h = self._sublayer_input(x, self.cross_attn_norm)
        # The k rows that share a memory row attend to it as one query of k*T positions:
        # cross-attention treats query positions independently, and its K/V (cached or not)
        # are then read once per sentence instead of once per beam.
        B, T, E = h.shape
        N = memory.shape[0]
        h = _sublayer_attention(
            self.cross_attn,
            maps,
            "cross",
            h.reshape(N, B // N * T, E),  # (N, k*T, E)
            memory,
            key_padding_mask=memory_pad_mask,
            kv_cache=cross_cache,
        )
        h = h.reshape(B, T, E)
        if maps is not None:
            weights = maps["cross"]  # (N, H, k*T, S)
            maps["cross"] = weights.unflatten(2, (B // N, T)).transpose(1, 2).flatten(0, 1)
        x = self._sublayer_output(x, h, self.cross_attn_norm)
        h = self.ffn(self._sublayer_input(x, self.ffn_norm))
        return self._sublayer_output(x, h, self.ffn_norm)


class DecoderCache:
    """One self-attention and one cross-attention :class:`KVCache` per decoder layer.

    The self-attention caches grow by the decoded positions and hold one row per decoded
    sequence (sentence times beam); the cross-attention caches are filled with the projected
    memory on the first decoding step, only read afterwards, and hold one row per sentence
    (its beams share it). Made by :meth:`Transformer.make_decoder_cache`.
    """

    def __init__(self, self_caches: list[KVCache], cross_caches: list[KVCache]) -> None:
        self.self_caches = self_caches
        self.cross_caches = cross_caches

    @property
    def batch_size(self) -> int:
        return self.self_caches[0].batch_size

    @property
    def position(self) -> int:
        """Target positions decoded so far, the ``start_pos`` of the next step."""
        return self.self_caches[0].size

    def select(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Keep self-attention rows ``rows`` and, if given, cross-attention rows ``sentences``.

        ``rows`` reorders beams and drops finished ones; ``sentences`` drops finished
        sentences. Beam search moves rows at every step but drops sentences only now and
        then, so the memory's K/V are copied only then.
        """
        for cache in self.self_caches:
            cache.select(rows)
        if sentences is not None:
            for cache in self.cross_caches:
                cache.select(sentences)

    def reset(self) -> None:
        """Forget every position, self and cross (to decode a new batch of the same size)."""
        for cache in self.self_caches + self.cross_caches:
            cache.reset()


class FullPrefix:
    """What decoding keeps instead of a :class:`DecoderCache` when a decoder self-attention
    design refuses the KV cache (:attr:`~multihead.attention.HeadDesign.refuses_kv_cache`):
    the target tokens fed so far, ``(B, t)``. :meth:`Transformer.decode` runs the whole
    prefix through the decoder at each step and returns the new positions' logits, so each
    step computes the full pass of its prefix. Made by :meth:`Transformer.make_decoder_cache`;
    the searches use it as a :class:`DecoderCache`.
    """

    def __init__(self, batch_size: int) -> None:
        self.tokens: Tensor | None = None
        self._batch_size = batch_size

    @property
    def batch_size(self) -> int:
        return self._batch_size if self.tokens is None else self.tokens.shape[0]

    @property
    def position(self) -> int:
        """Target positions fed so far."""
        return 0 if self.tokens is None else self.tokens.shape[1]

    def extend(self, tgt_in: Tensor) -> Tensor:
        """The prefix with ``tgt_in`` ``(B, T)`` appended: ``(B, t + T)``, kept."""
        self.tokens = tgt_in if self.tokens is None else torch.cat([self.tokens, tgt_in], 1)
        return self.tokens

    def select(self, rows: Tensor, sentences: Tensor | None = None) -> None:
        """Keep prefix rows ``rows`` (the memory's rows are the search's own to select)."""
        if self.tokens is not None:
            self.tokens = self.tokens[rows]

    def reset(self) -> None:
        self.tokens = None


class OutputProjection(PackedLinear):
    """The projection to vocabulary logits, ``(..., E) -> (..., V)``: a
    :class:`~multihead.packed.PackedLinear`, so that a search runs it on oneDNN with
    its weight reordered once.

    At ``V`` ~ 8,000 this is the largest matmul of every decoding step. On the CPU,
    ``F.linear`` calls Intel MKL's sgemm; oneDNN on a weight kept in its own blocked layout
    ran the same product faster on an AVX2 AMD EPYC (docs/results/deployment.md, "Beam search
    per host").
    """


def _attention_config(
    sublayer: str, base: Mapping[str, Any] | None, override: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The layer's defaults updated by ``base`` then by ``override`` (any Mapping).

    A ``None`` value in ``override`` means "as in ``base``", so a config can list every key
    of a per-sublayer section and set only the ones it changes. Its ``design_options`` update
    ``base``'s one by one, unless it names another design than ``base``: then they are that
    design's alone.
    """
    options = _attention_options()
    config = {k: v for k, v in options.items() if v is not inspect.Parameter.empty}
    for name, mapping in (("attention", base), (sublayer, override)):
        if mapping is None:
            continue
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{name} must be a mapping or None, got {type(mapping).__name__}")
        unknown = set(mapping) - set(options)
        if unknown:
            near = [(k, closest_name(k, options)) for k in sorted(unknown)]
            raise ValueError(
                f"unknown key(s) {[k for k, _ in near]} in {name}"
                + "".join(f" ({k}: closest {c})" for k, c in near if c)
                + f"; expected {list(options)} (a head design's own options go in "
                f"{name}.design_options)"
            )
        own = mapping.get("design_options")
        if own is not None and not isinstance(own, Mapping):
            raise ValueError(
                f"{name}.design_options must be a mapping of the design's options, got {own!r}"
            )
        layer_keys = sorted(set(own or {}) & set(options))
        if layer_keys:
            raise ValueError(
                f"{name}.design_options has {', '.join(layer_keys)}, the layer's own: set "
                f"{name}.{layer_keys[0]} instead"
            )
        given = (
            dict(mapping)
            if mapping is base
            else {k: v for k, v in mapping.items() if v is not None}
        )
        if mapping is not base and given.get("design", config["design"]) == config["design"]:
            own = {**config["design_options"], **(own or {})}  # the same design: one by one
        given["design_options"] = dict(own or {})
        config.update(given)
    if "num_heads" not in config:
        raise ValueError(f"{sublayer}: num_heads is not set; give it in attention (e.g. 4)")
    return config


def sublayer_config(attn: MultiHeadAttention) -> dict[str, Any]:
    """``attn``'s :attr:`~multihead.attention.MultiHeadAttention.head_config` in the form of
    a sublayer's config (:attr:`Transformer.attention_config`): the layer's own keys, and its
    design's options under ``design_options``."""
    layer_keys = _attention_options()
    config = {k: v for k, v in attn.head_config.items() if k != "kind"}
    own = {k: v for k, v in config.items() if k not in layer_keys}
    return {"design": None, **{k: v for k, v in config.items() if k in layer_keys}} | {
        "design_options": own
    }


def _layer_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """The layer's arguments from its sublayer's config: the design's options as keywords."""
    layer = {k: v for k, v in config.items() if k != "design_options"}
    return {**layer, **config["design_options"]}


def _place_positions(
    configs: dict[str, dict[str, Any]], positional: str, d_model: int, cross: Mapping | None
) -> None:
    """With ``positional="rope"``, rotary positions in both self-attentions: every feature of
    a head unless ``rotary_dim`` says fewer; with ``"alibi"``, ALiBi in both (the encoder's
    symmetric, see :mod:`~multihead.attention.alibi`). Never in cross-attention (its queries
    and keys are positions of two different sentences); ``attention.rotary_dim`` is for the
    others."""
    asked_cross = (cross or {}).get("rotary_dim")
    if asked_cross is not None:
        raise ValueError(
            f"cross_attention: rotary_dim={asked_cross} is not used with cross-attention; "
            "rotary positions are for self-attention (model.positional=rope)"
        )
    configs["cross_attention"]["rotary_dim"] = None
    for sublayer in ("encoder_self_attention", "decoder_self_attention"):
        config = configs[sublayer]
        asked = config.get("rotary_dim")
        if positional == "alibi" and asked is None:
            config["positions"] = ALiBi(config["num_heads"])  # no parameters: one per stack
            continue
        if positional != "rope":
            if asked is not None:
                raise ValueError(
                    f"{sublayer}: rotary_dim={asked} is not used with positional={positional!r}; "
                    "rotary positions come from model.positional=rope"
                )
            continue
        config["rotary_dim"] = d_model // config["num_heads"] if asked is None else asked


class Transformer(nn.Module):
    """Encoder-decoder Transformer for translation.

    Post-LN as in the original paper by default; ``norm_first=True`` gives pre-LN with a
    final LayerNorm on the encoder and decoder outputs. Dropout follows fairseq: ``dropout``
    on the embeddings and on each sublayer's output, ``attention_dropout`` on the attention
    weights, ``activation_dropout`` inside the FFN; all but the attention weights' is
    :class:`~multihead.model.dropout.Dropout`.

    Initialisation (as fairseq): token embeddings ``normal(0, E^-0.5)`` with the padding row
    zero (then scaled by ``sqrt(E)`` in the forward pass); an untied output projection the
    same; FFN weights Xavier-uniform with zero biases; attention as
    :class:`~multihead.attention.MultiHeadAttention`; LayerNorm weight 1, bias 0.

    Args:
        src_vocab_size: source vocabulary size.
        tgt_vocab_size: target vocabulary size.
        d_model: ``E``.
        ffn_dim: inner size of the feed-forward sublayers.
        num_encoder_layers: encoder depth.
        num_decoder_layers: decoder depth.
        dropout: on embeddings and sublayer outputs.
        attention_dropout: on attention weights.
        activation_dropout: after the FFN activation.
        activation: ``"relu"`` or ``"gelu"``.
        norm_first: pre-LN instead of post-LN.
        positional: ``"sinusoidal"``, ``"learned"`` (added to the embeddings), ``"rope"``
            (rotary positions in every self-attention sublayer, all of each head's features
            rotated unless ``attention.rotary_dim`` says fewer) or ``"alibi"`` (ALiBi's
            score bias in every self-attention sublayer, symmetric in the encoder);
            cross-attention has none.
        max_positions: the longest source or target sequence (bos included).
        share_embeddings: tie the source, target and output embeddings (one matrix); needs
            ``src_vocab_size == tgt_vocab_size`` (a joint vocabulary).
        tie_output: tie the output projection to the target embedding. Implied by
            ``share_embeddings``.
        pad_id: the padding token id, in both vocabularies.
        attention: keyword arguments of :class:`~multihead.attention.MultiHeadAttention`
            for every attention sublayer: ``num_heads`` (required), ``num_kv_heads``,
            ``backend``, ``design`` and the other head options, with the layer's defaults;
            the design's own options in one mapping, ``design_options`` (e.g.
            ``{"design": "moh", "design_options": {"top_k_heads": 2}}``).
        encoder_self_attention, decoder_self_attention, cross_attention: keys that override
            ``attention`` for one sublayer, e.g. ``{"num_kv_heads": 1}`` for the
            decoder self-attention only; ``None`` values inherit from ``attention``. Any
            ``Mapping`` (an omegaconf ``DictConfig`` too). A head design with an
            ``at_depth`` hook is given its layer's depth in its stack (0 first): e.g. a
            differential sublayer without a ``lambda_init`` gets the paper's for that depth.
        match_parameters: ``"mha"``: a parameter-matched control, the FFN's width set so that
            the model has the parameters of the same model with MHA in every sublayer
            (:func:`matched_ffn_dim`; ``ffn_dim`` is then MHA's width, and the width built
            is in :attr:`head_tag`); ``None``: ``ffn_dim``.

    Shapes:
        src ``(B, S)`` long; tgt_in ``(B, T)`` long (bos-prefixed); logits ``(B, T, V)``.

    Example:
        >>> model = Transformer(src_vocab_size=100, tgt_vocab_size=100, d_model=32,
        ...     ffn_dim=64, num_encoder_layers=2, num_decoder_layers=2, dropout=0.1,
        ...     max_positions=64,
        ...     attention={"num_heads": 4}, decoder_self_attention={"num_kv_heads": 1})
        >>> model(torch.randint(1, 100, (2, 7)), torch.randint(1, 100, (2, 5))).shape
        torch.Size([2, 5, 100])
        >>> model.head_config["decoder_self_attention"]["kind"]
        'mqa'
    """

    def __init__(
        self,
        *,
        src_vocab_size: int,
        tgt_vocab_size: int,
        d_model: int,
        ffn_dim: int,
        num_encoder_layers: int,
        num_decoder_layers: int,
        dropout: float,
        max_positions: int,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        positional: str = "sinusoidal",
        share_embeddings: bool = True,
        tie_output: bool = True,
        pad_id: int = 0,
        attention: Mapping[str, Any] | None = None,
        encoder_self_attention: Mapping[str, Any] | None = None,
        decoder_self_attention: Mapping[str, Any] | None = None,
        cross_attention: Mapping[str, Any] | None = None,
        match_parameters: str | None = None,
    ) -> None:
        super().__init__()
        check_match(match_parameters)
        sizes = {
            "d_model": d_model,
            "ffn_dim": ffn_dim,
            "num_encoder_layers": num_encoder_layers,
            "num_decoder_layers": num_decoder_layers,
            "max_positions": max_positions,
            "src_vocab_size": src_vocab_size,
            "tgt_vocab_size": tgt_vocab_size,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (
            ("dropout", dropout),
            ("attention_dropout", attention_dropout),
            ("activation_dropout", activation_dropout),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
        for name, value in (
            ("norm_first", norm_first),
            ("share_embeddings", share_embeddings),
            ("tie_output", tie_output),
        ):
            check_bool(name, value)
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                f"share_embeddings=True needs one joint vocabulary, but src_vocab_size="
                f"{src_vocab_size} != tgt_vocab_size={tgt_vocab_size}; set "
                "share_embeddings=False or build a joint vocabulary"
            )
        overrides = (encoder_self_attention, decoder_self_attention, cross_attention)
        self.attention_config = {
            sublayer: _attention_config(sublayer, attention, override)
            for sublayer, override in zip(ATTENTION_SUBLAYERS, overrides, strict=True)
        }
        _place_positions(self.attention_config, positional, d_model, cross_attention)
        # Each sublayer's design with its backend first (a layer on the meta device, which
        # holds no memory): a design that runs on one backend only is refused before any
        # rule of the backend itself, naming the override that selects the one it needs.
        for sublayer, override in zip(ATTENTION_SUBLAYERS, overrides, strict=True):
            try:
                config = _layer_arguments(self.attention_config[sublayer])
                MultiHeadAttention(d_model, **config, device="meta")
            except DesignBackendError as err:
                own = override is not None and override.get("backend") is not None
                key = f"attention.{sublayer}.backend" if own else "attention.backend"
                raise ValueError(f"{sublayer}: {err}; set {key}={err.backends[0]}") from None
        # The encoder and cross-attention always mask padded source tokens: their backends
        # must take a padding mask (the registry says which do).
        padded = [name for name, backend in BACKENDS.items() if backend.padding_mask]
        for sublayer in ("encoder_self_attention", "cross_attention"):
            if self.attention_config[sublayer]["backend"] not in padded:
                raise ValueError(
                    f"{sublayer} backend {self.attention_config[sublayer]['backend']!r} takes no "
                    "padding mask on CUDA, and the encoder and cross-attention always mask "
                    f"padded source tokens; use one of {', '.join(padded)} for "
                    f"{sublayer} (e.g. attention.backend=efficient "
                    "attention.decoder_self_attention.backend=flash)"
                )
        self.d_model = d_model
        self.pad_id = pad_id
        self._said_full_prefix = False  # make_decoder_cache logs it once
        self.max_positions = max_positions
        self.norm_first = norm_first

        src_token = make_token_embedding(src_vocab_size, d_model, pad_id)
        tgt_token = (
            src_token if share_embeddings else make_token_embedding(tgt_vocab_size, d_model, pad_id)
        )
        embedding_args = dict(positional=positional, max_positions=max_positions, dropout=dropout)
        self.encoder_embedding = TransformerEmbedding(src_token, **embedding_args)
        self.decoder_embedding = TransformerEmbedding(tgt_token, **embedding_args)

        layer_args = dict(
            activation=activation,
            norm_first=norm_first,
            dropout=dropout,
            attention_dropout=attention_dropout,
            activation_dropout=activation_dropout,
        )
        enc, dec, cross = map(_layer_arguments, self.attention_config.values())
        if match_parameters is not None:
            layers = [enc] * num_encoder_layers + [dec, cross] * num_decoder_layers
            ffns = num_encoder_layers + num_decoder_layers
            ffn_dim = matched_ffn_dim(d_model, ffn_dim, ffns, layers)
        self.ffn_dim, self.match_parameters = ffn_dim, match_parameters
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(d_model, ffn_dim, enc, **layer_args) for _ in range(num_encoder_layers)
        )
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(d_model, ffn_dim, dec, cross, **layer_args)
            for _ in range(num_decoder_layers)
        )
        # A head design that depends on its layer's depth in the stack (differential
        # attention's lambda_init) is told it; a design without such a hook has no at_depth.
        for _, depth, _, attn in self.attention_sublayers():
            at_depth = getattr(attn.design, "at_depth", None)
            if at_depth is not None:
                at_depth(depth)
        # Pre-LN leaves the residual stream unnormalised; post-LN already ends with a norm.
        self.encoder_norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()

        # No bias, as fairseq: with tying the logits are dot products with the embeddings.
        self.output_projection = OutputProjection(d_model, tgt_vocab_size, bias=False)
        if share_embeddings or tie_output:
            self.output_projection.weight = tgt_token.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0.0, std=d_model**-0.5)

    # ------------------------------------------------------------------ forward passes
    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits.

        Args:
            src: ``(B, S)`` source ids, right-padded with ``pad_id``.
            tgt_in: ``(B, T)`` target ids shifted right (bos first), right-padded.

        Returns:
            ``(B, T, V)`` logits; position ``t`` predicts target token ``t + 1``.
        """
        return self.output_projection(self.decoder_states(src, tgt_in))

    def decoder_states(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced decoder outputs ``(B, T, E)``, before the output projection.

        :meth:`forward` projects them to logits. Training feeds them to
        :func:`multihead.training.loss.linear_cross_entropy` instead, which projects a
        chunk of positions at a time and never holds all ``(B, T, V)`` logits.
        """
        memory, src_pad_mask = self.encode(src)
        return self._decoder_states(tgt_in, memory, src_pad_mask)

    def encode(
        self, src: Tensor, maps: list[dict[str, Tensor]] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Encode ``src`` ``(B, S)``.

        Args:
            src: ``(B, S)`` source ids, right-padded with ``pad_id``.
            maps: if given, one dict per layer with its self-attention weights is appended.

        Returns:
            ``(memory, src_pad_mask)``: ``(B, S, E)`` and ``(B, S)`` bool, True = padding.
        """
        if src.dim() != 2:
            raise ValueError(f"src must be (B, S) token ids, got shape {tuple(src.shape)}")
        src_pad_mask = src.eq(self.pad_id)  # (B, S)
        x = self.encoder_embedding(src)  # (B, S, E)
        for layer in self.encoder_layers:
            layer_maps = None if maps is None else {}
            x = layer(x, src_pad_mask, layer_maps)
            if maps is not None:
                maps.append(layer_maps)
        return self.encoder_norm(x), src_pad_mask

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_pad_mask: Tensor,
        caches: DecoderCache | FullPrefix | None = None,
        start_pos: int | None = None,
        maps: list[dict[str, Tensor]] | None = None,
    ) -> Tensor:
        """Decoder logits for ``tgt_in``, optionally one step of incremental decoding.

        Args:
            tgt_in: ``(B, T)`` target ids. With ``caches``, only the new positions.
            memory: ``(N, S, E)`` from :meth:`encode`, ``N`` dividing ``B``: rows
                ``i*k .. i*k + k-1`` of ``tgt_in`` (``k = B / N``, e.g. the beams of one
                sentence) all read memory row ``i``. With ``caches`` it is projected into
                the cross-attention caches on the first call and only checked afterwards.
            src_pad_mask: ``(N, S)`` bool, True = padding.
            caches: a :class:`DecoderCache` from :meth:`make_decoder_cache`, updated in place;
                or its :class:`FullPrefix`, to which ``tgt_in`` is appended and whose whole
                prefix is run (``maps`` then has its every position).
            start_pos: position of ``tgt_in[:, 0]``. Defaults to the positions already in
                ``caches`` (0 without caches); an explicit value must agree with them.
            maps: if given, one dict per layer with its ``"self"`` and ``"cross"`` attention
                weights is appended.

        Returns:
            ``(B, T, V)`` logits. The output projection, the largest matmul when decoding,
            only runs on the positions fed, so an incremental step costs ``(B, 1, V)``.
        """
        if isinstance(caches, FullPrefix):  # a design that refuses the cache: the full pass
            if start_pos is not None and start_pos != caches.position:
                raise ValueError(
                    f"start_pos={start_pos} disagrees with the {caches.position} positions fed"
                )
            T = tgt_in.shape[1]
            prefix = caches.extend(tgt_in)  # (B, t + T)
            states = self._decoder_states(prefix, memory, src_pad_mask, maps=maps)[:, -T:]
        else:
            states = self._decoder_states(tgt_in, memory, src_pad_mask, caches, start_pos, maps)
        return self.output_projection(states)  # (B, T, V)

    def _decoder_states(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_pad_mask: Tensor,
        caches: DecoderCache | None = None,
        start_pos: int | None = None,
        maps: list[dict[str, Tensor]] | None = None,
    ) -> Tensor:
        """:meth:`decode` without the output projection: ``(B, T, E)``."""
        if tgt_in.dim() != 2:
            raise ValueError(f"tgt_in must be (B, T) token ids, got shape {tuple(tgt_in.shape)}")
        cached = 0 if caches is None else caches.position
        if start_pos is None:
            start_pos = cached
        elif caches is not None and start_pos != cached:
            raise ValueError(
                f"start_pos={start_pos} disagrees with the {cached} positions in the caches"
            )
        if memory.dim() != 3 or tgt_in.shape[0] % memory.shape[0] != 0:
            raise ValueError(
                f"memory must be (N, S, E) with N dividing the {tgt_in.shape[0]} rows of "
                f"tgt_in, got shape {tuple(memory.shape)}"
            )
        if caches is None and start_pos and self.decoder_embedding.positional is None:
            raise ValueError(
                f"start_pos={start_pos} without caches: the attention layers' positions (rope, "
                "alibi) are taken from the caches; decode incrementally with make_decoder_cache"
            )
        x = self.decoder_embedding(tgt_in, start_pos)  # (B, T, E)
        for i, layer in enumerate(self.decoder_layers):
            self_cache = None if caches is None else caches.self_caches[i]
            cross_cache = None if caches is None else caches.cross_caches[i]
            layer_maps = None if maps is None else {}
            x = layer(x, memory, src_pad_mask, self_cache, cross_cache, layer_maps)
            if maps is not None:
                maps.append(layer_maps)
        return self.decoder_norm(x)  # (B, T, E)

    def make_decoder_cache(
        self,
        batch_size: int,
        max_tgt_len: int,
        src_len: int,
        *,
        num_sentences: int | None = None,
    ) -> DecoderCache | FullPrefix:
        """Empty caches to decode ``batch_size`` rows; a :class:`FullPrefix` instead when a
        decoder self-attention design refuses the KV cache (said once in the log).

        Args:
            batch_size: rows decoded together (sentences times beams).
            max_tgt_len: the most target positions that will be fed, bos included.
            src_len: ``S``, the memory length.
            num_sentences: ``N``, the rows of the memory (see :meth:`decode`); defaults to
                ``batch_size``.
        """
        refusing = self.cache_refused_by
        if refusing:
            if not self._said_full_prefix:
                self._said_full_prefix = True
                log.info(
                    "decoding recomputes the full prefix at each step: head design %s refuses "
                    "the KV cache in the decoder self-attention",
                    ", ".join(repr(name) for name in refusing),
                )
            return FullPrefix(batch_size)
        layers = self.decoder_layers
        num_sentences = batch_size if num_sentences is None else num_sentences
        return DecoderCache(
            [layer.self_attn.make_kv_cache(batch_size, max_tgt_len) for layer in layers],
            [layer.cross_attn.make_kv_cache(num_sentences, src_len) for layer in layers],
        )

    @property
    def cache_refused_by(self) -> list[str]:
        """The names of the decoder self-attention designs that refuse the KV cache
        (:attr:`~multihead.attention.HeadDesign.refuses_kv_cache`); ``[]``: it decodes
        with one."""
        designs = [layer.self_attn.design for layer in self.decoder_layers]
        names = [d.name for d in designs if d is not None and d.refuses_kv_cache]
        return list(dict.fromkeys(names))

    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> dict[str, list[Tensor]]:
        """Attention weights of every layer, from the ``math`` path, for diagnostics.

        Call it under ``torch.no_grad()`` in eval mode (attention dropout would otherwise
        apply to the weights as in training).

        Returns:
            ``{"encoder_self": [(B, H, S, S)] * num_encoder_layers,
            "decoder_self": [(B, H, T, T)] * num_decoder_layers,
            "cross": [(B, H, T, S)] * num_decoder_layers}``.
        """
        encoder_maps: list[dict[str, Tensor]] = []
        decoder_maps: list[dict[str, Tensor]] = []
        memory, src_pad_mask = self.encode(src, encoder_maps)
        self.decode(tgt_in, memory, src_pad_mask, maps=decoder_maps)
        return {
            "encoder_self": [m["self"] for m in encoder_maps],
            "decoder_self": [m["self"] for m in decoder_maps],
            "cross": [m["cross"] for m in decoder_maps],
        }

    def aux_loss(self) -> Tensor | None:
        """The sum of the sparse attention layers' load-balancing losses, or ``None``.

        Each :class:`~multihead.attention.MultiHeadAttention` with ``top_k_heads`` sets its
        ``aux_loss`` on every training-mode forward pass; this sums them over the layers
        (as the Switch Transformer does), for the training loss to add with a small weight.
        ``None`` when no layer is sparse, or after an eval-mode pass.
        """
        losses = [
            attn.aux_loss
            for _, _, _, attn in self.attention_sublayers()
            if attn.aux_loss is not None
        ]
        return torch.stack(losses).sum() if losses else None

    # ------------------------------------------------------------------ summaries
    def num_parameters(self) -> int:
        """Trainable and frozen parameters, tied matrices counted once."""
        return sum(p.numel() for p in self.parameters())

    def attention_parameters(self) -> int:
        """Parameters of the attention sublayers (projections and biases)."""
        return sum(p.numel() for *_, attn in self.attention_sublayers() for p in attn.parameters())

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """K/V cache bytes per decoded target token and sentence, all decoder layers.

        Only the decoder self-attention caches grow with the target; the cross-attention
        cache holds one entry per *source* token, see
        :meth:`cross_kv_cache_bytes_per_source_token`.
        """
        return sum(layer.self_attn.kv_cache_bytes_per_token(dtype) for layer in self.decoder_layers)

    def cross_kv_cache_bytes_per_source_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Cross-attention K/V cache bytes per source token and sentence, all layers."""
        return sum(
            layer.cross_attn.kv_cache_bytes_per_token(dtype) for layer in self.decoder_layers
        )

    def attention_sublayers(self) -> Iterator[tuple[str, int, str, MultiHeadAttention]]:
        """``(sublayer, layer index, module path, layer)`` of every attention sublayer.

        Sublayers come in :data:`ATTENTION_SUBLAYERS` order; the module path works with
        ``get_submodule`` / ``set_submodule``.
        """
        paths = {
            "encoder_self_attention": ("encoder_layers", "self_attn"),
            "decoder_self_attention": ("decoder_layers", "self_attn"),
            "cross_attention": ("decoder_layers", "cross_attn"),
        }
        for sublayer, (stack, name) in paths.items():
            for i in range(len(getattr(self, stack))):
                path = f"{stack}.{i}.{name}"
                yield sublayer, i, path, self.get_submodule(path)

    @property
    def head_config(self) -> dict[str, dict[str, Any]]:
        """Which heads each sublayer has, read from all its layers.

        Returns:
            ``{sublayer: {**layer.head_config, "backend": name, "tag": layer.head_tag,
            "active_head_fraction": f}}`` for the three of :data:`ATTENTION_SUBLAYERS`,
            with the layer's :attr:`~multihead.attention.MultiHeadAttention.head_config`
            (``kind``, ``num_heads``, ``num_kv_heads`` and the head design's arguments)
            and :attr:`~multihead.attention.MultiHeadAttention.head_tag` (e.g. ``"gqa8kv2"``),
            plus ``backend_reroute``, the rule in words, for a backend that hands some
            inputs to another (:func:`~multihead.attention.backend_rules`). A value the
            layers of a sublayer do not share (after per-layer pruning) is theirs in layer
            order, joined by ``+`` (e.g. ``num_heads: "4+3"``, ``tag: "mha4+mha3"``).
        """
        layers: dict[str, list[dict[str, Any]]] = {}
        for sublayer, _, _, attn in self.attention_sublayers():
            reroute = BACKENDS[attn.backend].reroute
            layers.setdefault(sublayer, []).append(
                {
                    **attn.head_config,
                    "backend": attn.backend,
                    "tag": attn.head_tag,
                    "active_head_fraction": attn.active_head_fraction,
                    **({} if reroute is None else {"backend_reroute": reroute.why}),
                }
            )
        return {sublayer: _shared_or_joined(configs) for sublayer, configs in layers.items()}

    @property
    def head_tag(self) -> str:
        """A short run-name fragment, e.g. ``enc-mha8_dec-gqa8kv2_cross-mha8_sdpa``: each
        sublayer's layer tag (a head design follows its heads, e.g. ``enc-mha8-moh-k2s1``),
        the FFN's width of a parameter-matched control (``ffn288``), then the backends."""
        config = self.head_config
        shorts = ("enc", "dec", "cross")
        parts = [f"{short}-{c['tag']}" for short, c in zip(shorts, config.values(), strict=True)]
        parts += [] if self.match_parameters is None else [f"ffn{self.ffn_dim}"]
        backends = sorted({c["backend"] for c in config.values()})
        return "_".join(parts + ["-".join(backends)])


def _shared_or_joined(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """One description of several layers: each value they share, else their values in
    layer order joined by ``+``."""
    merged = {}
    for key in dict.fromkeys(key for config in configs for key in config):
        values = [config.get(key) for config in configs]
        same = all(value == values[0] for value in values)
        merged[key] = values[0] if same else "+".join(str(value) for value in values)
    return merged
