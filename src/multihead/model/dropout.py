"""Dropout from 16-bit random numbers: the model's one dropout (embeddings, sublayer outputs, FFN).

``nn.Dropout`` draws one Bernoulli number per element (``bernoulli_``), which on a CPU took a
quarter of the recipe's training step (issue 58). Here the random bits come in bulk: one
64-bit draw (``random_`` over the full int64 range) gives four 16-bit numbers ``r``, uniform
on ``[-2^15, 2^15)``, and an element is kept when ``r >= -2^15 + k`` with
``k = round(p * 2^16)``. So:

- the keep probability is exactly ``1 - k / 2^16``, within ``2^-17`` (7.6e-6) of ``1 - p``
  (for p = 0.3: k = 19661, keep 0.7000046);
- the kept elements are scaled by ``1 / (1 - p)``, as ``nn.Dropout``: the mean is ``x`` times
  ``(1 - k / 2^16) / (1 - p)``, within ``2^-17 / (1 - p)`` of 1;
- each call draws fresh bits from the device's default generator (``torch.manual_seed``
  reproduces them), so masks are independent of each other and across positions, as far
  as the generator's 64-bit outputs are (Mersenne Twister on CPU, Philox on CUDA).

The product ``x * keep`` with a boolean ``keep`` makes autograd save the 1-byte mask, not a
float one, and the gradient is ``grad * keep / (1 - p)``. (The product converts the mask to
``x``'s dtype on the fly, forward and backward: a ``copy_`` in a profile.) In eval mode, or
with ``p = 0``, it is the identity. The dtype is ``x``'s, so it runs as is under autocast.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_LEVELS = 2**16  # the values a 16-bit random number takes


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """A boolean mask of ``shape``, each element True with probability
    ``1 - round(p * 2^16) / 2^16``, independently."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    # from=-2^63 with no upper bound: all 64 bits uniform (a bounded range would use modulo).
    words.random_(-(2**63), None)
    r = words.view(torch.int16)[:n].view(shape)  # four 16-bit numbers per draw
    return r >= -(2**15) + round(p * _LEVELS)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element of ``x`` with probability ``p`` (to 2^-17) and scale the rest by
    ``1 / (1 - p)``; ``x`` itself when not ``training`` or ``p == 0``."""
    if not training or p == 0:
        return x
    return (x * keep_mask(x.shape, p, x.device)).mul_(1 / (1 - p))


class Dropout(nn.Module):
    """:func:`dropout` as a module, in place of ``nn.Dropout`` (same ``p``, same train/eval).

    Args:
        p: the probability of zeroing an element, in ``[0, 1)``.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
            raise ValueError(f"dropout p must be a number in [0, 1), got {p!r}")
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
