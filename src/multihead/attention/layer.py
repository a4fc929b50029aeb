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
design); ``forward`` reads top to bottom: positions, project, turn Q and K, cache, mask,
attend, merge, output. A head design runs on the same steps and replaces those it must
(:class:`~multihead.attention.designs.HeadDesign`); the plain layer has none.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

# The built-in head designs register themselves by name when imported.
from multihead.attention import differential, latent, mixing, sparse  # noqa: F401
from multihead.attention.backends import BACKENDS, attend, check_backend, default_scale
from multihead.attention.checks import check_bool, check_positive_int
from multihead.attention.designs import (
    Call,
    HeadDesign,
    check_built_options,
    check_design,
    design_arguments,
    resolve_design,
    scale_heads,
    weights_times_values,
)
from multihead.attention.kv_cache import CacheLayout, KVCache, new_positions
from multihead.attention.masks import build_attention_mask
from multihead.attention.positional import PositionalPart
from multihead.attention.projection import QKVProjection
from multihead.attention.rotary import RotaryPositions


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
        design: a head design: a name of :data:`~multihead.attention.designs.DESIGNS`, an
            import path (``"my_pkg.module.MyDesign"``), a name an installed package declares
            in entry-point group ``multihead.designs``
            (:func:`~multihead.attention.designs.design_class`), or a
            :class:`~multihead.attention.designs.HeadDesign` instance; ``None``: the
            textbook layer.
        positions: a positional part (:mod:`~multihead.attention.positional`) for
            self-attention; ``None``: none, or rotary from ``rotary_dim``.
        rotary_dim: rotary embeddings (:mod:`~multihead.attention.rotary`) on the first
            ``rotary_dim`` features of each head of Q and K; with MLA, the width of its
            decoupled rotary key (DeepSeek-V2's ``qk_rope_head_dim``).
        rope_theta, rope_interleaved: the rotary base and pairing, with ``rotary_dim``.
        design_options: the named design's own options, the keyword-only arguments of its
            class (``design="moh", top_k_heads=2``); refused without a design name.
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
        check_bool("bias", bias)
        check_bool("rope_interleaved", rope_interleaved)
        # Construction knows the name, packages and dropout; the device and dtype are checked
        # on the first forward pass on each, since the parameters may still move.
        check_backend(backend, None, dtype or torch.float32, dropout=dropout)
        if rotary_dim is None and (rope_theta != 10000.0 or rope_interleaved):
            raise ValueError(
                f"rope_theta={rope_theta} and rope_interleaved={rope_interleaved} need rotary "
                "positions; set rotary_dim too"
            )
        design, design_options = resolve_design(design, design_options)
        params = inspect.signature(design).parameters if isinstance(design, type) else {}
        if "rotary_dim" in params:
            # The design's own rotary key (MLA's decoupled one), not the layer's positions:
            # each rotary keyword goes to it, and one it does not take must be the default.
            rotary = dict(rotary_dim=rotary_dim, rope_theta=rope_theta)
            rotary |= dict(rope_interleaved=rope_interleaved)
            layer_defaults = inspect.signature(type(self).__init__).parameters
            for name, value in rotary.items():
                if name in params:
                    design_options[name] = value
                elif value != layer_defaults[name].default:
                    raise ValueError(
                        f"head design {design.name!r} takes rotary_dim but no {name}; got "
                        f"{name}={value!r}"
                    )
            rotary_dim = None

        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.backend = backend
        self.scale = default_scale(self.head_dim)
        # Q, K and V stacked in one (E + 2*G*D, E) matrix (the projection part owns that
        # layout), each head D = E / H wide. A design may set other widths (MLA's, DeepSeek's):
        # Q/K heads narrower or wider, V heads of their own width, Q projected from a low-rank
        # latent of the query instead of from x, and K, V not projected here (its latent's).
        # It says so by its options, before it is built: an instance, or a class and options.
        widths = getattr(design, "widths", None)
        options = design_options if isinstance(design, type) else getattr(design, "options", {})
        q_in, qk_dim, v_dim, projects_kv = (
            (embed_dim, self.head_dim, self.head_dim, True)
            if widths is None
            else widths(embed_dim, num_heads, options)
        )
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
            check_built_options(design, design_options)
        self._design_name = None
        if design is not None:
            check_design(design)
            self._design_name = design.attribute
            self.add_module(design.attribute, design)
            design.check(self)  # what the design cannot work with, refused by its name
        seam = None if self.positions is None else self.positions.seam
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
    def head_config(self) -> dict[str, str | int]:
        """Which heads this layer has: ``kind`` (``"mha"``, ``"gqa"``, ``"mqa"``, or a
        design's own, ``"mla"``), ``H``, ``G``, and the head design's constructor arguments
        (``design``, its name or import path, and its options)."""
        H, G, design = self.num_heads, self.num_kv_heads, self.design
        kind = getattr(design, "kind", None) or ("mha" if G == H else "mqa" if G == 1 else "gqa")
        rotary = {} if self.positions is None else self.positions.options
        return dict(
            kind=kind, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            **design_arguments(self.design), **rotary,
        )  # fmt: skip

    @property
    def head_tag(self) -> str:
        """A short name for :attr:`head_config`, for run names: the kind, ``H``, ``G`` for
        GQA, the design's tag and the positional part's. E.g. ``"mha4"``, ``"gqa8kv2"``,
        ``"mqa4-moh-k2s1"``, ``"mha4-group_mlp2"``, ``"mha8-alibi"``."""
        config = self.head_config
        kv = f"kv{self.num_kv_heads}" if config["kind"] == "gqa" else ""
        design = "" if self.design is None else self.design.tag
        positions = "" if self.positions is None else self.positions.tag
        return f"{config['kind']}{self.num_heads}{kv}{design}{positions}"

    @property
    def has_positions(self) -> bool:
        """Whether the layer places Q and K at positions (rotary, ALiBi, MLA's rotary key)."""
        return self.positions is not None or getattr(self.design, "has_positions", False)

    @property
    def active_head_fraction(self) -> float:
        """The fraction of the ``H`` heads computed for each token (1.0 unless sparse)."""
        return getattr(self.design, "active_head_fraction", 1.0)

    @property
    def aux_loss(self) -> Tensor | None:
        """The head design's auxiliary loss of the last training-mode call (the sparse
        heads' load balancing), or ``None`` (dense layers, eval mode)."""
        return getattr(self.design, "aux_loss", None)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, dropout={self.dropout}, backend={self.backend!r}"
        )

    def head_outputs(self, weights: Tensor, source: Tensor) -> Tensor:
        """Each head's output as it enters ``W^O``, ``(B, H, L, D)``, from the attention
        weights ``(B, H, L, S)`` and the keys' source ``(B, S, E)``: weights times V, or the
        design's (:meth:`.designs.HeadDesign.head_outputs`)."""
        if self.design is None:
            return weights_times_values(self, weights, source)
        return self.design.head_outputs(self, weights, source)

    # ------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V this layer caches for each decoded position and sentence."""
        return self.cache_layout.bytes_per_token(dtype)

    @property
    def cache_layout(self) -> CacheLayout:
        """What the layer's KV cache holds per position: ``G`` heads of ``D`` for K and V,
        or the design's own (MLA's latent)."""
        layout = getattr(self.design, "cache_layout", None)
        return CacheLayout(self.num_kv_heads, self.head_dim, False) if layout is None else layout

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
                ``None`` by default. Refused by a design whose heads have no output of their
                own (``group_mlp``, ``head_attention``, ``diff``).
            position_ids: ``(L,)`` or ``(B, L)`` positions of the queries, for a
                positional part (a left-padded batch); ``None``: those after the positions in
                ``kv_cache`` (``0 .. L-1`` without a cache).

        Returns:
            ``(B, L, E)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (B, L, E={self.embed_dim}), got {tuple(query.shape)}")
        B, L, E = query.shape
        if key_value is not None:  # cross-attention, unless key_value is the query itself
            key_value = self._memory(query, key_value, is_causal)
        if position_ids is not None and not self.has_positions:
            raise ValueError("position_ids are for a positional part; this layer has none")
        if head_mask is not None or self.head_mask is not None:
            head_mask = self._head_mask(head_mask)
        design = self.design
        refuses = design is not None and design.refuses_kv_cache
        if refuses and kv_cache is not None and key_value is None:
            raise ValueError(
                f"head design {design.name!r} refuses a KV cache in self-attention: its formula "
                "needs every key of the sequence at once; decode by running the full prefix "
                "at each step (the Transformer's searches do)"
            )

        # 1. Positions of the new queries (self-attention), for the positional part or the
        # design: position_ids, else those after the positions in the cache.
        positions = None
        if key_value is None and (self.positions is not None or design is not None):
            positions = new_positions(kv_cache, L, query.device, position_ids)  # (L,)/(B, L)

        # 2. Project: Q (B, H, L, D); K, V (B, G, S, D) of the query (self-attention) or of
        # key_value, or none (None) when the cache holds the memory's, projected at the first
        # step. A design may project otherwise (HeadDesign.project: MoH, MLA's latent).
        if design is None and key_value is None:
            q, k, v = self.in_proj.qkv(query)  # one GEMM for the three
        else:
            memory_cached = key_value is not None and kv_cache is not None and kv_cache.size > 0
            source = None if memory_cached else query if key_value is None else key_value
            if design is None:
                q, k, v = self.in_proj.q(query), None, None
                if source is not None:
                    k, v = self.in_proj.kv(source)
            else:
                call = Call(self, query, kv_cache, positions, head_mask, need_weights)
                q, k, v = design.project(source, call)

        # 3. Positions: Q and the new K turned (the rotate seam), before K is cached, so
        # each key is placed once, at its own position.
        if self.positions is not None:
            q, k = self.positions.rotate(q, positions), self.positions.rotate(k, positions)

        # 4. Cache: the new K, V appended and all of them back (B, G, S, D), the keys'
        # positions with them for a score bias; or the memory's read back.
        biased = self.positions is not None and self.positions.seam == "score_bias"
        if kv_cache is not None:
            if k is None:
                k, v = kv_cache.get()
            else:
                k, v = kv_cache.update(k, v, positions) if biased else kv_cache.update(k, v)
            if kv_cache.static:  # its keys are the whole buffers: hide those not written yet
                attn_mask, is_causal = kv_cache.hide_unwritten(attn_mask, L, is_causal)

        # 5. Mask: the caller's masks and a positional score bias (B or 1, H, L, S).
        score_bias = self._score_bias(positions, kv_cache) if biased else None
        mask = build_attention_mask(
            key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
            batch_size=B, num_heads=self.num_heads, q_len=L, kv_len=k.shape[2], dtype=q.dtype,
            device=q.device, score_bias=score_bias,
        )  # fmt: skip

        # 6. Attend: the heads (B, H, L, D). 7. Merge: each scaled by head_mask, side by
        # side as they enter W^O (H * D is E, or less in a layer with pruned heads); output.
        if design is not None:  # the design's (HeadDesign.attend and .merge)
            heads, weights = design.attend(q, k, v, mask, call)
            out = design.merge(heads, call)  # (B, L, E)
        else:  # the kernel, with dropout in training mode only
            heads, weights = attend(
                q, k, v, mask, backend=self.backend, dropout_p=self.dropout * self.training,
                scale=self.scale, need_weights=need_weights,
            )  # fmt: skip
            if head_mask is not None:
                heads = scale_heads(heads, head_mask)
            out = self.out_proj(heads.transpose(1, 2).reshape(B, L, -1))  # (B, L, H*D) -> (B, L, E)
        return (out, weights) if need_weights else out

    def _memory(self, query: Tensor, key_value: Tensor, is_causal: bool) -> Tensor | None:
        """``key_value`` checked for cross-attention; ``None`` if it is ``query`` (self)."""
        if key_value is query:
            return None
        B, E = query.shape[0], self.embed_dim
        if key_value.dim() != 3 or key_value.shape[0] != B or key_value.shape[-1] != E:
            raise ValueError(
                f"key_value must be (B={B}, S, E={E}) to match the query, "
                f"got {tuple(key_value.shape)}"
            )
        if is_causal:
            raise ValueError("is_causal is for self-attention; got a key_value as well")
        if self.has_positions:
            raise ValueError("positions are for self-attention; got a key_value (cross-attention)")
        return key_value

    def _score_bias(self, positions: Tensor, kv_cache: KVCache | None) -> Tensor:
        """The positional part's bias ``(B or 1, H, L, S)`` for queries at ``positions``:
        the keys' positions are the queries' (a full pass) or read back from the cache (a
        left-padded row's own)."""
        key_positions = positions if kv_cache is None else kv_cache.key_positions()
        return self.positions.score_bias(positions, key_positions)

    def _head_mask(self, head_mask: Tensor | None) -> Tensor:
        """The call's ``head_mask``, else the layer's, checked."""
        head_mask = self.head_mask if head_mask is None else head_mask
        if not isinstance(head_mask, Tensor) or tuple(head_mask.shape) != (self.num_heads,):
            got = tuple(head_mask.shape) if isinstance(head_mask, Tensor) else repr(head_mask)
            raise ValueError(f"head_mask must be a tensor of shape ({self.num_heads},), got {got}")
        if self.design is not None and not self.design.takes_head_mask:
            raise ValueError(
                f"head_mask is undefined for head design {self.design.name!r}: it mixes the "
                "heads after the scale, so a head has no contribution of its own to scale; use "
                "a design whose heads have their own outputs (HeadDesign.takes_head_mask)"
            )
        return head_mask
