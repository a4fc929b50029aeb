"""Differential attention (Ye et al., "Differential Transformer", ICLR 2025), a head design.

Two softmax maps per head, the second subtracted with a learned weight ``lambda``, cancel the
attention both give to irrelevant keys (the paper's "attention noise")::

    A_i  = softmax(Q_i K_i^T / sqrt(D)) - lambda * softmax(Q_j K_j^T / sqrt(D))   j = i + H/2
    h_i  = (1 - lambda_init) * RMSNorm(A_i [V_a ; V_b])       V of width 2D, no affine weight
    lambda = exp(l_q1 . l_k1) - exp(l_q2 . l_k2) + lambda_init  four learned (D,) vectors

As HF's ``DiffLlamaAttention`` (the tests' reference), the ``H`` query and ``G`` K/V heads
keep their plain projections, positions and cache: query heads ``i`` and ``i + H/2`` make
differential head ``i``, each map reading its own query head's K/V head (GQA as usual), and V
of K/V head ``g < G/2`` is joined with that of ``g + G/2`` (so ``G`` is even).

``lambda_init`` is an option, one value per layer; unset, it is the paper's for the layer's
depth (:func:`lambda_init_at`), which a model stacking layers gives it (:meth:`at_depth`, the
Transformer's), else the first layer's. HF's swap copies DiffLlama's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention.designs import Call, HeadDesign, options_digest, register_design
from multihead.attention.masks import AttentionMask


def lambda_init_at(depth: int) -> float:
    """The paper's ``lambda_init`` of the layer at ``depth`` (0 for the first layer)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


class DifferentialHeads(HeadDesign):
    """The four ``lambda`` vectors of a layer (``D`` wide, drawn from ``N(0, 0.1)`` as the
    paper), and its differential attention (the module's formula; ``bias`` is unused: the
    design has no projection of its own). ``norm_eps`` is HF's ``rms_norm_eps``.

    Attention dropout, which the paper does not define here (HF's DiffLlama refuses it), is
    drawn by each of the two kernel calls: the two halves of V see different masks.
    """

    name = attribute = "diff"
    takes_head_mask = False  # an output head is two query heads' maps, subtracted, normalised
    conversions = frozenset({"with_kv_heads"})

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        device=None,
        dtype=None,
        lambda_init: float | None = None,
        norm_eps: float = 1e-5,
    ) -> None:
        if num_kv_heads % 2:
            raise ValueError(
                f"differential attention needs an even num_kv_heads (V of K/V head g is joined "
                f"with g + G/2), got num_kv_heads={num_kv_heads}"
            )
        super().__init__()
        self.by_depth = lambda_init is None  # the paper's schedule: at_depth sets it
        self.lambda_init = lambda_init_at(0) if lambda_init is None else float(lambda_init)
        self.norm_eps = float(norm_eps)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            vector = torch.empty(embed_dim // num_heads, device=device, dtype=dtype)
            self.register_parameter(name, nn.Parameter(vector.normal_(0.0, 0.1)))

    @property
    def options(self) -> dict[str, float]:
        return {"lambda_init": self.lambda_init, "norm_eps": self.norm_eps}

    @property
    def tag(self) -> str:
        """``-diff``, with a digest of ``lambda_init`` if given (not the paper's by depth) and
        of ``norm_eps`` if not the default (:func:`~.designs.options_digest`)."""
        return f"-{self.name}{options_digest(self, ('lambda_init',) if self.by_depth else ())}"

    def extra_repr(self) -> str:
        return f"lambda_init={self.lambda_init:.4g}, norm_eps={self.norm_eps:g}"

    def at_depth(self, depth: int) -> None:
        """The layer is at ``depth`` in its model's stack (0 first): an unset ``lambda_init``
        becomes the paper's for it."""
        if self.by_depth:
            self.lambda_init = lambda_init_at(depth)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, call: Call
    ) -> tuple[Tensor, Tensor | None]:
        """The ``H/2`` differential heads ``(B, H/2, L, 2D)`` of Q ``(B, H, L, D)``, K and V
        ``(B, G, S, D)``, and the weights of the ``H`` maps before the subtraction."""
        # Two kernel calls of plain widths (as HF: flash kernels need V as wide as K), one
        # per half of the 2D-wide V. Query heads i and i + H/2 (grouped with K/V heads g and
        # g + G/2) read the same V: that of K/V head g, then that of g + G/2.
        v_a, v_b = v.chunk(2, dim=1)  # (B, G/2, S, D) each
        heads_a, weights = call.attend(q, k, v_a.repeat(1, 2, 1, 1), mask)  # (B, H, L, D)
        heads_b, _ = call.attend(q, k, v_b.repeat(1, 2, 1, 1), mask)  # (B, H, L, D)
        heads = torch.cat((heads_a, heads_b), dim=-1)  # (B, H, L, 2D)
        first, second = heads.chunk(2, dim=1)  # (B, H/2, L, 2D) each
        heads = first - self.lambda_full().to(heads.dtype) * second  # (B, H/2, L, 2D)
        # Each differential head normalised alone (the paper's GroupNorm, HF's RMSNorm without
        # weights), scaled so that the layer's output starts at plain attention's size.
        heads = (1 - self.lambda_init) * F.rms_norm(heads, heads.shape[-1:], eps=self.norm_eps)
        return heads, weights  # the layer merges them as they are: (B, L, H/2 * 2D = E)

    def lambda_full(self) -> Tensor:
        """``lambda``, a scalar, in fp32 at least (as HF)."""
        work = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        q1, k1, q2, k2 = (getattr(self, f"lambda_{n}").to(work) for n in ("q1", "k1", "q2", "k2"))
        return torch.exp((q1 * k1).sum()) - torch.exp((q2 * k2).sum()) + self.lambda_init


register_design(DifferentialHeads.name, DifferentialHeads)
