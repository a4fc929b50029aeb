"""A key/value cache for incremental decoding, one class for every head design.

Keys and values are stored with ``num_kv_heads`` heads, not ``num_heads``: with GQA or
MQA the cache really is ``num_heads / num_kv_heads`` times smaller. The buffers are
allocated once at full length and written in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from multihead.attention.checks import check_positive_int
from multihead.attention.masks import causal_keep


class CacheLayout(NamedTuple):
    """What a layer caches per position: ``heads`` tensors of ``width`` numbers for K and
    as many for V, or one set serving as both when ``shared_kv`` (MLA's latent)."""

    heads: int
    width: int
    shared_kv: bool

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes cached for each position and sentence, in ``dtype``."""
        tensors = 1 if self.shared_kv else 2
        return tensors * self.heads * self.width * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Keys and values of the positions seen so far, ``(B, G, max_len, D)`` each.

    Args:
        batch_size, max_len, num_kv_heads, head_dim: ``B``, the most positions, ``G``, ``D``.
        device, dtype: where and how to store (the projections' output dtype).
        static: the mode for ``torch.compile`` (below).
        share_kv: keys and values are one tensor, stored once (MLA's latent).

    By default :meth:`update` and :meth:`get` return the filled ``(B, G, size, D)``: the mode
    for eager decoding and beam search (:meth:`select`). ``static=True`` is gpt-fast's cache,
    for compiled decoding: the filled length is the 0-dim tensor :attr:`position`, new
    entries are written there with ``index_copy_``, :meth:`update` and :meth:`get` return
    the whole ``(B, G, max_len, D)`` buffers, and :meth:`hide_unwritten` masks the positions
    not written yet (and, for causal attention, those after each query): every step of one
    query length has the same shapes. A ``key_padding_mask`` covers all ``max_len``
    positions, and :attr:`size` is ``max_len`` once anything is written. Writing past
    ``max_len`` raises in eager mode only (a check would read the position back).

    Example: self-attention appends each step's position; cross-attention projects the
    memory on the first step and reads it back afterwards.

        >>> import torch
        >>> from multihead import MultiHeadAttention
        >>> attn = MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2).eval()
        >>> x, memory = torch.randn(1, 5, 16), torch.randn(1, 7, 16)
        >>> pad = torch.tensor([[False] * 4 + [True] * 3])
        >>> self_cache = attn.make_kv_cache(batch_size=1, max_len=8)
        >>> cross_cache = attn.make_kv_cache(batch_size=1, max_len=7)
        >>> outs = []
        >>> for t in range(5):
        ...     h = attn(x[:, t : t + 1], is_causal=True, kv_cache=self_cache)
        ...     outs.append(attn(h, memory, key_padding_mask=pad, kv_cache=cross_cache))
        >>> full = attn(attn(x, is_causal=True), memory, key_padding_mask=pad)
        >>> torch.allclose(torch.cat(outs, dim=1), full, atol=1e-5)
        True
    """

    def __init__(
        self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, *,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
        static: bool = False, share_kv: bool = False,
    ) -> None:  # fmt: skip
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_len", max_len)
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.share_kv = share_kv
        self.v = self.k if share_kv else torch.zeros(shape, device=device, dtype=dtype)
        self.size = 0  # positions filled so far; max_len once written when static
        self.static = static
        # The keys' positions (B, max_len), stored when update is given them: a score bias
        # (ALiBi) reads them back (key_positions), so a left-padded batch's keys keep theirs.
        self._key_positions: Tensor | None = None
        # Static mode: positions filled so far, a tensor so the step's graph does not change.
        self.position = torch.zeros((), dtype=torch.long, device=device) if static else None

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    def nbytes(self) -> int:
        """Bytes of the filled positions (static: all, once written); shared K/V once."""
        per_position = self.k[:, :, 0].numel() * self.k.element_size() * (1 if self.share_kv else 2)
        return per_position * self.size

    def update(
        self, k: Tensor, v: Tensor | None, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Append ``(B, G, L, D)`` keys/values (``v`` is ``None`` when shared), and their
        ``positions`` ``(L,)`` or ``(B, L)`` if given (:meth:`key_positions`); return all
        filled ``(B, G, size, D)`` (static: the ``(B, G, max_len, D)`` buffers)."""
        L = k.shape[2]
        if not self.static and self.size + L > self.max_len:
            raise ValueError(
                f"KVCache overflow: holds {self.size} of {self.max_len} positions, "
                f"cannot add {L} more"
            )
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KVCache has batch size {self.batch_size}, got {k.shape[0]}")
        start = self.position if self.static else self.size
        index = start + torch.arange(L, device=self.k.device)  # (L,)
        if positions is not None:
            if self._key_positions is None:
                self._key_positions = torch.zeros(
                    self.batch_size, self.max_len, dtype=torch.long, device=self.k.device
                )
            positions = positions.expand(self.batch_size, L).long()  # (B, L)
            self._key_positions.index_copy_(1, index, positions)
        # Written by index (gpt-fast's way): a static cache's position is a tensor, so the
        # compiled step does not change with it. Cast as a slice assignment would.
        self.k.index_copy_(2, index, k.to(self.k.dtype))
        if not self.share_kv:
            self.v.index_copy_(2, index, v.to(self.v.dtype))
        if self.static:
            self.position += L
        # Static: a constant, as reading a count here would recompile the step.
        self.size = self.max_len if self.static else self.size + L
        return self.get()

    def hide_unwritten(
        self, attn_mask: Tensor | None, q_len: int, is_causal: bool
    ) -> tuple[Tensor, bool]:
        """Static mode: ``attn_mask`` also hiding from the newest ``L`` queries the keys not
        written yet and, if ``is_causal``, those after each query; and ``is_causal`` then
        False: the layer's mask for the whole ``max_len`` buffers."""
        keys = torch.arange(self.max_len, device=self.position.device)  # (max_len,)
        if is_causal:  # the queries are positions position - L .. position - 1
            hidden = ~causal_keep(q_len, self.max_len, keys.device, self.position - q_len)
        else:
            hidden = (keys >= self.position).expand(q_len, self.max_len)  # (L, max_len)
        if attn_mask is None or attn_mask.dtype == torch.bool:
            return (hidden if attn_mask is None else attn_mask | hidden), False
        return attn_mask.masked_fill(hidden, float("-inf")), False

    def key_positions(self) -> Tensor:
        """The positions of the filled keys, ``(B, size)`` (static: ``(B, max_len)``), as
        :meth:`update` was given them."""
        if self._key_positions is None:
            raise ValueError("this KVCache stored no key positions: pass positions to update")
        return self._key_positions[:, : self.size]

    def get(self) -> tuple[Tensor, Tensor]:
        """The filled keys and values, ``(B, G, size, D)`` each (static: all of them)."""
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
        if self._key_positions is not None:
            self._key_positions = self._key_positions.index_select(0, index)

    def reset(self) -> None:
        """Forget every position (the buffers are kept)."""
        self.size = 0
        if self.position is not None:
            self.position.zero_()


def new_positions(
    kv_cache: KVCache | None, length: int, device: torch.device, position_ids: Tensor | None
) -> Tensor:
    """The positions of ``length`` new tokens: ``position_ids`` ``(L,)`` or ``(B, L)`` if
    given (a left-padded batch), else those after the positions in ``kv_cache``."""
    if position_ids is not None:
        return position_ids
    start = 0 if kv_cache is None else kv_cache.position if kv_cache.static else kv_cache.size
    return start + torch.arange(length, device=device)  # (L,)
