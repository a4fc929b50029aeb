"""Which head design a layer is built with: the one place that knows them all.

A layer has at most one (:class:`~multihead.attention.steps.HeadDesign`), held under its
``attribute``, the name its parameters have always had in checkpoints: ``head_gate``
(sparse heads' router), ``head_mix`` (a mixing) or ``kv_latent`` (latent attention).
"""

from __future__ import annotations

from multihead.attention.latent import LatentKV
from multihead.attention.mixing import HEAD_MIXINGS
from multihead.attention.sparse import SparseHeads
from multihead.attention.steps import HeadDesign


def build_head_design(
    embed_dim: int, num_heads: int, *, backend: str, top_k_heads: int | None = None,
    num_shared_heads: int = 0, head_mixing: str | None = None, mixing_groups: int | None = None,
    kv_latent_dim: int | None = None, num_kv_heads: int | None = None,
    kv_latent_norm: bool = False, rotary_dim: int | None = None, rope_theta: float = 10000.0,
    rope_interleaved: bool = False, bias: bool = True, device=None, dtype=None,
) -> HeadDesign | None:  # fmt: skip
    """The part for the design the layer's arguments ask for, or ``None``.

    Raises:
        ValueError: options of a design that was not asked for, two designs at once, or a
            design's own check (see each part).
    """
    if top_k_heads is None and num_shared_heads:
        raise ValueError(
            f"num_shared_heads={num_shared_heads} needs sparse heads; set top_k_heads too"
        )
    if mixing_groups is not None and head_mixing != "group_mlp":
        raise ValueError(
            f"mixing_groups={mixing_groups} is for head_mixing='group_mlp', "
            f"got head_mixing={head_mixing!r}"
        )
    if top_k_heads is not None and head_mixing is not None:
        raise ValueError(
            f"top_k_heads={top_k_heads} cannot be combined with head_mixing={head_mixing!r}: "
            "a layer has one head design (a mixing reads every head, a sparse layer skips some)"
        )
    if kv_latent_norm and kv_latent_dim is None:
        raise ValueError("kv_latent_norm=True needs latent attention; set kv_latent_dim too")
    factory = {"device": device, "dtype": dtype}
    if kv_latent_dim is not None:
        others = {"top_k_heads": top_k_heads, "head_mixing": head_mixing}
        if num_kv_heads not in (None, num_heads):
            others["num_kv_heads"] = num_kv_heads
        named = {k: v for k, v in others.items() if v is not None}
        if named:
            raise ValueError(
                f"kv_latent_dim={kv_latent_dim} cannot be combined with "
                + ", ".join(f"{k}={v!r}" for k, v in named.items())
                + ": latent attention builds every K/V head from one latent (a layer has one "
                "head design)"
            )
        return LatentKV(
            embed_dim, num_heads, kv_latent_dim, bias=bias, norm=kv_latent_norm,
            rope_dim=rotary_dim, rope_theta=rope_theta, rope_interleaved=rope_interleaved,
            **factory,
        )  # fmt: skip
    if top_k_heads is not None:
        return SparseHeads(embed_dim, num_heads, top_k_heads, num_shared_heads, **factory)
    if head_mixing is None:
        return None
    if head_mixing not in HEAD_MIXINGS:
        raise ValueError(
            f"unknown head_mixing {head_mixing!r}; expected None or one of "
            + ", ".join(HEAD_MIXINGS)
        )
    if head_mixing == "talking_heads" and backend != "math":
        raise ValueError(
            f"head_mixing='talking_heads' mixes the full attention logits, which only the "
            f"'math' backend computes; got backend={backend!r}. Use backend='math', or a "
            "mixing that runs on any backend: group_mlp, head_attention"
        )
    mixing = HEAD_MIXINGS[head_mixing]
    return mixing(num_heads, embed_dim // num_heads, groups=mixing_groups, **factory)
