"""Conversions of a layer's heads: from ``torch.nn.MultiheadAttention``, and to fewer K/V heads.

Each returns a new :class:`~multihead.attention.MultiHeadAttention` and leaves its input as
it was; :meth:`MultiHeadAttention.from_torch` and :meth:`MultiHeadAttention.with_kv_heads`
call them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.attention.layer import MultiHeadAttention


def from_torch(module: nn.MultiheadAttention, backend: str = "sdpa") -> MultiHeadAttention:
    """An equivalent layer with ``module``'s weights.

    The new layer is batch-first whatever ``module.batch_first`` says. Masks mean the
    same in both (bool True = masked out; float added), except that a 3-D
    ``attn_mask`` here broadcasts to ``(B, H, L, S)`` instead of being ``(B*H, L, S)``.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
    if not module._qkv_same_embed_dim:
        raise ValueError(
            f"from_torch needs kdim == vdim == embed_dim, got kdim={module.kdim}, "
            f"vdim={module.vdim}, embed_dim={module.embed_dim}"
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("from_torch does not support add_bias_kv or add_zero_attn")
    weight = module.in_proj_weight
    layer = MultiHeadAttention(
        module.embed_dim,
        module.num_heads,
        dropout=module.dropout,
        bias=module.in_proj_bias is not None,
        backend=backend,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        layer.in_proj.weight.copy_(weight)
        layer.out_proj.weight.copy_(module.out_proj.weight)
        if module.in_proj_bias is not None:
            layer.in_proj.bias.copy_(module.in_proj_bias)
            layer.out_proj.bias.copy_(module.out_proj.bias)
    return layer.train(module.training)


def pool_kv_heads(layer: MultiHeadAttention, num_kv_heads: int) -> MultiHeadAttention:
    """A copy of ``layer`` with fewer K/V heads, each the mean of the heads in its group.

    This is the checkpoint conversion of the GQA paper (Ainslie et al., 2023): the ``G``
    current K (and V) projection heads are split into ``num_kv_heads`` consecutive groups
    and each group is mean-pooled into one head. The head design (sparse heads, mixing) and
    its parameters are kept.
    """
    G, D, E = layer.num_kv_heads, layer.head_dim, layer.embed_dim
    if num_kv_heads <= 0 or G % num_kv_heads != 0:
        raise ValueError(
            f"cannot pool {G} K/V heads into {num_kv_heads}: num_kv_heads must divide {G}"
        )
    weight = layer.in_proj.weight
    new = MultiHeadAttention(
        E,
        layer.num_heads,
        num_kv_heads,
        dropout=layer.dropout,
        bias=layer.in_proj.bias is not None,
        backend=layer.backend,
        **({} if layer.design is None else layer.design.options),
        device=weight.device,
        dtype=weight.dtype,
    )

    def pool(t: Tensor) -> Tensor:  # (G*D, ...) -> (num_kv_heads*D, ...)
        grouped = t.reshape(num_kv_heads, G // num_kv_heads, D, *t.shape[1:])
        return grouped.mean(dim=1).reshape(num_kv_heads * D, *t.shape[1:])

    with torch.no_grad():
        for name in ("weight", "bias"):
            old = getattr(layer.in_proj, name)
            if old is None:
                continue
            q, k, v = old.split([E, G * D, G * D], dim=0)
            getattr(new.in_proj, name).copy_(torch.cat([q, pool(k), pool(v)], dim=0))
        new.out_proj.load_state_dict(layer.out_proj.state_dict())
        if layer.design is not None:
            new.design.load_state_dict(layer.design.state_dict())
    return new.train(layer.training)
