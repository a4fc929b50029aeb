"""Multi-head attention with grouped K/V heads (MHA, GQA, MQA) in one layer.

The layer computes the formula of "Attention Is All You Need"::

    head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(D)) V W_i^V
    out    = concat(head_1, ..., head_H) W^O

with ``G = num_kv_heads`` key/value heads shared by groups of ``H / G`` query heads::

    MHA (G = H)          GQA (1 < G < H)      MQA (G = 1)
    q: 1 2 3 4           q: 1 2 3 4           q: 1 2 3 4
       | | | |              \\| |/               \\ \\/ /
    kv:1 2 3 4           kv:  1  2            kv:   1

Two further head designs are options of the same layer (off by default):

* sparse heads (Mixture-of-Head attention, MoH): a per-token gate picks ``top_k_heads`` of
  the routed heads; only those are computed and they are summed with softmax weights;
  ``num_shared_heads`` heads are always on;
* head mixing: ``talking_heads`` (learned H x H mixes of the logits and of the weights),
  ``group_mlp`` (an MLP over each group's concatenated head outputs) or ``head_attention``
  (attention among the H head outputs at each position).

The kernel that evaluates softmax(QK^T)V is picked by name from
:mod:`multihead.attention.backends`; this module only projects, reshapes, routes and caches.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention.backends import (
    BACKENDS,
    check_backend,
    default_scale,
    math_attention_with_weights,
)
from multihead.attention.kv_cache import KVCache
from multihead.attention.masks import AttentionMask, build_attention_mask

HEAD_MIXINGS = ("talking_heads", "group_mlp", "head_attention")
# Mixings that need every head's full logits, which only the math path materialises.
_LOGIT_MIXINGS = ("talking_heads",)


def _check_head_design(
    num_heads: int,
    backend: str,
    top_k_heads: int | None,
    num_shared_heads: int,
    head_mixing: str | None,
    mixing_groups: int | None,
) -> None:
    """Raise ValueError for a head design that cannot be built, naming the values."""
    for name, value in (("top_k_heads", top_k_heads), ("num_shared_heads", num_shared_heads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if top_k_heads is None:
        if num_shared_heads:
            raise ValueError(
                f"num_shared_heads={num_shared_heads} needs sparse heads; set top_k_heads too"
            )
    else:
        if not 0 <= num_shared_heads < num_heads:
            raise ValueError(
                f"num_shared_heads must be in [0, num_heads={num_heads}), got {num_shared_heads}"
            )
        routed = num_heads - num_shared_heads
        if not 1 <= top_k_heads <= routed:
            raise ValueError(
                f"top_k_heads must be in [1, {routed}] (num_heads={num_heads} minus "
                f"num_shared_heads={num_shared_heads}), got top_k_heads={top_k_heads}"
            )
        if head_mixing is not None:
            raise ValueError(
                f"top_k_heads={top_k_heads} cannot be combined with head_mixing="
                f"{head_mixing!r}: a mixing reads every head, a sparse layer skips some"
            )
    if head_mixing is not None and head_mixing not in HEAD_MIXINGS:
        raise ValueError(
            f"unknown head_mixing {head_mixing!r}; expected None or one of "
            f"{', '.join(HEAD_MIXINGS)}"
        )
    if head_mixing in _LOGIT_MIXINGS and backend != "math":
        raise ValueError(
            f"head_mixing={head_mixing!r} mixes the full attention logits, which only the "
            f"'math' backend computes; got backend={backend!r}. Use backend='math', or a "
            "mixing that runs on any backend: "
            + ", ".join(m for m in HEAD_MIXINGS if m not in _LOGIT_MIXINGS)
        )
    if mixing_groups is not None:
        if head_mixing != "group_mlp":
            raise ValueError(
                f"mixing_groups={mixing_groups} is for head_mixing='group_mlp', "
                f"got head_mixing={head_mixing!r}"
            )
        if isinstance(mixing_groups, bool) or not isinstance(mixing_groups, int):
            raise TypeError(f"mixing_groups must be an integer, got {mixing_groups!r}")
    if head_mixing == "group_mlp":
        groups = mixing_groups or 2
        if groups <= 0 or num_heads % groups != 0:
            raise ValueError(
                f"mixing_groups ({groups}) must be a positive divisor of num_heads ({num_heads})"
            )


def _kv_for_heads(t: Tensor, first: int, count: int, num_heads: int) -> Tensor:
    """The K (or V) heads ``(B, G, S, D)`` serving query heads ``first .. first + count - 1``.

    Returned in the grouped form the kernels take: a slice when those query heads make
    whole groups, the single head for MQA, else one K/V head per query head (a copy).
    """
    G = t.shape[1]
    per_group = num_heads // G
    if G == 1:
        return t
    if first % per_group == 0 and count % per_group == 0:
        return t[:, first // per_group : (first + count) // per_group]  # (B, count/r, S, D)
    index = torch.arange(first, first + count, device=t.device) // per_group
    return t.index_select(1, index)  # (B, count, S, D)


def _pack_front(flags: Tensor) -> tuple[Tensor, Tensor]:
    """Indices of the True entries of ``flags`` ``(..., N)``, in order, packed to the front.

    Returns ``(index, valid)``, both ``(..., M)`` with ``M`` the most True entries of any
    row; ``index`` is ``N`` where ``valid`` is False (past a row's last True entry).
    """
    N = flags.shape[-1]
    M = int(flags.sum(dim=-1).max())
    positions = torch.arange(N, device=flags.device)
    index = torch.where(flags, positions, N).sort(dim=-1).values[..., :M]  # (..., M)
    return index, index < N


def _mask_rows(t: Tensor | None, first: int, count: int, slots: Tensor | None) -> Tensor | None:
    """Rows of a mask broadcastable to ``(B, H, L, X)`` for some heads and query slots.

    Keeps heads ``first .. first + count - 1``; with ``slots`` ``(B, count, C)`` (query
    positions), gathers those rows, giving a tensor broadcastable to ``(B, count, C, X)``.
    """
    if t is None:
        return None
    t = t[(None,) * (4 - t.dim())]  # (b, h, l, X) with b, h, l either full or 1
    if t.shape[1] > 1:
        t = t[:, first : first + count]
    if slots is None or t.shape[2] == 1:
        return t
    B, _, C = slots.shape
    t = t.expand(B, count, t.shape[2], t.shape[3])  # (B, count, L, X), a view
    return t.gather(2, slots.unsqueeze(-1).expand(B, count, C, t.shape[3]))  # (B, count, C, X)


class TalkingHeads(nn.Module):
    """The two ``(H, H)`` mixes of talking-heads attention (Shazeer et al., 2020).

    Head ``j``'s logits become ``sum_i logits_i * logit_mix[i, j]`` (before the mask and
    softmax) and its weights ``sum_i weights_i * weight_mix[i, j]`` (after the softmax, before
    the weights multiply V); the output projection ``W^O`` then runs as usual. Both start as
    the identity, so the layer starts as plain multi-head attention.
    """

    def __init__(self, num_heads: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.logit_mix = nn.Parameter(torch.eye(num_heads, device=device, dtype=dtype))
        self.weight_mix = nn.Parameter(torch.eye(num_heads, device=device, dtype=dtype))


class GroupMLPMixing(nn.Module):
    """An MLP over each group's concatenated head outputs, before ``W^O``.

    The ``H`` heads are split into ``groups`` consecutive groups of ``H / groups`` heads;
    group ``g``'s concatenated outputs ``x_g`` (width ``w = E / groups``) become
    ``x_g + W2_g gelu(W1_g x_g + b1_g) + b2_g`` with one ``(w, w)`` MLP per group. ``W2`` and
    the biases start at zero, so the mixing starts as the identity.
    """

    def __init__(self, num_heads: int, head_dim: int, groups: int, *, device=None, dtype=None):
        super().__init__()
        self.groups = groups
        width = num_heads // groups * head_dim
        factory = {"device": device, "dtype": dtype}
        bound = 1.0 / math.sqrt(width)  # nn.Linear's default bound for a (w, w) layer
        self.w1 = nn.Parameter(torch.empty(groups, width, width, **factory).uniform_(-bound, bound))
        self.b1 = nn.Parameter(torch.zeros(groups, width, **factory))
        self.w2 = nn.Parameter(torch.zeros(groups, width, width, **factory))
        self.b2 = nn.Parameter(torch.zeros(groups, width, **factory))

    def forward(self, heads: Tensor) -> Tensor:
        """``heads`` ``(B, L, H, D)`` -> ``(B, L, H, D)``."""
        B, L, H, D = heads.shape
        x = heads.reshape(B, L, self.groups, -1)  # (B, L, g, w): a group's heads concatenated
        hidden = F.gelu(torch.einsum("blgi,gio->blgo", x, self.w1) + self.b1)  # (B, L, g, w)
        x = x + torch.einsum("blgi,gio->blgo", hidden, self.w2) + self.b2
        return x.view(B, L, H, D)


class HeadAttentionMixing(nn.Module):
    """Attention among the ``H`` head outputs at each position, before ``W^O``.

    A projection shared by all heads (``head_mix``, ``D -> 3D``) turns each head output
    ``o_i`` into ``(q_i, k_i, v_i)``; head ``i`` then becomes
    ``o_i + sum_j softmax_j(q_i . k_j / sqrt(D)) v_j``. The value rows of ``head_mix`` start
    at zero, so the mixing starts as the identity.
    """

    def __init__(self, head_dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.head_mix = nn.Linear(head_dim, 3 * head_dim, device=device, dtype=dtype)
        with torch.no_grad():
            self.head_mix.weight[2 * head_dim :].zero_()
            self.head_mix.bias[2 * head_dim :].zero_()

    def forward(self, heads: Tensor) -> Tensor:
        """``heads`` ``(B, L, H, D)`` -> ``(B, L, H, D)``."""
        q, k, v = self.head_mix(heads).chunk(3, dim=-1)  # (B, L, H, D) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(heads.shape[-1])  # (B, L, H, H)
        weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # head i over heads j
        return heads + weights @ v


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
        top_k_heads: sparse heads (MoH, eq. 5.3.12 of the notes): a gate ``G(x)``, a linear
            ``E -> H - num_shared_heads`` without bias, scores the routed heads of each
            token; only the ``top_k_heads`` best are computed (their query projection,
            scores, weighted values and slice of ``W^O``) and their outputs are summed with
            weights ``softmax(G(x))`` taken over the selected heads only. K/V are still
            projected for all ``G`` K/V heads. ``None`` (default) = every head, unweighted.
        num_shared_heads: with ``top_k_heads``, heads ``0 .. num_shared_heads - 1`` are always
            on with weight 1 (MoH's shared heads); heads after them are routed.
        head_mixing: ``None`` (default), ``"talking_heads"``, ``"group_mlp"`` or
            ``"head_attention"``; see :class:`TalkingHeads` (inside the attention, ``math``
            backend only), :class:`GroupMLPMixing` and :class:`HeadAttentionMixing` (on the
            head outputs, before ``W^O``, any backend). Each starts as the identity.
        mixing_groups: the number of head groups of ``"group_mlp"`` (default 2); must
            divide ``num_heads``.
        device, dtype: for the parameters.

    The sparse layer sets :attr:`aux_loss` in training mode: the load-balancing loss of the
    Switch Transformer over the routed heads, ``R * sum_i f_i P_i`` with ``R`` routed heads,
    ``f_i`` the fraction of the ``k`` selections per token that went to head ``i`` (tokens of
    the whole query, padding included) and ``P_i`` the mean gate probability (softmax over
    all routed heads) of head ``i``. It is 1 for a perfectly balanced router; a model adds
    ``weight * aux_loss`` to its loss. ``aux_loss`` is ``None`` in eval mode and for dense
    layers. The sparse path sizes its packed buffers from the routing, reading two counts
    back to the host on every call (a sync on CUDA; shapes vary for ``torch.compile``).

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

    Sparse heads: 2 of 6 routed heads per token plus 2 shared heads, so 4 of 8 are active:

        >>> moh = MultiHeadAttention(embed_dim=64, num_heads=8, top_k_heads=2, num_shared_heads=2)
        >>> moh(x, is_causal=True).shape, moh.aux_loss is not None, moh.active_head_fraction
        (torch.Size([2, 5, 64]), True, 0.5)
        >>> moh.head_design
        'mha-moh-k2s2'
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
        _check_head_design(
            num_heads, backend, top_k_heads, num_shared_heads, head_mixing, mixing_groups
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

        # The head designs' parameters come after the projections' init, so a layer with
        # them draws the same Q/K/V/O weights as the plain layer from the same seed.
        self.top_k_heads = top_k_heads
        self.num_shared_heads = num_shared_heads
        self.head_mixing = head_mixing
        self.mixing_groups = (mixing_groups or 2) if head_mixing == "group_mlp" else None
        self.aux_loss: Tensor | None = None
        factory = {"device": device, "dtype": dtype}
        if top_k_heads is not None:
            self.head_gate = nn.Linear(embed_dim, num_heads - num_shared_heads, False, **factory)
        if head_mixing == "talking_heads":
            self.head_mix = TalkingHeads(num_heads, **factory)
        elif head_mixing == "group_mlp":
            self.head_mix = GroupMLPMixing(num_heads, self.head_dim, self.mixing_groups, **factory)
        elif head_mixing == "head_attention":
            self.head_mix = HeadAttentionMixing(self.head_dim, **factory)

    def __getstate__(self) -> dict:
        # The last aux_loss holds an autograd graph, which can be neither copied nor pickled.
        return {**self.__dict__, "aux_loss": None}

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
            + "".join(f", {name}={value!r}" for name, value in self.design_options.items())
        )

    @property
    def design_options(self) -> dict[str, int | str]:
        """The head-design keyword arguments that differ from the plain layer's defaults."""
        options = {
            "top_k_heads": self.top_k_heads,
            "num_shared_heads": self.num_shared_heads or None,
            "head_mixing": self.head_mixing,
            "mixing_groups": self.mixing_groups,
        }
        return {name: value for name, value in options.items() if value is not None}

    @property
    def head_design(self) -> str:
        """The variant plus any head design, for run names.

        E.g. ``"mha"``, ``"gqa"``, ``"mqa"``, ``"mha-moh-k2"`` (sparse, top-2),
        ``"gqa-moh-k2s1"`` (one shared head), ``"mha-talking_heads"``, ``"mha-group_mlp2"``,
        ``"mha-head_attention"``.
        """
        design = self.variant
        if self.top_k_heads is not None:
            shared = f"s{self.num_shared_heads}" if self.num_shared_heads else ""
            design += f"-moh-k{self.top_k_heads}{shared}"
        if self.head_mixing is not None:
            design += f"-{self.head_mixing}{self.mixing_groups or ''}"
        return design

    @property
    def active_head_fraction(self) -> float:
        """The fraction of the ``H`` heads computed for each token (1.0 unless sparse)."""
        if self.top_k_heads is None:
            return 1.0
        return (self.top_k_heads + self.num_shared_heads) / self.num_heads

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
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else weight.dtype
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
                by the ``math`` path whatever the backend. With sparse heads a token's
                unselected heads have all-zero weights (they were not computed), and the
                weights are those of the softmax, before the gate's factor; with talking
                heads they are the mixed weights, those that multiply V.

        Returns:
            ``(B, L, E)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (B, L, E={self.embed_dim}), got {tuple(query.shape)}")
        B, L, E = query.shape
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        if key_value is query:
            key_value = None
        # The sparse layer projects densely only its shared heads' queries; the routed heads'
        # queries are projected for the selected (token, head) pairs in _sparse_attention.
        q_dim = E if self.top_k_heads is None else self.num_shared_heads * D

        w, b = self.in_proj.weight, self.in_proj.bias
        if key_value is None and q_dim == E:
            # Self-attention: Q, K and V from one GEMM, then split (views, no copies).
            qkv = self.in_proj(query)  # (B, L, E + 2*G*D)
            q, k, v = qkv.split([E, G * D, G * D], dim=-1)
        else:
            if key_value is not None:
                if key_value.dim() != 3 or key_value.shape[0] != B or key_value.shape[-1] != E:
                    raise ValueError(
                        f"key_value must be (B={B}, S, E={E}) to match the query, "
                        f"got {tuple(key_value.shape)}"
                    )
                if is_causal:
                    raise ValueError("is_causal is for self-attention; got a key_value as well")
            q = F.linear(query, w[:q_dim], None if b is None else b[:q_dim])  # (B, L, q_dim)
            if key_value is not None and kv_cache is not None and kv_cache.size > 0:
                k = v = None  # the memory was projected on the first step
            else:
                source = query if key_value is None else key_value
                kv = F.linear(source, w[E:], None if b is None else b[E:])  # (B, S, 2*G*D)
                k, v = kv.split([G * D, G * D], dim=-1)

        q = q.view(B, L, q_dim // D, D).transpose(1, 2)  # (B, H, L, D); shared heads if sparse
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
        if not need_weights and self.head_mixing not in _LOGIT_MIXINGS:
            if (q.device, q.dtype) not in self._checked:
                check_backend(self.backend, q.device, q.dtype)
                self._checked.add((q.device, q.dtype))
        if self.top_k_heads is not None:
            return self._sparse_attention(query, q, k, v, mask, need_weights)

        out, weights = self._attend(q, k, v, mask, need_weights)  # (B, H, L, D)
        out = self.mix_head_outputs(out.transpose(1, 2))  # (B, L, H, D)
        out = out.reshape(B, L, E)  # (B, L, H*D): heads concatenated
        out = self.out_proj(out)
        return (out, weights) if need_weights else out

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """softmax(QK^T)V ``(B, H, L, D)`` by the backend, or by the math path with the
        weights ``(B, H, L, S)`` when they are asked for or talking heads mix the logits."""
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights or self.head_mixing in _LOGIT_MIXINGS:
            mixes = {}  # talking heads: logit_mix and weight_mix, named as the math path's
            if self.head_mixing in _LOGIT_MIXINGS:
                mixes = dict(self.head_mix.named_parameters())
            out, weights = math_attention_with_weights(
                q, k, v, mask, dropout_p, self.scale, **mixes
            )
        else:
            out = BACKENDS[self.backend](q, k, v, mask, dropout_p, self.scale)
        if mask.empty_rows is not None:
            # Rows with no key to attend to: zeros, not the mean of unmasked values.
            out = out.masked_fill(mask.empty_rows, 0.0)
            if weights is not None:
                weights = weights.masked_fill(mask.empty_rows, 0.0)
        return out, weights

    def mix_head_outputs(self, heads: Tensor) -> Tensor:
        """``heads`` ``(B, L, H, D)`` as they enter ``W^O``: mixed by ``group_mlp`` or
        ``head_attention``, unchanged otherwise (talking heads mix inside the attention)."""
        if self.head_mixing is None or self.head_mixing in _LOGIT_MIXINGS:
            return heads
        return self.head_mix(heads)

    def _sparse_attention(
        self,
        query: Tensor,
        q_shared: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttentionMask,
        need_weights: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Shared heads densely, then only the routed (token, head) pairs the gate selects.

        ``q_shared`` ``(B, s, L, D)`` holds the shared heads' queries; ``k``, ``v``
        ``(B, G, S, D)`` all K/V heads. The routed heads' queries are projected here, for
        the selected pairs only (``M`` rows per head, ``M`` the most pairs any head got in
        the batch, ``B * L * k / R`` for a balanced router); their scores and values run in
        the chosen backend on ``(B, R, C, D)`` queries, ``C`` the most positions any
        (sentence, head) got; their ``W^O`` slices again on the ``M`` rows per head.
        """
        B, L, E = query.shape
        H, D = self.num_heads, self.head_dim
        s, top_k = self.num_shared_heads, self.top_k_heads
        R = H - s
        w_q, b_q = self.in_proj.weight[s * D : E], self.in_proj.bias
        w_o = self.out_proj.weight.view(E, H, D)  # column block h of W^O is head h's slice

        def attend(q: Tensor, first: int, count: int, slots: Tensor | None):
            head_mask = mask
            if slots is not None and mask.kernel_causal:
                # Packed rows need the causal mask written out: the kernels' own is by row.
                causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # (L, S)
                head_mask = dataclasses.replace(mask, tensor=causal, kernel_causal=False)
            head_mask = dataclasses.replace(
                head_mask,
                tensor=_mask_rows(head_mask.tensor, first, count, slots),
                empty_rows=_mask_rows(mask.empty_rows, first, count, slots),
            )
            if slots is not None and head_mask.tensor is not None and head_mask.tensor.shape[2] > 1:
                # Packed rows are no longer positions 0..L-1: only the tensor says who sees what.
                head_mask = dataclasses.replace(
                    head_mask, causal_requested=False, has_attn_mask=True
                )
            k_h, v_h = _kv_for_heads(k, first, count, H), _kv_for_heads(v, first, count, H)
            return self._attend(q, k_h, v_h, head_mask, need_weights)

        # Route: each token picks its top-k routed heads, weighted by a softmax over them.
        logits = self.head_gate(query)  # (B, L, R)
        top_logits, top_heads = logits.topk(top_k, dim=-1)  # (B, L, k)
        top_gate = torch.softmax(top_logits.float(), dim=-1).to(logits.dtype)  # (B, L, k)
        gate = torch.zeros_like(logits).scatter(-1, top_heads, top_gate)  # (B, L, R)
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top_heads, True)
        chosen = chosen.transpose(1, 2)  # (B, R, L)
        if self.training:
            f = chosen.sum(dim=(0, 2)).to(torch.float32) / (B * L * top_k)  # (R,), sums to 1
            p = torch.softmax(logits.float(), dim=-1).mean(dim=(0, 1))  # (R,)
            self.aux_loss = R * (f * p).sum()
        else:
            self.aux_loss = None

        # Two packings of the selected pairs. Attention runs per sentence: for each
        # (sentence, head), its positions to the front of C slots, C the most any got.
        # Projections run per head over the whole batch: its pairs to the front of M rows,
        # M the most pairs any head got, close to B*L*k/R even when sentences route unevenly.
        order, filled = _pack_front(chosen)  # (B, R, C)
        C = order.shape[-1]
        slots = order.clamp(max=L - 1)  # padding slots read the last position, weighted 0
        first_token = torch.arange(B, device=query.device) * L  # (B,)
        tokens = (slots + first_token[:, None, None]).transpose(0, 1).reshape(R, B * C)
        pair_slot, pair_valid = _pack_front(filled.transpose(0, 1).reshape(R, B * C))  # (R, M)
        M = pair_slot.shape[-1]
        pair_slot_or_spare = pair_slot  # B*C for padding rows: a spare slot, dropped
        pair_slot = pair_slot.clamp(max=B * C - 1)
        pair_token = tokens.gather(1, pair_slot)  # (R, M): indices into the B*L tokens

        # Queries of the selected pairs only: per routed head, its (D, E) rows of W^Q.
        x = query.reshape(B * L, E).index_select(0, pair_token.reshape(-1)).view(R, M, E)
        q = torch.bmm(x, w_q.view(R, D, E).transpose(1, 2))  # (R, M, D)
        if b_q is not None:
            q = q + b_q[s * D : E].view(R, 1, D).to(q.dtype)  # autocast: keep q's dtype
        spare = pair_slot_or_spare.unsqueeze(-1).expand(R, M, D)
        q = q.new_zeros(R, B * C + 1, D).scatter(1, spare, q)[:, : B * C]  # (R, B*C, D)
        q = q.view(R, B, C, D).transpose(0, 1)  # (B, R, C, D)
        routed, routed_weights = attend(q, s, R, slots)  # (B, R, C, D)

        # Weight each pair by its gate value (0 for padding), then W^O per head slice.
        routed = routed.transpose(0, 1).reshape(R, B * C, D)
        routed = routed.gather(1, pair_slot.unsqueeze(-1).expand(R, M, D))  # (R, M, D)
        slot_gate = gate.transpose(1, 2).gather(2, slots).transpose(0, 1).reshape(R, B * C)
        pair_gate = slot_gate.gather(1, pair_slot) * pair_valid  # (R, M)
        y = torch.bmm(routed * pair_gate.unsqueeze(-1), w_o[:, s:].permute(1, 2, 0))  # (R, M, E)
        out = y.new_zeros(B * L, E).index_add(0, pair_token.reshape(-1), y.reshape(-1, E))
        out = out.view(B, L, E)
        if s:
            shared, shared_weights = attend(q_shared, 0, s, None)  # (B, s, L, D)
            shared = shared.transpose(1, 2).reshape(B, L, s * D)  # (B, L, s*D)
            out = out + shared @ w_o[:, :s].reshape(E, s * D).T
        if self.out_proj.bias is not None:
            out = out + self.out_proj.bias.to(out.dtype)
        if not need_weights:
            return out

        # Weights (B, H, L, S): the routed pairs scattered back, zeros for unselected heads.
        S = k.shape[2]
        # order is L in padding slots: a spare row, dropped.
        weights = q.new_zeros(B, R, L + 1, S).scatter(
            2, order.unsqueeze(-1).expand(B, R, C, S), routed_weights
        )[:, :, :L]
        if s:
            weights = torch.cat([shared_weights, weights], dim=1)
        return out, weights

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
        consecutive groups and each group is mean-pooled into one head. The head design
        (sparse heads, mixing) and its parameters are kept.
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
            **self.design_options,
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
            for name in ("head_gate", "head_mix"):
                if hasattr(self, name):
                    getattr(new, name).load_state_dict(getattr(self, name).state_dict())
        return new.train(self.training)
