"""Sparse heads: Mixture-of-Head attention (MoH; Jin et al., 2024), a part of the layer.

Each token's router ``G(x)`` (``layer.head_gate``, a linear ``E -> R`` without bias over
the ``R = H - Hs`` routed heads; MoH's name is its state_dict key) picks its ``k`` best; only
those are computed (query projection, scores and values, slice of ``W^O``), summed with
weights ``softmax(G(x))`` over the selected heads. Heads ``0 .. Hs - 1`` are shared: always
on, weight 1. K/V are projected for all ``G`` heads.

Example: 2 of 6 routed heads per token plus 2 shared heads, so 4 of 8 are active:

    >>> import torch
    >>> from multihead import MultiHeadAttention
    >>> moh = MultiHeadAttention(64, 8, design="moh", top_k_heads=2, num_shared_heads=2)
    >>> moh(torch.randn(2, 5, 64), is_causal=True).shape, moh.active_head_fraction
    (torch.Size([2, 5, 64]), 0.5)
    >>> moh.aux_loss is not None, moh.head_tag
    (True, 'mha8-moh-k2s2')
    >>> moh.head_gate  # the router: 6 routed heads' logits per token
    SparseHeads(in_features=64, out_features=6, bias=False, top_k_heads=2, num_shared_heads=2)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from multihead.attention.backends import softmax
from multihead.attention.checks import check_int_in
from multihead.attention.designs import (
    AttentionLayer,
    Call,
    HeadDesign,
    merge_heads,
    register_design,
    scale_heads,
    weights_times_values,
)
from multihead.attention.masks import AttentionMask, causal_keep


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


def _mask_for_heads(
    mask: AttentionMask, first: int, count: int, slots: Tensor | None, L: int, S: int
) -> AttentionMask:
    """``mask`` for query heads ``first .. first + count - 1`` and, with ``slots``
    ``(B, count, C)``, the query position of each packed row (the positions a head selected).

    Packed rows are no longer positions ``0 .. L - 1``, so a kernel's own causal mask would be
    wrong for them: it is written out, and from then on only the tensor says who sees what.
    """

    def rows(t: Tensor | None) -> Tensor | None:  # broadcastable to (B, count, C or L, X)
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

    tensor = mask.tensor
    if slots is not None and mask.kernel_causal(L, S):
        tensor = causal_keep(L, S, slots.device)
    tensor = rows(tensor)
    packed = slots is not None and tensor is not None and tensor.shape[2] > 1
    return AttentionMask(
        tensor=tensor,
        is_causal=mask.is_causal and not packed,
        empty_rows=rows(mask.empty_rows),
        key_padding_mask=mask.key_padding_mask,
        has_attn_mask=mask.has_attn_mask or packed,
    )


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


class SparseHeads(HeadDesign, nn.Linear):
    """The MoH router of a layer with ``num_heads`` heads, and the routed attention.

    Args:
        embed_dim, num_heads: ``E``, ``H``.
        top_k_heads: ``k``, the routed heads each token computes, in ``[1, H - Hs]``.
        num_shared_heads: ``Hs``, heads always on, in ``[0, H)``.
        device, dtype: for the router's weight.

    In training mode each call sets :attr:`aux_loss`, the Switch Transformer's
    load-balancing loss over the routed heads, ``R * sum_i f_i P_i``: ``f_i`` is the fraction
    of the ``k`` selections per token that went to head ``i`` (every query token, padding
    included), ``P_i`` the mean routing probability (softmax over all routed heads) of head
    ``i``. It is 1 for a perfectly balanced router; a model adds ``weight * aux_loss`` to
    its loss. It is ``None`` in eval mode. The packed buffers are sized from the routing,
    which reads two counts back to the host on every call (a sync on CUDA; shapes vary for
    ``torch.compile``).
    """

    name = "moh"
    attribute = "head_gate"
    conversions = frozenset({"with_kv_heads"})

    def __init__(
        self, embed_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool = True,
        device=None, dtype=None, top_k_heads: int, num_shared_heads: int = 0,
    ) -> None:  # fmt: skip
        check_int_in(
            "num_shared_heads", num_shared_heads, 0, num_heads - 1,
            why=f" (fewer than num_heads={num_heads})",
        )  # fmt: skip
        routed = num_heads - num_shared_heads
        check_int_in(
            "top_k_heads", top_k_heads, 1, routed,
            why=f" (num_heads={num_heads} minus num_shared_heads={num_shared_heads})",
        )  # fmt: skip
        super().__init__(embed_dim, routed, bias=False, device=device, dtype=dtype)
        self.num_heads = num_heads
        self.top_k = top_k_heads
        self.num_shared = num_shared_heads
        self.aux_loss: Tensor | None = None

    def __getstate__(self) -> dict:
        # The last aux_loss holds an autograd graph, which can be neither copied nor pickled.
        return {**self.__dict__, "aux_loss": None}

    @property
    def options(self) -> dict[str, int]:
        shared = {"num_shared_heads": self.num_shared} if self.num_shared else {}
        return {"top_k_heads": self.top_k, **shared}

    @property
    def tag(self) -> str:
        """``-moh-k<k>`` plus ``s<s>`` with shared heads, e.g. ``-moh-k2s1``."""
        return f"-moh-k{self.top_k}" + (f"s{self.num_shared}" if self.num_shared else "")

    @property
    def active_head_fraction(self) -> float:
        return (self.top_k + self.num_shared) / self.num_heads

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, top_k_heads={self.top_k}, num_shared_heads={self.num_shared}"
        )

    def head_outputs(self, layer: AttentionLayer, weights: Tensor, source: Tensor) -> Tensor:
        """``weights @ V`` per head ``(B, H, L, D)``: zero where a token did not select the
        head (its weights are zero there); the routing weight is not applied."""
        return weights_times_values(layer, weights, source)

    def project(
        self, source: Tensor | None, call: Call
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The shared heads' queries ``(B, Hs, L, D)`` (the routed heads' are projected for
        the selected pairs only, in :meth:`attend`), K and V ``(B, G, S, D)`` for every K/V
        head."""
        in_proj = call.layer.in_proj
        q_shared = in_proj.q(call.query, self.num_shared)  # (B, Hs, L, D)
        return q_shared, *((None, None) if source is None else in_proj.kv(source))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, call: Call
    ) -> tuple[RoutedHeads, Tensor | None]:
        """Shared heads densely, then only the routed (token, head) pairs selected: their
        queries on ``M`` rows per head (the most pairs any head got, ``B * L * k / R`` when
        balanced), their attention in the layer's backend on ``(B, R, C, D)`` queries
        (``C``: the most positions any (sentence, head) got). ``q`` is the shared heads'
        ``(B, Hs, L, D)``, placed at their positions by the layer, as K was."""
        layer, query = call.layer, call.query
        B, L, E = query.shape
        H, D, S = layer.num_heads, layer.head_dim, k.shape[2]
        Hs, top_k, R = self.num_shared, self.top_k, self.out_features
        (w, _, _), (b, _, _) = layer.in_proj.blocks(), layer.in_proj.blocks("bias")
        q_shared, positions = q, call.positions

        def attend_heads(q: Tensor, first: int, count: int, slots: Tensor | None):
            heads_mask = _mask_for_heads(mask, first, count, slots, L, S)
            k_h, v_h = _kv_for_heads(k, first, count, H), _kv_for_heads(v, first, count, H)
            return call.attend(q, k_h, v_h, heads_mask)

        # Route: each token picks its top-k routed heads, weighted by a softmax over them.
        logits = self(query)  # (B, L, R)
        top_logits, top_heads = logits.topk(top_k, dim=-1)  # (B, L, k)
        top_weight = softmax(top_logits).to(logits.dtype)  # (B, L, k)
        route_weight = torch.zeros_like(logits).scatter(-1, top_heads, top_weight)  # (B, L, R)
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top_heads, True)
        chosen = chosen.transpose(1, 2)  # (B, R, L)
        if self.training:
            f = chosen.sum(dim=(0, 2)).to(torch.float32) / (B * L * top_k)  # (R,), sums to 1
            p = softmax(logits).mean(dim=(0, 1))  # (R,)
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
        q = torch.bmm(x, w[Hs * D :].view(R, D, E).transpose(1, 2))  # (R, M, D)
        if b is not None:
            q = q + b[Hs * D :].view(R, 1, D).to(q.dtype)  # autocast: keep q's dtype
        if layer.positions is not None:  # each pair's query at its token's position
            pair_position = positions.expand(B, L).reshape(B * L)[pair_token]  # (R, M)
            q = layer.positions.rotate(q.unsqueeze(1), pair_position).squeeze(1)  # (R, M, D)
        spare = pair_slot_or_spare.unsqueeze(-1).expand(R, M, D)
        q = q.new_zeros(R, B * C + 1, D).scatter(1, spare, q)[:, : B * C]  # (R, B*C, D)
        q = q.view(R, B, C, D).transpose(0, 1)  # (B, R, C, D)
        routed, routed_weights = attend_heads(q, Hs, R, slots)  # (B, R, C, D)

        # Each pair's output and routing weight (0 for padding), for merge.
        routed = routed.transpose(0, 1).reshape(R, B * C, D)
        routed = routed.gather(1, pair_slot.unsqueeze(-1).expand(R, M, D))  # (R, M, D)
        slot_weight = route_weight.transpose(1, 2).gather(2, slots).transpose(0, 1)
        pair_weight = slot_weight.reshape(R, B * C).gather(1, pair_slot) * pair_valid  # (R, M)
        shared = shared_weights = None
        if Hs:
            shared, shared_weights = attend_heads(q_shared, 0, Hs, None)  # (B, Hs, L, D)
        heads = RoutedHeads(routed, pair_weight, pair_token, shared)
        if not call.need_weights:
            return heads, None

        # Weights (B, H, L, S): the routed pairs scattered back, zeros for unselected heads.
        # order is L in padding slots: a spare row, dropped.
        weights = q.new_zeros(B, R, L + 1, S).scatter(
            2, order.unsqueeze(-1).expand(B, R, C, S), routed_weights
        )[:, :, :L]
        if Hs:
            weights = torch.cat([shared_weights, weights], dim=1)
        return heads, weights

    def merge(self, heads: RoutedHeads, call: Call) -> Tensor:
        """The output ``(B, L, E)``: each selected pair's output times its routing weight
        through its head's ``(E, D)`` slice of ``W^O``, summed per token, plus the shared
        heads through theirs. ``head_mask`` scales the shared heads' outputs and each routed
        pair's weight."""
        layer, head_mask = call.layer, call.head_mask
        B, L, E = call.query.shape
        H, D, Hs = layer.num_heads, layer.head_dim, self.num_shared
        w_o = layer.out_proj.weight.view(E, H, D)  # column block h of W^O is head h's slice
        routed, pair_weight, pair_token, shared = heads
        if head_mask is not None:
            pair_weight = pair_weight * head_mask[Hs:].to(pair_weight.dtype).unsqueeze(-1)
        y = torch.bmm(routed * pair_weight.unsqueeze(-1), w_o[:, Hs:].permute(1, 2, 0))  # (R,M,E)
        out = y.new_zeros(B * L, E).index_add(0, pair_token.reshape(-1), y.reshape(-1, E))
        out = out.view(B, L, E)
        if Hs:
            if head_mask is not None:
                shared = scale_heads(shared, head_mask[:Hs])
            out = out + merge_heads(shared) @ w_o[:, :Hs].reshape(E, Hs * D).T  # (B, L, E)
        if layer.out_proj.bias is not None:
            out = out + layer.out_proj.bias.to(out.dtype)
        return out


class RoutedHeads(NamedTuple):
    """What :meth:`SparseHeads.attend` gives its :meth:`~SparseHeads.merge`: the selected
    pairs' outputs ``(R, M, D)``, routing weights ``(R, M)`` (0 for padding) and tokens
    ``(R, M)`` (indices into the ``B*L`` tokens), and the shared heads ``(B, Hs, L, D)``
    (``None`` without)."""

    routed: Tensor
    pair_weight: Tensor
    pair_token: Tensor
    shared: Tensor | None


register_design(SparseHeads.name, SparseHeads)
