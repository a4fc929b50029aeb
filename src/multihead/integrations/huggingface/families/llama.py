"""The Llama family (Llama, Qwen2, Mistral): HF's own projections inside the layer, the
rotary positions the layer's."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from multihead.attention import MultiHeadAttention, QKVProjection
from multihead.integrations.huggingface.adapter import HFAttentionAdapter, HFLayout
from multihead.integrations.huggingface.registry import register_family


def from_llama(
    module: LlamaAttention | Qwen2Attention | MistralAttention, backend: str, **design
) -> HFAttentionAdapter:
    """A Llama-family attention (Llama, Qwen2, Mistral) as an adapter holding its weights.

    ``q_proj``, ``k_proj`` and ``v_proj`` (``(H*D, E)``, ``(G*D, E)``, ``(G*D, E)``) are the
    layer's ``in_proj`` in its separate layout (``QKVProjection.from_linears``) and ``o_proj``
    is its ``out_proj``: the module's own ``nn.Linear``, not copies, so an optimizer built
    before the swap trains them, a frozen one stays frozen, and Qwen2's ``o_proj`` keeps no
    bias beside its biased Q/K/V. HF's
    ``num_key_value_heads`` is ``num_kv_heads`` (GQA, MQA). Rotary positions are the layer's
    own, "rotate half" as HF's ``apply_rotary_pos_emb``, ``rope_theta`` from the config.

    * Only HF's ``rope_type="default"``: a scaled RoPE (llama3, yarn, linear, dynamic, ...)
      changes the angles or scales ``cos`` and ``sin``, which the layer does not; refused.
    * ``partial_rotary_factor``: these three families rotate every feature of a head
      whatever the config says (``apply_rotary_pos_emb`` multiplies the whole head by a
      ``head_dim``-wide ``cos``; transformers 5.24), so ``rotary_dim`` is ``head_dim`` and the
      factor is ignored, as HF ignores it. :func:`replace_hf_attention` compares the model's
      ``cos`` and ``sin`` with the layer's and refuses a difference, should HF change that.
    * ``head_dim * num_attention_heads != hidden_size`` (a config's explicit ``head_dim``):
      refused, the layer's head width is ``E / H``.
    * Mistral's (and Qwen2's) sliding window is in the mask HF builds for the layer.

    ``design``: the layer's head design arguments (DiffLlama's, :func:`from_diffllama`).
    """
    config = module.config
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope_type={rope_type!r} (scaled rotary positions) is not supported; the layer "
            "computes HF's rope_type='default' only"
        )
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if module.head_dim * heads != config.hidden_size:
        raise ValueError(
            f"head_dim ({module.head_dim}) * num_attention_heads ({heads}) must equal "
            f"hidden_size ({config.hidden_size}), the layer's head width is E / H"
        )
    attn = MultiHeadAttention(
        config.hidden_size, heads, kv_heads, dropout=module.attention_dropout, bias=False,
        backend=backend, rotary_dim=module.head_dim, rope_theta=rope.get("rope_theta", 10000.0),
        device="meta", **design,  # its own projections are replaced by the module's
    )  # fmt: skip
    attn.scale = module.scaling
    attn.in_proj = QKVProjection.from_linears(
        module.q_proj, module.k_proj, module.v_proj, heads, kv_heads
    )
    attn.out_proj = module.o_proj
    layout = HFLayout.renaming(module, LLAMA_NAMES)
    adapter = HFAttentionAdapter(attn, layer_idx=module.layer_idx, layout=layout)
    return adapter.train(module.training)


# The Llama family's names: the layer holds HF's own modules under its own names.
LLAMA_NAMES = {
    "attn.in_proj.q_proj.": "q_proj.", "attn.in_proj.k_proj.": "k_proj.",
    "attn.in_proj.v_proj.": "v_proj.", "attn.out_proj.": "o_proj.",
}  # fmt: skip


register_family(LlamaAttention, Qwen2Attention, MistralAttention, convert=from_llama)
