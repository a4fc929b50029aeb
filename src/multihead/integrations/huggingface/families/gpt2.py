"""GPT-2: its fused, transposed ``Conv1D`` Q/K/V on the layer's stacked ``in_proj``."""

from __future__ import annotations

from torch import Tensor
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

from multihead.attention import MultiHeadAttention
from multihead.integrations.huggingface.adapter import (
    HFAttentionAdapter,
    HFLayout,
    inverse,
    load_hf,
    renamed,
)
from multihead.integrations.huggingface.registry import register_family


def from_gpt2(module: GPT2Attention, backend: str) -> HFAttentionAdapter:
    """GPT-2's attention as an adapter with the same weights, copied.

    ``c_attn`` is a ``Conv1D`` of weight ``(E, 3E)`` (``x @ W + b``) holding Q, K, V side by
    side: its transpose is the layer's stacked ``in_proj`` ``(3E, E)`` as it is. Being a
    transpose, it is a new parameter (as ``c_proj``'s is): an optimizer built before the swap
    does not hold it.
    """
    if module.is_cross_attention:
        raise ValueError("GPT-2 cross-attention (add_cross_attention=True) is not supported")
    weight = module.c_attn.weight
    attn = MultiHeadAttention(
        module.embed_dim, module.num_heads, dropout=module.attn_dropout.p, backend=backend,
        device=weight.device, dtype=weight.dtype,
    )  # fmt: skip
    # 1/sqrt(D), or 1, over layer_idx + 1 under scale_attn_by_inverse_layer_idx.
    attn.scale = module.scaling
    adapter = HFAttentionAdapter(
        attn, layer_idx=module.layer_idx, resid_dropout=module.resid_dropout,
        layout=HFLayout.of(module, _gpt2_to_hf, _gpt2_from_hf),
    )  # fmt: skip
    load_hf(adapter, module)
    return adapter.train(module.training)


_GPT2 = {"attn.in_proj.": "c_attn.", "attn.out_proj.": "c_proj."}


def _gpt2_to_hf(own: dict[str, Tensor]) -> dict[str, Tensor]:
    """The layer's ``nn.Linear`` weights ``(out, in)`` as GPT-2's ``Conv1D`` ones ``(in, out)``."""
    theirs = renamed(own, _GPT2)
    return {k: v.T.contiguous() if k.endswith("weight") else v for k, v in theirs.items()}


def _gpt2_from_hf(theirs: dict[str, Tensor]) -> dict[str, Tensor]:
    own = renamed(theirs, inverse(_GPT2))
    return {k: v.T if k.endswith("weight") else v for k, v in own.items()}


register_family(GPT2Attention, convert=from_gpt2)
