"""Hugging Face ``transformers`` models on the layer's kernels, or on the layer itself.

Two ways in (``pip install 'multihead[hf]'``; tested with transformers 5.24 and 5.25):

* Through HF's attention interface. :func:`register` adds ``"multihead"`` (the layer's
  default backend, ``sdpa``) and ``"multihead_<backend>"`` for every backend of
  :data:`~multihead.attention.BACKENDS` to ``AttentionInterface``, with the mask they read to
  ``AttentionMaskInterface``::

      register()
      model = AutoModelForCausalLM.from_config(config, attn_implementation="multihead")

  Every attention call of a model that dispatches through the interface (Llama, Qwen2,
  Mistral, GPT-2, ...) then runs the named backend, on HF's own projections, rotary
  positions and cache. A backend that cannot run raises ``BackendUnavailableError``. A
  keyword the model passes that changes the scores or selects the keys (logit softcapping,
  attention sinks, a position bias, a sparse indexer's top-k keys: anything not in
  :data:`HONOURED`) raises ``ValueError`` at the call, naming it; the cache's bookkeeping
  (``cache_position``) and the call's other keywords that HF's own sdpa function ignores
  pass. A model that builds an attention module computing
  its attention in its own code (Bloom, Falcon, GIT's text attention, ...) raises
  ``ValueError`` when it is built or switched by ``set_attn_implementation``
  (:func:`routes_through_interface`). Nothing falls back in silence.
* Through the module. :func:`replace_hf_attention` swaps each attention module of a
  supported family for an :class:`HFAttentionAdapter` holding a
  :class:`~multihead.attention.MultiHeadAttention` with the same weights, which takes HF's
  call and cache. Then the layer's own conversions apply (``adapter.attn.with_kv_heads``).
  Supported: GPT-2, the Llama family (Llama, Qwen2, Mistral), whose rotary positions the
  layer applies itself (HF's default ``rope_type`` only; see ``families/llama.py``),
  DiffLlama, on the layer's differential design (``families/diffllama.py``), BLOOM, whose
  ALiBi the layer adds itself (:class:`BloomAttentionAdapter`), DeepSeek-V2/V3, on the
  layer's MLA design, which caches the latent alone and decodes with absorbed weights (HF's
  module re-expands the cached latent at every step; see ``families/deepseek.py``), and any
  family a user registers (:func:`register_family`). A swapped model saves as it loads:
  its ``state_dict`` is the stock model's, in HF's names and layout (:class:`HFLayout`), so
  ``save_pretrained`` writes what the stock class's ``from_pretrained`` loads, and it loads
  a stock ``state_dict``; a layer converted to what HF's module has no weights for keeps its
  own names, and ``save_pretrained`` refuses it by name (:func:`check_hf_format`).

Why the mask is registered too: HF builds the mask by the implementation's name
(``masking_utils.create_causal_mask``). A name it has no mask function for gets no mask at
all, so a left-padded row attends to its padding
(``tests/integrations/test_huggingface.py::test_without_the_mask_function_a_left_padded_row_is_wrong``).

The modules, each importing only those above it:

* ``interface``: the attention function, its mask and the keywords it takes (:data:`HONOURED`);
* ``registry``: the families the swap converts, by HF attention class (:func:`register_family`);
* ``refusal``: the rule that finds a model whose attention never reaches the interface
  (:func:`own_attention`) and its message; ``registration``: :func:`register`;
* ``adapter``: what a family's converter builds (:class:`HFAttentionAdapter`, :class:`HFLayout`);
* ``families/``: one file per family, a converter and its save map, registered when imported;
* ``swap``: :func:`replace_hf_attention` and the check at ``save_pretrained``;
* ``decoding``: :class:`AppendCache` and :func:`prepare_for_decoding`, for decoding on the CPU.
"""

from __future__ import annotations

from multihead.attention import BACKENDS
from multihead.integrations.huggingface import families  # noqa: F401  (registers them, in order)
from multihead.integrations.huggingface.adapter import CacheLayer, HFAttentionAdapter, HFLayout
from multihead.integrations.huggingface.decoding import AppendCache, prepare_for_decoding
from multihead.integrations.huggingface.families.bloom import BloomAttentionAdapter
from multihead.integrations.huggingface.interface import (
    DEFAULT_BACKEND,
    FEATURES,
    HONOURED,
    attention_function,
    hf_name,
    multihead_mask,
)
from multihead.integrations.huggingface.refusal import (
    own_attention,
    refusal,
    routes_through_interface,
)
from multihead.integrations.huggingface.registration import register
from multihead.integrations.huggingface.registry import FAMILIES, Family, register_family
from multihead.integrations.huggingface.swap import check_hf_format, replace_hf_attention

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "FAMILIES",
    "FEATURES",
    "HONOURED",
    "AppendCache",
    "BloomAttentionAdapter",
    "CacheLayer",
    "Family",
    "HFAttentionAdapter",
    "HFLayout",
    "attention_function",
    "check_hf_format",
    "hf_name",
    "multihead_mask",
    "own_attention",
    "prepare_for_decoding",
    "refusal",
    "register",
    "register_family",
    "replace_hf_attention",
    "routes_through_interface",
]
