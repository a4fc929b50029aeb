"""Hugging Face ``transformers`` models on the layer's kernels, or on the layer itself.

Two ways in (``pip install 'multihead[hf]'``; tested with transformers 5.24):

* Through HF's attention interface. :func:`register` adds ``"multihead"`` (the layer's
  default backend, ``sdpa``) and ``"multihead_<backend>"`` for every backend of
  :data:`~multihead.attention.BACKENDS` to ``AttentionInterface``, with the mask they read to
  ``AttentionMaskInterface``::

      register()
      model = AutoModelForCausalLM.from_config(config, attn_implementation="multihead")

  Every attention call of a model that dispatches through the interface (Llama, Qwen2,
  Mistral, GPT-2, ...) then runs the named backend, on HF's own projections, rotary
  positions and cache. A backend that cannot run raises ``BackendUnavailableError``; a
  feature the kernels do not compute (logit softcapping, attention sinks, a position bias)
  raises ``ValueError``. Nothing falls back in silence.
* Through the module. :func:`replace_hf_attention` swaps each attention module of a
  supported family for an :class:`HFAttentionAdapter` holding a
  :class:`~multihead.attention.MultiHeadAttention` with the same weights, which takes HF's
  call and cache. Then the layer's own conversions apply (``adapter.attn.with_kv_heads``).
  GPT-2 is supported; the Llama family (Llama, Qwen2, Mistral) needs rotary positions inside
  the layer and is refused, naming the module, until the layer has them.

Why the mask is registered too: HF builds the mask by the implementation's name
(``masking_utils.create_causal_mask``). A name it has no mask function for gets no mask at
all, so a left-padded row attends to its padding
(``tests/integrations/test_huggingface.py::test_without_the_mask_function_a_left_padded_row_is_wrong``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from multihead.attention import BACKENDS, MultiHeadAttention, build_attention_mask
from multihead.attention.backends import check_backend, math_attention_with_weights

DEFAULT_BACKEND = "sdpa"  # the layer's default, what "multihead" runs

# Keyword arguments some HF models pass to the attention function for a change to the formula
# that the kernels do not make: refused by name rather than dropped.
REFUSED = {
    "softcap": "logit softcapping (Gemma 2)",
    "s_aux": "attention sinks (gpt-oss)",
    "position_bias": "an additive position bias (T5-style)",
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


def register() -> dict[str, str]:
    """Register the layer's backends with HF's attention and mask interfaces.

    Returns:
        ``{attn_implementation name: backend}``, ``"multihead"`` included.
    """
    names = {"multihead": DEFAULT_BACKEND} | {hf_name(b): b for b in BACKENDS}
    for name, backend in names.items():
        AttentionInterface.register(name, attention_function(backend))
        AttentionMaskInterface.register(name, multihead_mask)
    return names


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


def _layer_mask(attention_mask: Tensor | None) -> Tensor | None:
    """HF's mask in the layer's convention: bool True = masked out (HF: True = attend);
    a float mask is a bias either way."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return attention_mask
    return ~attention_mask


_checked: set[tuple[str, torch.device, torch.dtype, float, int]] = set()


def _check_once(backend: str, query: Tensor, dropout: float) -> None:
    """``check_backend`` on the first call with each backend, device, dtype, dropout and
    head size: it costs 0.2 ms (it lists the backends that can run, for its message)."""
    head_dim = query.shape[-1]
    key = (backend, query.device, query.dtype, dropout, head_dim)
    if torch.compiler.is_compiling():
        # Checked while tracing (Python only); adding to _checked would fail the compiled
        # code's guard on the set and recompile the next call.
        check_backend(backend, query.device, query.dtype, dropout=dropout, head_dim=head_dim)
    elif key not in _checked:
        check_backend(backend, query.device, query.dtype, dropout=dropout, head_dim=head_dim)
        _checked.add(key)


