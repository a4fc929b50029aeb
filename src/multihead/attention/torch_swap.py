"""Swap ``torch.nn.MultiheadAttention`` for :class:`MultiHeadAttention` inside any model, and back.

:func:`replace_torch_attention` puts a :class:`TorchAttentionAdapter` wherever a model holds an
``nn.MultiheadAttention``: a :class:`MultiHeadAttention` made of the old module's own
parameters, behind ``nn.MultiheadAttention``'s call, so the code that calls it does not change
and the layer's own features apply (``module.attn = with_kv_heads(module.attn, 2)``).
:func:`restore_torch_attention` goes back, for a model whose layers still have torch's shape.
``docs/reuse.md`` shows both on a model.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from multihead.attention.layer import MultiHeadAttention


class TorchAttentionAdapter(nn.Module):
    """``nn.MultiheadAttention``'s call and attributes around a :class:`MultiHeadAttention`.

    ``forward`` takes ``nn.MultiheadAttention``'s arguments and returns its ``(output,
    weights)`` tuple; ``key`` must be ``value``, and a query row whose keys are all masked
    gets zeros where torch gives NaN. ``docs/reuse.md`` says what holds and what is refused.

    Args:
        attn: the layer that computes the attention. Replace it (for example by
            ``with_kv_heads(adapter.attn, 2)``) and the adapter calls the new one.
        batch_first: as ``nn.MultiheadAttention``'s: the caller's tensors are ``(B, L, E)``
            when True, ``(L, B, E)`` when False.
        name: the module's path in its model, for error messages.
    """

    # False although kdim == vdim == embed_dim: only then does nn.TransformerEncoderLayer in
    # eval mode call the adapter instead of its fused kernel, which would run torch's
    # attention on in_proj_weight in place of the layer.
    _qkv_same_embed_dim = False
    bias_k = None
    bias_v = None
    add_zero_attn = False

    def __init__(self, attn: MultiHeadAttention, *, batch_first: bool, name: str = "") -> None:
        super().__init__()
        self.attn = attn
        self.batch_first = batch_first
        self.name = name

    def __getattr__(self, name: str) -> object:
        # What code written for nn.MultiheadAttention reads, read from the current layer.
        # in_proj_weight and in_proj_bias are the layer's own stacked projection while it has
        # torch's (3E, E) shape (so open_clip's init writes the layer's weights), else None.
        if name in ("embed_dim", "num_heads", "head_dim", "dropout", "out_proj"):
            return getattr(self.attn, name)
        if name in ("kdim", "vdim"):
            return self.attn.embed_dim
        if name in ("in_proj_weight", "in_proj_bias"):
            shaped = _torch_shaped_projection(self.attn)
            return getattr(self.attn.in_proj, name.removeprefix("in_proj_")) if shaped else None
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return f"batch_first={self.batch_first}"

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        where = repr(self.name) if self.name else "the adapter"
        if query.is_nested:
            raise ValueError(
                f"{where} got a nested tensor: nn.TransformerEncoder makes them on its fast "
                "path; call replace_torch_attention on the model that holds the encoder, "
                "which turns that path off (use_nested_tensor=False)"
            )
        # Projecting K from key and V from value would need a second input path through the
        # layer, its KV cache and every head design, for a call no torch.nn model makes.
        if key is not value:
            raise ValueError(
                f"{where} was called with key and value as different tensors; "
                "MultiHeadAttention projects K and V from one input, so key must be value "
                "(keep this model's nn.MultiheadAttention)"
            )
        self_attention = key is query
        unbatched = query.dim() == 2
        if unbatched:  # (L, E): a batch of one
            query, key = query.unsqueeze(0), key.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        H = self.attn.num_heads

        # torch takes is_causal as a promise that attn_mask is causal; for self-attention the
        # layer's own causal mask replaces it. Cross-attention keeps the mask itself.
        causal = is_causal and self_attention
        if is_causal and not self_attention and attn_mask is None:
            raise ValueError(
                f"{where}: is_causal on cross-attention needs the causal attn_mask itself"
            )
        mask = None if causal else attn_mask
        if mask is not None and mask.dim() == 3:
            if mask.shape[0] != B * H:
                raise ValueError(
                    f"{where}: a 3-D attn_mask must be (B*H, L, S) = {(B * H, L, S)}, "
                    f"got {tuple(mask.shape)}"
                )
            mask = mask.reshape(B, H, L, S)  # torch's row b*H + h is (batch b, head h)
        if key_padding_mask is not None and key_padding_mask.is_floating_point():
            # A float padding mask is added to the scores, like a float attn_mask; a bool
            # attn_mask joins it as -inf where masked out.
            padding = key_padding_mask[:, None, None, :].to(query.dtype)  # (B, 1, 1, S)
            if mask is not None and mask.dtype == torch.bool:
                mask = padding.new_zeros(mask.shape).masked_fill(mask, float("-inf"))
            mask = padding if mask is None else mask.to(query.dtype) + padding
            key_padding_mask = None

        result = self.attn(
            query,
            None if self_attention else key,
            key_padding_mask=key_padding_mask,
            attn_mask=mask,
            is_causal=causal,
            need_weights=need_weights,
        )
        out, weights = result if need_weights else (result, None)  # (B, L, E), (B, H, L, S)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, L, S)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (L, B, E); torch's weights stay batch-first
        return out, weights


def _torch_shaped_projection(attn: MultiHeadAttention) -> bool:
    """Whether ``attn.in_proj`` stacks full Q, K and V, ``(3E, E)``, as torch's does."""
    return tuple(attn.in_proj.weight.shape) == (3 * attn.embed_dim, attn.embed_dim)


