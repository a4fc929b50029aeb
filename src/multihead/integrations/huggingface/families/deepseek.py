"""DeepSeek-V2/V3: multi-head latent attention on the layer's MLA design, which caches the
latent alone and decodes with absorbed weights."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from multihead.attention import MultiHeadAttention
from multihead.integrations.huggingface.adapter import (
    HFAttentionAdapter,
    HFLayout,
    inverse,
    load_hf,
    renamed,
)
from multihead.integrations.huggingface.registry import register_family

# The rotary module each DeepSeek attention's model builds: the converter takes its
# frequencies and magnitude from one built on the same config.
_DEEPSEEK_ROTARY = {
    DeepseekV2Attention: DeepseekV2RotaryEmbedding,
    DeepseekV3Attention: DeepseekV3RotaryEmbedding,
}
# HF's rope types whose frequencies are fixed when the model is built (dynamic and longrope
# change them with the sequence length, at every call).
_FIXED_ROPE = ("default", "linear", "llama3", "yarn")


def from_deepseek(
    module: DeepseekV2Attention | DeepseekV3Attention, backend: str
) -> HFAttentionAdapter:
    """DeepSeek-V2/V3's multi-head latent attention on the layer's MLA design
    (:mod:`~multihead.attention.latent`), which caches the latent alone and decodes with
    absorbed weights; HF's module caches it too but expands every cached position through
    ``kv_b_proj`` at every step.

    The weights (``dn = qk_nope_head_dim``, ``dr = qk_rope_head_dim``, ``dv = v_head_dim``):

    * ``kv_a_proj_with_mqa`` ``(r + dr, E)``: its first ``r`` rows are the latent's
      down-projection, the last ``dr`` the shared rotary key's (``k_rope``).
    * ``kv_a_layernorm`` is the latent's norm: the module itself, so its epsilon (1e-6,
      DeepSeek's RMSNorm default, not ``rms_norm_eps``) and its fp32 computation are HF's.
    * ``kv_b_proj`` ``(H (dn + dv), r)`` holds each head's K rows then its V rows; the
      design's ``up`` stacks all K rows (``W_UK``), then all V rows (``W_UV``).
    * ``q_proj`` (or with ``q_lora_rank``: ``q_a_proj``, ``q_a_layernorm``, kept, and
      ``q_b_proj``) ``(H (dn + dr), ·)`` holds each head's ``dn`` rows then ``dr`` rotary rows:
      the layer's Q projection and the design's ``q_rope``.
    * ``o_proj`` ``(E, H dv)`` is the layer's ``out_proj``, the module's own.

    Positions: HF's frequencies (``rope_type`` default, linear, llama3 or yarn), rotating
    neighbouring pairs (V2 always; V3 with ``rope_interleave``, whose permutation of the
    rotated features, the same for Q and K, leaves the scores as they are) or halves. YaRN's
    ``attention_factor`` (the magnitude of HF's ``cos`` and ``sin``, from ``mscale`` over
    ``mscale_all_dim``) scales the rotary Q and K rows, the same by linearity; its
    ``mscale_all_dim`` term is in the module's ``scaling``, the layer's softmax scale.
    Refused: a rope type whose frequencies change with the length (dynamic, longrope),
    rotary frequencies for other than ``qk_rope_head_dim`` features (``partial_rotary_factor``)
    and ``num_key_value_heads != num_attention_heads`` (HF's own forward breaks on it).
    """
    config = module.config
    H, E, r = module.num_heads, module.hidden_size, module.kv_lora_rank
    dn, dr, dv = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
    rope = dict(config.rope_parameters)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _FIXED_ROPE:
        raise ValueError(
            f"rope_type={rope_type!r} (frequencies that change with the length) is not "
            f"supported; the layer takes fixed ones: {', '.join(_FIXED_ROPE)}"
        )
    if config.num_key_value_heads != H:
        raise ValueError(
            f"num_key_value_heads={config.num_key_value_heads} (!= num_attention_heads={H}): "
            "MLA has one K/V head per query head, as HF's DeepSeek expands them"
        )
    rotary = _DEEPSEEK_ROTARY[type(module)](config)  # HF's frequencies, built as the model's
    if rotary.inv_freq.numel() * 2 != dr:
        raise ValueError(
            f"rotary frequencies for {rotary.inv_freq.numel() * 2} features (rope_parameters "
            f"{rope}) for qk_rope_head_dim={dr}: HF would rotate them all with fewer; the "
            "layer rotates qk_rope_head_dim features"
        )
    factor = float(rotary.attention_scaling)  # YaRN's attention_factor; 1 otherwise
    interleaved = isinstance(module, DeepseekV2Attention) or bool(config.rope_interleave)
    q_rank, bias = module.q_lora_rank, bool(config.attention_bias)
    weight = module.kv_a_proj_with_mqa.weight
    attn = MultiHeadAttention(
        E, H, dropout=module.attention_dropout, bias=bias, backend=backend, design="mla",
        kv_latent_dim=r, kv_latent_norm=True, q_latent_dim=q_rank, qk_head_dim=dn,
        v_head_dim=dv, softmax_scale=module.scaling, rotary_dim=dr,
        rope_theta=float(rope["rope_theta"]), rope_interleaved=interleaved,
        rope_inv_freq=rotary.inv_freq, device=weight.device, dtype=weight.dtype,
    )  # fmt: skip
    latent = attn.design
    if bias:  # on kv_a_proj_with_mqa, q_a_proj and o_proj; none on the Q rows
        attn.in_proj.register_parameter("bias", None)
        latent.q_rope.register_parameter("bias", None)
    latent.norm = module.kv_a_layernorm
    if q_rank is not None:
        latent.q_down, latent.q_norm = module.q_a_proj, module.q_a_layernorm
    attn.out_proj = module.o_proj
    sizes = dict(
        latent=latent.attribute, heads=H, nope=dn, factor=factor, low_rank=q_rank is not None
    )
    layout = HFLayout.of(
        module, partial(_deepseek_to_hf, value=dv, **sizes), partial(_deepseek_from_hf, **sizes)
    )
    adapter = HFAttentionAdapter(attn, layer_idx=module.layer_idx, layout=layout)
    load_hf(adapter, module)  # Q, the latent's down and up, the rotary rows; the rest is HF's
    return adapter.train(module.training)


def _deepseek_names(latent: str, low_rank: bool) -> dict[str, str]:
    """The DeepSeek weights the layer holds as HF's own modules, by name."""
    names = {"attn.out_proj.": "o_proj.", f"attn.{latent}.norm.": "kv_a_layernorm."}
    if low_rank:
        names |= {f"attn.{latent}.q_down.": "q_a_proj.", f"attn.{latent}.q_norm.": "q_a_layernorm."}
    return names


def _deepseek_to_hf(
    own: dict[str, Tensor], *, latent: str, heads: int, nope: int, value: int, factor: float,
    low_rank: bool,
) -> dict[str, Tensor]:  # fmt: skip
    """The layer's MLA weights in HF's DeepSeek layout (:func:`from_deepseek`, reversed)."""
    own, part = dict(own), f"attn.{latent}."
    q = own.pop("attn.in_proj.weight").unflatten(0, (heads, nope))  # (H, dn, ·)
    q_rope = own.pop(part + "q_rope.weight").unflatten(0, (heads, -1)) / factor  # (H, dr, ·)
    theirs = {
        f"{'q_b_proj' if low_rank else 'q_proj'}.weight": torch.cat((q, q_rope), 1).flatten(0, 1)
    }
    for name in ("weight", "bias"):
        if part + "down." + name in own:  # (r, ·) over (dr, ·)
            rope = own.pop(part + "k_rope." + name) / factor
            theirs[f"kv_a_proj_with_mqa.{name}"] = torch.cat((own.pop(part + "down." + name), rope))
    w_uk, w_uv = own.pop(part + "up.weight").split([heads * nope, heads * value])  # (H dn|dv, r)
    kv = (w_uk.unflatten(0, (heads, nope)), w_uv.unflatten(0, (heads, value)))
    theirs["kv_b_proj.weight"] = torch.cat(kv, 1).flatten(0, 1)  # each head's K rows, V rows
    return theirs | renamed(own, _deepseek_names(latent, low_rank))


def _deepseek_from_hf(
    theirs: dict[str, Tensor], *, latent: str, heads: int, nope: int, factor: float,
    low_rank: bool,
) -> dict[str, Tensor]:  # fmt: skip
    """HF's DeepSeek weights in the layer's MLA layout (:func:`from_deepseek`)."""
    theirs, part = dict(theirs), f"attn.{latent}."
    q = theirs.pop("q_b_proj.weight" if low_rank else "q_proj.weight").unflatten(0, (heads, -1))
    own = {  # (H, dn + dr, ·): each head's dn rows, then its dr rotary rows
        "attn.in_proj.weight": q[:, :nope].flatten(0, 1),
        part + "q_rope.weight": q[:, nope:].flatten(0, 1) * factor,
    }
    r = theirs["kv_a_layernorm.weight"].shape[0]
    for name in ("weight", "bias"):  # (r + dr, ·): the latent's rows, the rotary key's
        kv_a = theirs.pop(f"kv_a_proj_with_mqa.{name}", None)
        if kv_a is not None:
            own[part + "down." + name], own[part + "k_rope." + name] = kv_a[:r], kv_a[r:] * factor
    kv_b = theirs.pop("kv_b_proj.weight").unflatten(0, (heads, -1))  # (H, dn + dv, r)
    own[part + "up.weight"] = torch.cat(
        (kv_b[:, :nope].flatten(0, 1), kv_b[:, nope:].flatten(0, 1))
    )
    return own | renamed(theirs, inverse(_deepseek_names(latent, low_rank)))


def _check_deepseek_rotary(model: nn.Module) -> None:
    """Refuse a swap of a DeepSeek model whose rotary module is not the one its config builds,
    whose frequencies and magnitude :func:`from_deepseek` took: a model cast after it was
    built rounds its ``inv_freq`` (HF's angles with it)."""
    rotary_classes = tuple(_DEEPSEEK_ROTARY.values())
    for name, module in model.named_modules():
        if not isinstance(module, rotary_classes):
            continue
        built = type(module)(module.config)
        same = (
            module.inv_freq.dtype == built.inv_freq.dtype
            and torch.equal(module.inv_freq.cpu(), built.inv_freq)
            and module.attention_scaling == built.attention_scaling
        )
        if not same:
            raise ValueError(
                f"cannot replace the attention: {name!r} ({type(module).__name__}) holds an "
                f"inv_freq in {module.inv_freq.dtype} or an attention_scaling other than its "
                "config builds (the model was cast after it was built?); build the model with "
                "dtype= instead of casting it, or call replace_hf_attention before casting"
            )


register_family(
    DeepseekV2Attention,
    DeepseekV3Attention,
    convert=from_deepseek,
    check_model=_check_deepseek_rotary,
)
