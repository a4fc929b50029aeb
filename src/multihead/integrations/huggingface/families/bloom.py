"""BLOOM: its per-head Q/K/V rows on the layer's stacked ``in_proj``, its ALiBi the layer's
own, and its call (the residual added inside the attention) in an adapter of its own."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from transformers.models.bloom.modeling_bloom import BloomAttention

from multihead.attention import MultiHeadAttention
from multihead.attention.alibi import ALiBi
from multihead.integrations.huggingface.adapter import (
    CacheLayer,
    HFAttentionAdapter,
    HFLayout,
    inverse,
    load_hf,
    renamed,
)
from multihead.integrations.huggingface.interface import layer_mask
from multihead.integrations.huggingface.registry import register_family


class _BloomCacheLayer(CacheLayer):
    """HF's cache for a layer with ALiBi: each key at its index in the cache (static: in
    the whole buffer), the query positions after the cached ones. Only distances enter
    ALiBi, and a left-padded row's tokens are as far apart by index as by BLOOM's positions."""

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None):
        k, v = self.cache.update(k, v, self.layer_idx)
        self.keys = k  # (B, H, S, D): S keys, of which HF's mask hides the unwritten
        return k, v

    def key_positions(self) -> Tensor:
        return torch.arange(self.keys.shape[2], device=self.keys.device)  # (S,)


class BloomAttentionAdapter(HFAttentionAdapter):
    """BLOOM's attention call around a :class:`MultiHeadAttention` with ALiBi.

    ``forward(hidden_states, residual, alibi, attention_mask, layer_past=None, **kwargs) ->
    (residual + dropout(output), None)``, as ``BloomBlock`` calls it: BLOOM adds the residual
    inside its attention (``dropout_add`` with ``hidden_dropout``). ``alibi`` (HF's bias,
    ``m_h`` times each key's position) is ignored: the layer's own ALiBi part adds
    ``-m_h |i - j|``, which differs from it by one constant per query row, cancelled by
    softmax. BLOOM does not dispatch through ``AttentionInterface``, so its model always
    builds HF's eager mask, additive (0 where a query attends, the dtype's minimum where
    not); the adapter reads it as a bool mask, so rows of padding come out as zeros.
    """

    reads_named_mask = False  # the swap leaves BLOOM's implementation name as it is

    def forward(
        self, hidden_states: Tensor, residual: Tensor, alibi: Tensor | None = None,
        attention_mask: Tensor | None = None, layer_past=None, **kwargs,
    ) -> tuple[Tensor, None]:  # fmt: skip
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0  # HF's convention: True = attend
        out = self.attn(
            hidden_states,
            attn_mask=layer_mask(attention_mask),
            is_causal=attention_mask is None,
            kv_cache=None if layer_past is None else _BloomCacheLayer(layer_past, self.layer_idx),
        )
        return residual + self.resid_dropout(out), None


def from_bloom(module: BloomAttention, backend: str) -> BloomAttentionAdapter:
    """BLOOM's attention as an adapter with the same weights.

    ``query_key_value`` ``(3E, E)`` holds each head's q, k and v rows together (head ``h``:
    rows ``3hD .. 3hD + 3D``, q then k then v); the layer's ``in_proj`` stacks all the q rows,
    then the k rows, then the v rows. ``dense`` is ``out_proj``. BLOOM's tensor-parallel
    ``slow_but_exact`` path (``pretraining_tp > 1``) leaves out ``dense``'s bias: refused.
    """
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise ValueError(
            f"slow_but_exact=True with pretraining_tp={module.pretraining_tp} (BLOOM's sliced "
            "output projection without its bias) is not supported"
        )
    E, H = module.hidden_size, module.num_heads
    weight = module.query_key_value.weight
    attn = MultiHeadAttention(
        E, H, dropout=module.attention_dropout.p, backend=backend, positions=ALiBi(H),
        device=weight.device, dtype=weight.dtype,
    )  # fmt: skip
    layout = HFLayout.of(module, partial(_bloom_to_hf, heads=H), partial(_bloom_from_hf, heads=H))
    adapter = BloomAttentionAdapter(
        attn, layer_idx=module.layer_idx, resid_dropout=nn.Dropout(module.hidden_dropout),
        layout=layout,
    )  # fmt: skip
    load_hf(adapter, module)
    return adapter.train(module.training)


_BLOOM = {"attn.in_proj.": "query_key_value.", "attn.out_proj.": "dense."}


def _bloom_to_hf(own: dict[str, Tensor], heads: int) -> dict[str, Tensor]:
    """The layer's stacked rows (all q, all k, all v) as BLOOM's (each head's q, k, v)."""
    theirs = renamed(own, _BLOOM)
    for name in ("query_key_value.weight", "query_key_value.bias"):
        theirs[name] = theirs[name].unflatten(0, (3, heads, -1)).transpose(0, 1).flatten(0, 2)
    return theirs


def _bloom_from_hf(theirs: dict[str, Tensor], heads: int) -> dict[str, Tensor]:
    own = renamed(theirs, inverse(_BLOOM))
    for name in ("attn.in_proj.weight", "attn.in_proj.bias"):
        own[name] = own[name].unflatten(0, (heads, 3, -1)).transpose(0, 1).flatten(0, 2)
    return own


register_family(BloomAttention, convert=from_bloom)
