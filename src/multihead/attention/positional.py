"""Where a position encoding enters attention: the two seams of a positional part.

* ``seam = "rotate"``: :meth:`PositionalPart.rotate` turns Q ``(B, H, L, D)`` and the new K
  ``(B, G, L, D)`` by their positions, after the projection and before K is cached (rotary
  embeddings, :class:`~multihead.attention.rotary.RotaryPositions`);
* ``seam = "score_bias"``: :meth:`PositionalPart.score_bias` gives an additive bias
  ``(B or 1, H, L, S)`` on the scores from the queries' and the keys' positions (ALiBi).
  The layer adds it to the float mask of ``math``, ``sdpa`` and ``efficient`` (``flex``
  reads it as a ``score_mod``); a backend whose registry entry has ``score_bias=False``
  (``flash``, ``cudnn``, ``flash_attn``) is refused by name. With a KV cache the keys'
  positions are those the cache stored beside them (:meth:`KVCache.key_positions`).

Positions are ``(L,)``, or ``(B, L)`` for a left-padded batch; a part is built with the
layer's ``head_dim`` and ``num_heads`` and may hold no parameters (a checkpoint then holds
nothing of it).
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn


class PositionalPart(nn.Module):
    """A position encoding; a subclass sets :attr:`seam` and overrides that seam's method.

    Attributes:
        seam: ``"rotate"`` or ``"score_bias"``.
    """

    seam: ClassVar[str]
    tag: ClassVar[str] = ""  # what it adds to the layer's head_tag: "-rope", "-alibi"

    @property
    def options(self) -> dict[str, object]:
        """The layer's constructor arguments that build this part, for ``head_config``."""
        return {}

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x`` ``(B, heads, L, D)`` at ``positions``; unchanged for a score-bias part."""
        return x

    def score_bias(self, query_positions: Tensor, key_positions: Tensor) -> Tensor | None:
        """The bias ``(B or 1, H, L, S)`` added to the scores; ``None`` for a rotary part."""
        return None
