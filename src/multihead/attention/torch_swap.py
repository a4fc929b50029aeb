"""Swap ``torch.nn.MultiheadAttention`` for :class:`MultiHeadAttention` inside any model.

:func:`replace_torch_attention` puts a :class:`TorchAttentionAdapter` wherever a model holds an
``nn.MultiheadAttention``. The adapter holds a :class:`MultiHeadAttention` with the same
weights (:meth:`MultiHeadAttention.from_torch`) and takes ``nn.MultiheadAttention``'s call, so
the code that calls it does not change. Then the layer's own features apply, GQA first:

    >>> import torch
    >>> from torch import nn
    >>> from multihead import replace_torch_attention
    >>> from multihead.attention import TorchAttentionAdapter
    >>> block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dropout=0.0, batch_first=True)
    >>> encoder = nn.TransformerEncoder(block, num_layers=2, enable_nested_tensor=False)
    >>> x = torch.randn(2, 5, 32)
    >>> before = encoder(x)
    >>> encoder = replace_torch_attention(encoder)
    >>> torch.allclose(encoder(x), before, atol=1e-5)
    True
    >>> for module in encoder.modules():  # 2 K/V heads for the 4 query heads
    ...     if isinstance(module, TorchAttentionAdapter):
    ...         module.attn = module.attn.with_kv_heads(2)
    >>> encoder.layers[0].self_attn.attn.num_kv_heads
    2
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.attention.convert import unsupported_torch_options
from multihead.attention.layer import MultiHeadAttention


class TorchAttentionAdapter(nn.Module):
    """``nn.MultiheadAttention``'s call around a :class:`MultiHeadAttention`.

    ``forward(query, key, value, key_padding_mask, need_weights, attn_mask,
    average_attn_weights, is_causal)`` means what it means for ``nn.MultiheadAttention`` and
    returns its ``(output, weights)`` tuple: sequence-first tensors unless ``batch_first``,
    unbatched ``(L, E)`` inputs, ``attn_mask`` of shape ``(L, S)`` or ``(B*H, L, S)``, bool
    (True = masked out) or float (added to the scores), masks of either kind for
    ``key_padding_mask``, weights ``(B, L, S)`` averaged over the heads or ``(B, H, L, S)``.
    ``is_causal`` is torch's hint that ``attn_mask`` is the causal mask: for self-attention
    the layer then applies its own causal mask, as torch's kernel does.

    A query row whose keys are all masked attends to nothing: zeros from the layer, where
    torch gives NaN when it computes the weights (``need_weights=True``, and the fast path
    of ``nn.TransformerEncoderLayer``).

    K and V come from one input here: ``key`` must be ``value``, as in every
    ``nn.Transformer*`` layer and vision transformer.

    Args:
        attn: the layer that computes the attention. Replace it (for example by
            ``adapter.attn.with_kv_heads(2)``) and the adapter calls the new one.
        batch_first: as ``nn.MultiheadAttention``'s: the caller's tensors are ``(B, L, E)``
            when True, ``(L, B, E)`` when False.
    """

    # nn.TransformerEncoderLayer's eval-mode fast path runs torch's fused kernel on
    # self_attn.in_proj_weight and in_proj_bias. The adapter has no such tensors (the layer's
    # projections are attn.in_proj and attn.out_proj, and after with_kv_heads not of torch's
    # shape): with these the encoder layer takes its regular path, which calls forward below.
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None

    def __init__(self, attn: MultiHeadAttention, *, batch_first: bool) -> None:
        super().__init__()
        self.attn = attn
        self.batch_first = batch_first

    @property
    def embed_dim(self) -> int:
        return self.attn.embed_dim

    @property
    def num_heads(self) -> int:
        return self.attn.num_heads

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
        if query.is_nested:
            raise ValueError(
                "got a nested tensor: nn.TransformerEncoder makes them on its fast path; "
                "call replace_torch_attention on the model that holds the encoder, which "
                "turns that path off (use_nested_tensor=False)"
            )
        if key is not value:
            raise ValueError(
                "key and value must be the same tensor: MultiHeadAttention projects K and V "
                "from one input"
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
            raise ValueError("is_causal on cross-attention needs the causal attn_mask itself")
        mask = None if causal else attn_mask
        if mask is not None and mask.dim() == 3:
            if mask.shape[0] != B * H:
                raise ValueError(
                    f"a 3-D attn_mask must be (B*H, L, S) = {(B * H, L, S)}, "
                    f"got {tuple(mask.shape)}"
                )
            mask = mask.reshape(B, H, L, S)  # torch's row b*H + h is (batch b, head h)
        if key_padding_mask is not None and key_padding_mask.is_floating_point():
            # A float padding mask is added to the scores, like a float attn_mask.
            padding = key_padding_mask[:, None, None, :].to(query.dtype)  # (B, 1, 1, S)
            mask = padding if mask is None else _additive(mask, query.dtype) + padding
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


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = masked out) as a float one: ``-inf`` where masked, else 0."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def replace_torch_attention(model: nn.Module, *, backend: str = "sdpa") -> nn.Module:
    """Replace every ``torch.nn.MultiheadAttention`` inside ``model`` by a
    :class:`TorchAttentionAdapter` holding ``MultiHeadAttention.from_torch(module, backend)``.

    The weights are the same, so the model computes what it did (within float rounding),
    and its code does not change. A module shared at several places gets one adapter,
    shared the same way. Parameter names change (``self_attn.in_proj_weight`` becomes
    ``self_attn.attn.in_proj.weight``); hooks on the old modules are not carried over.
    Every ``nn.TransformerEncoder`` that now holds an adapter has its nested-tensor fast
    path turned off (``use_nested_tensor = False``): that path feeds padded batches to the
    attention as nested tensors, which the layer does not take. Outputs at non-padded
    positions are unchanged; padded positions are computed instead of set to zero.

    Args:
        model: changed in place.
        backend: the kernel of the new layers (see :class:`MultiHeadAttention`).

    Returns:
        ``model``, or the adapter when ``model`` is itself an ``nn.MultiheadAttention``.

    Raises:
        ValueError: a module uses an option the layer cannot match (``kdim``/``vdim`` unequal
            to ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``); the message names the
            module's path. Nothing is replaced then.
    """
    found = {}  # id -> (path, module), the first path of each module
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.MultiheadAttention):
            found.setdefault(id(module), (path, module))
    for path, module in found.values():
        problem = unsupported_torch_options(module)
        if problem is not None:
            raise ValueError(f"cannot replace {path or 'the model'!r}: {problem}")

    adapters = {
        key: TorchAttentionAdapter(
            MultiHeadAttention.from_torch(module, backend), batch_first=module.batch_first
        ).train(module.training)
        for key, (_, module) in found.items()
    }
    if isinstance(model, nn.MultiheadAttention):
        return adapters[id(model)]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in adapters:
                setattr(parent, name, adapters[id(child)])
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
            isinstance(m, TorchAttentionAdapter) for m in module.modules()
        ):
            module.use_nested_tensor = False
    return model
