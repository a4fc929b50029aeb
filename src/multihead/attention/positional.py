"""Where a position encoding enters attention: the two seams of a positional part.

``seam = "rotate"``: Q and the new K turned by their positions after the projection, before K
is cached (:class:`~multihead.attention.rotary.RotaryPositions`). ``seam = "score_bias"``: an
additive bias on the scores from the queries' and the keys' positions (ALiBi), which a backend
without ``score_bias`` in its registry entry refuses by name. Positions are ``(L,)``, or
``(B, L)`` for a left-padded batch; ``docs/reuse.md`` teaches writing a part.
"""

from __future__ import annotations

import hashlib
import json
from typing import ClassVar

from torch import Tensor, nn


def tag_digest(options: dict[str, object]) -> str:
    """``"-"`` and six hex digits of a hash of ``options``, ``""`` if there are none: how a
    tag (a positional part's, a head design's) tells apart settings it does not spell.
    Stable across processes: the options as sorted JSON (tensors as lists)."""
    if not options:
        return ""
    text = json.dumps(options, sort_keys=True, default=_json_value)
    return "-" + hashlib.sha1(text.encode()).hexdigest()[:6]


def _json_value(value: object) -> object:
    return value.tolist() if isinstance(value, Tensor) else repr(value)


class PositionalPart(nn.Module):
    """A position encoding; a subclass sets :attr:`seam` and overrides that seam's method."""

    seam: ClassVar[str]  # "rotate" or "score_bias" (the module's two)
    # What it adds to the layer's head_tag ("-rope", "-alibi"); a part with options makes it
    # a property that tells apart every setting that computes differently ("-rope8").
    tag: ClassVar[str] = ""

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
