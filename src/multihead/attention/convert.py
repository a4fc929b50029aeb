"""Conversions of a layer's heads, functions over layers: :func:`with_kv_heads` (fewer K/V heads),
:func:`with_kv_latent` (a K/V latent, MLA), :func:`expand_latent` (back to the equivalent MHA
layer) and :func:`prune_heads` (fewer query heads): each a new layer (built by
:func:`rebuild`), its input left as it was. A head design is kept where it declares the
conversion (``HeadDesign.conversions``), else refused by name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.attention.layer import MultiHeadAttention
from multihead.attention.projection import QKVProjection
from multihead.attention.rotary import RotaryPositions


def rebuild(
    layer: MultiHeadAttention, *, num_heads: int | None = None, num_kv_heads: int | None = None,
    **design,
) -> MultiHeadAttention:  # fmt: skip
    """A new layer like ``layer`` (its width, head width ``D``, dropout, bias, backend,
    device, dtype and mode) with ``num_heads`` and ``num_kv_heads`` (default: ``layer``'s)
    and the head design of the constructor arguments ``design``; fresh parameters.

    With fewer than ``E / D`` query heads (pruned) the projections are ``(H*D + 2*G*D, E)``
    and ``(E, H*D)``: the one way every conversion gets a layer of new shapes.
    """
    E, D, w = layer.embed_dim, layer.head_dim, layer.out_proj.weight
    H = layer.num_heads if num_heads is None else num_heads
    G = layer.num_kv_heads if num_kv_heads is None else num_kv_heads
    bias = layer.in_proj.blocks("bias")[0] is not None  # either layout of in_proj
    if bias != (layer.out_proj.bias is not None):
        raise ValueError(
            f"cannot rebuild a layer whose in_proj has {'a' if bias else 'no'} bias and whose "
            f"out_proj has {'none' if bias else 'one'} (a swapped Qwen2): the layer has one bias"
        )
    factory = {"device": w.device, "dtype": w.dtype}
    common = {"dropout": layer.dropout, "bias": bias, "backend": layer.backend, **factory}
    if H * D == E:
        new = type(layer)(E, H, G, **common, **design)
    else:  # pruned: built with all E / D heads, then its projections cut to H heads of D
        new = type(layer)(E, E // D, **common, **design)
        new.num_heads, new.num_kv_heads = H, G
        new.in_proj = QKVProjection(E, H, G, D, bias=bias, **factory)
        new.out_proj = nn.Linear(H * D, E, bias, **factory)
    new.positions = layer.positions  # the positions (no parameters) stay the layer's
    return new.train(layer.training)


def with_kv_heads(layer: MultiHeadAttention, num_kv_heads: int) -> MultiHeadAttention:
    """A copy of ``layer`` with fewer K/V heads, each the mean of the heads in its group.

    This is the checkpoint conversion of the GQA paper (Ainslie et al., 2023): the ``G``
    current K (and V) projection heads are split into ``num_kv_heads`` consecutive groups
    and each group is mean-pooled into one head.
    """
    G = layer.num_kv_heads
    _check_unpruned(layer, "with_kv_heads")
    _check_design(layer, "with_kv_heads")
    if num_kv_heads <= 0 or G % num_kv_heads != 0:  # no argument named: callers name it apart
        raise ValueError(f"cannot pool {G} K/V heads into {num_kv_heads}: it must divide {G}")
    design = {} if layer.design is None else layer.design.options
    new = rebuild(layer, num_kv_heads=num_kv_heads, **design)

    def pool(t: Tensor) -> Tensor:  # (G*D, ...) -> (num_kv_heads*D, ...)
        grouped = t.reshape(num_kv_heads, G // num_kv_heads, -1, *t.shape[1:])
        return grouped.mean(dim=1).reshape(-1, *t.shape[1:])

    with torch.no_grad():
        for name in ("weight", "bias"):
            if layer.in_proj.blocks(name)[0] is None:
                continue
            (q, k, v), (new_q, new_k, new_v) = layer.in_proj.blocks(name), new.in_proj.blocks(name)
            new_q.copy_(q), new_k.copy_(pool(k)), new_v.copy_(pool(v))
        new.out_proj.load_state_dict(layer.out_proj.state_dict())
        if layer.design is not None:
            new.design.load_state_dict(layer.design.state_dict())
    new.head_mask = layer.head_mask  # per query head: the query heads stay
    return new


def with_kv_latent(
    layer: MultiHeadAttention, kv_latent_dim: int, *, rope_dim: int | None = None,
    selection: str = "high", calibration: Tensor | None = None,
) -> MultiHeadAttention:  # fmt: skip
    """An MLA copy of an MHA/GQA/MQA ``layer`` with a ``kv_latent_dim`` latent.

    The joint truncated SVD of the stacked K and V weights (TransMLA, MHA2MLA; 2025):
    ``[W_K; W_V] = U S V^T`` (GQA's K/V heads repeated per query head first), ``W_DKV`` the
    top ``r`` rows of ``V^T`` and ``[W_UK; W_UV] = U_r S_r``. It is exact when ``r`` is the
    rank of the stack (at most ``min(G (2D - rope_dim), E)``); a larger ``r`` is refused, its
    last numbers always zero. Biases: the K bias adds the same ``q . b_K`` to every score of
    a query, which softmax ignores, so it is dropped; the V bias adds ``b_V`` to every head
    output (weights sum to 1), which moves into the output projection's bias (a query with no
    key left, zeroed by the layer, then differs).

    A rotary ``layer`` (MHA2MLA's partial RoPE, ``docs/reuse.md``): each K/V group keeps
    ``rope_dim`` rotated features (whole pairs; ``None``: all ``R``; chosen by ``selection``,
    ``"norm"`` on ``calibration``, the layer's inputs ``(B, S, E)``) as its rotary key
    (``rope_kv_heads = G``, their frequencies, the source's scale); the other ``D - rope_dim``
    go through the SVD. Exact at full rank with ``rope_dim = R``.
    """
    _check_design(layer, "with_kv_latent")
    _check_unpruned(layer, "with_kv_latent")
    E, H, G, D = layer.embed_dim, layer.num_heads, layer.num_kv_heads, layer.head_dim
    rope = layer.positions
    if rope is not None and not isinstance(rope, RotaryPositions):
        raise ValueError(f"with_kv_latent keeps rotary positions only, got {type(rope).__name__}")
    R = 0 if rope is None else rope.rotary_dim
    rope_dim = R if rope_dim is None else rope_dim
    if rope_dim != R and not (type(rope_dim) is int and 0 < rope_dim <= R and rope_dim % 2 == 0):
        where = f"an even number in [2, {R}], whole pairs" if R else "None: it has no rotary"
        raise ValueError(f"rope_dim of {layer.head_tag!r} must be {where}, got {rope_dim!r}")
    if selection not in ("high", "uniform", "norm"):
        raise ValueError(f"selection must be 'high', 'uniform' or 'norm', got {selection!r}")
    if selection == "norm" and calibration is None and rope_dim:
        raise ValueError("selection='norm' needs calibration, the layer's inputs (B, S, E)")
    (w_q, w_k, w_v), (b_q, b_k, b_v) = layer.in_proj.blocks(), layer.in_proj.blocks("bias")
    rotary, heads = {}, torch.arange(H, device=w_q.device)[:, None]
    rope_index = torch.empty(G, 0, dtype=torch.long, device=w_q.device)  # (G, rope_dim)
    if rope_dim:
        pairs = _rotary_pairs(layer, rope_dim, selection, calibration)  # (G, rope_dim/2)
        rope_index = rotary_index(rope, pairs)  # (G, rope_dim): source features, new order
        freqs = rope.frequencies(w_q.device, torch.float64).expand(G, -1).gather(1, pairs)
        rotary = {"rotary_dim": rope_dim, "rope_theta": rope.theta, "rope_kv_heads": G,
                  "rope_interleaved": rope.interleaved, "qk_head_dim": D - rope_dim,
                  "rope_inv_freq": tuple(map(tuple, freqs.tolist())),  # hashable, for configs
                  "softmax_scale": layer.scale}  # fmt: skip
    new = rebuild(layer, num_kv_heads=H, kv_latent_dim=kv_latent_dim, **rotary)
    new.positions = None  # a rotary key is the latent part's own
    # The SVD's rank: G(D - rope_dim) distinct K rows and G D V rows (GQA's repeats add none),
    # E columns. Above it the latent's last numbers are always zero; above G(2D - rope_dim)
    # it also caches more than the layer it replaces.
    kv_rows = G * (2 * D - rope_dim)
    if kv_latent_dim > min(kv_rows, E):
        rank = min(kv_rows, E)
        raise ValueError(
            f"a K/V latent of {kv_latent_dim} is more than the rank {rank} of the K/V stack of "
            f"{layer.head_tag!r} (E = {E}, G(2D - rope_dim) = {kv_rows}): "
            f"{kv_latent_dim - rank} of its numbers would always be zero"
        )
    kept = torch.ones(G, D, dtype=torch.bool, device=w_q.device)  # (G, D): not rotated now
    kept[heads[:G], rope_index] = False
    kept_q = kept.repeat_interleave(H // G, dim=0).flatten()  # (H*D,)
    rows_k = (rope_index + D * heads[:G]).flatten()  # (G*rope_dim,): each group's rotary K
    rows_q = (rope_index.repeat_interleave(H // G, 0) + D * heads).flatten()  # its heads' Q

    def per_query_head(t: Tensor) -> Tensor:  # (G*D, ...) -> (H*D, ...): repeated per group
        return t.view(G, D, -1).repeat_interleave(H // G, dim=0).reshape(H * D, *t.shape[1:])

    with torch.no_grad():
        stacked = torch.cat([per_query_head(w_k)[kept_q], per_query_head(w_v)]).double()
        U, S, Vh = torch.linalg.svd(stacked, full_matrices=False)  # stacked: (H(2D - d_R), E)
        r = kv_latent_dim  # at most the rank, checked above
        latent = new.design
        latent.up.weight.copy_(U[:, :r] * S[:r])
        latent.down.weight.copy_(Vh[:r])
        for name, q, k in (("weight", w_q, w_k), ("bias", b_q, b_k)):
            if q is not None:
                getattr(new.in_proj, name).copy_(q[kept_q])
                if rope_dim:
                    getattr(latent.q_rope, name).copy_(q[rows_q])
                    getattr(latent.k_rope, name).copy_(k[rows_k])
        new.out_proj.weight.copy_(layer.out_proj.weight)
        if b_v is not None:
            latent.down.bias.zero_()
            new.out_proj.bias.copy_(
                layer.out_proj.bias + layer.out_proj.weight @ per_query_head(b_v)
            )
    new.head_mask = layer.head_mask  # per query head: the query heads stay
    return new


def rotary_index(rope: RotaryPositions, pairs: Tensor) -> Tensor:
    """The features of the pairs ``pairs`` ``(G, n)`` of ``rope``, ``(G, 2n)``, in a key
    of those pairs in ``rope``'s pairing: ``(a_0, b_0, a_1, ..)`` interleaved, else
    ``(a_0, a_1, .., b_0, ..)`` (pair ``i`` is features ``2i, 2i+1``, or ``i, i + R/2``)."""
    R = torch.arange(rope.rotary_dim, device=pairs.device)
    if rope.interleaved:
        return R.view(-1, 2)[pairs].flatten(1)  # (G, n, 2) -> (G, 2n)
    return R.view(2, -1)[:, pairs].transpose(0, 1).flatten(1)  # (2, G, n) -> (G, 2n)


def _rotary_pairs(
    layer: MultiHeadAttention, rope_dim: int, selection: str, calibration: Tensor | None
) -> Tensor:
    """The rotary pairs each K/V group of ``layer`` keeps, ``(G, rope_dim/2)`` ascending
    (``"norm"``: the largest sum over the group's heads of the mean ``|q_i| |k_i|``)."""
    H, G, n = layer.num_heads, layer.num_kv_heads, rope_dim // 2
    half, interleaved = layer.positions.rotary_dim // 2, layer.positions.interleaved
    w = layer.in_proj.blocks()[0]
    if selection != "norm":  # "high": the first pairs, which turn fastest
        step = half // n if selection == "uniform" else 1
        return (torch.arange(n, device=w.device) * step).expand(G, n)
    with torch.no_grad():
        q, k, _ = layer.in_proj.qkv(calibration.to(w))  # (B, H or G, S, D)
    # (B, heads, S, R) -> (B, heads, S, R/2, 2) interleaved, or (.., 2, R/2): each pair's a, b
    split, ab = ((half, 2), -1) if interleaved else ((2, half), -2)
    norms = [x[..., : 2 * half].unflatten(-1, split).norm(dim=ab).mean((0, 2)) for x in (q, k)]
    score = norms[0].view(G, H // G, half).sum(1) * norms[1]  # (G, R/2)
    return score.topk(n, dim=1).indices.sort(dim=1).values


def expand_latent(layer: MultiHeadAttention) -> MultiHeadAttention:
    """The MHA layer equal to an MLA ``layer``: K/V weights ``W_UK W_DKV``, ``W_UV W_DKV``
    (its design's ``mha_kv``).

    For engines without latent attention (CTranslate2). A layer with a latent norm (not
    linear), a decoupled rotary key, its own Q/K or V width, a low-rank (normalised) query or
    its own scale has none and is refused.
    """
    latent = layer.design
    if latent is None or "expand_latent" not in latent.conversions:
        raise ValueError(f"expand_latent needs an MLA layer, got {layer.head_tag!r}")
    with torch.no_grad():
        kv = {name: latent.mha_kv(name) for name in ("weight", "bias")}  # raises if none
        new = rebuild(layer)
        for name, (k, v) in kv.items():
            (q, _, _), (new_q, new_k, new_v) = layer.in_proj.blocks(name), new.in_proj.blocks(name)
            if q is not None:
                new_q.copy_(q), new_k.copy_(k), new_v.copy_(v)
        new.out_proj.load_state_dict(layer.out_proj.state_dict())
    return new


def _check_design(layer: MultiHeadAttention, what: str) -> None:
    if layer.design is not None and what not in layer.design.conversions:
        raise ValueError(
            f"{what} converts a plain MHA/GQA/MQA layer or a design that declares it; got "
            f"head design {layer.head_tag!r}"
        )


def _check_unpruned(layer: MultiHeadAttention, what: str) -> None:
    # The conversions above rebuild the layer from (E, H), which gives head_dim = E / H.
    if layer.num_heads * layer.head_dim != layer.embed_dim:
        raise ValueError(
            f"{what} converts a layer with all its heads; this one has pruned heads "
            f"({layer.num_heads} heads of {layer.head_dim} for embed_dim={layer.embed_dim})"
        )


def prune_heads(layer: MultiHeadAttention, indices) -> MultiHeadAttention:
    """A copy of ``layer`` without the query heads ``indices`` (Michel et al., 2019).

    Their rows of ``W^Q`` and columns of ``W^O`` go, and the K/V heads no query head reads
    any more: for MHA each head's own, for GQA whole groups only (a group's query heads
    all go together with its K/V head, else ``ValueError``); MQA keeps its one K/V head.
    ``head_dim`` and the scale stay, so the copy has ``num_heads * head_dim < embed_dim``
    (the projections are ``(H'D + 2G'D, E)`` and ``(E, H'D)``) and computes what ``layer``
    does with those heads' ``head_mask`` entries at 0. A :attr:`head_mask` set on ``layer``
    keeps its entries for the heads that stay. Layers with a head design are refused.
    """
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    _check_design(layer, "prune_heads")
    if layer.positions is not None and layer.positions.seam == "score_bias":
        raise ValueError(
            f"prune_heads cannot keep a score bias, one per head of {H} "
            f"({type(layer.positions).__name__}); prune a layer without one"
        )
    pruned = sorted({int(i) for i in indices})
    if any(not 0 <= i < H for i in pruned):
        raise ValueError(f"head indices must be in [0, {H}), got {pruned}")
    if len(pruned) == H:
        raise ValueError(f"prune_heads must keep at least one of the {H} heads, got {pruned}")
    per_group = H // G
    keep = [h for h in range(H) if h not in pruned]
    keep_kv = sorted({h // per_group for h in keep})
    if G > 1 and len(keep) != len(keep_kv) * per_group:  # a K/V head kept for part of its group
        raise ValueError(
            f"GQA prunes whole groups of {per_group} query heads (heads {per_group}g .. "
            f"{per_group}g+{per_group - 1} with K/V head g); got heads {pruned}"
        )

    new = rebuild(layer, num_heads=len(keep), num_kv_heads=len(keep_kv))
    with torch.no_grad():
        for name in ("weight", "bias"):
            if layer.in_proj.blocks(name)[0] is None:  # either layout of in_proj
                continue
            (q, k, v), (new_q, new_k, new_v) = layer.in_proj.blocks(name), new.in_proj.blocks(name)
            # (H*D, ...) -> (H, D, ...): the kept heads' D-blocks -> (H'*D, ...)
            new_q.copy_(q.unflatten(0, (H, D))[keep].flatten(0, 1))
            new_k.copy_(k.unflatten(0, (G, D))[keep_kv].flatten(0, 1))
            new_v.copy_(v.unflatten(0, (G, D))[keep_kv].flatten(0, 1))
        w_o = layer.out_proj.weight  # (E, H*D) -> (E, H, D) -> (E, H'*D)
        new.out_proj.weight.copy_(w_o.unflatten(1, (H, D))[:, keep].flatten(1, 2))
        if layer.out_proj.bias is not None:
            new.out_proj.bias.copy_(layer.out_proj.bias)
    if layer.head_mask is not None:
        new.head_mask = layer.head_mask[keep]
    return new