# The hooks that see parameter names, which differ between the two.
_STATE_DICT_HOOKS = {
    "_state_dict_pre_hooks": "state_dict pre-hooks",
    "_state_dict_hooks": "state_dict hooks",
    "_load_state_dict_pre_hooks": "load_state_dict pre-hooks",
    "_load_state_dict_post_hooks": "load_state_dict post-hooks",
}


def _carry_hooks(old: nn.Module, new: nn.Module, path: str) -> None:
    """Give ``new`` the forward and backward hooks of ``old`` (the adapter takes
    ``nn.MultiheadAttention``'s call and returns its tuple, so they mean the same on either):
    the same dicts, so the handles that registered them still remove them. State-dict hooks
    are left behind, with a warning."""
    for name in vars(old):
        if name.startswith(("_forward_", "_backward_", "_is_full_backward_hook")):
            setattr(new, name, getattr(old, name))
    left = [kind for name, kind in _STATE_DICT_HOOKS.items() if getattr(old, name)]
    if left:
        warnings.warn(
            f"{path or 'the model'!r}: its {', '.join(left)} are not carried over to the new "
            "module, whose parameter names differ",
            stacklevel=2,
        )


def _unsupported(module: nn.MultiheadAttention) -> str | None:
    """What ``module`` has that :class:`MultiHeadAttention` cannot do, or ``None``."""
    if type(module).forward is not nn.MultiheadAttention.forward:
        return f"{type(module).__name__} has its own forward, which the adapter would not run"
    if not module._qkv_same_embed_dim:
        return (
            f"kdim={module.kdim}, vdim={module.vdim} differ from embed_dim={module.embed_dim} "
            "(MultiHeadAttention projects K and V from inputs of width embed_dim)"
        )
    if module.bias_k is not None:
        return "add_bias_kv=True is not supported"
    if module.add_zero_attn:
        return "add_zero_attn=True is not supported"
    return None


def _layer_made_of(module: nn.MultiheadAttention, backend: str) -> MultiHeadAttention:
    """The :class:`MultiHeadAttention` made of ``module``'s own parameter objects."""
    weight, bias = module.in_proj_weight, module.in_proj_bias
    attn = MultiHeadAttention(
        module.embed_dim, module.num_heads, dropout=module.dropout, bias=bias is not None,
        backend=backend, device="meta", dtype=weight.dtype,
    )  # fmt: skip
    # The module's parameters in place of the placeholders made on "meta".
    attn.in_proj.weight, attn.in_proj.bias = weight, bias
    attn.out_proj = module.out_proj
    return attn.train(module.training)


def from_torch(module: nn.MultiheadAttention, backend: str = "sdpa") -> MultiHeadAttention:
    """An equivalent layer with a copy of ``module``'s weights.

    The new layer is batch-first whatever ``module.batch_first`` says. Masks mean the
    same in both (bool True = masked out; float added), except that a 3-D
    ``attn_mask`` here broadcasts to ``(B, H, L, S)`` instead of being ``(B*H, L, S)``.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
    problem = _unsupported(module)
    if problem is not None:
        raise ValueError(f"from_torch cannot convert this module: {problem}")
    return copy.deepcopy(_layer_made_of(module, backend))


def _no_torch_equivalent(adapter: TorchAttentionAdapter) -> str | None:
    """Why ``adapter``'s layer has no ``nn.MultiheadAttention`` equivalent, or ``None``."""
    attn = adapter.attn
    if attn.design is not None:
        return f"its layer has a head design ({attn.head_tag})"
    if attn.num_kv_heads != attn.num_heads:
        return f"its layer has {attn.num_kv_heads} K/V heads for {attn.num_heads} query heads"
    if not _torch_shaped_projection(attn):
        return f"its in_proj is {tuple(attn.in_proj.weight.shape)}, not (3E, E) (pruned heads)"
    if attn.head_mask is not None:
        return "its layer has a head_mask"
    return None


