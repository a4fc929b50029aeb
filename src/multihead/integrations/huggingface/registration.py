"""What :func:`register` does to HF: the layer's backends under their names in
``AttentionInterface`` with the mask they read in ``AttentionMaskInterface``, and the
refusal of those names for a model whose attention would not reach them."""

from __future__ import annotations

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from multihead.integrations.huggingface.interface import attention_function, multihead_mask, names
from multihead.integrations.huggingface.refusal import refusal, routes_through_interface


def register() -> dict[str, str]:
    """Register the layer's backends with HF's attention and mask interfaces.

    Returns:
        ``{attn_implementation name: backend}``, ``"multihead"`` included.
    """
    registered = names()
    for name, backend in registered.items():
        AttentionInterface.register(name, attention_function(backend))
        AttentionMaskInterface.register(name, multihead_mask)
    _refuse_models_that_compute_attention_themselves()
    return registered


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
    registered = set(names())
    get_correct, set_implementation = (
        PreTrainedModel.get_correct_attn_implementation,
        PreTrainedModel.set_attn_implementation,
    )

    def check(model_class: type, name) -> None:
        if name in registered and not routes_through_interface(model_class):
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
