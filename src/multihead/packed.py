"""Linear layers for CPU decoding: the weight reordered once into oneDNN's blocked layout.

A decoding step multiplies a handful of rows (``M`` = the batch) by every weight of the
model. On the CPU ``F.linear`` hands that to MKL's sgemm, which at ``M = 8`` runs at about
a sixth of the GEMM peak on a 2-core AMD EPYC; oneDNN on a weight already in its own
layout runs the same product 3-5x faster (docs/benchmarks.md, "Long-context decoding").
Reordering costs about as much as the product, so it is done once and kept.

:class:`PackedLinear` is an ``nn.Linear`` (same parameters, same ``state_dict``) whose
forward uses the reordered copy when it can and ``F.linear`` otherwise: with autograd on,
in training mode, under CPU autocast (``F.linear`` is what autocast casts), off the CPU, or
in a dtype other than the weight's.

The copy follows its weight. It is made again when the parameter is another object
(``load_state_dict(assign=True)``), its storage moved (``p.data = new``, a cast), its dtype,
device or version counter changed (``load_state_dict``, an in-place edit under ``no_grad``),
or any ``torch.optim.Optimizer`` has stepped since it was made: fused SGD, Adam, AdamW and
Adagrad write the weight without moving its version counter, so a global step hook (registered
when the first copy is made) counts steps and a copy older than the last step is made again.
The copy holds the storage it was made from, so a new weight cannot reuse its address. It is
dropped at ``train()``/``eval()`` and at a cast (``.to``, ``.float()``). What no check sees is
a write that moves neither the storage nor the version counter outside an optimizer's
``step``: an in-place edit of ``p.data`` (``p.data.copy_(new)``: ``.data`` has a version
counter of its own), or a fused kernel called without an optimizer object (``torch.optim``'s
functional ``adamw(..., fused=True)``). After one, ``model.eval()`` (or
``prepare_for_decoding(model)`` again) makes every copy anew.

Cost: one integer comparison per inference call beside the checks above, one integer
increment per optimizer step in the process, and one reordering at the first inference call
after a step.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

# Optimizer steps taken in this process since the hook was registered (its handle, None
# before the first copy). A fused step moves no version counter, so a copy made before the
# last step is stale.
_optimizer_steps: int = 0
_step_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizer_steps() -> None:
    """Register the step counter once, when the first copy is made: before any copy exists
    no step can make one stale."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_step)


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
    _packed_from: Tensor | None = None  # the weight it was reordered from: its storage, kept
    _packed_param: weakref.ref | None = None  # the parameter it was reordered from
    _packed_version: int = -1  # the weight's version counter when it was reordered
    _packed_steps: int = -1  # optimizer steps taken in the process when it was reordered

    def __getstate__(self) -> dict:
        # Copies and pickles leave the oneDNN copy behind (torch cannot copy its storage);
        # the copy's first call without autograd makes its own.
        state = super().__getstate__()
        for attribute in _PACKED:
            state.pop(attribute, None)
        return state

    def _drop(self) -> None:
        self._packed = self._packed_from = self._packed_param = None

    def train(self, mode: bool = True) -> PackedLinear:
        self._drop()  # training may change the weight without a trace: reorder again
        return super().train(mode)

    def _apply(self, fn, recurse: bool = True):
        self._drop()  # a cast or a move: the old weight's copy and storage are not kept
        return super()._apply(fn, recurse)

    def _is_current(self, weight: Tensor) -> bool:
        """Whether the copy was made from ``weight`` as it is now: the same parameter, the
        same storage (held by ``_packed_from``, so no new tensor can take its address), dtype,
        device and version, and no optimizer step since."""
        source = self._packed_from
        return (
            self._packed is not None
            and self._packed_param() is weight
            and weight.data_ptr() == source.data_ptr()
            and weight.dtype == source.dtype
            and weight.device == source.device
            and weight.shape == source.shape
            and weight._version == self._packed_version
            and _optimizer_steps == self._packed_steps
        )

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if (
            torch.is_grad_enabled()
            or self.training
            or torch.is_autocast_enabled("cpu")
            or x.dtype != weight.dtype
            or not can_pack(weight)
        ):
            return F.linear(x, weight, self.bias)
        if not self._is_current(weight):
            _watch_optimizer_steps()
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._packed_from = weight.detach()
            self._packed_param = weakref.ref(weight)
            self._packed_version = weight._version
            self._packed_steps = _optimizer_steps
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


# What a PackedLinear holds beside nn.Linear's state: left behind by copies, freed by unpacking.
_PACKED = ("_packed", "_packed_from", "_packed_param", "_packed_version", "_packed_steps")


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
            for attribute in _PACKED:  # the copy, freed
                module.__dict__.pop(attribute, None)
            names.append(name)
    return names
