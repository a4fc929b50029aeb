"""A decoder-only language model whose every attention layer is a
:class:`~multihead.attention.MultiHeadAttention`: the long-context comparison's model.

The designs compared differ in the ``attention`` mapping alone (MHA, GQA, MQA, MLA through
``num_kv_heads`` and ``design``); everything else is one family: token embedding tied to the
output, pre-LN blocks of causal self-attention and a GELU FFN (the Transformer's own
:class:`~multihead.model.transformer._ResidualLayer`, without cross-attention), a final
LayerNorm, rotary positions inside the attention layers. The file reads top to bottom: the
block, the model, its summaries.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from multihead.attention import BACKENDS, DesignBackendError, KVCache, MultiHeadAttention
from multihead.model.embedding import TransformerEmbedding, make_token_embedding
from multihead.model.transformer import (
    OutputProjection,
    _attention_config,
    _layer_arguments,
    _ResidualLayer,
    _shared_or_joined,
)

SUBLAYER = (
    "decoder_self_attention"  # the one kind of attention sublayer, named as the Transformer's
)


class DecoderBlock(_ResidualLayer):
    """Causal self-attention then FFN, each ``x + dropout(f(LN(x)))`` (pre-LN)."""

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        """``x`` ``(B, T, E)`` (with ``cache``: the new positions only); returns ``(B, T, E)``."""
        h = self.self_attn(self.self_attn_norm(x), is_causal=True, kv_cache=cache)
        x = x + self.dropout(h)
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


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
        pad_id: the embedding's zero row.
        attention: keyword arguments of :class:`~multihead.attention.MultiHeadAttention` as
            the Transformer takes them (``num_heads``, ``num_kv_heads``, ``design`` and
            ``design_options``, ``backend``, ...). Rotary positions: ``rotary_dim`` (the
            head width unless given; with ``design="mla"`` it is the decoupled rotary key).
        decoder_self_attention: keys that override ``attention`` (``None`` values inherit),
            as the Transformer's section of that name: the attention presets' form.

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
        pad_id: int = 0,
        attention: Mapping[str, Any] | None = None,
        decoder_self_attention: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "d_model": d_model,
            "ffn_dim": ffn_dim,
            "num_layers": num_layers,
            "max_positions": max_positions,
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
        self.blocks = nn.ModuleList(
            DecoderBlock(
                d_model,
                ffn_dim,
                layer,
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

    def states(self, input_ids: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """The last block's normalised outputs ``(B, T, E)``, before the output projection.

        With ``caches`` (from :meth:`make_cache`), ``input_ids`` are the new positions only,
        placed after those already cached.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T) token ids, got {tuple(input_ids.shape)}")
        if input_ids.is_floating_point():
            raise ValueError(f"input_ids must be token ids (long), got {input_ids.dtype}")
        start = 0 if caches is None else caches[0].size
        x = self.embedding(input_ids, start)  # (B, T, E)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.norm(x)  # (B, T, E)

    def forward(self, input_ids: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """Logits ``(B, T, V)`` for ``input_ids``; see :meth:`states`."""
        return self.output_projection(self.states(input_ids, caches))

    def make_cache(self, batch_size: int, max_len: int) -> list[KVCache]:
        """One empty :class:`KVCache` per block, for ``max_len`` positions of ``batch_size``."""
        return [block.self_attn.make_kv_cache(batch_size, max_len) for block in self.blocks]

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
        """A run-name fragment, e.g. ``lm-gqa8kv2_sdpa``."""
        config = self.head_config[SUBLAYER]
        return f"lm-{config['tag']}_{config['backend']}"
