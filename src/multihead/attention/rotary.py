"""Rotary position embeddings (RoPE; Su et al., "RoFormer", 2021).

RoPE encodes a position by rotating pairs of query and key features by angles that grow
with it, ``angle_i(p) = p * theta^(-2i / R)`` for pair ``i`` of the ``R`` rotated features.
A rotation keeps the dot product's dependence on the *difference* of the two positions
only, so attention scores become relative without any table added to the embeddings::

    <rot(q, m), rot(k, n)> = <rot(q, m - n), k>

Two pairings are in use, and checkpoints differ by which one: "rotate half" (feature ``j``
with ``j + R/2``; HF Llama, the default) or ``interleaved`` neighbours ``(2i, 2i + 1)``
(RoFormer, HF Cohere). ``rotary_dim < head_dim`` rotates the first ``R`` features of each
head only (GPT-NeoX). Where the layer applies it: ``docs/reuse.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.attention.checks import check_bool
from multihead.attention.positional import PositionalPart, tag_digest

# The layer's (and MLA's) rotary options at their defaults, which a tag leaves out.
ROPE_DEFAULTS = {"rope_theta": 10000.0, "rope_interleaved": False}


class RotaryPositions(PositionalPart):
    """Rotate Q and K by their positions (the ``"rotate"`` seam).

    Args:
        head_dim: ``D``, the width of one head.
        rotary_dim: ``R``, the rotated features of each head: even, at most ``D``;
            ``None`` means ``D``.
        theta: the base of the angles' geometric progression (10,000 in RoFormer and
            Llama 2; 500,000 in Llama 3; 1,000,000 in Qwen2).
        interleaved: pair neighbouring features instead of the two halves (see the module).
        inv_freq: explicit inverse frequencies instead of ``theta``'s: ``R/2``, or ``n`` rows
            of them, row ``i`` for heads ``i*heads/n ..`` (a conversion's, per K/V group).

    The part has no parameters and no buffers (the angles are computed at every call), so
    a checkpoint holds nothing of it.
    """

    seam = "rotate"

    def __init__(
        self,
        head_dim: int,
        *,
        rotary_dim: int | None = None,
        theta: float = 10000.0,
        interleaved: bool = False,
        inv_freq=None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
            raise ValueError(f"rotary_dim must be an int, got {rotary_dim!r}")
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(
                f"rotary_dim must be an even number in [2, head_dim={head_dim}], got {rotary_dim}"
            )
        if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 1:
            raise ValueError(f"rope_theta must be a number > 1, got {theta!r}")
        check_bool("rope_interleaved", interleaved)
        n = rotary_dim // 2
        # A config value checked here, on the CPU whatever device the layer is built on (a
        # model built on the meta device to check its settings reads these numbers).
        freqs = (
            None
            if inv_freq is None
            else torch.as_tensor(inv_freq, dtype=torch.float64, device="cpu")
        )
        if freqs is not None and (freqs.dim() > 2 or freqs.shape[-1:] != (n,) or freqs.min() <= 0):
            raise ValueError(f"inv_freq must be positive, ({n},) or (n, {n}), got {inv_freq!r}")
        inv_freq = None if freqs is None else tuple(map(tuple, freqs.view(-1, n).tolist()))
        self.inv_freq = inv_freq
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.theta = float(theta)
        self.interleaved = bool(interleaved)

    @property
    def tag(self) -> str:
        """``-rope`` at the defaults (every feature, base 10,000, halves paired, no explicit
        frequencies); ``-rope<R>`` where it rotates ``R`` of the ``D`` features of a head, and
        a digest of a base, a pairing or frequencies other than the defaults
        (:func:`~multihead.attention.positional.tag_digest`)."""
        width = "" if self.rotary_dim == self.head_dim else str(self.rotary_dim)
        other = {k: v for k, v in self.options.items() if k != "rotary_dim"}
        other = {k: v for k, v in other.items() if (k, v) not in ROPE_DEFAULTS.items()}
        return f"-rope{width}{tag_digest(other)}"

    @property
    def options(self) -> dict[str, int | float | bool]:
        freqs = {} if self.inv_freq is None else {"rope_inv_freq": self.inv_freq}
        rope = dict(rotary_dim=self.rotary_dim, rope_theta=self.theta)
        return rope | dict(rope_interleaved=self.interleaved, **freqs)

    def frequencies(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The inverse frequencies of the ``R/2`` pairs, ``(R/2,)``, or ``(n, R/2)`` explicit."""
        if self.inv_freq is not None:
            return torch.tensor(self.inv_freq, device=device, dtype=dtype)
        R = self.rotary_dim
        # The same operations as HF's default rope init: 1 / theta^(2i / R), i < R/2.
        exponents = torch.arange(0, R, 2, device=device, dtype=dtype) / R  # (R/2,)
        return 1.0 / (self.theta**exponents)  # (R/2,)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.items())

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` of every rotated feature's angle, ``(..., L, R)`` in ``dtype``
        (``(..., n, L, R)`` with ``n`` rows of explicit frequencies).

        ``positions`` is ``(L,)`` or ``(B, L)``. The angles are computed in fp32, or in
        ``dtype`` when it is wider (fp64 stays fp64; bf16 is not precise enough for angles
        of hundreds of radians), then cast, as HF Llama does.
        """
        work = torch.promote_types(dtype, torch.float32)
        inv_freq = self.frequencies(positions.device, work)  # (R/2,) or (n, R/2)
        positions = positions.to(work)[..., None]  # (..., L, 1)
        if inv_freq.dim() == 2:
            positions, inv_freq = positions.unsqueeze(-3), inv_freq[:, None]  # (..., 1, L, 1)
        angles = positions * inv_freq  # (..., L, R/2) or (..., n, L, R/2)
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)  # (..., L, R): pair i at 2i, 2i+1
        else:
            angles = torch.cat((angles, angles), dim=-1)  # (..., L, R): pair i at i, i + R/2
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x`` ``(B, heads, L, D)`` rotated by ``positions``, ``(L,)`` or ``(B, L)``."""
        cos, sin = self.cos_sin(positions, x.dtype)  # (L, R) or (B, L, R)
        if self.inv_freq is not None:  # (n, L, R) or (B, n, L, R): row i for heads i*heads/n..
            n = len(self.inv_freq)
            cos, sin = (t.repeat_interleave(x.shape[1] // n, dim=-3) for t in (cos, sin))
        elif cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, L, R): one angle for all heads
        R = self.rotary_dim
        rot, rest = x[..., :R], x[..., R:]  # (B, heads, L, R), (B, heads, L, D - R)
        # Each pair (a, b) becomes (a cos - b sin, a sin + b cos): x cos + turn(x) sin, where
        # turn(x) maps every pair (a, b) to (-b, a).
        if self.interleaved:
            a, b = rot[..., 0::2], rot[..., 1::2]  # (B, heads, L, R/2) each
            turned = torch.stack((-b, a), dim=-1).flatten(-2)  # (B, heads, L, R)
        else:
            a, b = rot[..., : R // 2], rot[..., R // 2 :]
            turned = torch.cat((-b, a), dim=-1)  # (B, heads, L, R)
        rotated = rot * cos + turned * sin
        return rotated if R == x.shape[-1] else torch.cat((rotated, rest), dim=-1)
