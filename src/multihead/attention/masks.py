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
  is zeroed afterwards (``AttentionMask.empty_rows``), without asking the device whether
  there are any (that would be a host-device sync on every call).
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
            broadcastable to ``(B, H, L, S)``. It holds the causal mask too, except when
            nothing else is masked and ``L == S``: then the kernel applies its own, which
            costs nothing (see :meth:`kernel_causal`).
        is_causal: the caller asked for causal attention (bottom-right aligned when
            ``L < S``: the queries are the last ``L`` positions). Kernels that take only a
            causal flag and sequence lengths (flash-attn) read this and not ``tensor``.
        empty_rows: ``None`` or a bool tensor broadcastable to ``(B, H, L, 1)``, True for
            query rows that had no key left to attend to; their output must be zeroed.
        key_padding_mask: the caller's ``(B, S)`` padding mask, True = padding.
        has_attn_mask: ``tensor`` holds more than padding and causality (the caller's
            ``attn_mask``, or query rows packed out of position order), so only the kernels
            that take an arbitrary mask can run it.
    """

    tensor: Tensor | None = None
    is_causal: bool = False
    empty_rows: Tensor | None = None
    key_padding_mask: Tensor | None = None
    has_attn_mask: bool = False

    def kernel_causal(self, q_len: int, kv_len: int) -> bool:
        """Whether the kernel must apply its own causal mask (top-left aligned, ``L == S``):
        asked for, and not in ``tensor``. A single newest query (``L = 1 < S``) needs none."""
        return self.is_causal and self.tensor is None and q_len == kv_len


def causal_keep(q_len: int, kv_len: int, device: torch.device, first: int | Tensor | None = None):
    """The causal mask, bool ``(L, S)``, True where query ``i`` may see key ``j``: query
    ``i`` is position ``first + i`` and sees the keys up to it. ``first`` defaults to
    ``S - L``: the queries are the last ``L`` positions (bottom-right aligned); a static
    cache passes its position tensor."""
    first = kv_len - q_len if first is None else first
    rows = torch.arange(q_len, device=device)[:, None] + first  # (L, 1)
    return torch.arange(kv_len, device=device)[None, :] <= rows  # (L, S)


def apply_mask(scores: Tensor, mask: AttentionMask) -> Tensor:
    """``scores`` ``(B, H, L, S)`` with ``mask`` applied: ``-inf`` where masked, bias added.

    The written-out kernels (math, talking heads) mask their scores here, in one way.
    """
    L, S = scores.shape[-2:]
    if mask.kernel_causal(L, S):
        scores = scores.masked_fill(~causal_keep(L, S, scores.device), float("-inf"))
    if mask.tensor is not None:
        if mask.tensor.dtype == torch.bool:
            scores = scores.masked_fill(~mask.tensor, float("-inf"))
        else:
            scores = scores + mask.tensor
    return scores


def build_attention_mask(
    *, key_padding_mask: Tensor | None, attn_mask: Tensor | None, is_causal: bool,
    batch_size: int, num_heads: int, q_len: int, kv_len: int, dtype: torch.dtype,
    device: torch.device, score_bias: Tensor | None = None,
) -> AttentionMask:  # fmt: skip
    """Validate the user's masks (as for :meth:`MultiHeadAttention.forward`; with ``L < S``
    the queries are the *last* ``L`` positions) and merge them into one
    :class:`AttentionMask` for sizes ``B, H, L, S``, float masks in ``dtype``; a positional
    part's ``score_bias`` ``(B or 1, H, L, S)`` joins the float mask."""
    if key_padding_mask is None and attn_mask is None and score_bias is None:
        if not is_causal or q_len == kv_len:  # nothing to merge: the kernel's causal mask
            return AttentionMask(is_causal=is_causal)
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
        # Not `s not in (1, t)`: torch.compile (2.13) finds `5 in (1, t)` False for a symbolic
        # size t of 5, which automatic dynamic shapes make of a cache's length.
        if len(shape) > 4 or any(s != 1 and s != t for s, t in pairs):
            raise ValueError(
                f"attn_mask of shape {shape} does not broadcast to (B, H, L, S) = {target}"
            )
        if attn_mask.dtype == torch.bool:
            keep = ~attn_mask if keep is None else keep & ~attn_mask
        elif attn_mask.is_floating_point():
            bias = attn_mask.to(dtype)
        else:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if score_bias is not None:
        score_bias = score_bias.to(dtype)
        bias = score_bias if bias is None else bias + score_bias

    # Causal attention is written into the mask only when the kernels' own (free, top-left
    # aligned) causal mask cannot serve: another mask is present, or L < S. A single newest
    # query (L = 1) sees every key and needs none.
    own_causal = keep is None and bias is None and q_len == kv_len
    if is_causal and not own_causal and q_len > 1:
        causal = causal_keep(q_len, kv_len, device)  # (L, S)
        keep = causal if keep is None else keep & causal

    # Rows with no key left are un-masked here and zeroed after the kernel. Both are done
    # whether or not any row is empty: asking would read a flag back from the device.
    tensor: Tensor | None = None
    empty_rows: Tensor | None = None
    if bias is not None:
        if keep is not None:
            bias = bias.masked_fill(~keep, float("-inf"))
        empty_rows = torch.isneginf(bias).all(dim=-1, keepdim=True)
        tensor = bias.masked_fill(empty_rows, 0.0)
    elif keep is not None:
        empty_rows = ~keep.any(dim=-1, keepdim=True)
        tensor = keep | empty_rows

    return AttentionMask(
        tensor=tensor,
        is_causal=is_causal,
        empty_rows=empty_rows,
        key_padding_mask=key_padding_mask,
        has_attn_mask=attn_mask is not None,
    )
