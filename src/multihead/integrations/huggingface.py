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
  layer applies itself (HF's default ``rope_type`` only; see :func:`_from_llama`), DiffLlama,
  on the layer's differential design (:func:`_from_diffllama`), BLOOM, whose ALiBi the
  layer adds itself (:class:`BloomAttentionAdapter`), and DeepSeek-V2/V3, on the layer's MLA
  design, which caches the latent alone and decodes with absorbed weights (HF's module
  re-expands the cached latent at every step; see :func:`_from_deepseek`). A swapped model
  saves as it loads: its ``state_dict`` is the stock model's, in HF's names and layout
  (:class:`HFLayout`), so ``save_pretrained`` writes what the stock class's
  ``from_pretrained`` loads, and it loads a stock ``state_dict``; a layer converted to what
  HF's module has no weights for keeps its own names, and ``save_pretrained`` refuses it by
  name (:func:`check_hf_format`).

Why the mask is registered too: HF builds the mask by the implementation's name
(``masking_utils.create_causal_mask``). A name it has no mask function for gets no mask at
all, so a left-padded row attends to its padding
(``tests/integrations/test_huggingface.py::test_without_the_mask_function_a_left_padded_row_is_wrong``).
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.bloom.modeling_bloom import BloomAttention
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from multihead.attention import (
    BACKENDS,
    MultiHeadAttention,
    QKVProjection,
    build_attention_mask,
)
from multihead.attention.alibi import ALiBi
from multihead.attention.backends import attend
from multihead.integrations.hf_decoding import AppendCache, prepare_for_decoding  # noqa: F401

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


def register() -> dict[str, str]:
    """Register the layer's backends with HF's attention and mask interfaces.

    Returns:
        ``{attn_implementation name: backend}``, ``"multihead"`` included.
    """
    names = _names()
    for name, backend in names.items():
        AttentionInterface.register(name, attention_function(backend))
        AttentionMaskInterface.register(name, multihead_mask)
    _refuse_models_that_compute_attention_themselves()
    return names


def _names() -> dict[str, str]:
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


def _layer_mask(attention_mask: Tensor | None) -> Tensor | None:
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
        out, weights = attend(
            query, key, value, mask, backend=backend, dropout_p=dropout, scale=scale,
            need_weights=bool(kwargs.get("output_attentions")),
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), weights  # (B, L, H, D)

    attention.__name__ = attention.__qualname__ = f"multihead_{backend}_attention"
    return attention


# ------------------------------------------------- models that never reach the interface
def routes_through_interface(model_class: type) -> bool:
    """Whether every attention ``model_class`` builds reaches HF's ``AttentionInterface``, or
    computes the same under any implementation name: :func:`own_attention` finds none."""
    return not own_attention(model_class)


@cache
def own_attention(model_class: type) -> tuple[str, ...]:
    """The attention classes ``model_class`` builds that compute their attention in their own
    code and would read, or fail on, a :func:`register` name: ``()`` for a model that may
    take one.

    HF accepts any registered name for any model. An attention module that calls its own
    eager code (Bloom, XGLM, GIT's text attention, ...) never calls the registered function:
    it reads the mask :func:`multihead_mask` built (``None`` for plain causality) as an
    additive bias, so causality is lost in silence; others index a dict of their own by the
    name (Falcon, GPT-Neo, GIT: ``KeyError``) or fail later (MPT).

    The rule, read from the source once per class, before any weight is built: an
    ``nn.Module`` class with ``Attention`` in its name, among those ``model_class`` builds
    (named in its ``__init__``, or a base's, directly or in a dict, and so on down), that
    does not look the function up (``ALL_ATTENTION_FUNCTIONS.get_interface(``) is refused if
    it reads ``_attn_implementation``, or if it computes a softmax itself over a mask it is
    given (a ``forward`` argument named ``*mask*``). An attention that takes no mask and
    reads no name (GOT-OCR2's vision windows) computes what it computes under ``eager``, as
    under ``sdpa``; a wrapper that passes the mask on to its own attention module (BERT's)
    or a linear attention without softmax (RWKV, Mamba-style hybrids) is not refused either.
    A sub-model built through the auto classes (a multimodal model's language model) is
    checked when it is built. Exact on every small-buildable causal LM of transformers 5.24
    (``tests/integrations/test_hf_sweep.py``, which also counts the calls of the attention
    function). HF's own test (``PreTrainedModel._can_set_attn_implementation``) reads the
    whole file: GIT's vision attention dispatches, its text attention does not. A source
    that cannot be read (a class defined in a notebook) is refused.
    """
    try:
        inspect.getsource(model_class)
    except (OSError, TypeError):
        return (model_class.__name__,)
    return tuple(sorted(c.__name__ for c in _built_classes(model_class) if _computes_its_own(c)))


@cache
def _sources(cls: type) -> tuple[tuple[type, str], ...]:
    """``cls`` and its bases up to HF's and torch's own classes, each with its source."""
    out = []
    for base in cls.__mro__:
        if not issubclass(base, nn.Module) or base.__module__.split(".")[0] == "torch":
            continue
        if base in PreTrainedModel.__mro__:
            continue
        try:
            out.append((base, inspect.getsource(base)))
        except (OSError, TypeError):
            out.append((base, ""))
    return tuple(out)


def _built_classes(model_class: type) -> set[type]:
    """The ``nn.Module`` classes named in ``model_class``'s ``__init__`` (or its bases'),
    resolved in their module, a dict's values included (GIT's classes by name), and so on
    down."""
    seen, todo = set(), [model_class]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for base, _ in _sources(cls):
            if "__init__" not in vars(base):
                continue
            try:
                init = inspect.getsource(vars(base)["__init__"])
            except (OSError, TypeError):
                continue
            names = vars(sys.modules[base.__module__])
            for word in set(re.findall(r"\b[A-Za-z_]\w*", init)):
                value = names.get(word)
                for found in value.values() if isinstance(value, dict) else [value]:
                    if isinstance(found, type) and issubclass(found, nn.Module):
                        todo.append(found)
    return seen


def _computes_its_own(cls: type) -> bool:
    """Whether ``cls`` is an attention module that computes its attention in its own code
    over the name's mask, or reads the name (:func:`own_attention`'s rule)."""
    if "Attention" not in cls.__name__:
        return False
    sources = _sources(cls)
    source = "".join(text for _, text in sources)
    if not all(text for _, text in sources):
        return True
    if "ALL_ATTENTION_FUNCTIONS.get_interface(" in source:
        return False
    if "_attn_implementation" in source:
        return True
    masked = any("mask" in p for p in inspect.signature(cls.forward).parameters)
    return masked and re.search(r"softmax\(|logsumexp\(", source) is not None


def refusal(model_class: type, name: str) -> str:
    """The one-line reason a ``model_class`` built with ``attn_implementation=name`` is
    refused, pointing to :func:`replace_hf_attention` where its table covers the model."""
    swappable = sorted(c.__name__ for c in CONVERTERS if c.__module__ == model_class.__module__)
    if swappable:
        fix = (
            "build it with attn_implementation='eager' and call replace_hf_attention(model) "
            f"({', '.join(swappable)} supported)"
        )
    else:
        fix = "use attn_implementation='eager'; replace_hf_attention supports " + ", ".join(
            c.__name__ for c in CONVERTERS
        )
    classes = own_attention(model_class)
    where = f" ({', '.join(classes)})" if classes else ""
    return (
        f"{model_class.__name__} computes its attention in its own code{where}, not through "
        f"transformers' AttentionInterface, so attn_implementation={name!r} would not reach "
        f"the multihead kernels; {fix}"
    )


def _refuse_models_that_compute_attention_themselves() -> None:
    """Refuse :func:`register`'s names for a model that fails :func:`routes_through_interface`,
    with :func:`refusal`'s ``ValueError``, wherever HF takes a name:

    * at build, in HF's check of the name (``get_correct_attn_implementation``, run by every
      ``PreTrainedModel`` before its layers are built), so that it raises instead of running
      wrong or failing on our name;
    * in ``set_attn_implementation``, before HF's own test: for a model that test rejects
      (Bloom, Falcon) HF logs a warning and keeps ``eager``, and for one it accepts (GIT) it
      skips the check above. A name in a dict (per sub-config) is checked against every
      sub-model.
    """
    if getattr(PreTrainedModel.get_correct_attn_implementation, "_multihead", False):
        return
    names = set(_names())
    get_correct, set_implementation = (
        PreTrainedModel.get_correct_attn_implementation,
        PreTrainedModel.set_attn_implementation,
    )

    def check(model_class: type, name) -> None:
        if name in names and not routes_through_interface(model_class):
            raise ValueError(refusal(model_class, name))

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        applicable = get_correct(self, requested_attention, is_init_check)
        check(type(self), applicable)
        return applicable

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        requested, pending = [], [attn_implementation]
        while pending:
            value = pending.pop()
            if isinstance(value, dict):
                pending.extend(value.values())
            else:
                requested.append(value)
        for name in requested:
            for module in self.modules():
                if isinstance(module, PreTrainedModel):
                    check(type(module), name)
        return set_implementation(self, attn_implementation, *args, **kwargs)

    get_correct_attn_implementation._multihead = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation
    PreTrainedModel.set_attn_implementation = set_attn_implementation


# --------------------------------------------------------------------------- module swap
class _CacheLayer:
    """One layer of an HF ``Cache`` as the layer's self-attention sees a cache: it asks for
    ``update(k, v)`` (the new positions appended, all of them returned) and ``static``.

    HF's static cache returns its whole buffers; the mask HF builds hides the unwritten
    positions, so the layer need not know (``static`` is False for every HF cache).

    An MLA layer's latent ``[c ; k_R]`` goes to HF's K slot, with 0 features in the V slot:
    ``r + d_R`` numbers per token and layer.
    """

    static = False

    def __init__(self, cache, layer_idx: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx

    @property
    def size(self) -> int:
        """The positions cached so far: where the layer's rotary positions start when the
        caller gives no ``position_ids``."""
        return self.cache.get_seq_length(self.layer_idx)

    def update(self, k: Tensor, v: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if v is None:  # one tensor for K and V (an MLA latent): HF's V slot holds 0 features
            return self.cache.update(k, k[..., :0], self.layer_idx)[0], None
        return self.cache.update(k, v, self.layer_idx)


# --------------------------------------------------------------------------- HF's layout
@dataclass(frozen=True)
class HFLayout:
    """How a swapped module's weights are its HF module's: the names and layout that
    ``state_dict`` of a swapped model gives (so ``save_pretrained`` writes what the stock
    class's ``from_pretrained`` loads) and that ``load_state_dict`` takes back. The
    converters read HF's weights through ``from_hf`` too: one map each way per family.

    Attributes:
        module: the HF attention class replaced, e.g. ``"LlamaAttention"``.
        shapes: its ``state_dict``'s names and shapes.
        to_hf: the adapter's own ``state_dict`` (names relative to the adapter) to HF's;
            raises ``KeyError`` for a name it has no place for.
        from_hf: HF's (names relative to the HF module) to the adapter's own.
    """

    module: str
    shapes: dict[str, tuple[int, ...]]
    to_hf: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    from_hf: Callable[[dict[str, Tensor]], dict[str, Tensor]]

    def write(self, own: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """``own`` in HF's names and layout, or ``None`` when the layer no longer has HF's
        weights: a conversion changed its heads, its design or its layout."""
        try:
            theirs = self.to_hf(own)
        except (KeyError, RuntimeError):  # a weight HF has no place for, or another shape
            return None
        return theirs if {k: tuple(v.shape) for k, v in theirs.items()} == self.shapes else None


def _layout(module: nn.Module, to_hf: Callable, from_hf: Callable) -> HFLayout:
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    return HFLayout(type(module).__name__, shapes, to_hf, from_hf)


def _renamed(weights: dict[str, Tensor], prefixes: dict[str, str]) -> dict[str, Tensor]:
    """``weights`` with each name's prefix replaced by its entry in ``prefixes``; a name
    that starts with none raises ``KeyError``."""
    out = {}
    for name, tensor in weights.items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            raise KeyError(name)
        out[prefixes[prefix] + name[len(prefix) :]] = tensor
    return out


def _inverse(prefixes: dict[str, str]) -> dict[str, str]:
    return {theirs: ours for ours, theirs in prefixes.items()}


def _write_hf_layout(adapter: HFAttentionAdapter, state_dict, prefix: str, metadata) -> None:
    """A ``state_dict`` post-hook of every adapter: its weights under HF's names, in HF's
    layout, where the layer still has HF's weights (:meth:`HFLayout.write`); else its own."""
    if adapter.layout is None:
        return
    own = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    theirs = adapter.layout.write(own)
    if theirs is None:
        return
    for name in own:
        del state_dict[prefix + name]
    state_dict.update({prefix + k: v for k, v in theirs.items()})


def _read_hf_layout(adapter: HFAttentionAdapter, state_dict, prefix: str, *args) -> None:
    """A ``load_state_dict`` pre-hook of every adapter: HF's names and layout (a swapped
    model's ``state_dict``, or the stock model's) become the layer's own."""
    layout = adapter.layout
    if layout is None or not all(prefix + k in state_dict for k in layout.shapes):
        return
    theirs = {k: state_dict.pop(prefix + k) for k in layout.shapes}
    state_dict.update({prefix + k: v for k, v in layout.from_hf(theirs).items()})


def check_hf_format(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the first swapped layer of ``model`` whose weights HF's
    module has no place for (a layer converted to other heads or another design): HF's
    ``from_pretrained`` would leave them at random. Run by ``save_pretrained`` of every
    model once :func:`replace_hf_attention` has run."""
    for name, module in model.named_modules():
        if not isinstance(module, HFAttentionAdapter):
            continue
        layout = module.layout
        if layout is None or set(module.state_dict()) != set(layout.shapes):
            target = "an HF module" if layout is None else layout.module
            raise ValueError(
                f"cannot save {name!r} in HF's format: its layer is {module.attn.head_tag!r}, "
                f"which {target} has no weights for; save torch.save(model.state_dict()) and "
                "load it into the model built, swapped and converted again (docs/reuse.md)"
            )


def _check_hf_format_at_save() -> None:
    """Make ``PreTrainedModel.save_pretrained`` run :func:`check_hf_format` first (once)."""
    if getattr(PreTrainedModel.save_pretrained, "_multihead", False):
        return
    save = PreTrainedModel.save_pretrained

    def save_pretrained(self, *args, **kwargs):
        check_hf_format(self)
        return save(self, *args, **kwargs)

    save_pretrained._multihead = True
    save_pretrained.__doc__ = save.__doc__
    PreTrainedModel.save_pretrained = save_pretrained


class HFAttentionAdapter(nn.Module):
    """An HF attention module's call around a :class:`MultiHeadAttention`.

    ``forward(hidden_states, attention_mask=None, cache=None, **kwargs) -> (output, None)``
    as the HF decoder layers call it: ``hidden_states`` ``(B, L, E)``, the model's mask (HF's
    convention, built by :func:`multihead_mask`: :func:`replace_hf_attention` sets the
    model's implementation to one of :func:`register`'s names) and HF's ``Cache``, which
    receives this layer's K and V at ``layer_idx``.

    A layer with rotary positions takes HF's ``position_ids`` ``(B, L)`` (left-padded rows
    start at 0 after their padding), else ``cache_position``, else the positions after the
    cache's; it ignores HF's ``position_embeddings`` (HF's ``cos`` and ``sin``): the layer
    rotates Q and K itself, and :func:`replace_hf_attention` checked at the swap that its
    angles are the model's.

    Args:
        attn: the layer that computes the attention (replace it, e.g. by
            ``with_kv_heads(adapter.attn, 2)``, and the adapter calls the new one).
        layer_idx: the module's index in HF's cache.
        resid_dropout: the dropout the HF module applies after its output projection
            (GPT-2's ``resid_dropout``), kept as it was; ``None``: none (Llama).
        layout: how the weights are the HF module's (:class:`HFLayout`): the adapter's
            ``state_dict`` is in HF's names and layout while the layer has HF's weights, and
            ``load_state_dict`` takes them; ``None``: its own names only.
    """

    def __init__(
        self, attn: MultiHeadAttention, *, layer_idx: int, resid_dropout: nn.Module | None = None,
        layout: HFLayout | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.attn = attn
        self.layer_idx = layer_idx
        self.resid_dropout = nn.Identity() if resid_dropout is None else resid_dropout
        self.layout = layout
        self.register_state_dict_post_hook(_write_hf_layout)
        self.register_load_state_dict_pre_hook(_read_hf_layout)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        cache=None,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        position_ids = None
        if self.attn.has_positions:
            position_ids = kwargs.get("position_ids")
            position_ids = kwargs.get("cache_position") if position_ids is None else position_ids
        elif position_embeddings is not None:
            raise ValueError(
                "HFAttentionAdapter got position_embeddings (rotary positions), but its "
                "MultiHeadAttention has none (rotary_dim=None)"
            )
        out = self.attn(
            hidden_states,
            attn_mask=_layer_mask(attention_mask),
            is_causal=attention_mask is None,  # HF's mask holds causality when there is one
            kv_cache=None if cache is None else _CacheLayer(cache, self.layer_idx),
            position_ids=position_ids,
        )
        return self.resid_dropout(out), None


def _copy_into(ours: nn.Parameter, theirs: Tensor) -> None:
    """``ours`` := ``theirs``, frozen if it is."""
    with torch.no_grad():
        ours.copy_(theirs)
    ours.requires_grad_(theirs.requires_grad)


def _load_hf(adapter: HFAttentionAdapter, module: nn.Module) -> None:
    """The adapter's parameters := ``module``'s weights read through the adapter's layout
    (:meth:`HFLayout.from_hf`), frozen where HF's are; a parameter the adapter holds as the
    module's own object (the Llama family's projections) stays as it is."""
    for name, theirs in adapter.layout.from_hf(module.state_dict(keep_vars=True)).items():
        ours = adapter.get_parameter(name)
        if ours is not theirs:
            _copy_into(ours, theirs)


def _from_gpt2(module: GPT2Attention, backend: str) -> HFAttentionAdapter:
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
        layout=_layout(module, _gpt2_to_hf, _gpt2_from_hf),
    )  # fmt: skip
    _load_hf(adapter, module)
    return adapter.train(module.training)


_GPT2 = {"attn.in_proj.": "c_attn.", "attn.out_proj.": "c_proj."}


def _gpt2_to_hf(own: dict[str, Tensor]) -> dict[str, Tensor]:
    """The layer's ``nn.Linear`` weights ``(out, in)`` as GPT-2's ``Conv1D`` ones ``(in, out)``."""
    theirs = _renamed(own, _GPT2)
    return {k: v.T.contiguous() if k.endswith("weight") else v for k, v in theirs.items()}


def _gpt2_from_hf(theirs: dict[str, Tensor]) -> dict[str, Tensor]:
    own = _renamed(theirs, _inverse(_GPT2))
    return {k: v.T if k.endswith("weight") else v for k, v in own.items()}


def _from_llama(
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

    ``design``: the layer's head design arguments (DiffLlama's, :func:`_from_diffllama`).
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
    layout = _layout(
        module, partial(_renamed, prefixes=_LLAMA), partial(_renamed, prefixes=_inverse(_LLAMA))
    )
    adapter = HFAttentionAdapter(attn, layer_idx=module.layer_idx, layout=layout)
    return adapter.train(module.training)


# The Llama family's names: the layer holds HF's own modules under its own names.
_LLAMA = {
    "attn.in_proj.q_proj.": "q_proj.", "attn.in_proj.k_proj.": "k_proj.",
    "attn.in_proj.v_proj.": "v_proj.", "attn.out_proj.": "o_proj.",
}  # fmt: skip


# --------------------------------------------------------------------------- BLOOM (ALiBi)
class _BloomCacheLayer(_CacheLayer):
    """HF's cache for a layer with ALiBi: each key at its index in the cache (static: in
    the whole buffer), the query positions after the cached ones. Only distances enter
    ALiBi, and a left-padded row's tokens are as far apart by index as by BLOOM's positions."""

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None):
        k, v = self.cache.update(k, v, self.layer_idx)
        self.keys = k  # (B, H, S, D): S keys, of which HF's mask hides the unwritten
        return k, v

    def key_positions(self) -> Tensor:
        return torch.arange(self.keys.shape[2], device=self.keys.device)  # (S,)


class BloomAttentionAdapter(HFAttentionAdapter):
    """BLOOM's attention call around a :class:`MultiHeadAttention` with ALiBi.

    ``forward(hidden_states, residual, alibi, attention_mask, layer_past=None, **kwargs) ->
    (residual + dropout(output), None)``, as ``BloomBlock`` calls it: BLOOM adds the residual
    inside its attention (``dropout_add`` with ``hidden_dropout``). ``alibi`` (HF's bias,
    ``m_h`` times each key's position) is ignored: the layer's own ALiBi part adds
    ``-m_h |i - j|``, which differs from it by one constant per query row, cancelled by
    softmax. BLOOM does not dispatch through ``AttentionInterface``, so its model always
    builds HF's eager mask, additive (0 where a query attends, the dtype's minimum where
    not); the adapter reads it as a bool mask, so rows of padding come out as zeros.
    """

    def forward(
        self, hidden_states: Tensor, residual: Tensor, alibi: Tensor | None = None,
        attention_mask: Tensor | None = None, layer_past=None, **kwargs,
    ) -> tuple[Tensor, None]:  # fmt: skip
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0  # HF's convention: True = attend
        out = self.attn(
            hidden_states,
            attn_mask=_layer_mask(attention_mask),
            is_causal=attention_mask is None,
            kv_cache=None if layer_past is None else _BloomCacheLayer(layer_past, self.layer_idx),
        )
        return residual + self.resid_dropout(out), None


def _from_bloom(module: BloomAttention, backend: str) -> BloomAttentionAdapter:
    """BLOOM's attention as an adapter with the same weights.

    ``query_key_value`` ``(3E, E)`` holds each head's q, k and v rows together (head ``h``:
    rows ``3hD .. 3hD + 3D``, q then k then v); the layer's ``in_proj`` stacks all the q rows,
    then the k rows, then the v rows. ``dense`` is ``out_proj``. BLOOM's tensor-parallel
    ``slow_but_exact`` path (``pretraining_tp > 1``) leaves out ``dense``'s bias: refused.
    """
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise ValueError(
            f"slow_but_exact=True with pretraining_tp={module.pretraining_tp} (BLOOM's sliced "
            "output projection without its bias) is not supported"
        )
    E, H = module.hidden_size, module.num_heads
    weight = module.query_key_value.weight
    attn = MultiHeadAttention(
        E, H, dropout=module.attention_dropout.p, backend=backend, positions=ALiBi(H),
        device=weight.device, dtype=weight.dtype,
    )  # fmt: skip
    layout = _layout(module, partial(_bloom_to_hf, heads=H), partial(_bloom_from_hf, heads=H))
    adapter = BloomAttentionAdapter(
        attn, layer_idx=module.layer_idx, resid_dropout=nn.Dropout(module.hidden_dropout),
        layout=layout,
    )  # fmt: skip
    _load_hf(adapter, module)
    return adapter.train(module.training)


_BLOOM = {"attn.in_proj.": "query_key_value.", "attn.out_proj.": "dense."}


def _bloom_to_hf(own: dict[str, Tensor], heads: int) -> dict[str, Tensor]:
    """The layer's stacked rows (all q, all k, all v) as BLOOM's (each head's q, k, v)."""
    theirs = _renamed(own, _BLOOM)
    for name in ("query_key_value.weight", "query_key_value.bias"):
        theirs[name] = theirs[name].unflatten(0, (3, heads, -1)).transpose(0, 1).flatten(0, 2)
    return theirs


def _bloom_from_hf(theirs: dict[str, Tensor], heads: int) -> dict[str, Tensor]:
    own = _renamed(theirs, _inverse(_BLOOM))
    for name in ("attn.in_proj.weight", "attn.in_proj.bias"):
        own[name] = own[name].unflatten(0, (heads, 3, -1)).transpose(0, 1).flatten(0, 2)
    return own


# --------------------------------------------------------------------------- DiffLlama
def _from_diffllama(module: DiffLlamaAttention, backend: str) -> HFAttentionAdapter:
    """DiffLlama's attention: a Llama one (:func:`_from_llama`) with the layer's differential
    design (:mod:`~multihead.attention.differential`), which pairs the heads as DiffLlama
    does, given the module's ``lambda_init`` (its depth's), its four ``lambda`` vectors and
    its RMSNorm's epsilon (``rms_norm_eps``)."""
    adapter = _from_llama(
        module, backend, design="diff", lambda_init=module.lambda_init,
        norm_eps=module.groupnorm.eps,
    )  # fmt: skip
    # Built on the meta device with the projections: the lambda vectors get storage here.
    adapter.attn.design.to_empty(device=module.q_proj.weight.device)
    names = _LLAMA | {f"attn.{adapter.attn.design.attribute}.lambda_": "lambda_"}
    adapter.layout = _layout(
        module, partial(_renamed, prefixes=names), partial(_renamed, prefixes=_inverse(names))
    )
    _load_hf(adapter, module)  # the lambdas; the projections are the module's own
    return adapter


# --------------------------------------------------------------------------- DeepSeek (MLA)
# The rotary module each DeepSeek attention's model builds: the converter takes its
# frequencies and magnitude from one built on the same config.
_DEEPSEEK_ROTARY = {
    DeepseekV2Attention: DeepseekV2RotaryEmbedding,
    DeepseekV3Attention: DeepseekV3RotaryEmbedding,
}
# HF's rope types whose frequencies are fixed when the model is built (dynamic and longrope
# change them with the sequence length, at every call).
_FIXED_ROPE = ("default", "linear", "llama3", "yarn")


def _from_deepseek(
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
    layout = _layout(
        module, partial(_deepseek_to_hf, value=dv, **sizes), partial(_deepseek_from_hf, **sizes)
    )
    adapter = HFAttentionAdapter(attn, layer_idx=module.layer_idx, layout=layout)
    _load_hf(adapter, module)  # Q, the latent's down and up, the rotary rows; the rest is HF's
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
    """The layer's MLA weights in HF's DeepSeek layout (:func:`_from_deepseek`, reversed)."""
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
    return theirs | _renamed(own, _deepseek_names(latent, low_rank))


def _deepseek_from_hf(
    theirs: dict[str, Tensor], *, latent: str, heads: int, nope: int, factor: float,
    low_rank: bool,
) -> dict[str, Tensor]:  # fmt: skip
    """HF's DeepSeek weights in the layer's MLA layout (:func:`_from_deepseek`)."""
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
    return own | _renamed(theirs, _inverse(_deepseek_names(latent, low_rank)))


def _check_deepseek_rotary(model: nn.Module) -> None:
    """Refuse a swap of a DeepSeek model whose rotary module is not the one its config builds,
    whose frequencies and magnitude :func:`_from_deepseek` took: a model cast after it was
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


# --------------------------------------------------------------------------- the swap
# The HF attention classes the swap converts, by exact type: a subclass may change forward.
CONVERTERS = {
    GPT2Attention: _from_gpt2,
    LlamaAttention: _from_llama,
    Qwen2Attention: _from_llama,
    MistralAttention: _from_llama,
    BloomAttention: _from_bloom,
    DiffLlamaAttention: _from_diffllama,
    DeepseekV2Attention: _from_deepseek,
    DeepseekV3Attention: _from_deepseek,
}


def _check_rotary_angles(
    model: nn.Module, adapters: dict[str, HFAttentionAdapter], backend: str
) -> None:
    """Refuse a swap whose layers would rotate Q and K by other angles than the model's.

    The adapters ignore HF's ``position_embeddings``; rather than trusting that the config
    says everything, the ``cos`` and ``sin`` of every rotary embedding module in ``model``
    (one with an ``inv_freq`` buffer, as HF's are) at positions ``0 .. 4095`` are compared
    with each rotary layer's, in fp32 (HF computes them there).
    """
    parts = [a.attn.positions for a in adapters.values() if a.attn.positions is not None]
    layers = {tuple(p.options.items()): p for p in parts}.values()  # one of each
    if not layers:
        return
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "inv_freq", None), Tensor):
            continue
        if module.inv_freq.dtype != torch.float32:
            # HF keeps inv_freq in fp32 when the model is built with dtype=; a cast of the
            # whole model (.to(torch.bfloat16)) rounds it, and HF's angles with it.
            raise ValueError(
                f"cannot replace the attention: {name!r} ({type(module).__name__}) holds its "
                f"inv_freq in {module.inv_freq.dtype} (the model was cast after it was built), "
                "so HF's rotary angles are rounded; build the model with dtype= instead of "
                "casting it, or call replace_hf_attention before casting"
            )
        positions = torch.arange(4096, device=module.inv_freq.device)[None]  # (1, 4096)
        probe = torch.zeros((), device=module.inv_freq.device)  # HF reads its device, dtype
        theirs = module(probe, positions)  # cos, sin: (1, 4096, R)
        for rotary in layers:
            ours = rotary.cos_sin(positions, torch.float32)
            same = all(
                a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-6)
                for a, b in zip(ours, theirs, strict=True)
            )
            if not same:
                raise ValueError(
                    f"cannot replace the attention: {name!r} ({type(module).__name__}) gives "
                    f"rotary cos/sin of width {theirs[0].shape[-1]} that differ from the "
                    f"layer's ({rotary.extra_repr()}); use attn_implementation="
                    f"{hf_name(backend)!r} instead"
                )


def _refuse_output_attentions(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook of a swapped model: ``output_attentions`` (the call's, else the
    config's) is refused by name. HF records the weights with hooks on its own attention
    classes (``_can_record_outputs``), which the adapters replaced: the model would return
    ``attentions=()``. The interface path (``attn_implementation="multihead"``) returns them."""
    config = getattr(model, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        raise ValueError(
            f"output_attentions=True: {type(model).__name__}'s attention modules were replaced "
            "by replace_hf_attention and HF records the weights only from its own; use "
            "attn_implementation='multihead' on an unswapped model for the weights"
        )


def replace_hf_attention(model: nn.Module, *, backend: str = DEFAULT_BACKEND) -> nn.Module:
    """Swap every attention module of a supported HF family in ``model`` for an
    :class:`HFAttentionAdapter` with the same weights, in place.

    The model's ``attn_implementation`` becomes :func:`hf_name` of ``backend``, so that HF
    builds the mask the adapters read. Every module is converted before any is replaced:
    on an error nothing has changed.

    Args:
        model: an HF ``PreTrainedModel`` (GPT-2, Llama, Qwen2, Mistral, DiffLlama, BLOOM,
            DeepSeek-V2, DeepSeek-V3).
        backend: the layer's backend.

    Returns:
        ``model``.

    Raises:
        ValueError: a module that cannot be converted (named), or none to convert; when
            called with ``output_attentions=True`` (:func:`_refuse_output_attentions`).
    """
    register()
    _check_hf_format_at_save()
    adapters, copied = {}, set()
    for name, module in model.named_modules():
        convert = CONVERTERS.get(type(module))
        if convert is not None:
            try:
                adapters[name] = convert(module, backend)
            except ValueError as err:
                raise ValueError(f"cannot replace {name!r}: {err}") from err
            own = {id(p) for p in module.parameters()}
            if any(id(p) not in own for p in adapters[name].parameters() if p.requires_grad):
                copied.add(type(module).__name__)
    if copied:
        # The Llama family keeps its own projections; a layout the layer cannot hold as it
        # is (GPT-2's transposed Conv1D, BLOOM's per-head q,k,v rows, DiffLlama's lambdas in
        # the design) is copied into new parameters, which an existing optimizer does not hold.
        warnings.warn(
            f"replace_hf_attention: the weights of {', '.join(sorted(copied))} are copied into "
            "new parameters; an optimizer built before the swap no longer trains them: build "
            "it after the swap",
            stacklevel=2,
        )
    _check_rotary_angles(model, adapters, backend)
    _check_deepseek_rotary(model)
    if not adapters:
        raise ValueError(
            f"no attention module to replace in {type(model).__name__}; supported: "
            + ", ".join(c.__name__ for c in CONVERTERS)
        )
    for name, adapter in adapters.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, adapter)
    if not all(isinstance(a, BloomAttentionAdapter) for a in adapters.values()):
        # BLOOM builds its eager mask whatever the name (HF would warn that it cannot set it).
        model.set_attn_implementation(hf_name(backend))
    model.register_forward_pre_hook(_refuse_output_attentions, with_kwargs=True)
    return model
