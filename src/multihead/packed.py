"""Linear layers for CPU decoding: the weight reordered once into oneDNN's blocked layout.

A decoding step multiplies a handful of rows (``M`` = the batch) by every weight of the
model. On the CPU ``F.linear`` hands that to MKL's sgemm, which at ``M = 8`` runs at about
a sixth of the GEMM peak on a 2-core AMD EPYC; oneDNN on a weight already in its own
layout runs the same product 3-5x faster (docs/benchmarks.md, "Long-context decoding").
Reordering costs about as much as the product, so it is done once and kept.

:class:`PackedLinear` is an ``nn.Linear`` (same parameters, same ``state_dict``) whose
forward uses the reordered copy when it can and ``F.linear`` otherwise: with autograd on,
in training mode, off the CPU, or in a dtype other than the weight's. The copy is dropped
whenever the weight may change: at a call with autograd on (an optimiser step needs one
first; a fused step changes the weight without moving its version counter) and at
``train()``/``eval()``; and it is made again when the weight's version counter moved
(``load_state_dict``, an in-place edit under ``no_grad``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def can_pack(weight: Tensor) -> bool:
    """Whether oneDNN can take ``weight``: on the CPU, in fp32, or in bf16 where the CPU has
    native bf16 (AVX512-BF16 or AMX)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies by a oneDNN copy of its weight in inference.

    Turn a module into one in place with :func:`pack_linears` (its parameters stay the
    same objects, so an optimiser and a ``state_dict`` see no change); :func:`unpack_linears`
    turns it back.
    """

    _packed: Tensor | None = None  # the reordered weight
    _packed_version: int = -1  # the weight's version counter when it was reordered

    def __getstate__(self) -> dict:
        # Copies and pickles leave the oneDNN copy behind (torch cannot copy its storage);
        # the copy's first call without autograd makes its own.
        state = super().__getstate__()
        state.pop("_packed", None)
        state.pop("_packed_version", None)
        return state

    def train(self, mode: bool = True) -> PackedLinear:
        self._packed = None  # training may change the weight without a trace: reorder again
        return super().train(mode)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if torch.is_grad_enabled():
            self._packed = None  # a step may follow that changes the weight without a trace
            return F.linear(x, weight, self.bias)
        if self.training or x.dtype != weight.dtype or not can_pack(weight):
            return F.linear(x, weight, self.bias)
        if self._packed is None or self._packed_version != weight._version:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._packed_version = weight._version
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> list[str]:
    """Turn every plain ``nn.Linear`` of ``model`` into a :class:`PackedLinear`, in place.

    Only exact ``nn.Linear`` instances change: a subclass may have its own forward.

    Returns:
        The names of the modules turned.
    """
    names = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            names.append(name)
    return names


def unpack_linears(model: nn.Module) -> list[str]:
    """Undo :func:`pack_linears`: every :class:`PackedLinear` is an ``nn.Linear`` again and
    its reordered copy is freed. Returns the names of the modules turned back."""
    names = []
    for name, module in model.named_modules():
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            for attribute in ("_packed", "_packed_version"):  # the copy, freed
                module.__dict__.pop(attribute, None)
            names.append(name)
    return names
