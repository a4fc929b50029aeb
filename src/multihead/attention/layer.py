"""Multi-head attention with grouped K/V heads (MHA, GQA, MQA) in one layer.

The layer computes the formula of "Attention Is All You Need"::

    head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(D)) V W_i^V
    out    = concat(head_1, ..., head_H) W^O

with ``G = num_kv_heads`` key/value heads shared by groups of ``H / G`` query heads::

    MHA (G = H)          GQA (1 < G < H)      MQA (G = 1)
    q: 1 2 3 4           q: 1 2 3 4           q: 1 2 3 4
       | | | |              \\| |/               \\ \\/ /
    kv:1 2 3 4           kv:  1  2            kv:   1

``forward`` is that formula as four steps, ``_project -> _mask -> _attend -> out_proj``. A
head design is a part the layer is built with, which replaces the steps it changes: sparse
heads (:mod:`~multihead.attention.sparse`) or a head mixing
(:mod:`~multihead.attention.mixing`). The kernel that evaluates softmax(QK^T)V is picked by
name from :mod:`~multihead.attention.backends`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention.backends import (
    BACKENDS,
    check_backend,
    default_scale,
    math_attention_with_weights,
)
from multihead.attention.designs import build_head_design
from multihead.attention.kv_cache import KVCache
from multihead.attention.masks import AttentionMask, build_attention_mask
from multihead.attention.mixing import HeadMixing
from multihead.attention.sparse import SparseHeads


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
        top_k_heads, num_shared_heads: sparse heads, see
            :class:`~multihead.attention.sparse.SparseHeads` (state_dict ``head_gate``).
        head_mixing, mixing_groups: a head mixing, ``"talking_heads"`` (``math`` backend
            only), ``"group_mlp"`` (``mixing_groups`` groups, default 2) or
            ``"head_attention"``; see :mod:`~multihead.attention.mixing` (``head_mix``).
            A layer has at most one head design.
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
        top_k_heads: int | None = None,
        num_shared_heads: int = 0,
        head_mixing: str | None = None,
        mixing_groups: int | None = None,
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
        # Construction knows the name, packages and dropout; the device and dtype are checked
        # on the first forward pass on each, since the parameters may still move.
        here = torch.device("cpu" if device is None else device)
        check_backend(backend, here, dtype or torch.float32, dropout=dropout, anywhere=True)

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

        # The head design comes after the projections' init, so a layer with one draws the
        # same Q/K/V/O weights as the plain layer from the same seed.
        design = build_head_design(
            embed_dim, num_heads, backend=backend, top_k_heads=top_k_heads,
            num_shared_heads=num_shared_heads, head_mixing=head_mixing,
            mixing_groups=mixing_groups, device=device, dtype=dtype,
        )  # fmt: skip
        self._design_name = None if design is None else design[0]
        if design is not None:
            self.add_module(*design)

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

    # ------------------------------------------------------------------ what was built
    @property
    def design(self) -> SparseHeads | HeadMixing | None:
        """The head design part, or ``None`` for the textbook layer."""
        return None if self._design_name is None else getattr(self, self._design_name)

    @property
    def head_config(self) -> dict[str, str | int]:
        """Which heads this layer has: ``kind`` (``"mha"``, ``"gqa"`` or ``"mqa"``), ``H``,
        ``G`` and the constructor arguments of its head design, if any."""
        kind = "mha" if self.num_kv_heads == self.num_heads else "gqa"
        kind = "mqa" if self.num_kv_heads == 1 and self.num_heads > 1 else kind
        design = {} if self.design is None else self.design.options
        return {
            "kind": kind,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            **design,
        }

    @property
    def head_tag(self) -> str:
        """A short name for :attr:`head_config`, for run names: the kind, ``H``, ``G`` for
        GQA, and the design's tag. E.g. ``"mha4"``, ``"gqa8kv2"``, ``"mqa4-moh-k2s1"``,
        ``"mha4-group_mlp2"``."""
        config = self.head_config
        kv = f"kv{self.num_kv_heads}" if config["kind"] == "gqa" else ""
        design = "" if self.design is None else self.design.tag
        return f"{config['kind']}{self.num_heads}{kv}{design}"

    @property
    def active_head_fraction(self) -> float:
        """The fraction of the ``H`` heads computed for each token (1.0 unless sparse)."""
        return getattr(self.design, "active_head_fraction", 1.0)

    @property
    def aux_loss(self) -> Tensor | None:
        """The sparse heads' load-balancing loss of the last training-mode call, or ``None``
        (dense layers, eval mode); see :class:`~multihead.attention.sparse.SparseHeads`."""
        return getattr(self.design, "aux_loss", None)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, dropout={self.dropout}, backend={self.backend!r}"
        )

    # ------------------------------------------------------------------ KV cache
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
        static: bool = False,
    ) -> KVCache:
        """An empty :class:`KVCache` for this layer (``num_kv_heads`` heads).

        ``device`` defaults to the parameters' device; ``dtype`` to the autocast dtype
        when autocast is on, else the parameters' dtype. ``static=True`` makes the cache
        whose shapes never change, for decoding under ``torch.compile`` (see
        :class:`KVCache`).
        """
        weight = self.in_proj.weight
        device = weight.device if device is None else torch.device(device)
        if dtype is None:
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else weight.dtype
        return KVCache(
            batch_size,
            max_len,
            self.num_kv_heads,
            self.head_dim,
            device=device,
            dtype=dtype,
            static=static,
        )

    # ------------------------------------------------------------------ forward
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
                by the ``math`` path whatever the backend (a head design's own weights:
                see its part).

        Returns:
            ``(B, L, E)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        B, L, E = self._check_inputs(query, key_value, is_causal)
        key_value = None if key_value is query else key_value
        if self.design is not None:
            # The one hook: a head design runs these steps itself, with its own in place of
            # the ones it changes (sparse heads: all but the mask; a mixing: attend or W^O).
            return self.design.attention(
                self, query, key_value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                is_causal=is_causal, kv_cache=kv_cache, need_weights=need_weights,
            )  # fmt: skip
        q, k, v = self._project(query, key_value, kv_cache)  # (B, H, L, D), (B, G, S, D)
        mask = self._mask(q, k, key_padding_mask, attn_mask, is_causal, kv_cache)
        heads, weights = self._attend(q, k, v, mask, need_weights)  # (B, H, L, D)
        out = self.out_proj(heads.transpose(1, 2).reshape(B, L, E))  # heads concatenated
        return (out, weights) if need_weights else out

    def _check_inputs(self, query: Tensor, key_value: Tensor | None, is_causal: bool):
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (B, L, E={self.embed_dim}), got {tuple(query.shape)}")
        B, L, E = query.shape
        if key_value is not None and key_value is not query:
            if key_value.dim() != 3 or key_value.shape[0] != B or key_value.shape[-1] != E:
                raise ValueError(
                    f"key_value must be (B={B}, S, E={E}) to match the query, "
                    f"got {tuple(key_value.shape)}"
                )
            if is_causal:
                raise ValueError("is_causal is for self-attention; got a key_value as well")
        return B, L, E

    def _project(
        self, query: Tensor, key_value: Tensor | None, kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Q ``(B, H, L, D)`` and K, V ``(B, G, S, D)``, the cached positions included."""
        B, L, E = query.shape
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        if key_value is None:
            # Self-attention: Q, K and V from one GEMM, then split (views, no copies).
            q, k, v = self.in_proj(query).split([E, G * D, G * D], dim=-1)  # (B, L, E|G*D)
            k = k.view(B, L, G, D).transpose(1, 2)  # (B, G, L, D)
            v = v.view(B, L, G, D).transpose(1, 2)  # (B, G, L, D)
            if kv_cache is not None:
                k, v = kv_cache.update(k, v)  # (B, G, S, D): the new positions appended
        else:
            w, b = self.in_proj.weight, self.in_proj.bias
            q = F.linear(query, w[:E], None if b is None else b[:E])  # (B, L, E)
            k, v = self._project_kv(key_value, kv_cache, cross=True)  # (B, G, S, D)
        return q.view(B, L, H, D).transpose(1, 2), k, v  # (B, H, L, D)

    def _project_kv(
        self, source: Tensor, kv_cache: KVCache | None, *, cross: bool
    ) -> tuple[Tensor, Tensor]:
        """K and V ``(B, G, S, D)`` of ``source`` alone, through ``kv_cache`` if given.

        Self-attention appends the new positions to the cache; cross-attention stores the
        memory at the first step and reads it back at every later one, unprojected.
        """
        if cross and kv_cache is not None and kv_cache.size > 0:
            return kv_cache.get()
        B, E, G, D = source.shape[0], self.embed_dim, self.num_kv_heads, self.head_dim
        w, b = self.in_proj.weight, self.in_proj.bias
        k, v = F.linear(source, w[E:], None if b is None else b[E:]).split([G * D, G * D], -1)
        k = k.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
        v = v.view(B, -1, G, D).transpose(1, 2)  # (B, G, S, D)
        return (k, v) if kv_cache is None else kv_cache.update(k, v)

    def _mask(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        kv_cache: KVCache | None = None,
    ) -> AttentionMask:
        """The caller's masks for queries ``q`` ``(B, ·, L, D)`` and keys ``k`` ``(B, G, S, D)``,
        in the kernels' form (:func:`~multihead.attention.masks.build_attention_mask`).

        With a static ``kv_cache`` the keys are its whole buffers: the positions it hides
        (:meth:`KVCache.hidden_keys`) join ``attn_mask``, causality included.
        """
        if kv_cache is not None and kv_cache.static:
            hidden = kv_cache.hidden_keys(q.shape[2], is_causal)  # (L, S), True = masked out
            if attn_mask is None or attn_mask.dtype == torch.bool:
                attn_mask = hidden if attn_mask is None else attn_mask | hidden
            else:
                attn_mask = attn_mask.masked_fill(hidden, float("-inf"))
            is_causal = False
        return build_attention_mask(
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            is_causal=is_causal,
            batch_size=q.shape[0],
            num_heads=self.num_heads,
            q_len=q.shape[2],
            kv_len=k.shape[2],
            dtype=q.dtype,
            device=q.device,
        )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """softmax(QK^T)V ``(B, H, L, D)`` by the backend, or by the math path with the
        weights ``(B, H, L, S)`` when they are asked for."""
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            out, weights = math_attention_with_weights(q, k, v, mask, dropout_p, self.scale)
        else:
            self._check_backend_once(q)
            out = BACKENDS[self.backend](q, k, v, mask, dropout_p, self.scale)
        if mask.empty_rows is not None:
            # Rows with no key to attend to: zeros, not the mean of unmasked values.
            out = out.masked_fill(mask.empty_rows, 0.0)
            if weights is not None:
                weights = weights.masked_fill(mask.empty_rows, 0.0)
        return out, weights

    def _check_backend_once(self, q: Tensor) -> None:
        """Check the backend on the first call on ``q``'s device and dtype."""
        if torch.compiler.is_compiling():
            # Checked while tracing: Python only, nothing in the graph. Adding to _checked
            # here would fail the compiled code's guard on the set and recompile next call.
            check_backend(self.backend, q.device, q.dtype, head_dim=self.head_dim)
        elif (q.device, q.dtype) not in self._checked:
            check_backend(self.backend, q.device, q.dtype, head_dim=self.head_dim)
            self._checked.add((q.device, q.dtype))

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, backend: str = "sdpa") -> MultiHeadAttention:
        """An equivalent layer with ``module``'s weights, see :func:`.convert.from_torch`."""
        from multihead.attention.convert import from_torch

        return from_torch(module, backend)

    def with_kv_heads(self, num_kv_heads: int) -> MultiHeadAttention:
        """A copy with ``num_kv_heads`` mean-pooled K/V heads, see :func:`.pool_kv_heads`."""
        from multihead.attention.convert import pool_kv_heads

        return pool_kv_heads(self, num_kv_heads)
