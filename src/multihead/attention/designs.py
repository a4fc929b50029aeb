"""Head designs by name, like backends: the interface (:class:`HeadDesign`), the registry
(:data:`DESIGNS`, :func:`register_design`) and the steps that designs share.

The layer runs the same steps for every design (``MultiHeadAttention.forward``): positions,
project, turn Q and K, cache, mask. A design changes what it must through the hooks of
:class:`HeadDesign`, each seeing the call (:class:`Call`): the projection
(:meth:`~HeadDesign.project`), the heads' attention (:meth:`~HeadDesign.attend`, or only the
formula, through the math kernel's hooks), how the heads become the output
(:meth:`~HeadDesign.merge`); and it refuses, when built, a layer it cannot work in
(:meth:`~HeadDesign.check`). ``docs/reuse.md`` teaches writing one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ClassVar, NamedTuple, Protocol

from torch import Tensor, nn

from multihead.attention.backends import attend
from multihead.attention.kv_cache import KVCache
from multihead.attention.masks import AttentionMask
from multihead.attention.positional import PositionalPart
from multihead.attention.projection import QKVProjection


class AttentionLayer(Protocol):
    """What a design reads of the layer that holds it (``MultiHeadAttention``)."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dropout: float
    backend: str
    scale: float
    training: bool
    in_proj: QKVProjection
    out_proj: nn.Linear
    positions: PositionalPart | None
    design: HeadDesign | None


class Call(NamedTuple):
    """One call of the layer, as a design's hooks see it.

    Attributes:
        layer: the layer (its parts ``in_proj``, ``out_proj``, ``positions``; its sizes).
        query: the layer's input ``(B, L, E)``.
        kv_cache: the call's cache, or ``None`` (a full pass). With one the queries are the
            last ``L`` of the keys (cached decoding: each step sees only the keys so far);
            a design whose formula needs every key of the sentence refuses it, naming itself.
        positions: the queries' positions ``(L,)`` or ``(B, L)`` in self-attention (the
            call's ``position_ids``, else those after the cache's); ``None`` in
            cross-attention, whose queries and keys are positions of two sentences.
        head_mask: ``(H,)``, the scale on each head's output, or ``None``.
        need_weights: the caller asked for the weights ``(B, H, L, S)``.
    """

    layer: AttentionLayer
    query: Tensor
    kv_cache: KVCache | None
    positions: Tensor | None
    head_mask: Tensor | None
    need_weights: bool

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """:func:`~.backends.attend`, the heads ``(B, H, L, D)`` and the weights if asked
        for, by the layer's backend, dropout (training mode only) and scale (``scale``: a
        design's own, e.g. MLA's wider scores), with the design's formula hooks if it has
        them (:attr:`HeadDesign.on_logits`, :attr:`HeadDesign.on_weights`)."""
        layer, design = self.layer, self.layer.design
        return attend(
            q, k, v, mask, backend=layer.backend, dropout_p=layer.dropout * layer.training,
            scale=layer.scale if scale is None else scale, need_weights=self.need_weights,
            on_logits=design.on_logits, on_weights=design.on_weights,
        )  # fmt: skip


