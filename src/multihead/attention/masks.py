"""The one place where user-facing masks become what the kernels consume.

At the API boundary every boolean mask means **True = masked out**, exactly as in
``torch.nn.MultiheadAttention``. Float masks are added to the attention scores. The
kernels (``F.scaled_dot_product_attention``, FlexAttention, the math path) want the
opposite boolean convention (True = attend), so the conversion happens here, once.

Two safety rules live here too:

* No large negative literal (``-1e9``) is ever used: masked scores are ``-inf``, which
  every float dtype represents, so fp16/bf16 autocast cannot overflow a mask.
* A query row whose keys are *all* masked would make softmax divide 0 by 0. Such rows are
  un-masked before the kernel runs (so forward and backward stay finite) and their output
  is zeroed afterwards (``AttentionMask.empty_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionMask:
    """A mask in kernel form, plus the raw facts some kernels need.

    Attributes:
        tensor: ``None``, a bool "keep" mask (True = attend) or a float additive bias,
            broadcastable to ``(B, H, L, S)``. Causal masking is folded in unless
            ``kernel_causal`` is set.
        kernel_causal: the kernel must apply its own built-in (top-left aligned,
            ``L == S``) causal mask, because ``tensor`` does not hold it; only set when no
            other mask is present.
        empty_rows: ``None`` or a bool tensor broadcastable to ``(B, H, L, 1)``, True for
            query rows that had no key left to attend to; their output must be zeroed.
        causal_requested: the caller asked for causal attention (bottom-right aligned when
            ``L < S``), whether or not ``tensor`` holds it. Kernels that take only a causal
            flag and a padding mask (flash-attn) read this instead of ``tensor``.
        key_padding_mask: the caller's ``(B, S)`` padding mask, True = padding.
        has_attn_mask: the caller passed an ``attn_mask`` (an arbitrary mask).
    """

    tensor: Tensor | None = None
    kernel_causal: bool = False
    empty_rows: Tensor | None = None
    causal_requested: bool = False
    key_padding_mask: Tensor | None = None
    has_attn_mask: bool = False


def build_attention_mask(
    *,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    batch_size: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionMask:
    """Validate the user's masks and merge them into one kernel-ready mask.

    Args:
        key_padding_mask, attn_mask: as for
            :meth:`~multihead.attention.MultiHeadAttention.forward`.
        is_causal: causal attention. When ``L < S`` (decoding with a KV cache) the
            queries are the *last* ``L`` positions, so query ``i`` sees keys ``<= S - L + i``.
        batch_size, num_heads, q_len, kv_len: the sizes ``B, H, L, S``.
        dtype: the dtype of the attention scores, used for float masks.
        device: where a materialised causal mask is built.

    Returns:
        An :class:`AttentionMask`.
    """
    target = (batch_size, num_heads, q_len, kv_len)
    if is_causal and q_len > kv_len:
        raise ValueError(f"is_causal needs q_len <= kv_len, got L={q_len}, S={kv_len}")

    keep: Tensor | None = None  # bool, True = attend
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}"
            )
        if tuple(key_padding_mask.shape) != (batch_size, kv_len):
            raise ValueError(
                f"key_padding_mask must have shape (B, S) = {(batch_size, kv_len)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, S)

    bias: Tensor | None = None  # float, added to the scores
    if attn_mask is not None:
        shape = tuple(attn_mask.shape)
        pairs = zip(shape[::-1], target[::-1], strict=False)  # aligned from the right
        if len(shape) > 4 or any(s not in (1, t) for s, t in pairs):
            raise ValueError(
                f"attn_mask of shape {shape} does not broadcast to (B, H, L, S) = {target}"
            )
        if attn_mask.dtype == torch.bool:
            keep = ~attn_mask if keep is None else keep & ~attn_mask
        elif attn_mask.is_floating_point():
            bias = attn_mask.to(dtype)
        else:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")

    kernel_causal = False
    if is_causal:
        if keep is None and bias is None and q_len == kv_len:
            # The kernels' own causal mask is free: nothing is materialised.
            kernel_causal = True
        elif q_len > 1:  # a single newest query sees every key: no mask needed
            rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
            causal_keep = torch.arange(kv_len, device=device)[None, :] <= rows  # (L, S)
            keep = causal_keep if keep is None else keep & causal_keep

    tensor: Tensor | None = None
    empty_rows: Tensor | None = None
    if bias is not None:
        if keep is not None:
            bias = bias.masked_fill(~keep, float("-inf"))
        empty = torch.isneginf(bias).all(dim=-1, keepdim=True)
        if bool(empty.any()):
            empty_rows = empty
            bias = bias.masked_fill(empty, 0.0)
        tensor = bias
    elif keep is not None:
        empty = ~keep.any(dim=-1, keepdim=True)
        if bool(empty.any()):
            empty_rows = empty
            keep = keep | empty
        tensor = keep

    return AttentionMask(
        tensor=tensor,
        kernel_causal=kernel_causal,
        empty_rows=empty_rows,
        causal_requested=is_causal,
        key_padding_mask=key_padding_mask,
        has_attn_mask=attn_mask is not None,
    )
