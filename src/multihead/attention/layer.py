"""Multi-head attention with grouped K/V heads (MHA, GQA, MQA) in one layer.

The layer computes the formula of "Attention Is All You Need"::

    head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(D)) V W_i^V
    out    = concat(head_1, ..., head_H) W^O

with ``G = num_kv_heads`` key/value heads shared by groups of ``H / G`` query heads::

    MHA (G = H)          GQA (1 < G < H)      MQA (G = 1)
    q: 1 2 3 4           q: 1 2 3 4           q: 1 2 3 4
       | | | |              \\| |/               \\ \\/ /
    kv:1 2 3 4           kv:  1  2            kv:   1

The kernel that evaluates softmax(QK^T)V is picked by name from
:mod:`multihead.attention.backends`; this module only projects, reshapes and caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention.backends import (
    BACKENDS,
    BackendUnavailableError,
    available_backends,
    check_backend,
    default_scale,
    math_attention_with_weights,
    unavailable_reason,
)
from multihead.attention.kv_cache import KVCache
from multihead.attention.masks import build_attention_mask


class MultiHeadAttention(nn.Module):
    """Multi-head attention with ``num_kv_heads`` shared key/value heads.

    Tensors are batch-first. Boolean masks mean **True = masked out**, as in
    :class:`torch.nn.MultiheadAttention`; float masks are added to the scores.

    Args:
        embed_dim: ``E``, the model width.
        num_heads: ``H``, the number of query heads; ``E`` must be divisible by it.
        num_kv_heads: ``G``, the number of key/value heads. ``None`` means ``H`` (MHA),
            ``1`` means MQA, any other divisor of ``H`` means GQA.
        dropout: dropout on the attention weights, in training mode only.
        bias: add biases to the input and output projections.
        backend: the attention kernel, one of ``math``, ``sdpa``, ``flash``,
            ``efficient``, ``cudnn``, ``flex``, ``flash_attn``. ``math`` is the
            written-out reference. A backend that cannot run the inputs raises
            :class:`~multihead.attention.backends.BackendUnavailableError`; there is
            no silent fallback.
        device, dtype: for the parameters.

    Shapes:
        query ``(B, L, E)``; key_value ``(B, S, E)`` for cross-attention;
        key_padding_mask ``(B, S)``; attn_mask broadcastable to ``(B, H, L, S)``;
        output ``(B, L, E)``; weights ``(B, H, L, S)``.

    Example:
        >>> import torch
        >>> from multihead import MultiHeadAttention
        >>> attn = MultiHeadAttention(embed_dim=64, num_heads=8, num_kv_heads=2)
        >>> x, memory = torch.randn(2, 5, 64), torch.randn(2, 7, 64)
        >>> attn(x).shape                                    # self-attention
        torch.Size([2, 5, 64])
        >>> pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
        >>> attn(x, memory, key_padding_mask=pad).shape      # cross-attention
        torch.Size([2, 5, 64])
        >>> y = attn(x, is_causal=True)                       # decoder self-attention

    Incremental decoding keeps ``G`` heads per position in a :class:`KVCache`. For
    self-attention each call appends the new positions; for cross-attention the first
    call projects the memory and later calls reuse it without projecting again:

        >>> attn = attn.eval()
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
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        backend: str = "sdpa",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be positive, got {embed_dim} and {num_heads}"
            )
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        here = torch.device("cpu" if device is None else device)
        can_run = available_backends(here, dtype or torch.float32)
        runnable = ", ".join(can_run)
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)} "
                f"(on {here.type}/{dtype or torch.float32} these can run: {runnable})"
            )
        if backend == "flex" and dropout > 0:
            raise ValueError(
                f"backend 'flex' does not support attention dropout (got dropout={dropout}); "
                "use dropout=0.0 or another backend, e.g. one of "
                f"{', '.join(n for n in can_run if n != 'flex')}"
            )
        if backend == "flash_attn":
            reason = unavailable_reason(backend, torch.device("cuda"), torch.float16)
            if reason is not None:
                raise BackendUnavailableError(
                    f"attention backend 'flash_attn': {reason}. Backends that can run on "
                    f"{here.type}/{dtype or torch.float32}: {runnable}"
                )

        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.backend = backend
        self.scale = default_scale(self.head_dim)
        kv_dim = num_kv_heads * self.head_dim
        # Q, K and V projections stacked in one matrix, (E + 2*G*D, E): self-attention
        # does one GEMM for all three; cross-attention uses the row slices [Q] and [K; V].
        self.in_proj = nn.Linear(embed_dim, embed_dim + 2 * kv_dim, bias, device, dtype)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias, device, dtype)
        self._checked: set[tuple[torch.device, torch.dtype]] = set()
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # As torch.nn.MultiheadAttention: Xavier on the stacked projection as if it held all
        # three E x E matrices, U(+-sqrt(6 / (E + 3E))), zero biases. The bound is that of the
        # MHA stack whatever G is: Xavier on the smaller (E + 2*G*D, E) stack of GQA/MQA would
        # draw every weight larger (27% for MQA at 4 heads), so the variants would differ in
        # initial scale as well as in K/V sharing.
        bound = (6.0 / (self.embed_dim + 3 * self.embed_dim)) ** 0.5
        nn.init.uniform_(self.in_proj.weight, -bound, bound)
        if self.in_proj.bias is not None:
            nn.init.zeros_(self.in_proj.bias)
            nn.init.zeros_(self.out_proj.bias)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, dropout={self.dropout}, backend={self.backend!r}"
        )

    @property
    def variant(self) -> str:
        """``"mha"``, ``"gqa"`` or ``"mqa"``."""
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V this layer caches for each decoded position and sentence."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def make_kv_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty :class:`KVCache` for this layer (``num_kv_heads`` heads).

        ``device`` defaults to the parameters' device; ``dtype`` to the autocast dtype
        when autocast is on, else the parameters' dtype.
        """
        weight = self.in_proj.weight
        device = weight.device if device is None else torch.device(device)
        if dtype is None:
            if torch.is_autocast_enabled(device.type):
                dtype = torch.get_autocast_dtype(device.type)
            else:
                dtype = weight.dtype
        return KVCache(
            batch_size, max_len, self.num_kv_heads, self.head_dim, device=device, dtype=dtype
        )

    def forward(
        self,
        query: Tensor,
        key_value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to itself, or to ``key_value`` (cross-attention).

        Args:
            query: ``(B, L, E)``.
            key_value: ``(B, S, E)`` memory for cross-attention; ``None`` (or ``query``
                itself) for self-attention.
            key_padding_mask: ``(B, S)`` bool, True = padding.
            attn_mask: bool (True = masked out) or float (added to the scores),
                broadcastable to ``(B, H, L, S)``.
            is_causal: causal self-attention. With a KV cache the new queries are the
                last ``L`` of ``S`` positions and each sees the keys up to itself.
            kv_cache: a :class:`KVCache` from :meth:`make_kv_cache`.
            need_weights: also return the attention weights ``(B, H, L, S)``, computed
                by the ``math`` path whatever the backend.

        Returns:
            ``(B, L, E)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (B, L, E={self.embed_dim}), got {tuple(query.shape)}")
        B, L, E = query.shape
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        if key_value is query:
            key_value = None

        if key_value is None:
            # Self-attention: Q, K and V from one GEMM, then split (views, no copies).
            qkv = self.in_proj(query)  # (B, L, E + 2*G*D)
            q, k, v = qkv.split([E, G * D, G * D], dim=-1)
        else:
            if key_value.dim() != 3 or key_value.shape[0] != B or key_value.shape[-1] != E:
                raise ValueError(
                    f"key_value must be (B={B}, S, E={E}) to match the query, "
                    f"got {tuple(key_value.shape)}"
                )
            if is_causal:
                raise ValueError("is_causal is for self-attention; got a key_value as well")
            w, b = self.in_proj.weight, self.in_proj.bias
            q = F.linear(query, w[:E], None if b is None else b[:E])  # (B, L, E)
            if kv_cache is not None and kv_cache.size > 0:
                k = v = None  # the memory was projected on the first step
            else:
                kv = F.linear(key_value, w[E:], None if b is None else b[E:])  # (B, S, 2*G*D)
                k, v = kv.split([G * D, G * D], dim=-1)

        q = q.view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        if k is not None:
            k = k.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
            v = v.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
        if kv_cache is not None:
            # Self-attention appends the new positions; cross-attention stores the memory
            # once and reads it back at every later step.
            k, v = kv_cache.update(k, v) if k is not None else kv_cache.get()  # (B, G, S, D)
        S = k.shape[2]

        mask = build_attention_mask(
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            is_causal=is_causal,
            batch_size=B,
            num_heads=H,
            q_len=L,
            kv_len=S,
            dtype=q.dtype,
            device=q.device,
        )
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            out, weights = math_attention_with_weights(q, k, v, mask, dropout_p, self.scale)
        else:
            if (q.device, q.dtype) not in self._checked:
                check_backend(self.backend, q.device, q.dtype)
                self._checked.add((q.device, q.dtype))
            out = BACKENDS[self.backend](q, k, v, mask, dropout_p, self.scale)  # (B, H, L, D)
        if mask.empty_rows is not None:
            # Rows with no key to attend to: zeros, not the mean of unmasked values.
            out = out.masked_fill(mask.empty_rows, 0.0)
            if weights is not None:
                weights = weights.masked_fill(mask.empty_rows, 0.0)

        out = out.transpose(1, 2).reshape(B, L, E)  # (B, L, H*D): heads concatenated
        out = self.out_proj(out)
        return (out, weights) if need_weights else out

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, backend: str = "sdpa") -> MultiHeadAttention:
        """An equivalent layer with ``module``'s weights.

        The new layer is batch-first whatever ``module.batch_first`` says. Masks mean the
        same in both (bool True = masked out; float added), except that a 3-D
        ``attn_mask`` here broadcasts to ``(B, H, L, S)`` instead of being ``(B*H, L, S)``.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
        if not module._qkv_same_embed_dim:
            raise ValueError(
                f"from_torch needs kdim == vdim == embed_dim, got kdim={module.kdim}, "
                f"vdim={module.vdim}, embed_dim={module.embed_dim}"
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("from_torch does not support add_bias_kv or add_zero_attn")
        weight = module.in_proj_weight
        layer = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            backend=backend,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            layer.in_proj.weight.copy_(weight)
            layer.out_proj.weight.copy_(module.out_proj.weight)
            if module.in_proj_bias is not None:
                layer.in_proj.bias.copy_(module.in_proj_bias)
                layer.out_proj.bias.copy_(module.out_proj.bias)
        return layer.train(module.training)

    def with_kv_heads(self, num_kv_heads: int) -> MultiHeadAttention:
        """A copy with fewer K/V heads, each the mean of the heads in its group.

        This is the checkpoint conversion of the GQA paper (Ainslie et al., 2023): the
        ``G`` current K (and V) projection heads are split into ``num_kv_heads``
        consecutive groups and each group is mean-pooled into one head.
        """
        G, D, E = self.num_kv_heads, self.head_dim, self.embed_dim
        if num_kv_heads <= 0 or G % num_kv_heads != 0:
            raise ValueError(
                f"cannot pool {G} K/V heads into {num_kv_heads}: num_kv_heads must divide {G}"
            )
        weight = self.in_proj.weight
        new = MultiHeadAttention(
            E,
            self.num_heads,
            num_kv_heads,
            dropout=self.dropout,
            bias=self.in_proj.bias is not None,
            backend=self.backend,
            device=weight.device,
            dtype=weight.dtype,
        )

        def pool(t: Tensor) -> Tensor:  # (G*D, ...) -> (num_kv_heads*D, ...)
            grouped = t.reshape(num_kv_heads, G // num_kv_heads, D, *t.shape[1:])
            return grouped.mean(dim=1).reshape(num_kv_heads * D, *t.shape[1:])

        with torch.no_grad():
            for name in ("weight", "bias"):
                old = getattr(self.in_proj, name)
                if old is None:
                    continue
                q, k, v = old.split([E, G * D, G * D], dim=0)
                getattr(new.in_proj, name).copy_(torch.cat([q, pool(k), pool(v)], dim=0))
            new.out_proj.load_state_dict(self.out_proj.state_dict())
        return new.train(self.training)
