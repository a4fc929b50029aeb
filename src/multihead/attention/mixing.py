"""Head mixings: parts of the layer that let its heads interact (``design=`` by name).

Plain multi-head attention keeps the ``H`` heads apart until ``W^O`` sums them. A mixing adds
one interaction, through the math kernel's hooks (talking heads) or by replacing
:meth:`~HeadDesign.merge`, and each starts as the identity, so a layer with one starts as
plain multi-head attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention.backends import softmax
from multihead.attention.checks import check_positive_int
from multihead.attention.designs import (
    AttentionLayer,
    Call,
    HeadDesign,
    register_design,
    weights_times_values,
)
from multihead.attention.masks import AttentionMask


class HeadMixing(HeadDesign):
    """A mixing of the heads, each a design of its own name (``design="talking_heads"``);
    they share where the layer holds them (``head_mix``, their ``state_dict`` prefix)."""

    attribute = "head_mix"
    conversions = frozenset({"with_kv_heads"})


class TalkingHeads(HeadMixing):
    """The two ``(H, H)`` mixes of talking-heads attention (Shazeer et al., 2020).

    Head ``j``'s logits become ``sum_i logits_i * logit_mix[i, j]`` (before the mask and
    softmax) and its weights ``sum_i weights_i * weight_mix[i, j]`` (after the softmax,
    before the weights multiply V): the math formula with these two hooks, so it runs on
    backend ``math`` only. The attention weights it returns are the mixed ones, those that
    multiply V (head analysis reads them).
    """

    name = "talking_heads"

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None):
        super().__init__()
        self.logit_mix = nn.Parameter(torch.eye(num_heads, device=device, dtype=dtype))
        self.weight_mix = nn.Parameter(torch.eye(num_heads, device=device, dtype=dtype))

    def on_logits(self, scores: Tensor) -> Tensor:
        """``scores`` ``(B, H, L, S)`` mixed across heads, before the mask: a masked
        (-inf) logit mixed into other heads would give NaN."""
        return torch.einsum("bhls,hj->bjls", scores, self.logit_mix)

    def on_weights(self, weights: Tensor, scores: Tensor, mask: AttentionMask) -> Tensor:
        """``weights`` ``(B, H, L, S)`` mixed across heads; ``scores``: the masked ones."""
        if mask.empty_rows is not None:
            # An empty row is un-masked only to keep softmax finite; it lends no weight.
            weights = weights.masked_fill(mask.empty_rows, 0.0)
        weights = torch.einsum("bhls,hj->bjls", weights, self.weight_mix)
        # A per-head mask stays a mask after mixing: no head attends where it may not.
        return weights.masked_fill(torch.isneginf(scores), 0.0)


class OutputMixing(HeadMixing):
    """A mixing of the heads' outputs ``(B, L, H, D)`` before ``W^O``: the module's forward.
    It refuses a ``head_mask``: after the mix no head has an output of its own to scale."""

    takes_head_mask = False

    def merge(self, heads: Tensor, call: Call) -> Tensor:
        """The mixed heads, side by side, through ``W^O``: ``(B, L, E)``."""
        B, _, L, _ = heads.shape
        heads = self(heads.transpose(1, 2))  # (B, L, H, D), mixed
        return call.layer.out_proj(heads.reshape(B, L, -1))

    def head_outputs(self, layer: AttentionLayer, weights: Tensor, source: Tensor) -> Tensor:
        """Weights times V, mixed: ``(B, H, L, D)``."""
        heads = weights_times_values(layer, weights, source)  # (B, H, L, D)
        return self(heads.transpose(1, 2)).transpose(1, 2)


class GroupMLPMixing(OutputMixing):
    """An MLP over each group's concatenated head outputs, before ``W^O``.

    The ``H`` heads are split into ``groups`` consecutive groups of ``H / groups`` heads;
    group ``g``'s concatenated outputs ``x_g`` (width ``w = E / groups``) become
    ``x_g + W2_g gelu(W1_g x_g + b1_g) + b2_g`` with one ``(w, w)`` MLP per group. ``W2`` and
    the biases start at zero, so the mixing starts as the identity.
    """

    name = "group_mlp"

    def __init__(
        self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None,
        mixing_groups: int = 2,
    ):  # fmt: skip
        super().__init__()
        groups, head_dim = mixing_groups, embed_dim // num_heads
        check_positive_int("mixing_groups", groups)
        if num_heads % groups != 0:
            raise ValueError(f"mixing_groups ({groups}) must divide num_heads ({num_heads})")
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

    @property
    def options(self) -> dict[str, int]:
        return {"mixing_groups": self.groups}

    @property
    def tag(self) -> str:
        return f"-{self.name}{self.groups}"


class HeadAttentionMixing(OutputMixing):
    """Attention among the ``H`` head outputs at each position, before ``W^O``.

    A projection shared by all heads (``head_mix``, ``D -> 3D``) turns each head output
    ``o_i`` into ``(q_i, k_i, v_i)``; head ``i`` then becomes
    ``o_i + sum_j softmax_j(q_i . k_j / sqrt(D)) v_j``. The value rows of ``head_mix`` start
    at zero, so the mixing starts as the identity.
    """

    name = "head_attention"

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None):
        super().__init__()
        head_dim = embed_dim // num_heads
        self.head_mix = nn.Linear(head_dim, 3 * head_dim, device=device, dtype=dtype)
        with torch.no_grad():
            self.head_mix.weight[2 * head_dim :].zero_()
            self.head_mix.bias[2 * head_dim :].zero_()

    def forward(self, heads: Tensor) -> Tensor:
        """``heads`` ``(B, L, H, D)`` -> ``(B, L, H, D)``."""
        q, k, v = self.head_mix(heads).chunk(3, dim=-1)  # (B, L, H, D) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(heads.shape[-1])  # (B, L, H, H)
        weights = softmax(scores).to(v.dtype)  # head i over heads j
        return heads + weights @ v


for _mixing in (TalkingHeads, GroupMLPMixing, HeadAttentionMixing):
    register_design(_mixing.name, _mixing)
