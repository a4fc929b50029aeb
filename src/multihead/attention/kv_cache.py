"""A static key/value cache for incremental decoding.

Keys and values are stored with ``num_kv_heads`` heads, not ``num_heads``: with GQA or
MQA the cache really is ``num_heads / num_kv_heads`` times smaller. The buffers are
allocated once at full length and written by index (as in gpt-fast), so their shapes
never change between decoding steps.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values of the positions seen so far, ``(B, G, max_len, D)`` each.

    Args:
        batch_size: ``B``, the number of sequences decoded together.
        max_len: the most positions the cache can hold.
        num_kv_heads: ``G``.
        head_dim: ``D``.
        device, dtype: where and how to store. The dtype should match the projections'
            output dtype (e.g. ``torch.bfloat16`` under bf16 autocast).
        share_kv: keys and values are one tensor, stored once: multi-head latent attention
            caches its latent ``(B, 1, max_len, r)``, which serves as both.

    Example: self-attention appends each step's position; cross-attention projects the
    memory on the first step and reads it back afterwards.

        >>> import torch
        >>> from multihead import MultiHeadAttention
        >>> attn = MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2).eval()
        >>> x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
        >>> pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
        >>> self_cache = attn.make_kv_cache(batch_size=2, max_len=5)
        >>> cross_cache = attn.make_kv_cache(batch_size=2, max_len=7)
        >>> outs = []
        >>> for t in range(5):
        ...     h = attn(x[:, t : t + 1], is_causal=True, kv_cache=self_cache)
        ...     outs.append(attn(h, memory, key_padding_mask=pad, kv_cache=cross_cache))
        >>> full = attn(attn(x, is_causal=True), memory, key_padding_mask=pad)
        >>> torch.allclose(torch.cat(outs, dim=1), full, atol=1e-5)
        True
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        share_kv: bool = False,
    ) -> None:
        if batch_size < 1 or max_len < 1:
            raise ValueError(
                f"KVCache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}"
            )
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.share_kv = share_kv
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = self.k if share_kv else torch.zeros(shape, device=device, dtype=dtype)
        self.size = 0  # positions filled so far

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    def nbytes(self) -> int:
        """Bytes held by the filled part of the cache (keys and values, once if shared)."""
        per_position = self.k[:, :, 0].numel() * self.k.element_size() * (1 if self.share_kv else 2)
        return per_position * self.size

    def update(self, k: Tensor, v: Tensor | None) -> tuple[Tensor, Tensor]:
        """Append ``(B, G, L, D)`` keys/values (``v`` is ``None`` when shared); return all
        filled ``(B, G, size, D)``."""
        L = k.shape[2]
        if self.size + L > self.max_len:
            raise ValueError(
                f"KVCache overflow: holds {self.size} of {self.max_len} positions, "
                f"cannot add {L} more"
            )
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KVCache has batch size {self.batch_size}, got {k.shape[0]}")
        self.k[:, :, self.size : self.size + L] = k
        if not self.share_kv:
            self.v[:, :, self.size : self.size + L] = v
        self.size += L
        return self.get()

    def get(self) -> tuple[Tensor, Tensor]:
        """The filled keys and values, ``(B, G, size, D)`` each."""
        return self.k[:, :, : self.size], self.v[:, :, : self.size]

    def select(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (reorder beams, drop finished sentences).

        Only the filled positions are copied: beam search reorders every step, and copying
        the whole ``max_len`` buffer each time cost more than the attention itself.
        """
        for name in ("k",) if self.share_kv else ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((index.numel(), *old.shape[1:]))  # positions >= size unset
            filled = old[:, :, : self.size]
            if torch.is_grad_enabled() and filled.requires_grad:
                new[:, :, : self.size] = filled.index_select(0, index)  # out= has no autograd
            else:
                torch.index_select(filled, 0, index, out=new[:, :, : self.size])
            setattr(self, name, new)
        if self.share_kv:
            self.v = self.k

    def reset(self) -> None:
        """Forget every position (the buffers are kept)."""
        self.size = 0
