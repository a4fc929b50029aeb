"""A decoder-only language model whose every attention layer is a
:class:`~multihead.attention.MultiHeadAttention`: the long-context comparison's model.

The designs compared differ in the ``attention`` mapping alone (MHA, GQA, MQA, MLA through
``num_kv_heads`` and ``design``); everything else is one family: token embedding tied to the
output, pre-LN blocks of a short causal convolution, causal self-attention and a GELU FFN
(the Transformer's own :class:`~multihead.model.transformer._ResidualLayer`, without
cross-attention, with the convolution in front), a final LayerNorm, rotary positions inside
the attention layers. The file reads top to bottom: the convolution, the block, the cache,
the model, its summaries.

Why the convolution: a lookup of "the token after the last ``k``" needs each position to
carry its predecessor. Without one, a layer must first learn to copy it by attention (the
previous-token head of an induction circuit), which a small model trained for minutes does
not: at 400 updates MHA's loss at positions >= 1,024 was 0.8% below its loss at < 64, and on
MQAR it picked a random in-context value (docs/long_context.md, the log). Zoology's attention
models put a short convolution (its ``BaseConv``, kernel 3) beside attention for the same
reason; it is the same in every design, so the comparison still differs in attention alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import BACKENDS, DesignBackendError, KVCache, MultiHeadAttention
from multihead.model.embedding import TransformerEmbedding, make_token_embedding
from multihead.model.transformer import (
    OutputProjection,
    _attention_config,
    _layer_arguments,
    _ResidualLayer,
    _shared_or_joined,
    check_match,
    matched_ffn_dim,
)

SUBLAYER = (
    "decoder_self_attention"  # the one kind of attention sublayer, named as the Transformer's
)


class ShortConv(nn.Module):
    """A depthwise causal convolution: output ``t`` mixes inputs ``t - K + 1 .. t`` per feature.

    ``past`` holds the ``K - 1`` inputs before ``x`` (zeros before the sequence's start), so
    decoding one position at a time equals the full pass.
    """

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model)

    def forward(self, x: Tensor, past: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``x`` ``(B, T, E)``, ``past`` ``(B, K-1, E)`` or ``None``; returns the output
        ``(B, T, E)`` and the ``past`` of the next call."""
        B, T, E = x.shape
        if past is None:
            past = x.new_zeros(B, self.kernel_size - 1, E)
        full = torch.cat([past, x], dim=1)  # (B, K-1+T, E)
        out = F.conv1d(full.transpose(1, 2), self.conv.weight, self.conv.bias, groups=E)
        return out.transpose(1, 2), full[:, full.size(1) - (self.kernel_size - 1) :]  # (B, T, E)


class DecoderBlock(_ResidualLayer):
    """Short convolution, causal self-attention, FFN, each ``x + dropout(f(LN(x)))`` (pre-LN)."""

    def __init__(self, d_model: int, ffn_dim: int, attention: Mapping[str, Any], *,
                 conv_kernel: int, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(d_model, ffn_dim, attention, **kwargs)
        self.conv_norm = nn.LayerNorm(d_model)
        self.conv = ShortConv(d_model, conv_kernel)

    def forward(
        self, x: Tensor, cache: KVCache | None = None, past: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``x`` ``(B, T, E)`` (with ``cache``: the new positions only); returns ``(B, T, E)``
        and the convolution's ``past`` for the next positions."""
        h, past = self.conv(self.conv_norm(x), past)
        x = x + self.dropout(h)
        h = self.self_attn(self.self_attn_norm(x), is_causal=True, kv_cache=cache)
        x = x + self.dropout(h)
        return x + self.dropout(self.ffn(self.ffn_norm(x))), past


@dataclass
class LMCache:
    """What decoding keeps per block: the attention's :class:`KVCache` and the convolution's
    last ``K - 1`` inputs (``None`` before the first call)."""

    kv: list[KVCache]
    conv: list[Tensor | None]

    @property
    def size(self) -> int:
        """Positions cached."""
        return self.kv[0].size


class DecoderLM(nn.Module):
    """A causal LM: ``logits = W_E^T LN(blocks(embed(ids)))``.

    Args:
        vocab_size: token ids, special tokens included.
        d_model: ``E``.
        ffn_dim: the FFN's inner width.
        num_layers: blocks.
        max_positions: the longest sequence, prompt and decoded tokens together.
        dropout: on the embeddings and each sublayer's output.
        activation: the FFN's, ``"gelu"`` or ``"relu"``.
        conv_kernel: the short convolution's width ``K`` (Zoology's: 3).
        pad_id: the embedding's zero row.
        attention: keyword arguments of :class:`~multihead.attention.MultiHeadAttention` as
            the Transformer takes them (``num_heads``, ``num_kv_heads``, ``design`` and
            ``design_options``, ``backend``, ...). Rotary positions: ``rotary_dim`` (the
            head width unless given; with ``design="mla"`` it is the decoupled rotary key).
        decoder_self_attention: keys that override ``attention`` (``None`` values inherit),
            as the Transformer's section of that name: the attention presets' form.
        match_parameters: ``"mha"``: a parameter-matched control, the FFN's width set so that
            the model has the parameters of the same model with MHA (Llama 2's ablation;
            :func:`~multihead.model.transformer.matched_ffn_dim`; ``ffn_dim`` is then MHA's
            width, and the width built is in :attr:`head_tag`); ``None``: ``ffn_dim``.

    Shapes:
        input_ids ``(B, T)`` long; logits ``(B, T, V)``, position ``t`` predicting ``t + 1``.

    Example:
        >>> lm = DecoderLM(vocab_size=50, d_model=32, ffn_dim=64, num_layers=2,
        ...     max_positions=16, attention={"num_heads": 4, "num_kv_heads": 1})
        >>> lm(torch.randint(1, 50, (2, 7))).shape
        torch.Size([2, 7, 50])
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        ffn_dim: int,
        num_layers: int,
        max_positions: int,
        dropout: float = 0.0,
        activation: str = "gelu",
        conv_kernel: int = 3,
        pad_id: int = 0,
        attention: Mapping[str, Any] | None = None,
        decoder_self_attention: Mapping[str, Any] | None = None,
        match_parameters: str | None = None,
    ) -> None:
        super().__init__()
        check_match(match_parameters)
        sizes = {
            "vocab_size": vocab_size,
            "d_model": d_model,
            "ffn_dim": ffn_dim,
            "num_layers": num_layers,
            "max_positions": max_positions,
            "conv_kernel": conv_kernel,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        config = _attention_config(SUBLAYER, attention, decoder_self_attention)
        if config["rotary_dim"] is None:  # rotary positions on every feature of a head
            config["rotary_dim"] = d_model // config["num_heads"]
        self.attention_config = {SUBLAYER: config}
        self.max_positions = max_positions
        token = make_token_embedding(vocab_size, d_model, pad_id)
        self.embedding = TransformerEmbedding(
            token, positional="rope", max_positions=max_positions, dropout=dropout
        )
        layer = _layer_arguments(config)
        try:  # a design that runs on one backend only: name the override that selects it
            MultiHeadAttention(d_model, **layer, device="meta")
        except DesignBackendError as err:
            raise ValueError(f"{err}; set attention.backend={err.backends[0]}") from None
        if match_parameters is not None:
            ffn_dim = matched_ffn_dim(d_model, ffn_dim, num_layers, [layer] * num_layers)
        self.ffn_dim, self.match_parameters = ffn_dim, match_parameters
        self.blocks = nn.ModuleList(
            DecoderBlock(
                d_model,
                ffn_dim,
                layer,
                conv_kernel=conv_kernel,
                activation=activation,
                norm_first=True,
                dropout=dropout,
                attention_dropout=0.0,
                activation_dropout=0.0,
            )  # fmt: skip
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.output_projection = OutputProjection(d_model, vocab_size, bias=False)
        self.output_projection.weight = token.weight  # tied: logits are dot products

    def states(self, input_ids: Tensor, caches: LMCache | None = None) -> Tensor:
        """The last block's normalised outputs ``(B, T, E)``, before the output projection.

        With ``caches`` (from :meth:`make_cache`, updated in place), ``input_ids`` are the new
        positions only, placed after those already cached.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T) token ids, got {tuple(input_ids.shape)}")
        if input_ids.is_floating_point():
            raise ValueError(f"input_ids must be token ids (long), got {input_ids.dtype}")
        start = 0 if caches is None else caches.size
        x = self.embedding(input_ids, start)  # (B, T, E)
        for i, block in enumerate(self.blocks):
            if caches is None:
                x, _ = block(x)
            else:
                x, caches.conv[i] = block(x, caches.kv[i], caches.conv[i])
        return self.norm(x)  # (B, T, E)

    def forward(self, input_ids: Tensor, caches: LMCache | None = None) -> Tensor:
        """Logits ``(B, T, V)`` for ``input_ids``; see :meth:`states`."""
        return self.output_projection(self.states(input_ids, caches))

    def make_cache(self, batch_size: int, max_len: int) -> LMCache:
        """An empty :class:`LMCache`, for ``max_len`` positions of ``batch_size``."""
        kv = [block.self_attn.make_kv_cache(batch_size, max_len) for block in self.blocks]
        return LMCache(kv, [None] * len(self.blocks))

    # ------------------------------------------------------------------ summaries
    def attention_sublayers(self) -> Iterator[tuple[str, int, str, MultiHeadAttention]]:
        """``(sublayer, block index, module path, layer)`` of every attention layer."""
        for i in range(len(self.blocks)):
            path = f"blocks.{i}.self_attn"
            yield SUBLAYER, i, path, self.get_submodule(path)

    def num_parameters(self) -> int:
        """All parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def attention_parameters(self) -> int:
        """Parameters of the attention layers."""
        return sum(p.numel() for *_, attn in self.attention_sublayers() for p in attn.parameters())

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """KV-cache bytes per decoded token and sequence, all blocks."""
        return sum(attn.kv_cache_bytes_per_token(dtype) for *_, attn in self.attention_sublayers())

    def aux_loss(self) -> Tensor | None:
        """The sparse layers' load-balancing losses summed, or ``None`` (dense designs)."""
        losses = [a.aux_loss for *_, a in self.attention_sublayers() if a.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    @property
    def head_config(self) -> dict[str, dict[str, Any]]:
        """``{"decoder_self_attention": ...}`` as :attr:`Transformer.head_config` gives it."""
        layers = [
            {
                **attn.head_config,
                "backend": attn.backend,
                "tag": attn.head_tag,
                "active_head_fraction": attn.active_head_fraction,
                **({} if reroute is None else {"backend_reroute": reroute.why}),
            }
            for *_, attn in self.attention_sublayers()
            for reroute in [BACKENDS[attn.backend].reroute]
        ]
        return {SUBLAYER: _shared_or_joined(layers)}

    @property
    def head_tag(self) -> str:
        """A run-name fragment, e.g. ``lm-gqa8kv2_sdpa``; a parameter-matched control's
        names its FFN's width, ``lm-gqa8kv2_ffn608_sdpa``."""
        config = self.head_config[SUBLAYER]
        ffn = "" if self.match_parameters is None else f"_ffn{self.ffn_dim}"
        return f"lm-{config['tag']}{ffn}_{config['backend']}"
