"""The module a family's converter builds: an HF attention module's call around the layer
(:class:`HFAttentionAdapter`), HF's cache as the layer sees one (:class:`CacheLayer`), and
the save map that keeps HF's names and layout (:class:`HFLayout`), with its helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor, nn

from multihead.attention import MultiHeadAttention
from multihead.integrations.huggingface.interface import layer_mask


class CacheLayer:
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

    @classmethod
    def of(cls, module: nn.Module, to_hf: Callable, from_hf: Callable) -> HFLayout:
        """The layout of HF's ``module`` (its class name, its ``state_dict``'s shapes) with
        the family's two maps."""
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        return cls(type(module).__name__, shapes, to_hf, from_hf)

    @classmethod
    def renaming(cls, module: nn.Module, prefixes: dict[str, str]) -> HFLayout:
        """The layout of a family whose weights are HF's as they are, under other names:
        ``prefixes`` maps each prefix of the adapter's names to HF's (:func:`renamed`)."""
        return cls.of(
            module,
            partial(renamed, prefixes=prefixes),
            partial(renamed, prefixes=inverse(prefixes)),
        )


def renamed(weights: dict[str, Tensor], prefixes: dict[str, str]) -> dict[str, Tensor]:
    """``weights`` with each name's prefix replaced by its entry in ``prefixes``; a name
    that starts with none raises ``KeyError``."""
    out = {}
    for name, tensor in weights.items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            raise KeyError(name)
        out[prefixes[prefix] + name[len(prefix) :]] = tensor
    return out


def inverse(prefixes: dict[str, str]) -> dict[str, str]:
    """``prefixes`` the other way: HF's prefixes to the adapter's."""
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

    # The adapter reads the mask HF builds for the model's implementation name, so the swap
    # sets that name to one of register()'s; False where the model builds its mask whatever
    # the name (BLOOM's eager one).
    reads_named_mask: ClassVar[bool] = True

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
            attn_mask=layer_mask(attention_mask),
            is_causal=attention_mask is None,  # HF's mask holds causality when there is one
            kv_cache=None if cache is None else CacheLayer(cache, self.layer_idx),
            position_ids=position_ids,
        )
        return self.resid_dropout(out), None


def _copy_into(ours: nn.Parameter, theirs: Tensor) -> None:
    """``ours`` := ``theirs``, frozen if it is."""
    with torch.no_grad():
        ours.copy_(theirs)
    ours.requires_grad_(theirs.requires_grad)


def load_hf(adapter: HFAttentionAdapter, module: nn.Module) -> None:
    """The adapter's parameters := ``module``'s weights read through the adapter's layout
    (:meth:`HFLayout.from_hf`), frozen where HF's are; a parameter the adapter holds as the
    module's own object (the Llama family's projections) stays as it is."""
    for name, theirs in adapter.layout.from_hf(module.state_dict(keep_vars=True)).items():
        ours = adapter.get_parameter(name)
        if ours is not theirs:
            _copy_into(ours, theirs)
