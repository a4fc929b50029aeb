"""Conversions of a layer's heads, functions over layers: :func:`with_kv_heads` (fewer K/V heads),
:func:`with_kv_latent` (a K/V latent, MLA), :func:`expand_latent` (back to the equivalent MHA
layer) and :func:`prune_heads` (fewer query heads): each a new layer (built by
:func:`rebuild`), its input left as it was. A head design is kept where it declares the
conversion (``HeadDesign.conversions``), else refused by name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from multihead.attention.checks import check_positive_int
from multihead.attention.designs import design_arguments
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
    and each group is mean-pooled into one head. ``num_kv_heads`` equal to ``G`` is refused:
    nothing to pool, and the copy would differ only in its ``in_proj`` layout (stacked, where a
    swapped HF layer's is separate, which ``save_pretrained`` needs).
    """
    G = layer.num_kv_heads
    _check_unpruned(layer, "with_kv_heads")
    _check_design(layer, "with_kv_heads")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        raise TypeError(f"num_kv_heads must be an integer, got {num_kv_heads!r}")
    if num_kv_heads == G:  # as convert_attention refuses it
        raise ValueError(
            f"with_kv_heads({num_kv_heads}) would leave {layer.head_tag!r} as it is: it has "
            f"{G} K/V heads already"
        )
    if num_kv_heads <= 0 or G % num_kv_heads != 0:  # no argument named: callers name it apart
        raise ValueError(f"cannot pool {G} K/V heads into {num_kv_heads}: it must divide {G}")
    new = rebuild(layer, num_kv_heads=num_kv_heads, **design_arguments(layer.design))

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


ROTARY_KEYS = ("per_group", "shared")
FACTORISATIONS = ("svd", "pca")
# Added to the calibration inputs' second moment before the PCA, times its mean eigenvalue:
# directions of the input space the calibration batch barely visits keep the weights' own
# ranking (the SVD's), so the latent stays exact at full rank for every input, not only for
# the batch's, and a small batch is not overfitted (docs/log.md, issue 67: the value).
PCA_DAMPING = 1e-2


class _Split(NamedTuple):
    """A rotary layer's weights split into what rotates and what goes through the latent.

    ``q`` ``(H qk, E)`` the queries scored against the latent's keys, ``k`` ``(G qk, E)``
    the keys the latent carries (one set per source K/V group), ``q_rope`` ``(H d_R, E)``
    and ``k_rope`` ``(G_R d_R, E)`` the rotary query and key(s); each with its bias (or
    ``None``); ``options`` the latent's constructor arguments for them.
    """

    q: Tensor
    q_bias: Tensor | None
    k: Tensor
    q_rope: Tensor | None
    q_rope_bias: Tensor | None
    k_rope: Tensor | None
    k_rope_bias: Tensor | None
    options: dict


