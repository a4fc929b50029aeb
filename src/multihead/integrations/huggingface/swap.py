"""The swap: :func:`replace_hf_attention` puts an adapter on the layer in place of each
attention module a registered family covers (:mod:`.registry`), checks what no single
converter sees (the model's rotary angles), and makes ``save_pretrained`` refuse a layer
HF's format has no place for (:func:`check_hf_format`)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from multihead.integrations.huggingface.adapter import HFAttentionAdapter
from multihead.integrations.huggingface.interface import DEFAULT_BACKEND, hf_name
from multihead.integrations.huggingface.registration import register
from multihead.integrations.huggingface.registry import FAMILIES


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
    """Swap every attention module of a registered HF family in ``model`` for an
    :class:`HFAttentionAdapter` with the same weights, in place.

    The model's ``attn_implementation`` becomes :func:`hf_name` of ``backend``, so that HF
    builds the mask the adapters read. Every module is converted before any is replaced:
    on an error nothing has changed.

    Args:
        model: an HF ``PreTrainedModel`` (GPT-2, Llama, Qwen2, Mistral, DiffLlama, BLOOM,
            DeepSeek-V2, DeepSeek-V3, or a family of the user's: :func:`register_family`).
        backend: the layer's backend.

    Returns:
        ``model``.

    Raises:
        ValueError: a module that cannot be converted (named), or none to convert; when
            called with ``output_attentions=True`` (:func:`_refuse_output_attentions`).
    """
    register()
    _check_hf_format_at_save()
    adapters, copied, families = {}, set(), {}
    for name, module in model.named_modules():
        family = FAMILIES.get(type(module))
        if family is not None:
            families[family] = None  # each once, in the order met
            try:
                adapters[name] = family.convert(module, backend)
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
    for family in families:
        if family.check_model is not None:
            family.check_model(model)
    if not adapters:
        raise ValueError(
            f"no attention module to replace in {type(model).__name__}; supported: "
            + ", ".join(c.__name__ for c in FAMILIES)
        )
    for name, adapter in adapters.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, adapter)
    if any(a.reads_named_mask for a in adapters.values()):
        # Not for BLOOM alone, which builds its eager mask whatever the name (HF would warn
        # that it cannot set it).
        model.set_attn_implementation(hf_name(backend))
    model.register_forward_pre_hook(_refuse_output_attentions, with_kwargs=True)
    return model
