"""Multi-head latent attention (MLA; DeepSeek-V2, 2024), a part of the layer.

K and V come from one low-rank latent per token, ``c = x W_DKV`` (``r = kv_latent_dim``
numbers; DeepSeek and HF call ``r`` ``kv_lora_rank``), through per-head up-projections::

    c   = norm(x W_DKV^T + b_DKV)      (B, S, r)    optional RMSNorm, as DeepSeek
    K_h = c W_UK_h^T                   (B, S, D)    W_UK_h: (D, r), no bias
    V_h = c W_UV_h^T                   (B, S, D)    W_UV_h: (D, r), no bias

The KV cache holds ``c`` alone: ``r`` numbers per token and layer instead of MHA's ``2 H D``.
Without positions in the layer an MLA layer is exactly an MHA layer whose K/V weights are the
products ``W_UK W_DKV`` and ``W_UV W_DKV`` (without the norm).

Decoupled rotary positions (DeepSeek-V2, section 2.1.3; ``rope_dim = d_R``). Rotating K_h
would put a position-dependent matrix between ``W_UK`` and the query, so it could not be
folded. Instead each head's query gets ``d_R`` more features and all heads share one small
rotary key, cached beside the latent; the latent part stays position-free::

    q_h = [q_h^C ; RoPE(x W_QR_h^T)]   (B, H, L, D + d_R)     W_QR: (H d_R, E)
    k_h = [K_h   ; RoPE(x W_KR^T)]     (B, H, S, D + d_R)     W_KR: (d_R, E), one for all heads
    scores scaled by 1 / sqrt(D + d_R); the cache holds [c ; k_R]: r + d_R numbers per token.

Absorbed decoding. ``q_h . K_hj = (W_UK_h^T q_h) . c_j`` and ``sum_j p_j V_hj =
W_UV_h (sum_j p_j c_j)``, so in eval mode with a KV cache each step applies ``W_UK_h^T`` to
the query heads and ``W_UV_h`` to the attention's output heads (DeepSeek-V3's
``inference/model.py``) and attends over the cached latent as one shared K/V head of width
``r`` with the original ``1/sqrt(D)`` scale: no per-step up-projection of the cache. With
the rotary key, queries ``[W_UK_h^T q_h^C ; q_h^R]`` attend over the cached ``[c ; k_R]``
as K and V, and the first ``r`` features of each head's output are its latent head (the
rotary part is only scored, never a value): absorbed decoding stays exact.

DeepSeek's widths (``qk_head_dim``, ``v_head_dim``) and its low-rank query (``q_latent_dim``,
DeepSeek-V2 section 2.1.2; V3, not V2-Lite): Q, and the rotary query, come from a second
normalised latent ``c_Q = norm(x W_DQ^T + b_DQ)`` of ``r_Q`` numbers, not from ``x``. It is
never cached; the absorbed path applies ``W_UK`` after the query's projection from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention.checks import check_bool, check_int_in, check_positive_int
from multihead.attention.designs import (
    AttentionLayer,
    Call,
    HeadDesign,
    options_digest,
    register_design,
)
from multihead.attention.kv_cache import CacheLayout
from multihead.attention.masks import AttentionMask
from multihead.attention.rotary import RotaryPositions


class LatentKV(HeadDesign):
    """The latent K/V of an MLA layer with ``num_heads`` heads of ``head_dim``.

    Args:
        embed_dim, num_heads: ``E``, ``H`` (K and V have ``H`` heads, from the latent).
        num_kv_heads: must be ``H``.
        bias: a bias on the down-projection (as the layer's projections).
        kv_latent_dim: ``r``, the latent's width, at least 1.
        kv_latent_norm: RMSNorm on the latent, as DeepSeek-V2 (no MHA equivalent then).
        rotary_dim: ``d_R``, the width of the decoupled rotary key and of each head's rotary
            query features; ``None``: no positions. ``rope_theta``, ``rope_interleaved``,
            ``rope_inv_freq``: as :class:`~multihead.attention.rotary.RotaryPositions`.
        rope_kv_heads: ``G_R``, rotary keys (head ``h`` reads key ``h G_R / H``; the cache
            holds ``r + G_R d_R``); a converted GQA layer keeps one per K/V group.
        qk_head_dim: the width of each head's Q and K from the latent (DeepSeek's
            ``qk_nope_head_dim``); ``None``: ``D``, the width of V.
        v_head_dim: the width of each head's V (DeepSeek's ``v_head_dim``); ``None``:
            ``D = E / H``. The layer's output projection reads ``H * v_head_dim`` features.
        q_latent_dim: ``r_Q``, a low-rank query (DeepSeek's ``q_lora_rank``): ``x`` down to
            ``r_Q`` numbers, an RMSNorm (as DeepSeek's ``q_a_layernorm``), then the layer's
            Q projection and the rotary query read that; ``None``: they read ``x``.
        softmax_scale: the scores' scale; ``None``: ``(qk_head_dim + d_R)^-1/2`` with the
            rotary key, else the layer's ``1/sqrt(D)``.
        device, dtype: for the parameters.

    Attributes:
        absorb: decode over the latent, absorbed (the default); ``False`` re-expands K and V
            from the cached latent at every step, to measure what absorption buys.
    """

    name = kind = "mla"  # kind: head_config's, instead of mha/gqa/mqa
    attribute = "kv_latent"
    conversions = frozenset({"expand_latent"})

    def __init__(
        self, embed_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool = True,
        device=None, dtype=None, kv_latent_dim: int, kv_latent_norm: bool = False,
        rotary_dim: int | None = None, rope_theta: float = 10000.0,
        rope_interleaved: bool = False, rope_inv_freq=None, rope_kv_heads: int = 1,
        qk_head_dim: int | None = None, softmax_scale: float | None = None,
        v_head_dim: int | None = None, q_latent_dim: int | None = None,
    ) -> None:  # fmt: skip
        check_positive_int("kv_latent_dim", kv_latent_dim)
        check_bool("kv_latent_norm", kv_latent_norm)
        check_positive_int("rope_kv_heads", rope_kv_heads)
        if num_heads % rope_kv_heads != 0:
            raise ValueError(f"rope_kv_heads={rope_kv_heads} must divide num_heads={num_heads}")
        D = embed_dim // num_heads
        qk = D if qk_head_dim is None else qk_head_dim
        check_int_in("qk_head_dim", qk, 0 if rotary_dim else 1)  # 0: every Q/K feature rotary
        Dv = D if v_head_dim is None else v_head_dim
        check_positive_int("v_head_dim", Dv)
        if qk + (rotary_dim or 0) < Dv:  # V is padded to the Q/K width for the kernels
            name = "head_dim" if v_head_dim is None else "v_head_dim"
            raise ValueError(f"qk_head_dim + rotary_dim must be at least {name}={Dv}, got {qk}")
        if q_latent_dim is not None:
            check_positive_int("q_latent_dim", q_latent_dim)
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.latent_dim = kv_latent_dim
        self.head_dim, self.qk_head_dim, self.rope_kv_heads = D, qk, rope_kv_heads
        self.v_head_dim, self.q_latent_dim = Dv, q_latent_dim
        self.softmax_scale = softmax_scale
        self.down = nn.Linear(embed_dim, kv_latent_dim, bias, **factory)  # W_DKV
        self.norm = nn.RMSNorm(kv_latent_dim, **factory) if kv_latent_norm else None
        # [W_UK; W_UV]: (H * qk_head_dim + H * v_head_dim, r)
        self.up = nn.Linear(kv_latent_dim, num_heads * (qk + Dv), bias=False, **factory)
        self.q_down = self.q_norm = None
        if q_latent_dim is not None:  # W_DQ and its norm; W_UQ is the layer's Q projection
            self.q_down = nn.Linear(embed_dim, q_latent_dim, bias, **factory)
            self.q_norm = nn.RMSNorm(q_latent_dim, **factory)
        q_in = embed_dim if q_latent_dim is None else q_latent_dim
        self.absorb = True
        self.rope_dim = 0
        self.rope = None
        self.has_positions = rotary_dim is not None  # the layer gives project() positions
        if rotary_dim is not None:
            # RotaryPositions checks rotary_dim (even, >= 2).
            self.rope = RotaryPositions(
                rotary_dim, theta=rope_theta, interleaved=rope_interleaved, inv_freq=rope_inv_freq
            )
            self.rope_dim = rotary_dim
            self.q_rope = nn.Linear(q_in, num_heads * rotary_dim, bias, **factory)  # W_QR
            # W_KR: (G_R * d_R, E), one key per group of H / G_R heads
            self.k_rope = nn.Linear(embed_dim, rope_kv_heads * rotary_dim, bias, **factory)

    @property
    def options(self) -> dict[str, int | bool]:
        norm = {"kv_latent_norm": True} if self.norm is not None else {}
        rope = {} if self.rope is None else self.rope.options
        rope |= {} if self.rope_kv_heads == 1 else {"rope_kv_heads": self.rope_kv_heads}
        rope |= {} if self.qk_head_dim == self.head_dim else {"qk_head_dim": self.qk_head_dim}
        rope |= {} if self.softmax_scale is None else {"softmax_scale": self.softmax_scale}
        rope |= {} if self.v_head_dim == self.head_dim else {"v_head_dim": self.v_head_dim}
        rope |= {} if self.q_latent_dim is None else {"q_latent_dim": self.q_latent_dim}
        return {"kv_latent_dim": self.latent_dim, **norm, **rope}

    @property
    def tag(self) -> str:
        """``r<latent>``, ``n`` with the latent's norm, ``q<width>`` with a low-rank query,
        ``rope<d_R>`` with the decoupled rotary key (``x<G_R>`` with several), ``qk<width>``
        and ``v<width>`` for heads other than ``D`` wide, then a digest of any other option
        that differs from its default (``softmax_scale``, the rotary base, pairing and
        frequencies: :func:`~.designs.options_digest`). E.g. ``r64``, ``r512q1536rope64qk128``."""
        rope = f"rope{self.rope_dim}" if self.rope_dim else ""
        rope += f"x{self.rope_kv_heads}" if self.rope_kv_heads > 1 else ""
        q = "" if self.q_latent_dim is None else f"q{self.q_latent_dim}"
        qk = "" if self.qk_head_dim == self.head_dim else f"qk{self.qk_head_dim}"
        v = "" if self.v_head_dim == self.head_dim else f"v{self.v_head_dim}"
        spelled = (
            "kv_latent_dim", "kv_latent_norm", "q_latent_dim", "rotary_dim", "rope_kv_heads",
            "qk_head_dim", "v_head_dim",
        )  # fmt: skip
        norm = "n" if self.norm is not None else ""
        return f"r{self.latent_dim}{norm}{q}{rope}{qk}{v}{options_digest(self, spelled)}"

    @property
    def score_features(self) -> tuple[int, int]:
        """Each head's score width and how many of its features carry positions:
        ``qk_head_dim`` position-free features from the latent and ``d_R`` rotary ones
        (``multihead.analysis.describe`` reads it)."""
        return self.qk_head_dim + self.rope_dim, self.rope_dim

    @staticmethod
    def widths(embed_dim: int, num_heads: int, options: dict) -> tuple[int, int, int, bool]:
        """The layer's projections for the MLA of ``options`` (read before it is built):
        ``Q`` from ``x``, or from the low-rank query's ``q_latent_dim`` numbers; Q heads
        ``qk_head_dim`` wide and V heads ``v_head_dim`` (each ``D`` unless set); no K or V
        in ``in_proj``, since they come from the latent."""
        D = embed_dim // num_heads
        q_latent, qk, v = (options.get(n) for n in ("q_latent_dim", "qk_head_dim", "v_head_dim"))
        q_in = embed_dim if q_latent is None else q_latent
        return q_in, D if qk is None else qk, D if v is None else v, False

    def check(self, layer: AttentionLayer) -> None:
        """One K/V head per query head, and no rotary positions in the layer: rotating the
        up-projected keys would put a matrix of the position between ``W_UK`` and the query,
        so absorbed decoding could not move ``W_UK`` there (its own ``rotary_dim`` is the
        decoupled rotary key instead). A score bias (ALiBi) is a part of the mask: it joins."""
        super().check(layer)
        H, G = layer.num_heads, layer.num_kv_heads
        if G != H:
            raise ValueError(
                f"head design {self.name!r} has one K/V head per query head; got "
                f"num_kv_heads={G} for num_heads={H}"
            )
        if layer.positions is not None and layer.positions.seam == "rotate":
            raise ValueError(
                f"head design {self.name!r} takes no rotary positions in the layer "
                f"({type(layer.positions).__name__}): absorbed decoding moves W_UK to the "
                "query, which keys turned by their positions would forbid; give it its own "
                "decoupled rotary key (rotary_dim) instead"
            )

    @property
    def cache_layout(self) -> CacheLayout:
        """One latent of width ``r`` (and the rotary keys, ``r + G_R d_R``), stored once for
        K and V."""
        return CacheLayout(1, self.latent_dim + self.rope_kv_heads * self.rope_dim, shared_kv=True)

    def latent(self, source: Tensor) -> Tensor:
        """``c`` ``(B, S, r)`` of ``source`` ``(B, S, E)``."""
        c = self.down(source)
        return c if self.norm is None else self.norm(c)

    def query_input(self, query: Tensor) -> Tensor:
        """What the Q projections read: ``query`` ``(B, L, E)``, or its low-rank latent
        ``c_Q`` ``(B, L, r_Q)``."""
        return query if self.q_down is None else self.q_norm(self.q_down(query))

    def expand(self, c: Tensor) -> tuple[Tensor, Tensor]:
        """K ``(B, H, S, qk_head_dim)`` and V ``(B, H, S, v_head_dim)`` from the latent ``c``
        ``(B, S, r)``."""
        (B, S, _), H = c.shape, self.num_heads
        k, v = self.up(c).split([H * self.qk_head_dim, H * self.v_head_dim], dim=-1)  # (B,S,H*·)
        k = k.view(B, S, H, -1).transpose(1, 2)  # (B, H, S, qk_head_dim)
        v = v.view(B, S, H, -1).transpose(1, 2)  # (B, H, S, v_head_dim)
        return k, v

    def head_outputs(self, layer: AttentionLayer, weights: Tensor, source: Tensor) -> Tensor:
        """``weights @ V`` per head ``(B, H, L, v_head_dim)``, V of every head from the latent."""
        _, v = self.expand(self.latent(source))  # (B, H, S, v_head_dim)
        return weights @ v

    def mha_kv(self, name: str = "weight") -> tuple[Tensor | None, Tensor | None]:
        """The K and V blocks of the MHA layer equal to this one: ``W_UK W_DKV`` and
        ``W_UV W_DKV`` ``(H D, E)`` each (``name="bias"``: ``W_UK b_DKV``, ``W_UV b_DKV``, or
        ``None``), for :func:`~multihead.attention.convert.expand_latent`.

        Raises:
            ValueError: naming what no MHA layer computes (a latent norm, which is not linear;
                a decoupled rotary key; its own Q/K or V width; a low-rank, normalised query;
                its own scale).
        """
        own = ("kv_latent_norm", "rotary_dim", "qk_head_dim", "v_head_dim", "q_latent_dim",
               "softmax_scale")  # fmt: skip
        own = [name for name in own if name in self.options]  # each set only if not MHA's
        if own:
            raise ValueError(
                f"head design {self.name!r} ({self.tag}) has {', '.join(own)}, which no MHA "
                "layer computes: it has no MHA equivalent"
            )
        down = getattr(self.down, name)  # W_DKV (r, E) or b_DKV (r,)
        if down is None:
            return None, None
        w_uk, w_uv = self.up.weight.chunk(2)  # (E, r) each: W_UK, W_UV
        return w_uk @ down, w_uv @ down

    def load_factors(
        self, down: Tensor, up_k: Tensor, up_v: Tensor, *, down_bias: Tensor | None = None,
        q_rope: Tensor | None = None, k_rope: Tensor | None = None,
        q_rope_bias: Tensor | None = None, k_rope_bias: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Set the latent's weights to factors computed elsewhere (a conversion's), each cast
        to its parameter's dtype (``Q_in``: ``E``, or ``r_Q`` with a low-rank query):

        * ``down`` ``(r, E)``, ``W_DKV``, and ``down_bias`` ``(r,)``, ``b_DKV``;
        * ``up_k`` ``(H qk_head_dim, r)`` and ``up_v`` ``(H v_head_dim, r)``, ``W_UK`` and
          ``W_UV``, head after head;
        * with a rotary key, both needed: ``q_rope`` ``(H d_R, Q_in)``, ``W_QR``, and ``k_rope``
          ``(G_R d_R, E)``, ``W_KR``; their biases ``(H d_R,)`` and ``(G_R d_R,)``.

        A bias the design has and that is not given is set to zero; the latent's norm and the
        low-rank query keep theirs. Nothing changes unless every tensor fits.

        Raises:
            ValueError: a tensor of another shape, a rotary key's weight missing, or one given
                (or a bias) that the design does not have.
        """
        H, rope = self.num_heads, self.rope is not None
        w_uk, w_uv = self.up.weight.split([H * self.qk_head_dim, H * self.v_head_dim])
        params = {  # name: (the parameter or None, what is given)
            "down": (self.down.weight, down), "down_bias": (self.down.bias, down_bias),
            "up_k": (w_uk, up_k), "up_v": (w_uv, up_v),
            "q_rope": (self.q_rope.weight if rope else None, q_rope),
            "k_rope": (self.k_rope.weight if rope else None, k_rope),
            "q_rope_bias": (self.q_rope.bias if rope else None, q_rope_bias),
            "k_rope_bias": (self.k_rope.bias if rope else None, k_rope_bias),
        }  # fmt: skip
        if rope and (q_rope is None or k_rope is None):
            raise ValueError(
                f"head design {self.name!r} ({self.tag}) has a rotary key (rotary_dim="
                f"{self.rope_dim}): load_factors needs q_rope and k_rope"
            )
        for name, (param, given) in params.items():
            if given is not None and param is None:
                raise ValueError(f"head design {self.name!r} ({self.tag}) has no {name}")
            if given is not None and given.shape != param.shape:
                raise ValueError(
                    f"{name} of head design {self.name!r} ({self.tag}) must be "
                    f"{tuple(param.shape)}, got {tuple(given.shape)}"
                )
        with torch.no_grad():
            for name, (param, given) in params.items():
                if given is not None:
                    param.copy_(given)
                elif param is not None and name.endswith("_bias"):
                    param.zero_()

    def linear_kv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The K and V that the weights alone (no biases, no latent norm: what a conversion
        factorises) give each head from the keys' source ``x`` ``(B, S, E)``, before RoPE:
        K's features from the latent ``(B, H, S, qk_head_dim)``, V ``(B, H, S, v_head_dim)``
        and the rotary keys ``(B, G_R, S, d_R)`` (head ``h`` reads key ``h G_R / H``), or
        ``None`` without them."""
        k, v = self.expand(x @ self.down.weight.T)  # (B, H, S, Dq), (B, H, S, Dv)
        if self.rope is None:
            return k, v, None
        B, S, _ = x.shape
        k_rope = x @ self.k_rope.weight.T  # (B, S, G_R d_R)
        return k, v, k_rope.view(B, S, self.rope_kv_heads, self.rope_dim).transpose(1, 2)

    def project(self, source: Tensor | None, call: Call) -> tuple[Tensor, Tensor | None, None]:
        """Q ``(B, H, L, Dq [+ d_R])`` of the query (or of its low-rank latent), its rotary
        features turned and last; K: the latent ``c`` ``(B, 1, S, r [+ G_R d_R])`` of
        ``source``, its rotary keys turned and last; V ``None``: ``c`` serves as both, and
        the cache holds it once."""
        B, L, _ = call.query.shape
        H, d_R, G_R = self.num_heads, self.rope_dim, self.rope_kv_heads
        q_in = self.query_input(call.query)  # (B, L, E), or (B, L, r_Q) with a low-rank query
        c = q_rope = None
        if source is not None:  # None: cross-attention, the memory's latent is in the cache
            c = self.latent(source).unsqueeze(1)  # (B, 1, S, r)
        if self.rope is not None and source is not None:  # self-attention (the layer checks)
            positions = call.positions  # (L,) or (B, L)
            k_rope = self.k_rope(source).view(B, L, G_R, d_R).transpose(1, 2)  # (B,G_R,L,d_R)
            k_rope = self.rope.rotate(k_rope, positions).transpose(1, 2).reshape(B, 1, L, -1)
            c = torch.cat((c, k_rope), dim=-1)  # (B, 1, L, r + G_R d_R)
            q_rope = self.q_rope(q_in).view(B, L, H, d_R).transpose(1, 2)  # (B, H, L, d_R)
            q_rope = self.rope.rotate(q_rope, positions)
        # Q last: autograd sums the input's gradients in the order of its uses, kept as
        # they were when the design wrote its own forward (bit for bit).
        q = call.layer.in_proj.q(q_in)  # (B, H, L, Dq)
        if q_rope is not None:
            q = torch.cat((q, q_rope), dim=-1)  # (B, H, L, Dq + d_R)
        return q, c, None

    def attend(
        self, q: Tensor, k: Tensor, v: None, mask: AttentionMask, call: Call
    ) -> tuple[Tensor, Tensor | None]:
        """The heads ``(B, H, L, v_head_dim)`` of Q and the latent ``k`` ``(B, 1, S, ·)``
        (through the cache): absorbed in cached decoding (eval mode), else expanded."""
        H, r, d_R, G_R = self.num_heads, self.latent_dim, self.rope_dim, self.rope_kv_heads
        Dq, scale = self.qk_head_dim, self.softmax_scale
        if scale is None and self.rope is not None:
            scale = (Dq + d_R) ** -0.5  # the scores' width; None: the layer's 1/sqrt(D)
        c = k  # (B, 1, S, r [+ G_R d_R])
        if self.absorb and call.kv_cache is not None and not self.training:
            w_uk, w_uv = self.up.weight.split([H * Dq, H * self.v_head_dim])
            q, q_rope = (q, None) if self.rope is None else q.split([Dq, d_R], dim=-1)
            # q_h . (W_UK_h c_j) = (W_UK_h^T q_h) . c_j: W_UK meets the L queries, not the S
            # cached positions. Applied per head to the activations (DeepSeek-V3's
            # inference/model.py), not folded into W^Q: a step reads W^Q and W_UK, H(Dq + r)E
            # numbers fewer than a folded (H r, E) matrix, and nothing is kept per search.
            q = torch.einsum("bhld,hdr->bhlr", q, w_uk.view(H, Dq, r))  # (B, H, L, r)
            if q_rope is not None and G_R > 1:  # head h scores its own group's key only
                group = F.one_hot(torch.arange(H, device=q.device) * G_R // H, G_R).to(q.dtype)
                q_rope = (q_rope[..., None, :] * group[:, None, :, None]).flatten(-2)  # G_R d_R
            if q_rope is not None:
                q = torch.cat((q, q_rope), dim=-1)  # (B, H, L, r + G_R d_R)
            heads, weights = call.attend(q, c, c, mask, scale)
            heads = heads[..., :r]  # (B, H, L, r): the rotary key is scored, not a value
            # sum_j p_j (W_UV_h c_j) = W_UV_h (sum_j p_j c_j): each latent head through W_UV_h.
            heads = torch.einsum("bhlr,hdr->bhld", heads, w_uv.view(H, self.v_head_dim, r))
            return heads, weights  # (B, H, L, v_head_dim)
        k, v = self.expand(c[..., :r].squeeze(1))  # (B, H, S, Dq), (B, H, S, Dv)
        if self.rope is not None:
            k_rope = c[:, 0, :, r:].unflatten(-1, (G_R, d_R)).transpose(1, 2)  # (B,G_R,S,d_R)
            k_rope = k_rope.repeat_interleave(H // G_R, dim=1)  # (B, H, S, d_R)
            k = torch.cat((k, k_rope), dim=-1)  # (B, H, S, Dq + d_R)
        # Kernels take one head width for K and V: V padded, the padding dropped.
        if q.shape[-1] != v.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))  # (B, H, S, Dq + d_R)
        heads, weights = call.attend(q, k, v, mask, scale)
        return heads[..., : self.v_head_dim], weights  # (B, H, L, Dv)


register_design(LatentKV.name, LatentKV)