def with_kv_latent(
    layer: MultiHeadAttention, kv_latent_dim: int, *, rope_dim: int | None = None,
    selection: str = "high", rotary_key: str = "per_group", freqfold: int | None = None,
    calibration: Tensor | None = None, factorisation: str = "svd", balance_kv: bool = False,
) -> MultiHeadAttention:  # fmt: skip
    """An MLA copy of an MHA/GQA/MQA ``layer`` with a ``kv_latent_dim`` latent.

    **The latent** (``factorisation``): a rank-``r`` factorisation of the stacked K and V
    rows ``W = [W_K; W_V]`` (per K/V group; GQA's heads repeat them), ``W_DKV`` ``(r, E)``
    and ``[W_UK; W_UV]`` ``(., r)`` with ``W_UKV W_DKV = P W`` for a rank-``r`` projection
    ``P`` of the rows:

    * ``"svd"``, the weights alone (MHA2MLA's joint SVD): ``P`` keeps the top ``r`` left
      singular vectors of ``W``;
    * ``"pca"``, activation-aware (TransMLA): ``P`` keeps the top ``r`` principal
      directions of the K/V outputs ``y = W x`` on ``calibration`` (``x`` the layer's K/V
      source inputs ``(..., E)``, every row a sample), the eigenvectors of
      ``W (Sigma + d I) W^T`` with ``Sigma`` the inputs' second moment and ``d`` =
      :data:`PCA_DAMPING` times its mean eigenvalue;

    Which of them (and BKV, and the rotary key's layout) suits a model is measured, not
    assumed: :func:`~multihead.checkpoints.conversion.convert_attention` converts with each
    and keeps the one that computes best on held-out calibration (``docs/reuse.md``); this
    function builds the one it is told. ``calibration`` that neither ``"pca"`` nor
    ``selection="norm"`` reads is refused (it would be ignored).

    Either way ``W_DKV`` has unit rows and the up-projection carries the scale (``W_UKV =
    U S`` and ``W_DKV = V^T`` for the SVD). ``balance_kv`` (TransMLA's BKV): K's rows are
    divided by ``s`` = RMS(K outputs) / RMS(V outputs) (weights alone: their row norms)
    before the factorisation and ``W_UK`` multiplied by it after, so that trained K, often
    2-3 times V's norm, does not take V's share of the latent. It is exact when ``r`` is
    the rank of the stack (at most ``min(E, G (2D - rope_dim))``, ``2GD - rope_dim`` with
    a shared key); a larger ``r`` is refused, its last numbers always zero. Biases: the K
    bias adds the same ``q . b_K`` to every score of a query, which softmax ignores, so it
    is dropped; the V bias adds ``b_V`` to every head output (weights sum to 1), which
    moves into the output projection's bias (a query with no key left, zeroed by the
    layer, then differs).

    **A rotary layer** keeps ``rope_dim`` rotated features (``None``: all ``R``) in a
    decoupled rotary key (``docs/reuse.md``), as ``rotary_key`` says:

    * ``"per_group"`` (MHA2MLA's partial RoPE): each K/V group keeps ``rope_dim`` of its
      rotated features (whole pairs, chosen by ``selection``: ``"high"`` the fastest,
      ``"uniform"`` evenly spaced, ``"norm"`` the largest mean ``|q_i| |k_i|`` on
      ``calibration``) as its own rotary key (``rope_kv_heads = G``); the cache holds
      ``r + G rope_dim``. Exact at full rank with ``rope_dim = R``.
    * ``"shared"`` (TransMLA's RoRoPE with FreqFold): one rotary key of ``rope_dim`` for
      every head, as DeepSeek-V2's. Pair ``i``'s 2-D components in the ``G`` groups,
      ``k_gi``, rotate alike at frequency ``w_i``, so an orthogonal ``G x G`` mix of them
      (the same for both coordinates) commutes with RoPE and the queries absorb it. For
      each block of ``freqfold`` neighbouring pairs, the PCA of the ``G freqfold``
      components (their second moment over tokens and both coordinates, weighed as the
      latent's: by the calibration inputs with ``"pca"``, the weights alone with ``"svd"``)
      gives the mix; its top
      ``k = rope_dim freqfold / R`` components form the key, rotated at the block's
      frequencies (component ``j`` at pair ``j freqfold // k`` of the block), and the rest
      go to the latent, position-free: the approximation. Exact at full rank where
      nothing is dropped (``freqfold = 1`` and ``rope_dim = G R``) and for ``G = 1`` with
      ``rope_dim = R``; else its error is the layer's to measure. The cache holds
      ``r + rope_dim``. ``freqfold`` ``None``: the smallest that makes ``k`` whole.

    ``selection`` is the per-group keys' and ``freqfold`` the shared key's; either with the
    other is refused.
    """
    _check_design(layer, "with_kv_latent")
    _check_unpruned(layer, "with_kv_latent")
    check_positive_int("kv_latent_dim", kv_latent_dim)
    E, H, G, D = layer.embed_dim, layer.num_heads, layer.num_kv_heads, layer.head_dim
    rope = layer.positions
    if rope is not None and not isinstance(rope, RotaryPositions):
        raise ValueError(f"with_kv_latent keeps rotary positions only, got {type(rope).__name__}")
    R = 0 if rope is None else rope.rotary_dim
    if rotary_key not in ROTARY_KEYS:
        raise ValueError(f"rotary_key must be 'per_group' or 'shared', got {rotary_key!r}")
    shared = rotary_key == "shared"
    if shared and not R:
        raise ValueError(f"rotary_key='shared' needs a rotary layer; {layer.head_tag!r} has none")
    rope_dim = R if rope_dim is None else rope_dim
    widest = G * R if shared else R  # a shared key may keep every group's components
    if rope_dim != R and not (
        type(rope_dim) is int and 0 < rope_dim <= widest and rope_dim % 2 == 0
    ):
        where = f"an even number in [2, {widest}], whole pairs" if R else "None: it has no rotary"
        raise ValueError(f"rope_dim of {layer.head_tag!r} must be {where}, got {rope_dim!r}")
    if selection not in ("high", "uniform", "norm"):
        raise ValueError(f"selection must be 'high', 'uniform' or 'norm', got {selection!r}")
    if shared and selection != "high":
        raise ValueError(
            f"selection={selection!r} chooses per-group keys' pairs; a shared key keeps the "
            "top components of every pair (leave selection unset)"
        )
    if freqfold is not None and not shared:
        raise ValueError(f"freqfold={freqfold!r} folds the frequencies of rotary_key='shared'")
    if shared:
        freqfold = _freqfold(layer, rope_dim, freqfold)
    x = _calibration_rows(layer, calibration)  # (N, E) fp64, or None
    if factorisation not in FACTORISATIONS:
        raise ValueError(f"factorisation must be 'svd' or 'pca', got {factorisation!r}")
    if factorisation == "pca" and x is None:
        raise ValueError("factorisation='pca' needs calibration, the layer's inputs (B, S, E)")
    if not isinstance(balance_kv, bool):
        raise TypeError(f"balance_kv must be a bool, got {balance_kv!r}")
    norm = selection == "norm" and bool(rope_dim)  # per-group pairs chosen on the inputs
    if norm and x is None:
        raise ValueError("selection='norm' needs calibration, the layer's inputs (B, S, E)")
    if x is not None and factorisation != "pca" and not norm:
        raise ValueError(
            f"calibration would be ignored: factorisation={factorisation!r} reads the weights "
            "alone (factorisation='pca' and selection='norm' read it; convert_attention "
            "chooses among the factorisations by measuring)"
        )
    # The stack's rank: G(D - rope_dim) K rows and G D V rows per group (GQA's repeats add
    # none), or with a shared key G D K rows less the rope_dim it takes out; E columns. Above
    # it the latent's last numbers are always zero, and the cache may outgrow the layer's.
    kv_rows = 2 * G * D - rope_dim if shared else G * (2 * D - rope_dim)
    if kv_latent_dim > min(kv_rows, E):
        rank = min(kv_rows, E)
        rows = "2GD - rope_dim" if shared else "G(2D - rope_dim)"
        raise ValueError(
            f"a K/V latent of {kv_latent_dim} is more than the rank {rank} of the K/V stack of "
            f"{layer.head_tag!r} (E = {E}, {rows} = {kv_rows}): "
            f"{kv_latent_dim - rank} of its numbers would always be zero"
        )
    (w_q, w_k, w_v), (b_q, _, b_v) = layer.in_proj.blocks(), layer.in_proj.blocks("bias")
    with torch.no_grad():
        # The inputs' second moment, (E, E), damped; None: the weights alone (as for I).
        sigma = None if factorisation == "svd" else _second_moment(x)
        if not rope_dim:
            split = _Split(w_q, b_q, w_k, None, None, None, None, {})
        elif shared:
            split = _shared_key(layer, rope_dim, freqfold, sigma)
        else:
            split = _per_group_keys(layer, rope_dim, selection, x)
        down, up_k, up_v = _factorise(split.k.double(), w_v.double(), sigma, kv_latent_dim,
                                      balance_kv)  # fmt: skip
    new = rebuild(layer, num_kv_heads=H, design="mla", kv_latent_dim=kv_latent_dim, **split.options)
    new.positions = None  # a rotary key is the latent part's own

    def per_query_head(t: Tensor) -> Tensor:  # (G*w, ...) -> (H*w, ...): repeated per group
        w = len(t) // G  # 0 for a per-group key that keeps every feature of K
        return t.unflatten(0, (G, w)).repeat_interleave(H // G, dim=0).flatten(0, 1)

    # The latent's down-projection has no bias (zero): K's is dropped, V's moves to W^O's.
    new.design.load_factors(
        down, per_query_head(up_k), per_query_head(up_v), q_rope=split.q_rope,
        k_rope=split.k_rope, q_rope_bias=split.q_rope_bias, k_rope_bias=split.k_rope_bias,
    )  # fmt: skip
    with torch.no_grad():
        new.in_proj.weight.copy_(split.q)
        if split.q_bias is not None:
            new.in_proj.bias.copy_(split.q_bias)
        new.out_proj.weight.copy_(layer.out_proj.weight)
        if b_v is not None:
            new.out_proj.bias.copy_(
                layer.out_proj.bias + layer.out_proj.weight @ per_query_head(b_v)
            )
    new.head_mask = layer.head_mask  # per query head: the query heads stay
    return new


def _calibration_rows(layer: MultiHeadAttention, calibration: Tensor | None) -> Tensor | None:
    """``calibration`` ``(..., E)`` as ``(N, E)`` fp64 rows, one sample each; bad input
    refused in one line."""
    if calibration is None:
        return None
    E = layer.embed_dim
    if not isinstance(calibration, Tensor):
        raise TypeError(
            f"calibration must be the layer's inputs, a tensor (B, S, {E}); got "
            f"{type(calibration).__name__}"
        )
    if not calibration.is_floating_point():
        raise TypeError(
            f"calibration must be the layer's inputs, floats (B, S, {E}); got "
            f"{calibration.dtype} (token ids go to convert_attention, which runs the model)"
        )
    if calibration.dim() < 2 or calibration.shape[-1] != E:
        raise ValueError(
            f"calibration of {layer.head_tag!r} must be (B, S, {E}), its inputs; got shape "
            f"{tuple(calibration.shape)}"
        )
    if calibration.numel() == 0:
        raise ValueError(f"calibration is empty (shape {tuple(calibration.shape)})")
    x = calibration.detach().reshape(-1, E).double()
    if not torch.isfinite(x).all():
        raise ValueError("calibration holds NaN or infinite values")
    return x


def _second_moment(x: Tensor) -> Tensor:
    """``x^T x / N + d I`` ``(E, E)``, ``d`` = :data:`PCA_DAMPING` times its mean eigenvalue."""
    sigma = x.T @ x / len(x)  # (E, E)
    damping = PCA_DAMPING * sigma.diagonal().mean()
    return sigma + damping * torch.eye(len(sigma), dtype=sigma.dtype, device=sigma.device)


def _gram(w: Tensor, sigma: Tensor | None) -> Tensor:
    """The rows' second moment ``w Sigma w^T`` over the inputs (``w w^T`` without them)."""
    return w @ w.transpose(-2, -1) if sigma is None else w @ sigma @ w.transpose(-2, -1)


def _factorise(
    w_k: Tensor, w_v: Tensor, sigma: Tensor | None, r: int, balance: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``W_DKV`` ``(r, E)``, ``W_UK`` ``(m_K, r)``, ``W_UV`` ``(m_V, r)`` of the K rows
    ``w_k`` ``(m_K, E)`` and V rows ``w_v`` ``(m_V, E)`` (see :func:`with_kv_latent`)."""
    scale = torch.ones((), dtype=w_k.dtype, device=w_k.device)
    if balance and len(w_k):  # BKV: K and V with the same mean square output
        k_ms, v_ms = (_gram(w, sigma).diagonal().mean() for w in (w_k, w_v))
        if k_ms > torch.finfo(k_ms.dtype).eps * v_ms:  # else the rotary keys took all of K
            scale = (k_ms / v_ms).sqrt()
    stacked = torch.cat((w_k / scale, w_v))  # (m_K + m_V, E)
    if sigma is None:  # the weights alone: the SVD itself, U S and V^T
        U, S, Vh = torch.linalg.svd(stacked, full_matrices=False)
        up, down = U[:, :r] * S[:r], Vh[:r]
    else:
        _, vectors = torch.linalg.eigh(_gram(stacked, sigma))  # ascending eigenvalues
        top = vectors.flip(-1)[:, :r]  # (m, r): the outputs' top principal directions
        rows = top.T @ stacked  # (r, E)
        norms = rows.norm(dim=1)
        norms = norms.where(norms > 0, torch.ones_like(norms))
        up, down = top * norms, rows / norms[:, None]  # unit rows in W_DKV, as the SVD's
    up_k, up_v = up.split([len(w_k), len(w_v)])
    return down, up_k * scale, up_v


def _per_group_keys(
    layer: MultiHeadAttention, rope_dim: int, selection: str, x: Tensor | None
) -> _Split:
    """MHA2MLA's partial RoPE: each K/V group's ``rope_dim`` kept features as its key."""
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    rope = layer.positions
    (w_q, w_k, _), (b_q, b_k, _) = layer.in_proj.blocks(), layer.in_proj.blocks("bias")
    heads = torch.arange(H, device=w_q.device)[:, None]
    calibration = None if x is None else x.to(w_q)[None]  # (1, N, E)
    pairs = _rotary_pairs(layer, rope_dim, selection, calibration)  # (G, rope_dim/2)
    rope_index = rotary_index(rope, pairs)  # (G, rope_dim): source features, new order
    freqs = rope.frequencies(w_q.device, torch.float64).expand(G, -1).gather(1, pairs)
    kept = torch.ones(G, D, dtype=torch.bool, device=w_q.device)  # (G, D): not rotated now
    kept[heads[:G], rope_index] = False
    kept_q = kept.repeat_interleave(H // G, dim=0).flatten()  # (H*D,)
    rows_k = (rope_index + D * heads[:G]).flatten()  # (G*rope_dim,): each group's rotary K
    rows_q = (rope_index.repeat_interleave(H // G, 0) + D * heads).flatten()  # its heads' Q
    options = {"rotary_dim": rope_dim, "rope_theta": rope.theta, "rope_kv_heads": G,
               "rope_interleaved": rope.interleaved, "qk_head_dim": D - rope_dim,
               "rope_inv_freq": tuple(map(tuple, freqs.tolist())),  # hashable, for configs
               "softmax_scale": layer.scale}  # fmt: skip
    b = b_q is not None
    return _Split(
        w_q[kept_q], b_q[kept_q] if b else None, w_k[kept.flatten()], w_q[rows_q],
        b_q[rows_q] if b else None, w_k[rows_k], b_k[rows_k] if b else None, options,
    )  # fmt: skip


def _freqfold(layer: MultiHeadAttention, rope_dim: int, freqfold: int | None) -> int:
    """The shared key's fold: ``freqfold`` checked, or the smallest that fits ``rope_dim``."""
    G, half = layer.num_kv_heads, layer.positions.rotary_dim // 2

    def fits(ff: int) -> bool:  # whole blocks, each keeping a whole number k of components
        return (
            half % ff == 0
            and (rope_dim * ff) % (2 * half) == 0
            and rope_dim * ff // (2 * half) <= G * ff
        )

    if freqfold is None:
        return next(ff for ff in range(1, half + 1) if fits(ff))  # ff = R/2 always fits
    if (
        isinstance(freqfold, bool)
        or not isinstance(freqfold, int)
        or freqfold < 1
        or not fits(freqfold)
    ):
        raise ValueError(
            f"freqfold must divide the {half} rotary pairs of {layer.head_tag!r} into blocks "
            f"that each keep a whole number of the shared key's {rope_dim // 2} pairs, got "
            f"{freqfold!r}"
        )
    return freqfold


def _shared_key(
    layer: MultiHeadAttention, rope_dim: int, freqfold: int, sigma: Tensor | None
) -> _Split:
    """TransMLA's RoRoPE with FreqFold: one rotary key of ``rope_dim``, the top principal
    components of each block of ``freqfold`` pairs across the K/V groups."""
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    rope = layer.positions
    half, ff = rope.rotary_dim // 2, freqfold
    blocks, k = half // ff, rope_dim * ff // rope.rotary_dim  # k components kept per block
    (w_q, w_k, _), (b_q, b_k, _) = layer.in_proj.blocks(), layer.in_proj.blocks("bias")
    pair = torch.arange(half, device=w_q.device)
    # Feature of pair i's coordinate t (t = 0: a, 1: b) in a head, (2, R/2).
    ab = torch.stack((2 * pair, 2 * pair + 1) if rope.interleaved else (pair, pair + half))

    def components(t: Tensor, heads: int) -> Tensor:  # (heads*D, ..) -> (blocks, 2, heads*ff, ..)
        t = t.double().unflatten(0, (heads, D))[:, ab]  # (heads, 2, R/2, ...)
        t = t.unflatten(2, (blocks, ff)).movedim(2, 0)  # (blocks, heads, 2, ff, ...)
        return t.transpose(1, 2).flatten(2, 3)  # (blocks, 2, heads*ff, ...): rows (g, f)

    wk = components(w_k, G)  # (blocks, 2, G*ff, E)
    # The components' second moment over tokens and both coordinates (RoPE turns one into
    # the other, so the PCA must not tell them apart): (blocks, G*ff, G*ff).
    moment = _gram(wk, sigma).sum(1)
    _, vectors = torch.linalg.eigh(moment)  # ascending
    mix = vectors.flip(-1)[..., :k]  # (blocks, G*ff, k): the top components' mixes

    def key_layout(t: Tensor) -> Tensor:  # (blocks, 2, k, ..) -> (rope_dim, ..), rope's pairing
        t = t.movedim(1, 0).flatten(1, 2)  # (2, blocks*k, ...): pair b*k + j, coordinate t
        return (t.transpose(0, 1) if rope.interleaved else t).flatten(0, 1)

    # The key: k_j = sum_(g,f) mix[(g,f), j] k_(g,f), (blocks, 2, k, E) -> (rope_dim, E).
    k_rope = key_layout(torch.einsum("bmj,btme->btje", mix, wk))
    # What the key leaves of K, (I - mix mix^T) K, back at its features: the latent's.
    rest = wk - torch.einsum("bmj,bnj,btne->btme", mix, mix, wk)  # (blocks, 2, G*ff, E)
    k_rest = w_k.double().unflatten(0, (G, D)).clone()  # (G, D, E)
    k_rest[:, ab] = rest.unflatten(2, (G, ff)).movedim(2, 0).transpose(1, 2).flatten(2, 3)
    # Each query head scores the key through its own group's rows of the mix:
    # q_hj = sum_f mix[(g(h), f), j] q_hf, (H, blocks, ff, k).
    group_mix = mix.unflatten(1, (G, ff)).movedim(1, 0).repeat_interleave(H // G, dim=0)

    def rotary_queries(t: Tensor) -> Tensor:  # (H*D, ...) -> (H*rope_dim, ...)
        q = t.double().unflatten(0, (H, D))[:, ab]  # (H, 2, R/2, ...)
        q = q.unflatten(2, (blocks, ff))  # (H, 2, blocks, ff, ...)
        q = torch.einsum("hbfj,htbf...->hbtj...", group_mix, q)  # (H, blocks, 2, k, ...)
        return torch.stack([key_layout(q_h) for q_h in q]).flatten(0, 1)

    # Component j of block b turns at pair b*ff + j*ff//k of the source (TransMLA: the
    # block's first pair when k = 1).
    source = rope.frequencies(w_q.device, torch.float64).reshape(-1, half)
    if (source != source[0]).any():
        raise ValueError(f"{layer.head_tag!r} turns its heads at other frequencies: no shared key")
    chosen = (pair.view(blocks, ff)[:, torch.arange(k, device=pair.device) * ff // k]).flatten()
    options = {"rotary_dim": rope_dim, "rope_theta": rope.theta,
               "rope_interleaved": rope.interleaved,
               "rope_inv_freq": (tuple(source[0, chosen].tolist()),),  # hashable, for configs
               "softmax_scale": layer.scale}  # fmt: skip
    b = b_q is not None
    key_bias = key_layout(torch.einsum("bmj,btm->btj", mix, components(b_k, G))) if b else None
    return _Split(
        w_q, b_q, k_rest.flatten(0, 1), rotary_queries(w_q), rotary_queries(b_q) if b else None,
        k_rope, key_bias, options,
    )  # fmt: skip


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