class HeadDesign(nn.Module):
    """The interface of a head design: a name, what builds it, and hooks whose defaults are
    the plain layer's steps.

    Members that serve one design live in that design; the layer reads them where a design
    has them: ``kind`` (``head_config``'s, instead of mha/gqa/mqa), ``widths(embed_dim,
    num_heads, options)`` (a static method: the width ``Q`` is projected from, the width of
    each Q/K head and of each V head, and whether ``in_proj`` projects K and V; read before
    the design is built, from its options), ``cache_layout`` (what the KV cache holds per
    position), ``has_positions`` (it places Q and K itself), ``aux_loss`` (an auxiliary loss
    of the last training-mode call), ``active_head_fraction`` (of the ``H`` heads, those
    computed for each token) and ``at_depth(depth)``, which a model stacking layers calls
    with the layer's depth in its stack (0 first) before training.
    """

    name: ClassVar[str] = ""  # its registry name: "moh", "talking_heads", "mla", ...
    attribute: ClassVar[str] = ""  # where the layer holds it: its state_dict keys' prefix
    # An option that selects it without design= (the layer's older keywords: top_k_heads).
    selected_by: ClassVar[str | None] = None
    # Each head has an output of its own, which forward's head_mask scales; False: the
    # design mixes or pairs the heads after the scale would apply.
    takes_head_mask: ClassVar[bool] = True
    conversions: ClassVar[frozenset[str]] = frozenset()  # those of convert that keep it
    # The math kernel's hooks (backends.math_attention), for a design that changes the
    # formula: on_logits(scores) on the unmasked scores (B, H, L, S); on_weights(weights,
    # masked_scores, mask) on the weights before dropout. Either needs backend math (check).
    on_logits: Callable[[Tensor], Tensor] | None = None
    on_weights: Callable[[Tensor, Tensor, AttentionMask], Tensor] | None = None

    @property
    def options(self) -> dict[str, object]:
        """The layer's constructor arguments that build this design (besides its name)."""
        return {}

    @property
    def tag(self) -> str:
        """The part of the layer's ``head_tag`` it adds."""
        return f"-{self.name}" if self.name else ""

    def check(self, layer: AttentionLayer) -> None:
        """Raise, naming the design, if it cannot work in ``layer`` (its backend, K/V heads,
        positions): the layer calls it once built. By default: the formula hooks need the
        ``math`` backend, the one that computes the formula written out."""
        hooks = [name for name in ("on_logits", "on_weights") if getattr(self, name) is not None]
        if hooks and layer.backend != "math":
            raise ValueError(
                f"head design {self.name!r} runs on backend math only; got backend="
                f"{layer.backend!r}: it changes the formula through the math kernel's hooks "
                f"({', '.join(hooks)}), which only math computes"
            )

    def project(
        self, source: Tensor | None, call: Call
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Q ``(B, H, L, D)`` of ``call.query``, and K, V ``(B, G, S, D)`` of ``source``
        ``(B, S, E)``: the query itself (self-attention) or the memory; ``None``: the cache
        holds the memory's already, and K, V are ``None``. A V of ``None`` beside a K means
        one tensor for both, cached once (MLA's latent)."""
        in_proj, query = call.layer.in_proj, call.query
        if source is query:
            return in_proj.qkv(query)  # one GEMM for the three
        return in_proj.q(query), *((None, None) if source is None else in_proj.kv(source))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor | None, mask: AttentionMask, call: Call
    ) -> tuple[object, Tensor | None]:
        """The heads ``(B, H, L, D)`` (in the form :meth:`merge` takes) and the weights
        ``(B, H, L, S)`` if ``call.need_weights``, of what :meth:`project` gave (after the
        layer's positions and cache) and the layer's mask."""
        return call.attend(q, k, v, mask)

    def merge(self, heads: Tensor, call: Call) -> Tensor:
        """The layer's output ``(B, L, E)``: each head scaled by ``call.head_mask``, the heads
        side by side, ``W^O``."""
        if call.head_mask is not None:
            heads = scale_heads(heads, call.head_mask)
        return call.layer.out_proj(merge_heads(heads))

    def head_outputs(self, layer: AttentionLayer, weights: Tensor, source: Tensor) -> Tensor:
        """Each head's output as it enters ``W^O``, ``(B, H, L, D)``, from the attention
        weights ``(B, H, L, S)`` and the keys' source ``(B, S, E)``: what head analysis reads.
        Weights times V, refused where that would be wrong: a design with its own
        :meth:`project`, :meth:`attend` or :meth:`merge` overrides this."""
        steps = ("project", "attend", "merge")
        if any(getattr(type(self), n) is not getattr(HeadDesign, n) for n in steps):
            raise ValueError(
                f"head design {self.name!r} gives no per-head outputs (HeadDesign.head_outputs) "
                "for head analysis"
            )
        return weights_times_values(layer, weights, source)


DESIGNS: dict[str, type[HeadDesign]] = {}


def register_design(name: str, cls: type[HeadDesign]) -> type[HeadDesign]:
    """Add ``cls`` to :data:`DESIGNS` under ``name`` (replacing one of that name): from then
    on ``MultiHeadAttention(..., design=name)`` and the configs' ``design: name`` build it."""
    if not (isinstance(cls, type) and issubclass(cls, HeadDesign)):
        raise TypeError(f"register_design needs a HeadDesign subclass, got {cls!r}")
    check_attribute(cls)
    DESIGNS[name] = cls
    return cls


def check_attribute(design: type[HeadDesign] | HeadDesign) -> None:
    """Refuse a design without an ``attribute``: the layer holds it under that name (its
    ``state_dict`` keys' prefix), and an empty one fails deep in ``add_module``."""
    attribute = design.attribute
    if not (isinstance(attribute, str) and attribute.isidentifier()):
        cls = design if isinstance(design, type) else type(design)
        raise ValueError(
            f"head design {cls.name or cls.__name__!r} ({cls.__qualname__}) needs a class "
            f"attribute `attribute`, the name the layer holds it under (a Python identifier, "
            f"e.g. attribute = {(cls.name or 'my_design')!r}); got {attribute!r}"
        )


def _options(cls: type[HeadDesign]) -> dict[str, object]:
    """A design's own options and their defaults (``None`` for a required one)."""
    params = inspect.signature(cls.__init__).parameters.values()
    skip = ("bias", "device", "dtype")
    return {
        p.name: None if p.default is p.empty else p.default
        for p in params
        if p.kind is p.KEYWORD_ONLY and p.name not in skip
    }


def design_options() -> dict[str, object]:
    """The keys a config may give the layer for its design, each ``None`` (unset)."""
    return {"design": None, "head_mixing": None} | {
        name: None for cls in DESIGNS.values() for name in _options(cls)
    }


def resolve_design(
    design: str | HeadDesign | None, options: dict[str, object]
) -> tuple[type[HeadDesign] | HeadDesign | None, dict[str, object]]:
    """The design class ``design`` names (or the instance it is) and its options. An option
    that is ``None``, or off (its design's default of 0 or False: ``num_shared_heads=0``),
    is left out, so a config may give every key to every layer; with no name, the design
    that an option selects (``selected_by``), or ``None``.

    Raises:
        ValueError: an unknown name, options of no design or of two, options the design
            does not take.
    """
    off = {k for c in DESIGNS.values() for k, v in _options(c).items() if v in (0, False)}
    options = {k: v for k, v in options.items() if not (v is None or k in off and v in (0, False))}
    if "head_mixing" in options:  # the layer's older keyword naming a mixing
        if design is not None:
            raise ValueError(f"head_mixing={options['head_mixing']!r} and design={design!r}")
        design = options.pop("head_mixing")
    if design is None and options:
        chosen = sorted({n for n, c in DESIGNS.items() if c.selected_by in options})
        if len(chosen) != 1:
            which = f"select head designs {chosen}" if chosen else "select no head design"
            raise ValueError(
                f"options {sorted(options)} {which}; a layer has one, named by design= "
                f"(registered: {', '.join(DESIGNS)})"
            )
        design = chosen[0]
    if design is None or isinstance(design, HeadDesign):
        if options:
            raise ValueError(f"options {sorted(options)} need a design name, not an instance")
        return design, {}
    if design not in DESIGNS:
        raise ValueError(f"unknown head design {design!r}; registered: {', '.join(DESIGNS)}")
    unknown = sorted(set(options) - set(_options(DESIGNS[design])))
    if unknown:
        raise ValueError(
            f"head design {design!r} takes no option {', '.join(unknown)}; its options: "
            + ", ".join(_options(DESIGNS[design]))
        )
    return DESIGNS[design], options


# --------------------------------------------------------------------------- shared steps
def weights_times_values(layer: AttentionLayer, weights: Tensor, source: Tensor) -> Tensor:
    """``weights`` ``(B, H, L, S)`` times the V heads of ``source`` ``(B, S, E)``, each K/V
    head repeated for its group: ``(B, H, L, D)``."""
    _, v = layer.in_proj.kv(source)  # (B, G, S, D)
    return weights @ v.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1)


def merge_heads(heads: Tensor) -> Tensor:
    """Heads ``(B, H, L, D)`` concatenated, ``(B, L, H*D)``, as they enter ``W^O``."""
    B, H, L, D = heads.shape
    return heads.transpose(1, 2).reshape(B, L, H * D)


def scale_heads(heads: Tensor, head_mask: Tensor) -> Tensor:
    """``heads`` ``(B, H, L, ·)`` each scaled by its entry of ``head_mask`` ``(H,)``
    (Michel et al., NeurIPS 2019: 0 removes a head; a ones tensor that requires grad gives
    each head's importance as the gradient of the loss with respect to it)."""
    return heads * head_mask.to(heads.dtype).view(1, -1, 1, 1)
