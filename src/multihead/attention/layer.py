"""Multi-head attention with grouped K/V heads (MHA, GQA, MQA) in one layer.

The layer computes the formula of "Attention Is All You Need"::

    head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(D)) V W_i^V
    out    = concat(head_1, ..., head_H) W^O

with ``G = num_kv_heads`` key/value heads shared by groups of ``H / G`` query heads::

    MHA (G = H)          GQA (1 < G < H)      MQA (G = 1)
    q: 1 2 3 4           q: 1 2 3 4           q: 1 2 3 4
       | | | |              \\| |/               \\ \\/ /
    kv:1 2 3 4           kv:  1  2            kv:   1

The layer composes the parts below it (projection, positions, KV cache, kernel, head
design); ``forward`` reads top to bottom: project, positions, cache, attend, merge, output.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

# The built-in head designs register themselves by name when imported.
from multihead.attention import differential, latent, mixing, sparse  # noqa: F401
from multihead.attention.backends import BACKENDS, check_backend, default_scale
from multihead.attention.checks import check_positive_int
from multihead.attention.designs import (
    HeadDesign,
    check_attribute,
    kernel_of,
    make_mask,
    resolve_design,
    scale_heads,
)
from multihead.attention.kv_cache import CacheLayout, KVCache, new_positions
from multihead.attention.positional import PositionalPart
from multihead.attention.projection import QKVProjection
from multihead.attention.rotary import RotaryPositions

_NO_DESIGN = HeadDesign()  # the defaults of a layer without a head design


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
        backend: the kernel, a name of :data:`~multihead.attention.backends.BACKENDS`
            (``math``: the written-out reference); if it cannot run, it says why.
        design: a head design, a name of :data:`~multihead.attention.designs.DESIGNS` or a
            :class:`~multihead.attention.designs.HeadDesign` instance; ``None``: the textbook
            layer, or the design that one of ``design_options`` selects.
        positions: a positional part (:mod:`~multihead.attention.positional`) for
            self-attention; ``None``: none, or rotary from ``rotary_dim``.
        rotary_dim: rotary embeddings (:mod:`~multihead.attention.rotary`) on the first
            ``rotary_dim`` features of each head of Q and K; with MLA, the width of its
            decoupled rotary key (DeepSeek-V2's ``qk_rope_head_dim``).
        rope_theta, rope_interleaved: the rotary base and pairing, with ``rotary_dim``.
        design_options: the design's own options, as its class takes them. The older
            keywords select their design: ``top_k_heads``, ``num_shared_heads`` (``"moh"``),
            ``head_mixing`` (a mixing's name), ``mixing_groups``, ``kv_latent_dim``,
            ``kv_latent_norm`` (``"mla"``).
        device, dtype: for the parameters.

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

    Incremental decoding keeps ``G`` heads per position in a :class:`KVCache` (its example).
    """

    def __init__(
        self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *,
        dropout: float = 0.0, bias: bool = True, backend: str = "sdpa",
        design: str | HeadDesign | None = None, positions: PositionalPart | None = None,
        rotary_dim: int | None = None, rope_theta: float = 10000.0, rope_interleaved: bool = False,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
        **design_options,
    ) -> None:  # fmt: skip
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
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
        check_backend(backend, None, dtype or torch.float32, dropout=dropout)
        if rotary_dim is None and (rope_theta != 10000.0 or rope_interleaved):
            raise ValueError(
                f"rope_theta={rope_theta} and rope_interleaved={rope_interleaved} need rotary "
                "positions; set rotary_dim too"
            )
        design, design_options = resolve_design(design, design_options)
        if isinstance(design, type) and "rotary_dim" in inspect.signature(design).parameters:
            # The design's own rotary key (MLA's decoupled one), not the layer's positions.
            rotary = dict(rotary_dim=rotary_dim, rope_theta=rope_theta)
            design_options |= rotary | dict(rope_interleaved=rope_interleaved)
            rotary_dim = None

        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.backend = backend
        self.scale = default_scale(self.head_dim)
        # Q, K and V stacked in one (E + 2*G*D, E) matrix (the projection part owns that
        # layout); a design whose K and V come from elsewhere (MLA's latent) projects Q alone.
        projects_kv = design is None or design.projects_kv
        # MLA's widths (DeepSeek's): Q/K heads narrower or wider than E / H, V heads of their
        # own width, and Q projected from a low-rank latent of the query instead of from x.
        qk_dim = design_options.get("qk_head_dim", self.head_dim)
        v_dim = design_options.get("v_head_dim", self.head_dim)
        q_in = design_options.get("q_latent_dim", embed_dim)
        self.in_proj = QKVProjection(
            q_in, num_heads, num_kv_heads, qk_dim, bias=bias, kv=projects_kv,
            device=device, dtype=dtype,
        )  # fmt: skip
        self.out_proj = nn.Linear(num_heads * v_dim, embed_dim, bias, device, dtype)
        # forward's default head_mask, (H,) or None: a plain attribute, not in the state_dict.
        self.head_mask: Tensor | None = None
        # A position encoding for self-attention (torchtune's pos_embeddings): none by default.
        if positions is not None and rotary_dim is not None:
            raise ValueError(f"rotary_dim={rotary_dim} builds positions; positions was given too")
        if rotary_dim is not None:
            positions = RotaryPositions(
                self.head_dim, rotary_dim=rotary_dim, theta=rope_theta, interleaved=rope_interleaved
            )
        self.positions = positions
        # As torch.nn.MultiheadAttention: Xavier on the stacked projection as if it held all
        # three E x E matrices, U(+-sqrt(6 / (E + 3E))), zero biases, whatever G is: a smaller
        # GQA/MQA stack would otherwise draw larger weights (27% for MQA at 4 heads).
        bound = (6.0 / (embed_dim + 3 * embed_dim)) ** 0.5
        nn.init.uniform_(self.in_proj.weight, -bound, bound)
        if bias:
            nn.init.zeros_(self.in_proj.bias)
            nn.init.zeros_(self.out_proj.bias)

        # The head design comes after the projections' init, so a layer with one draws the
        # same Q/K/V/O weights as the plain layer from the same seed.
        if isinstance(design, type):
            factory = {"bias": bias, "device": device, "dtype": dtype}
            design = design(embed_dim, num_heads, num_kv_heads, **factory, **design_options)
        if design is not None:
            check_attribute(design)
        self._design_name = None if design is None else design.attribute
        if design is not None:
            self.add_module(design.attribute, design)
        part = self._part
        # What the design and the backend declare they work with (HeadDesign's attributes,
        # the backend's registry entry).
        if part.backends is not None and self.backend not in part.backends:
            raise ValueError(
                f"head design {part.name!r} runs on backend {', '.join(sorted(part.backends))} "
                f"only; got backend={self.backend!r}"
            )
        if not part.any_kv_heads and self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"head design {part.name!r} has one K/V head per query head; got "
                f"num_kv_heads={self.num_kv_heads} for num_heads={self.num_heads}"
            )
        seam = None if self.positions is None else self.positions.seam
        if seam is not None and seam not in part.seams:
            raise ValueError(
                f"head design {part.name!r} takes no positional part with seam {seam!r}; "
                f"it takes: {', '.join(sorted(part.seams)) or 'none'}"
            )
        if seam == "score_bias" and not BACKENDS[self.backend].score_bias:
            takes = [n for n, b in BACKENDS.items() if b.score_bias]
            raise ValueError(
                f"backend {self.backend!r} takes no score bias ({type(self.positions).__name__}); "
                f"use one of {', '.join(takes)}"
            )

    # ------------------------------------------------------------------ what was built
    @property
    def design(self) -> HeadDesign | None:
        """The head design part, or ``None`` for the textbook layer."""
        return None if self._design_name is None else getattr(self, self._design_name)

    @property
    def _part(self) -> HeadDesign:  # the design, or the interface's defaults
        return _NO_DESIGN if self._design_name is None else self.design

    @property
    def head_config(self) -> dict[str, str | int]:
        """Which heads this layer has: ``kind`` (``"mha"``, ``"gqa"``, ``"mqa"``, or a
        design's own, ``"mla"``), ``H``, ``G`` and the head design's constructor arguments."""
        H, G = self.num_heads, self.num_kv_heads
        kind = self._part.kind or ("mha" if G == H else "mqa" if G == 1 else "gqa")
        rotary = {} if self.positions is None else self.positions.options
        return dict(
            kind=kind, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            **self._part.options, **rotary,
        )  # fmt: skip

    @property
    def head_tag(self) -> str:
        """A short name for :attr:`head_config`, for run names: the kind, ``H``, ``G`` for
        GQA, the design's tag and the positional part's. E.g. ``"mha4"``, ``"gqa8kv2"``,
        ``"mqa4-moh-k2s1"``, ``"mha4-group_mlp2"``, ``"mha8-alibi"``."""
        config = self.head_config
        kv = f"kv{self.num_kv_heads}" if config["kind"] == "gqa" else ""
        positions = "" if self.positions is None else self.positions.tag
        return f"{config['kind']}{self.num_heads}{kv}{self._part.tag}{positions}"

    @property
    def has_positions(self) -> bool:
        """Whether the layer places Q and K at positions (rotary, or MLA's rotary key)."""
        return self.positions is not None or self._part.has_positions

    @property
    def active_head_fraction(self) -> float:
        """The fraction of the ``H`` heads computed for each token (1.0 unless sparse)."""
        return self._part.active_head_fraction

    @property
    def aux_loss(self) -> Tensor | None:
        """The head design's auxiliary loss of the last training-mode call (the sparse
        heads' load balancing), or ``None`` (dense layers, eval mode)."""
        return self._part.aux_loss

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, dropout={self.dropout}, backend={self.backend!r}"
        )

    def head_outputs(self, weights: Tensor, source: Tensor) -> Tensor:
        """Each head's output as it enters ``W^O``: :meth:`.designs.HeadDesign.head_outputs`."""
        return self._part.head_outputs(self, weights, source)

    # ------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V this layer caches for each decoded position and sentence."""
        return self.cache_layout.bytes_per_token(dtype)

    @property
    def cache_layout(self) -> CacheLayout:
        """What the layer's KV cache holds per position (a head design may change it)."""
        return self._part.cache_layout(self)

    def make_kv_cache(
        self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
        dtype: torch.dtype | None = None, static: bool = False,
    ) -> KVCache:  # fmt: skip
        """An empty :class:`KVCache` of :attr:`cache_layout`, on the parameters' device and
        in the autocast dtype if on, else theirs; ``static``: for ``torch.compile``."""
        weight = self.in_proj.weight
        device = weight.device if device is None else torch.device(device)
        if dtype is None:
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else weight.dtype
        heads, width, shared = self.cache_layout
        return KVCache(
            batch_size, max_len, heads, width, device=device, dtype=dtype, static=static,
            share_kv=shared,
        )  # fmt: skip

    # ------------------------------------------------------------------ forward
    def forward(
        self, query: Tensor, key_value: Tensor | None = None, *,
        key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
        is_causal: bool = False, kv_cache: KVCache | None = None, need_weights: bool = False,
        head_mask: Tensor | None = None, position_ids: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """Attend from ``query`` to itself, or to ``key_value`` (cross-attention).

        Args:
            query: ``(B, L, E)``.
            key_value: ``(B, S, E)`` memory for cross-attention; ``None`` for self-attention.
            key_padding_mask: ``(B, S)`` bool, True = padding.
            attn_mask: bool (True = masked out) or float (added to the scores),
                broadcastable to ``(B, H, L, S)``.
            is_causal: causal self-attention (with a KV cache: the queries are the last
                ``L`` of ``S`` positions).
            kv_cache: a :class:`KVCache` from :meth:`make_kv_cache`.
            need_weights: also return the weights ``(B, H, L, S)``, by the ``math`` path.
            head_mask: ``(H,)``, a scale on each query head's output before ``W^O``
                (:func:`~.designs.scale_heads`); ``None``: the layer's :attr:`head_mask`,
                ``None`` by default. Refused by ``group_mlp`` and ``head_attention``.
            position_ids: ``(L,)`` or ``(B, L)`` positions of the queries, for a
                positional part (a left-padded batch); ``None``: those after the positions in
                ``kv_cache`` (``0 .. L-1`` without a cache).

        Returns:
            ``(B, L, E)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (B, L, E={self.embed_dim}), got {tuple(query.shape)}")
        B, L, E = query.shape
        key_value = None if key_value is query else key_value
        if key_value is not None:
            if key_value.dim() != 3 or key_value.shape[0] != B or key_value.shape[-1] != E:
                raise ValueError(
                    f"key_value must be (B={B}, S, E={E}) to match the query, "
                    f"got {tuple(key_value.shape)}"
                )
            if is_causal:
                raise ValueError("is_causal is for self-attention; got a key_value as well")
            if self.has_positions:
                raise ValueError(
                    "positions are for self-attention; got a key_value (cross-attention)"
                )
        if position_ids is not None and not self.has_positions:
            raise ValueError("position_ids are for a positional part; this layer has none")
        head_mask = self.head_mask if head_mask is None else head_mask
        if head_mask is not None and (
            not isinstance(head_mask, Tensor) or tuple(head_mask.shape) != (self.num_heads,)
        ):
            got = tuple(head_mask.shape) if isinstance(head_mask, Tensor) else repr(head_mask)
            raise ValueError(f"head_mask must be a tensor of shape ({self.num_heads},), got {got}")
        part = self._part
        if head_mask is not None and not part.head_mask:
            raise ValueError(
                f"head_mask is undefined for head design {part.name!r}: it mixes the heads "
                "after the scale, so a head has no contribution of its own to scale; use "
                "a layer without a mixing, or talking_heads"
            )
        masks = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal)
        if part.replaces_forward:  # sparse heads, latent K/V: the design's own forward
            return part.attention(
                self, query, key_value, kv_cache=kv_cache, need_weights=need_weights,
                head_mask=head_mask, position_ids=position_ids, **masks,
            )  # fmt: skip

        # 1. Project: Q (B, H, L, D); K, V (B, G, S, D) of key_value, or of query (self).
        memory_cached = key_value is not None and kv_cache is not None and kv_cache.size > 0
        if key_value is None:
            q, k, v = self.in_proj.qkv(query)
        elif memory_cached:  # cross-attention: the memory was projected at the first step
            q, (k, v) = self.in_proj.q(query), kv_cache.get()
        else:
            q, (k, v) = self.in_proj.q(query), self.in_proj.kv(key_value)

        # 2. Positions (self-attention): Q and the new K turned, before K is cached, so
        # each key is placed once, at its own position.
        positions = None
        if self.positions is not None:
            positions = new_positions(kv_cache, L, query.device, position_ids)  # (L,)/(B, L)
            q, k = self.positions.rotate(q, positions), self.positions.rotate(k, positions)

        # 3. Cache: the new positions appended, all of them back (B, G, S, D). A score bias
        # reads the keys' own positions back from it (a left-padded row's start at 0).
        biased = self.positions is not None and self.positions.seam == "score_bias"
        if kv_cache is not None and not memory_cached:
            k, v = kv_cache.update(k, v, positions) if biased else kv_cache.update(k, v)

        # 4. Attend: the caller's masks and a positional score bias (B or 1, H, L, S).
        score_bias = None
        if biased:
            key_positions = positions if kv_cache is None else kv_cache.key_positions()
            score_bias = self.positions.score_bias(positions, key_positions)
        mask = make_mask(q, k, kv_cache, num_heads=self.num_heads, score_bias=score_bias, **masks)
        heads, weights = part.attend(q, k, v, mask, kernel_of(self, need_weights))  # (B,H,L,D)

        # 5. Merge: each head scaled by head_mask, the heads side by side as they enter W^O
        # (a mixing changes them here); H * D is E, or less in a layer with pruned heads.
        heads = part.mix(scale_heads(heads, head_mask).transpose(1, 2))  # (B, L, H, D)
        # 6. Output.
        out = self.out_proj(heads.reshape(B, L, -1))  # (B, L, E)
        return (out, weights) if need_weights else out