def attention_function(backend: str):
    """HF's attention-function signature around ``backend``'s kernel.

    ``attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
    **kwargs) -> (out, weights)``: ``query`` ``(B, H, L, D)``, ``key`` and ``value``
    ``(B, G, S, D)`` with HF's ``num_key_value_heads`` as ``G`` (the kernels take grouped heads
    as they are), ``out`` ``(B, L, H, D)``. ``attention_mask`` is :func:`multihead_mask`'s
    (or a 4D mask of the caller's, bool or float); without one, ``is_causal`` (else the
    module's ``is_causal``) makes it causal. The weights ``(B, H, L, S)`` come from the
    ``math`` path when HF asks for them (``output_attentions``), else ``None``.
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
        for kwarg, feature in REFUSED.items():
            if kwargs.get(kwarg) is not None:
                raise ValueError(
                    f"{type(module).__name__} passes {kwarg}= ({feature}), which backend "
                    f"{backend!r} does not compute; use attn_implementation='eager'"
                )
        B, H, L, D = query.shape
        _check_once(backend, query, dropout)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        mask = build_attention_mask(
            key_padding_mask=None,
            attn_mask=_layer_mask(attention_mask),
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
        weights = None
        if kwargs.get("output_attentions"):
            out, weights = math_attention_with_weights(query, key, value, mask, dropout, scale)
        else:
            out = BACKENDS[backend](query, key, value, mask, dropout, scale)  # (B, H, L, D)
        if mask.empty_rows is not None:
            # Query rows with no key to attend to (left padding): zeros, as in the layer.
            out = out.masked_fill(mask.empty_rows, 0.0)
        return out.transpose(1, 2).contiguous(), weights  # (B, L, H, D)

    attention.__name__ = attention.__qualname__ = f"multihead_{backend}_attention"
    return attention


# --------------------------------------------------------------------------- module swap
class _CacheLayer:
    """One layer of an HF ``Cache`` as the layer's self-attention sees a cache: it asks for
    ``update(k, v)`` (the new positions appended, all of them returned) and ``static``.

    HF's static cache returns its whole buffers; the mask HF builds hides the unwritten
    positions, so the layer need not know (``static`` is False for every HF cache).
    """

    static = False

    def __init__(self, cache, layer_idx: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(k, v, self.layer_idx)


class HFAttentionAdapter(nn.Module):
    """An HF attention module's call around a :class:`MultiHeadAttention`.

    ``forward(hidden_states, attention_mask=None, cache=None, **kwargs) -> (output, None)``
    as the HF decoder layers call it: ``hidden_states`` ``(B, L, E)``, the model's mask (HF's
    convention, built by :func:`multihead_mask`: :func:`replace_hf_attention` sets the
    model's implementation to one of :func:`register`'s names) and HF's ``Cache``, which
    receives this layer's K and V at ``layer_idx``.

    Args:
        attn: the layer that computes the attention (replace it, e.g. by
            ``adapter.attn.with_kv_heads(2)``, and the adapter calls the new one).
        layer_idx: the module's index in HF's cache.
        resid_dropout: the dropout the HF module applies after its output projection
            (GPT-2's ``resid_dropout``), kept as it was.
    """

    def __init__(
        self, attn: MultiHeadAttention, *, layer_idx: int, resid_dropout: nn.Module
    ) -> None:
        super().__init__()
        self.attn = attn
        self.layer_idx = layer_idx
        self.resid_dropout = resid_dropout

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        cache=None,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        if position_embeddings is not None:
            raise ValueError(
                "HFAttentionAdapter got position_embeddings (rotary positions), which "
                "MultiHeadAttention does not apply"
            )
        out = self.attn(
            hidden_states,
            attn_mask=_layer_mask(attention_mask),
            is_causal=attention_mask is None,  # HF's mask holds causality when there is one
            kv_cache=None if cache is None else _CacheLayer(cache, self.layer_idx),
        )
        return self.resid_dropout(out), None


def _from_gpt2(module: GPT2Attention, backend: str) -> HFAttentionAdapter:
    """GPT-2's attention as an adapter with the same weights.

    ``c_attn`` is a ``Conv1D`` of weight ``(E, 3E)`` (``x @ W + b``) holding Q, K, V side by
    side: its transpose is the layer's stacked ``in_proj`` ``(3E, E)`` as it is.
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
    pairs = [
        (attn.in_proj.weight, module.c_attn.weight.T),
        (attn.in_proj.bias, module.c_attn.bias),
        (attn.out_proj.weight, module.c_proj.weight.T),
        (attn.out_proj.bias, module.c_proj.bias),
    ]
    with torch.no_grad():
        for ours, theirs in pairs:
            ours.copy_(theirs)
            ours.requires_grad_(theirs.requires_grad)  # frozen stays frozen
    adapter = HFAttentionAdapter(
        attn, layer_idx=module.layer_idx, resid_dropout=module.resid_dropout
    )
    return adapter.train(module.training)


# The HF attention classes the swap converts, by exact type: a subclass may change forward.
CONVERTERS = {GPT2Attention: _from_gpt2}
# Families whose attention applies rotary positions between projection and kernel.
NEEDS_ROTARY = (LlamaAttention, Qwen2Attention, MistralAttention)


def replace_hf_attention(model: nn.Module, *, backend: str = DEFAULT_BACKEND) -> nn.Module:
    """Swap every attention module of a supported HF family in ``model`` for an
    :class:`HFAttentionAdapter` with the same weights, in place.

    The model's ``attn_implementation`` becomes :func:`hf_name` of ``backend``, so that HF
    builds the mask the adapters read. Every module is converted before any is replaced:
    on an error nothing has changed.

    Args:
        model: an HF ``PreTrainedModel`` (GPT-2 today).
        backend: the layer's backend.

    Returns:
        ``model``.

    Raises:
        ValueError: a module that cannot be converted (named), or none to convert.
    """
    register()
    adapters = {}
    for name, module in model.named_modules():
        if isinstance(module, NEEDS_ROTARY):
            raise ValueError(
                f"cannot replace {name!r} ({type(module).__name__}): it applies rotary "
                "positions, which MultiHeadAttention does not have yet; use "
                f"attn_implementation={hf_name(backend)!r} instead"
            )
        convert = CONVERTERS.get(type(module))
        if convert is not None:
            try:
                adapters[name] = convert(module, backend)
            except ValueError as err:
                raise ValueError(f"cannot replace {name!r}: {err}") from err
    if not adapters:
        raise ValueError(
            f"no attention module to replace in {type(model).__name__}; supported: "
            + ", ".join(c.__name__ for c in CONVERTERS)
        )
    for name, adapter in adapters.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, adapter)
    model.set_attn_implementation(hf_name(backend))
    return model
