"""The Q/K/V projection: the one part that knows how the Q, K and V weights are laid out.

:class:`QKVProjection` is **stacked** by default: one ``nn.Linear`` of ``[W^Q; W^K; W^V]``,
one GEMM for self-attention, state_dict keys ``in_proj.weight`` and ``in_proj.bias``. Or it is
**separate** (:meth:`QKVProjection.from_linears`): a Hugging Face model's own three
``nn.Linear``, kept with their parameter objects, optimizer state and hooks. Every other file
reads and writes the blocks through :meth:`QKVProjection.blocks`, in either layout.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class QKVProjection(nn.Linear):
    """Q of ``num_heads`` heads and K, V of ``num_kv_heads`` heads, each ``head_dim`` wide.

    Args:
        embed_dim: ``E``, the input width.
        num_heads, num_kv_heads, head_dim: ``H``, ``G``, ``D`` (``H*D < E`` once heads are
            pruned).
        bias: a bias on each block.
        kv: project K and V too; ``False``: Q alone (MLA's K and V come from its latent).
        device, dtype: for the parameters.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
        bias: bool = True, kv: bool = True, device=None, dtype=None,
    ) -> None:  # fmt: skip
        rows = (num_heads + (2 * num_kv_heads if kv else 0)) * head_dim
        super().__init__(embed_dim, rows, bias, device, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.has_kv = kv

    def reset_parameters(self) -> None:
        # An MLA layer whose Q/K features are all rotary (qk_head_dim 0) has no Q rows here:
        # nn.Linear's Kaiming init would warn that it draws nothing (it draws nothing anyway).
        if self.weight.numel():
            super().reset_parameters()

    @classmethod
    def from_linears(
        cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, num_heads: int,
        num_kv_heads: int,
    ) -> QKVProjection:  # fmt: skip
        """The separate layout: ``q_proj`` ``(H*D, E)``, ``k_proj`` and ``v_proj``
        ``(G*D, E)`` held as they are (not copied); the state_dict keys are theirs."""
        D = q_proj.out_features // num_heads
        if (q_proj.out_features, k_proj.out_features) != (num_heads * D, num_kv_heads * D):
            raise ValueError(
                f"q_proj, k_proj must have {num_heads} and {num_kv_heads} heads of one width, "
                f"got out_features {q_proj.out_features} and {k_proj.out_features}"
            )
        proj = cls(q_proj.in_features, num_heads, num_kv_heads, D, bias=False, device="meta")
        proj.register_parameter("weight", None)
        proj.q_proj, proj.k_proj, proj.v_proj = q_proj, k_proj, v_proj
        return proj

    @property
    def separate(self) -> bool:
        """Whether the blocks are three ``nn.Linear`` (:meth:`from_linears`)."""
        return self.weight is None

    def blocks(self, name: str = "weight") -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The Q, K and V blocks of ``name`` (``"weight"``: ``(H*D, E)``, ``(G*D, E)`` x 2;
        ``"bias"``): views of the stacked rows, or the separate parameters; ``None`` for a
        block that does not exist (no bias; K and V of a Q-only projection)."""
        if self.separate:
            return tuple(getattr(p, name) for p in (self.q_proj, self.k_proj, self.v_proj))
        t = getattr(self, name)
        if t is None:
            return None, None, None
        if not self.has_kv:
            return t, None, None
        HD, GD = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return tuple(t.split([HD, GD, GD], dim=0))

    def q(self, x: Tensor, heads: int | None = None) -> Tensor:
        """Q ``(B, h, L, D)`` of ``x`` ``(B, L, E)``: the first ``heads`` heads (``None``:
        all ``H``)."""
        B, L, _ = x.shape
        h = self.num_heads if heads is None else heads
        if self.separate and h == self.num_heads:
            q = self.q_proj(x)  # the module's own call (its hooks, a packed weight's kernel)
        else:
            (w, _, _), (b, _, _) = self.blocks(), self.blocks("bias")
            q = F.linear(x, w[: h * self.head_dim], None if b is None else b[: h * self.head_dim])
        return q.view(B, L, h, self.head_dim).transpose(1, 2)  # (B, h, L, D)

    def kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """K and V ``(B, G, S, D)`` of ``x`` ``(B, S, E)``."""
        B, G, D = x.shape[0], self.num_kv_heads, self.head_dim
        if self.separate:
            k, v = self.k_proj(x), self.v_proj(x)  # (B, S, G*D) each
        else:
            HD, w, b = self.num_heads * D, self.weight, self.bias
            k, v = F.linear(x, w[HD:], None if b is None else b[HD:]).split([G * D, G * D], -1)
        k = k.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
        v = v.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
        return k, v

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q ``(B, H, L, D)``, K and V ``(B, G, L, D)`` of ``x`` ``(B, L, E)`` (self-attention)."""
        if self.separate:
            return self.q(x), *self.kv(x)
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        # One GEMM for all three, split (B, L, H*D | G*D | G*D), then each (B, L, heads, D)
        # turned head-first: Q (B, H, L, D), K and V (B, G, L, D); views, no copies.
        qkv = self(x).split([H * D, G * D, G * D], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, D)).transpose(1, 2) for t in qkv)
        return q, k, v

    def extra_repr(self) -> str:
        layout = "separate" if self.separate else "stacked"
        heads = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}"
        return f"{super().extra_repr()}, {heads}, {layout}"
