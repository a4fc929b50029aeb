"""The textbook steps of attention, and what a head design is.

:meth:`MultiHeadAttention.forward <multihead.attention.MultiHeadAttention.forward>` is four
steps, each a public function here that the layer and every head design call::

    q, k, v = project(layer, query, key_value, kv_cache)     # (B, H, L, D), (B, G, S, D)
    mask = make_mask(layer, q, k, kv_cache, **masks)
    heads, weights = attend(layer, q, k, v, mask, need_weights)     # (B, H, L, D)
    out = layer.out_proj(merge_heads(heads))                   # (B, L, E)

A head design (:class:`HeadDesign`) runs these steps in the layer's one hook, with its own
in place of those it changes. A positional part (:class:`PositionalPart`, e.g. rotary
embeddings) is applied by :func:`project` to Q and K, before K is cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.attention.backends import BACKENDS, check_backend, math_attention_with_weights
from multihead.attention.kv_cache import CacheLayout, KVCache
from multihead.attention.masks import AttentionMask, build_attention_mask

if TYPE_CHECKING:
    from multihead.attention.layer import MultiHeadAttention


# --------------------------------------------------------------------------- the interface
class PositionalPart(Protocol):
    """A position encoding of queries ``(B, H, L, D)`` or new keys ``(B, G, L, D)`` at
    ``positions`` ``(L,)`` or ``(B, L)``, applied after the projection, before keys are
    cached (the layer's ``positions``: none by default; rotary embeddings,
    :class:`~multihead.attention.rotary.RotaryPositions`)."""

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor: ...


def new_positions(
    kv_cache: KVCache | None, length: int, device: torch.device, position_ids: Tensor | None
) -> Tensor:
    """The positions of ``length`` new tokens: ``position_ids`` ``(L,)`` or ``(B, L)`` if
    given (a left-padded batch), else those after the positions in ``kv_cache``."""
    if position_ids is not None:
        return position_ids
    start = 0 if kv_cache is None else kv_cache.position if kv_cache.static else kv_cache.size
    return start + torch.arange(length, device=device)  # (L,)


class HeadDesign:
    """What a head design is: an ``nn.Module`` subclassing this that owns its parameters,
    checks, tag and computation; the defaults here are a layer's without a design.

    Attributes:
        name: the design's name (``"moh"``, ``"talking_heads"``, ``"mla"``, ...).
        attribute: where the layer holds it: the prefix of its state_dict keys.
        kind: ``head_config["kind"]`` if not the layer's (mha, gqa, mqa): MLA's ``"mla"``.
        aux_loss: an auxiliary loss of the last training-mode call, or ``None``.
        positions: a positional part of the design's own (MLA's decoupled rotary key), or
            ``None``; the layer's ``positions`` is for the designs that use :func:`project`.
    """

    name: ClassVar[str] = ""
    attribute: ClassVar[str] = ""
    kind: ClassVar[str | None] = None
    aux_loss: Tensor | None = None
    positions: PositionalPart | None = None

    @property
    def options(self) -> dict[str, object]:
        """The layer's constructor arguments that build this part."""
        return {}

    @property
    def tag(self) -> str:
        """The part of the layer's :attr:`~MultiHeadAttention.head_tag` it adds."""
        return f"-{self.name}" if self.name else ""

    @property
    def active_head_fraction(self) -> float:
        """The fraction of the ``H`` heads computed for each token."""
        return 1.0

    def cache_layout(self, layer: MultiHeadAttention) -> CacheLayout:
        """What the layer's KV cache holds per position."""
        return CacheLayout(layer.num_kv_heads, layer.head_dim, shared_kv=False)

    def attention(
        self, layer: MultiHeadAttention, query: Tensor, key_value: Tensor | None, *,
        kv_cache: KVCache | None = None, need_weights: bool = False,
        head_mask: Tensor | None = None, position_ids: Tensor | None = None, **masks,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """The layer's forward with this design: the arguments and result of
        :meth:`MultiHeadAttention.forward` (``key_value`` ``None`` for self-attention);
        ``masks``, its ``key_padding_mask``, ``attn_mask`` and ``is_causal``, go to
        :func:`make_mask`; ``position_ids`` to the projection steps."""
        raise NotImplementedError


# --------------------------------------------------------------------------- the steps
def project(
    layer: MultiHeadAttention, query: Tensor, key_value: Tensor | None, kv_cache: KVCache | None,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Step 1: Q ``(B, H, L, D)`` of ``query``, and K, V ``(B, G, S, D)`` of ``key_value``
    (``None``: of ``query``), the cached positions included. Self-attention places Q and
    the new K at their positions (:func:`new_positions`) if the layer has a positional part."""
    B, L, _ = query.shape
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if key_value is not None:
        return project_queries(layer, query), *project_kv(layer, key_value, kv_cache, cross=True)
    # Self-attention: Q, K and V from one GEMM, then split (views, no copies).
    q, k, v = layer.in_proj(query).split([H * D, G * D, G * D], dim=-1)  # (B, L, ·)
    q = q.view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    k = k.view(B, L, G, D).transpose(1, 2)  # (B, G, L, D)
    v = v.view(B, L, G, D).transpose(1, 2)  # (B, G, L, D)
    if layer.positions is not None:  # none by default
        # Before the cache: each key is placed once, at its own position.
        positions = new_positions(kv_cache, L, query.device, position_ids)
        q, k = layer.positions(q, positions), layer.positions(k, positions)
    return (q, k, v) if kv_cache is None else (q, *kv_cache.update(k, v))


def project_queries(
    layer: MultiHeadAttention, query: Tensor, heads: int | None = None,
    positions: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Q ``(B, h, L, D)`` of the first ``heads`` query heads (``None``: all ``H``), placed at
    ``positions`` by the layer's positional part when given (self-attention)."""
    B, L, _ = query.shape
    h = layer.num_heads if heads is None else heads
    w, b = layer.in_proj.weight[: h * layer.head_dim], layer.in_proj.bias
    q = F.linear(query, w, None if b is None else b[: h * layer.head_dim])  # (B, L, h*D)
    q = q.view(B, L, h, layer.head_dim).transpose(1, 2)  # (B, h, L, D)
    return q if positions is None else layer.positions(q, positions)


def project_kv(
    layer: MultiHeadAttention, source: Tensor, kv_cache: KVCache | None, *, cross: bool,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """K and V ``(B, G, S, D)`` of ``source`` alone, through ``kv_cache`` if given: self-
    attention appends the new positions (K placed at ``positions`` first, when given);
    cross-attention stores the memory at the first step and reads it back at every later
    one, unprojected."""
    if cross and kv_cache is not None and kv_cache.size > 0:
        return kv_cache.get()
    B, G, D = source.shape[0], layer.num_kv_heads, layer.head_dim
    HD = layer.num_heads * D  # E, or less in a layer with pruned heads
    w, b = layer.in_proj.weight, layer.in_proj.bias
    k, v = F.linear(source, w[HD:], None if b is None else b[HD:]).split([G * D, G * D], -1)
    k = k.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
    v = v.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
    if positions is not None:
        k = layer.positions(k, positions)
    return (k, v) if kv_cache is None else kv_cache.update(k, v)


def make_mask(
    layer: MultiHeadAttention, q: Tensor, k: Tensor, kv_cache: KVCache | None = None, *,
    key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
    is_causal: bool = False,
) -> AttentionMask:  # fmt: skip
    """Step 2: the caller's masks for queries ``q`` ``(B, ·, L, ·)`` and keys ``k``
    ``(B, ·, S, ·)``, in the kernels' form (:func:`~.masks.build_attention_mask`).

    With a static ``kv_cache`` the keys are its whole buffers: the positions it hides
    (:meth:`KVCache.hide_unwritten`) join ``attn_mask``, causality included.
    """
    if kv_cache is not None and kv_cache.static:
        attn_mask, is_causal = kv_cache.hide_unwritten(attn_mask, q.shape[2], is_causal)
    return build_attention_mask(
        key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
        batch_size=q.shape[0], num_heads=layer.num_heads, q_len=q.shape[2], kv_len=k.shape[2],
        dtype=q.dtype, device=q.device,
    )  # fmt: skip


def attend(
    layer: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask,
    need_weights: bool, scale: float | None = None, **hooks,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Step 3: softmax(QK^T)V ``(B, H, L, D)`` by the layer's backend, or by the math path
    with the weights ``(B, H, L, S)`` when they are asked for or ``hooks``
    (``on_logits``, ``on_weights`` of :func:`~.backends.math_attention_with_weights`) are
    given. Query rows with no key to attend to come out as zeros. ``scale``: the layer's
    ``1/sqrt(D)`` unless a design's scores are wider (MLA's decoupled rotary key)."""
    dropout_p = layer.dropout if layer.training else 0.0
    scale = layer.scale if scale is None else scale
    weights = None
    if need_weights or hooks:
        out, weights = math_attention_with_weights(q, k, v, mask, dropout_p, scale, **hooks)
    else:
        if torch.compiler.is_compiling():
            # Checked while tracing (Python only); adding to the checked set would fail the
            # compiled code's guard on it and recompile the next call.
            check_backend(layer.backend, q.device, q.dtype, head_dim=layer.head_dim)
        elif (q.device, q.dtype) not in layer.checked_backends:
            check_backend(layer.backend, q.device, q.dtype, head_dim=layer.head_dim)
            layer.checked_backends.add((q.device, q.dtype))
        out = BACKENDS[layer.backend](q, k, v, mask, dropout_p, scale)
    if mask.empty_rows is not None:
        # Rows with no key to attend to: zeros, not the mean of unmasked values.
        out = out.masked_fill(mask.empty_rows, 0.0)
        if weights is not None:
            weights = weights.masked_fill(mask.empty_rows, 0.0)
    return out, weights


def merge_heads(heads: Tensor) -> Tensor:
    """Step 4's input: heads ``(B, H, L, D)`` concatenated, ``(B, L, H*D)``."""
    B, H, L, D = heads.shape
    return heads.transpose(1, 2).reshape(B, L, H * D)


# --------------------------------------------------------------------------- head_mask
def check_head_mask(head_mask: Tensor | None, num_heads: int) -> Tensor | None:
    """``head_mask`` if it is ``None`` or a ``(H,)`` tensor, else ValueError."""
    if head_mask is None:
        return None
    if not isinstance(head_mask, Tensor) or tuple(head_mask.shape) != (num_heads,):
        got = tuple(head_mask.shape) if isinstance(head_mask, Tensor) else repr(head_mask)
        raise ValueError(f"head_mask must be a tensor of shape ({num_heads},), got {got}")
    return head_mask


def scale_heads(heads: Tensor, head_mask: Tensor | None) -> Tensor:
    """``heads`` ``(B, H, L, ·)`` each scaled by its entry of ``head_mask`` ``(H,)``
    (Michel et al., NeurIPS 2019: 0 removes a head; a ones tensor that requires grad gives
    each head's importance as the gradient of the loss with respect to it)."""
    if head_mask is None:
        return heads
    return heads * head_mask.to(heads.dtype).view(1, -1, 1, 1)