def _swap(model: nn.Module, kind: type, check: Callable, make: Callable, *, verb: str) -> nn.Module:
    """Replace each module of type ``kind`` in ``model`` (once, however often it is shared)
    by ``make(module, path)``, or none if ``check(module)`` says why one cannot be: "cannot
    ``verb`` path: why". Returns ``model``, or its replacement when it is itself of ``kind``.
    """
    # id -> (path, module): named_modules gives a shared module once, at its first path.
    found = {id(m): (path, m) for path, m in model.named_modules() if isinstance(m, kind)}
    for path, module in found.values():
        problem = check(module)
        if problem is not None:
            raise ValueError(f"cannot {verb} {path or 'the model'!r}: {problem}")
    new = {key: make(module, path) for key, (path, module) in found.items()}
    if id(model) in new:
        return new[id(model)]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in new:
                setattr(parent, name, new[id(child)])
    return model


def replace_torch_attention(model: nn.Module, *, backend: str = "sdpa") -> nn.Module:
    """Replace, in place, every ``torch.nn.MultiheadAttention`` inside ``model`` by a
    :class:`TorchAttentionAdapter` around a :class:`MultiHeadAttention` of ``backend`` made of
    its own parameter objects, which takes over its forward and backward hooks.
    ``docs/reuse.md`` says what holds and what changes.

    Returns:
        ``model``, or the adapter when ``model`` is itself an ``nn.MultiheadAttention``.

    Raises:
        ValueError: a module the layer cannot stand in for, named by its path; nothing is
            replaced.
    """

    def adapter(module: nn.MultiheadAttention, path: str) -> TorchAttentionAdapter:
        new = TorchAttentionAdapter(
            _layer_made_of(module, backend), batch_first=module.batch_first, name=path
        )
        _carry_hooks(module, new, path)
        return new.train(module.training)

    model = _swap(model, nn.MultiheadAttention, _unsupported, adapter, verb="replace")
    _set_nested_tensor(model)
    return model


def restore_torch_attention(model: nn.Module) -> nn.Module:
    """Put an ``nn.MultiheadAttention`` back, in place, wherever ``model`` holds a
    :class:`TorchAttentionAdapter`: :func:`replace_torch_attention` undone, with the same
    parameter objects under the same names and the adapter's hooks.

    Returns:
        ``model``, or the new module when ``model`` is itself an adapter.

    Raises:
        ValueError: a layer that ``nn.MultiheadAttention`` cannot hold, named by its path
            and why (:func:`_no_torch_equivalent`); nothing is restored.
    """

    def torch_module(adapter: TorchAttentionAdapter, path: str) -> nn.MultiheadAttention:
        attn = adapter.attn
        weight, bias = attn.in_proj.weight, attn.in_proj.bias
        module = nn.MultiheadAttention(
            attn.embed_dim, attn.num_heads, dropout=attn.dropout, bias=bias is not None,
            batch_first=adapter.batch_first, device="meta", dtype=weight.dtype,
        )  # fmt: skip
        # The layer's parameters and out_proj in place of the placeholders made on "meta".
        module.in_proj_weight, module.in_proj_bias = weight, bias
        module.out_proj = attn.out_proj
        _carry_hooks(adapter, module, path)
        return module.train(adapter.training)

    model = _swap(model, TorchAttentionAdapter, _no_torch_equivalent, torch_module, verb="restore")
    _set_nested_tensor(model)
    return model


def _set_nested_tensor(model: nn.Module) -> None:
    # nn.TransformerEncoder's fast path feeds padded batches to the attention as nested
    # tensors, which the layer does not take: off while an encoder holds an adapter, then
    # back to the encoder's own setting.
    for module in model.modules():
        if not isinstance(module, nn.TransformerEncoder):
            continue
        if any(isinstance(m, TorchAttentionAdapter) for m in module.modules()):
            if not hasattr(module, "_use_nested_tensor_before_swap"):
                module._use_nested_tensor_before_swap = module.use_nested_tensor
            module.use_nested_tensor = False
        elif hasattr(module, "_use_nested_tensor_before_swap"):
            module.use_nested_tensor = module._use_nested_tensor_before_swap
            del module._use_nested_tensor_before_swap
