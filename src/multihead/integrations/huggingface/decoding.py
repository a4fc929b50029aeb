"""Decoding an HF model on the CPU: a cache that appends in place, and weights packed once.

Both are exported by :mod:`multihead.integrations.huggingface`::

    model = replace_hf_attention(model)        # or attn_implementation="multihead"
    prepare_for_decoding(model)                # eval mode, linear weights packed for oneDNN
    out = model.generate(ids, max_new_tokens=256, cache=AppendCache(config=model.config))

* :class:`AppendCache`: HF's default ``DynamicCache`` concatenates the whole past with each
  new token (``torch.cat``), so every step copies every cached key and value: at 4,096
  positions and batch 8 that copy costs more than the attention that reads them. This cache
  writes each new token into spare room at the end of its buffers and grows them by a
  quarter when they are full, so the past is copied once per growth instead of once per
  token. It is a ``DynamicCache`` otherwise: HF builds the same masks, and beam search,
  cropping and batch selection work on it (they rebind the layer's tensors; the next update
  copies them into a new buffer).
* :func:`prepare_for_decoding`: every ``nn.Linear`` of the model becomes a
  :class:`~multihead.packed.PackedLinear`, whose weight is reordered once for oneDNN
  (and again when the weight changes or an optimizer steps; after ``p.data.copy_(new)``,
  call it again).
  At batch 8 a step's projections are matrix products of 8 rows, which MKL runs at a small
  fraction of the GEMM peak (docs/benchmarks.md, "Long-context decoding").
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from multihead.packed import PackedLinear, pack_linears


class AppendLayer(DynamicLayer):
    """One layer of :class:`AppendCache`: ``keys`` and ``values`` ``(B, G, S, D)`` are views
    of the first ``S`` positions of buffers with room for more."""

    _key_buffer: Tensor | None = None
    _value_buffer: Tensor | None = None
    _keys_view: Tensor | None = None  # the keys last returned, a view of _key_buffer

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states[..., :0, :]  # (B, G, 0, D)
        self.values = value_states[..., :0, :]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        S, L = self.keys.shape[-2], key_states.shape[-2]
        # Still the views this layer returned (HF's crop, beam reordering and batch selection
        # rebind them) with room for L more: written in place; else copied into new buffers.
        if not (self.keys is self._keys_view and self._key_buffer.shape[-2] >= S + L):
            self._key_buffer = _grown(self.keys, S + L)
            self._value_buffer = _grown(self.values, S + L)
        self._key_buffer[..., S : S + L, :] = key_states
        self._value_buffer[..., S : S + L, :] = value_states
        self.keys = self._keys_view = self._key_buffer[..., : S + L, :]  # (B, G, S + L, D)
        self.values = self._value_buffer[..., : S + L, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = self._keys_view = None
        super().reset()


def spare_room(needed: int) -> int:
    """Positions a new buffer holds beyond ``needed``: a quarter more, at least 256.

    Geometric growth keeps the copies amortised (n tokens appended one by one copy about
    5n positions in all), and a quarter bounds the memory held beyond the past: doubling
    would hold twice a long prompt's cache from its first step.
    """
    return max(256, needed // 4)


def _grown(filled: Tensor, needed: int) -> Tensor:
    """A new buffer ``(B, G, needed + spare_room(needed), D)`` starting with ``filled``."""
    grown = filled.new_empty((*filled.shape[:-2], needed + spare_room(needed), filled.shape[-1]))
    grown[..., : filled.shape[-2], :] = filled
    return grown


class AppendCache(DynamicCache):
    """HF's ``DynamicCache`` with its full-attention layers appending in place
    (:class:`AppendLayer`); sliding-window and other layers stay HF's.

    Args:
        config: the model's config, as for ``DynamicCache``; ``None``: every layer appends.

    Example:
        ``model.generate(ids, cache=AppendCache(config=model.config))``: the same tokens as
        with ``DynamicCache`` (``tests/integrations/test_hf_decoding.py``).
    """

    def __init__(self, config=None) -> None:
        super().__init__(config=config)
        if config is None:
            self.layer_class_to_replicate = AppendLayer
        for index, layer in enumerate(self.layers):
            if type(layer) is DynamicLayer:
                self.layers[index] = AppendLayer()


def prepare_for_decoding(model: nn.Module) -> nn.Module:
    """Prepare ``model`` for decoding on the CPU, in place: eval mode, and every plain
    ``nn.Linear`` a :class:`~multihead.packed.PackedLinear` (the same parameters and
    ``state_dict``; its weight reordered for oneDNN at its first call without autograd).

    The reordered copies follow the weights: a copy is made again when its parameter is
    replaced (``load_state_dict(assign=True)``), rebound (``p.data = new``), cast or moved
    (``.to(torch.bfloat16)`` decodes in bf16, ``.float()`` back in fp32), edited in place
    (``load_state_dict``, ``p.copy_(new)`` under ``no_grad``), or after any
    ``torch.optim.Optimizer`` step in the process (fused ones included, which move no version
    counter). Under CPU autocast the layers compute as ``nn.Linear`` does there. No check
    sees an edit through ``.data`` (``p.data.copy_(new)``) or a fused kernel called without
    an optimizer (``torch.optim``'s functional API): call ``prepare_for_decoding(model)``
    again after one, which makes every copy anew.

    Memory: the reordered copies hold as much again as the linear weights. Training
    afterwards is unaffected (with autograd on, the layers are ``nn.Linear``'s), and
    :func:`~multihead.packed.unpack_linears` undoes it.

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` has no ``nn.Linear``.
    """
    pack_linears(model)
    if not any(isinstance(m, PackedLinear) for m in model.modules()):
        raise ValueError(f"prepare_for_decoding: {type(model).__name__} has no nn.Linear to pack")
    return model.eval()
