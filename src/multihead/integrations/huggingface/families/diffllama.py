"""DiffLlama: a Llama attention on the layer's differential design."""

from __future__ import annotations

from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

from multihead.integrations.huggingface.adapter import HFAttentionAdapter, HFLayout, load_hf
from multihead.integrations.huggingface.families.llama import LLAMA_NAMES, from_llama
from multihead.integrations.huggingface.registry import register_family


def from_diffllama(module: DiffLlamaAttention, backend: str) -> HFAttentionAdapter:
    """DiffLlama's attention: a Llama one (:func:`from_llama`) with the layer's differential
    design (:mod:`~multihead.attention.differential`), which pairs the heads as DiffLlama
    does, given the module's ``lambda_init`` (its depth's), its four ``lambda`` vectors and
    its RMSNorm's epsilon (``rms_norm_eps``)."""
    adapter = from_llama(
        module, backend, design="diff", lambda_init=module.lambda_init,
        norm_eps=module.groupnorm.eps,
    )  # fmt: skip
    # Built on the meta device with the projections: the lambda vectors get storage here.
    adapter.attn.design.to_empty(device=module.q_proj.weight.device)
    names = LLAMA_NAMES | {f"attn.{adapter.attn.design.attribute}.lambda_": "lambda_"}
    adapter.layout = HFLayout.renaming(module, names)
    load_hf(adapter, module)  # the lambdas; the projections are the module's own
    return adapter


register_family(DiffLlamaAttention, convert=from_diffllama)
