"""The layer's kernels as HF attention functions: the function HF's modules call through
``AttentionInterface``, the mask it reads, and the keywords it takes or refuses."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.masking_utils import sdpa_mask

from multihead.attention import BACKENDS, build_attention_mask
from multihead.attention.backends import attend

DEFAULT_BACKEND = "sdpa"  # the layer's default, what "multihead" runs

# The keywords beside the tensors that HF's models pass the attention function (by name, or
# from the model call's own keywords) and the kernels honour as they are. Any other keyword
# that is not None is refused by name: it changes the formula or describes the input in a way
# the kernels do not read, so dropping it would run another attention in silence.
HONOURED = frozenset({
    "sliding_window",  # in the mask HF builds for the layer (its sliding-window mask)
    "position_ids",  # read by HF's rotary step before the call, and by its mask builder
    "output_attentions",  # the weights, from the math path
    # Packed sequences as flash-attention reads them (and Mamba layers, seq_idx); eager and
    # sdpa read the packing from the mask HF builds from position_ids, as the kernels do.
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
    # The model call's keywords that HF passes down every layer, about its cache (written
    # before the call), its outputs or its loss. cache_position: where the new keys go in the
    # cache (HF's documented decoding loop over a StaticCache passes it); HF's own sdpa
    # function ignores it, as every one of these. deterministic: flash-attn's choice of
    # backward kernel (ModernBERT's), not the attention's math.
    "use_cache", "output_hidden_states", "output_router_logits", "num_items_in_batch",
    "logits_to_keep", "cache_position", "deterministic",
})  # fmt: skip

# What the keywords known to change the attention are, for the refusal's message.
FEATURES = {
    "softcap": "logit softcapping, Gemma 2's",
    "s_aux": "attention sinks, gpt-oss's",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias, T5's",
    "indices": "sparse attention: the indexer's top-k keys",
    "block_indices": "sparse attention: the indexer's top-k key blocks",
}


def hf_name(backend: str) -> str:
    """The ``attn_implementation`` name of ``backend``: ``"multihead_<backend>"``.

    HF reads every implementation name that contains ``"flash"`` as flash-attention and
    loads a kernel for it from the Hub, so ``flash`` and ``flash_attn`` are spelled ``fa``
    there: ``"multihead_fa"``, ``"multihead_fa_attn"``. A name containing ``"sdpa"`` makes
    HF check the model's ``_supports_sdpa`` flag: ``"multihead_sdpa"`` is refused by HF for a
    model without an SDPA path (Gemma 2), ``"multihead"`` is not.
    """
    return "multihead_" + backend.replace("flash", "fa")


def names() -> dict[str, str]:
    """``{attn_implementation name: backend}`` of every backend, ``"multihead"`` included."""
    return {"multihead": DEFAULT_BACKEND} | {hf_name(b): b for b in BACKENDS}


def multihead_mask(*, q_length: int, kv_length: int, allow_is_causal_skip: bool = True, **kwargs):
    """HF's boolean mask (True = attend, ``(B, 1, L, S)``), or ``None`` for plain causality.

    It is HF's ``sdpa_mask``, skipped only where the kernels' causal flag means the same as
    HF's: ``L == S``, or a single query. HF also skips the prefill of a static cache
    (``S > L`` with nothing cached), counting on SDPA's top-left causal alignment; the layer
    aligns causality bottom-right (the queries are the last ``L`` of ``S`` positions), so
    there the mask is written out.
    """
    skip = allow_is_causal_skip and (q_length == 1 or q_length == kv_length)
    return sdpa_mask(q_length=q_length, kv_length=kv_length, allow_is_causal_skip=skip, **kwargs)


def layer_mask(attention_mask: Tensor | None) -> Tensor | None:
    """HF's mask in the layer's convention: bool True = masked out (HF: True = attend);
    a float mask is a bias either way."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return attention_mask
    return ~attention_mask


def attention_function(backend: str):
    """HF's attention-function signature around ``backend``'s kernel.

    ``attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
    **kwargs) -> (out, weights)``: ``query`` ``(B, H, L, D)``, ``key`` and ``value``
    ``(B, G, S, D)`` with HF's ``num_key_value_heads`` as ``G`` (the kernels take grouped heads
    as they are), ``out`` ``(B, L, H, D)``. ``attention_mask`` is :func:`multihead_mask`'s
    (or a 4D mask of the caller's, bool or float); without one, ``is_causal`` (else the
    module's ``is_causal``) makes it causal. The weights ``(B, H, L, S)`` come from the
    ``math`` path when HF asks for them (``output_attentions``), else ``None``. Of the other
    keywords, those in :data:`HONOURED` are taken as they are; any other that is not ``None``
    raises ``ValueError`` naming it and the module's class.
    """

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ) -> tuple[Tensor, Tensor | None]:
        for kwarg, given in kwargs.items():
            if given is not None and kwarg not in HONOURED:
                feature = f" ({FEATURES[kwarg]})" if kwarg in FEATURES else ""
                raise ValueError(
                    f"{type(module).__name__} passes {kwarg}={feature}, which backend "
                    f"{backend!r} does not read; use attn_implementation='eager'"
                )
        if torch.is_autocast_enabled(query.device.type):
            # HF's rotary step (bf16 projections times fp32 cos/sin) leaves Q and K in fp32
            # under autocast while V is bf16; the kernels take one dtype: the autocast one,
            # as HF's own flash path casts them.
            dtype = torch.get_autocast_dtype(query.device.type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        B, H, L, D = query.shape
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        mask = build_attention_mask(
            key_padding_mask=None,
            attn_mask=layer_mask(attention_mask),
            # HF's mask holds causality when there is one.
            is_causal=causal and attention_mask is None,
            batch_size=B,
            num_heads=H,
            q_len=L,
            kv_len=key.shape[2],
            dtype=query.dtype,
            device=query.device,
        )
        scale = D**-0.5 if scaling is None else scaling
        out, weights = attend(
            query, key, value, mask, backend=backend, dropout_p=dropout, scale=scale,
            need_weights=bool(kwargs.get("output_attentions")),
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), weights  # (B, L, H, D)

    attention.__name__ = attention.__qualname__ = f"multihead_{backend}_attention"
    return attention
