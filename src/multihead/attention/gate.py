"""Michel et al.'s (NeurIPS 2019) per-head gate: ``head_mask`` scales each query head's
output before ``W^O``; 0 removes a head, and a ones tensor that requires grad gives each
head's importance as the gradient of the loss with respect to it."""

from __future__ import annotations

from torch import Tensor, nn


def check_head_mask(head_mask: Tensor | None, layer: nn.Module) -> Tensor | None:
    """``head_mask`` if it is ``None`` or a ``(H,)`` tensor for ``layer``, else ValueError."""
    if head_mask is None:
        return None
    if not isinstance(head_mask, Tensor) or tuple(head_mask.shape) != (layer.num_heads,):
        got = tuple(head_mask.shape) if isinstance(head_mask, Tensor) else repr(head_mask)
        raise ValueError(f"head_mask must be a tensor of shape ({layer.num_heads},), got {got}")
    return head_mask


def gate_heads(heads: Tensor, head_mask: Tensor) -> Tensor:
    """``heads`` ``(B, H, L, ·)`` each scaled by its gate in ``head_mask`` ``(H,)``."""
    return heads * head_mask.to(heads.dtype).view(1, -1, 1, 1)
