"""Attention with linear biases (ALiBi; Press et al., "Train Short, Test Long", ICLR 2022).

No positions are added to the tokens: head ``h`` adds ``-m_h |i - j|`` to the score of query
``i`` and key ``j``, so far keys weigh less, at a slope of its own. Only differences of
positions enter, so a left-padded row needs no ``position_ids``. Why the distance and not
BLOOM's ``m_h j``, and the encoder's symmetric bias: ``docs/reuse.md``, "ALiBi".
Cross-attention gets no bias: its queries and keys are positions of two different sentences.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from multihead.attention.checks import check_positive_int
from multihead.attention.positional import PositionalPart


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> Tensor:
    """The ``(H,)`` slopes ``m_h``, in fp32: ``2^(-8h/n)``, ``h = 1 .. n``, for ``n`` heads a
    power of two; else those of the largest power of two ``p < n``, then every other slope
    of ``2p`` (odd ``h``), as the paper's code and BLOOM define them."""
    check_positive_int("num_heads", num_heads)
    p = 2 ** math.floor(math.log2(num_heads))  # the largest power of two <= H
    exponents = torch.cat(
        (
            torch.arange(1, p + 1, device=device) * (8 / p),  # 2^(-8h/p), h = 1 .. p
            (2 * torch.arange(num_heads - p, device=device) + 1) * (4 / p),  # 2^(-8h/2p), odd h
        )
    )
    return torch.exp2(-exponents.float())  # (H,)


class ALiBi(PositionalPart):
    """Linear biases on the scores of ``num_heads`` heads (the ``"score_bias"`` seam; see the
    module). No parameters, no buffers: the slopes are computed at each call."""

    seam = "score_bias"
    tag = "-alibi"

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        alibi_slopes(num_heads)  # validates
        self.num_heads = num_heads

    @property
    def options(self) -> dict[str, bool]:
        return dict(alibi=True)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"

    def score_bias(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """The fp32 bias ``-m_h |i - j|`` ``(B or 1, H, L, S)`` of queries at
        ``query_positions`` ``(L,)`` or ``(B, L)`` and keys at ``(S,)`` or ``(B, S)``."""
        slopes = alibi_slopes(self.num_heads, query_positions.device)  # (H,)
        i, j = query_positions[..., :, None], key_positions[..., None, :]  # (·, L, 1), (·, 1, S)
        distance = (i - j).abs().float()  # (L, S) or (B, L, S)
        return -slopes[:, None, None] * distance[(None,) * (3 - distance.dim())][:, None]
