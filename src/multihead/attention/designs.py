"""Head designs by name, like backends: the interface (:class:`HeadDesign`), the registry
(:data:`DESIGNS`, :func:`register_design`) and the steps that every design shares.

A design replaces steps of the layer's forward (:meth:`HeadDesign.attend`,
:meth:`HeadDesign.mix`) or writes the whole of it (:meth:`HeadDesign.attention`) from the
layer's parts (:class:`AttentionLayer`) and the shared steps here, and declares what it works
with, which the layer checks when built. ``docs/reuse.md`` teaches writing one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ClassVar, Protocol

from torch import Tensor, nn

from multihead.attention.backends import attend
from multihead.attention.kv_cache import CacheLayout, KVCache
from multihead.attention.masks import AttentionMask, build_attention_mask
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


Kernel = Callable[..., tuple[Tensor, Tensor | None]]


class HeadDesign(nn.Module):
    """The interface of a head design; the defaults are the plain layer's."""

    name: ClassVar[str] = ""  # its registry name: "moh", "talking_heads", "mla", ...
    attribute: ClassVar[str] = ""  # where the layer holds it: its state_dict keys' prefix
    kind: ClassVar[str | None] = None  # head_config["kind"] if not mha/gqa/mqa: MLA's "mla"
    # An option that selects it without design= (the layer's older keywords: top_k_heads).
    selected_by: ClassVar[str | None] = None
    replaces_forward: ClassVar[bool] = False  # attention() is the layer's forward with it
    seams: ClassVar[frozenset[str]] = frozenset({"rotate", "score_bias"})  # positional seams
    backends: ClassVar[frozenset[str] | None] = None  # those it runs on; None: every one
    any_kv_heads: ClassVar[bool] = True  # it works with num_kv_heads < num_heads (GQA, MQA)
    projects_kv: ClassVar[bool] = True  # in_proj projects K, V (MLA's come from its latent)
    head_mask: ClassVar[bool] = True  # it takes a head_mask: each head has its own output
    conversions: ClassVar[frozenset[str]] = frozenset()  # those of convert that keep it
    # Its own attend() returns the weights that multiply V, so head analysis may rebuild
    # each head's output from them (talking heads).
    weights_are_final: ClassVar[bool] = False
    aux_loss: Tensor | None = None  # an auxiliary loss of the last training-mode call
    has_positions: bool = False  # it places Q and K itself (MLA's decoupled rotary key)
    active_head_fraction: float = 1.0  # of the H heads, those computed for each token

    @property
    def options(self) -> dict[str, object]:
        """The layer's constructor arguments that build this design (besides its name)."""
        return {}

    @property
    def tag(self) -> str:
        """The part of the layer's ``head_tag`` it adds."""
        return f"-{self.name}" if self.name else ""

    def cache_layout(self, layer: AttentionLayer) -> CacheLayout:
        """What the layer's KV cache holds per position."""
        return CacheLayout(layer.num_kv_heads, layer.head_dim, shared_kv=False)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, kernel: Kernel
    ) -> tuple[Tensor, Tensor | None]:
        """The heads ``(B, H, L, D)`` and weights: ``kernel(q, k, v, mask, **hooks)`` (the
        layer's :func:`kernel_of`), with hooks if the design changes the formula."""
        return kernel(q, k, v, mask)

    def mix(self, heads: Tensor) -> Tensor:
        """``heads`` ``(B, L, H, D)`` as they enter ``W^O``."""
        return heads

    def head_outputs(self, layer: AttentionLayer, weights: Tensor, source: Tensor) -> Tensor:
        """Each head's output as it enters ``W^O``, ``(B, H, L, D)``, from the attention
        weights ``(B, H, L, S)`` and the keys' source ``(B, S, E)``: what head analysis reads.
        Weights times V, refused where that would be wrong: a design that writes its own
        forward or :meth:`attend` (unless ``weights_are_final``) overrides this."""
        own_attend = type(self).attend is not HeadDesign.attend and not self.weights_are_final
        if self.replaces_forward or own_attend:
            raise ValueError(
                f"head design {self.name!r} gives no per-head outputs (HeadDesign.head_outputs) "
                "for head analysis"
            )
        heads = weights_times_values(layer, weights, source)  # (B, H, L, D)
        return self.mix(heads.transpose(1, 2)).transpose(1, 2)

    def attention(
        self, layer: AttentionLayer, query: Tensor, key_value: Tensor | None, *,
        kv_cache: KVCache | None = None, need_weights: bool = False,
        head_mask: Tensor | None = None, position_ids: Tensor | None = None, **masks,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """The layer's forward with this design (``replaces_forward``): the arguments and
        result of ``MultiHeadAttention.forward``, ``key_value`` ``None`` for self-attention;
        ``masks`` (``key_padding_mask``, ``attn_mask``, ``is_causal``) go to
        :func:`make_mask`."""
        raise NotImplementedError(f"design {self.name!r} changes steps of the layer's forward")


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
def make_mask(
    q: Tensor, k: Tensor, kv_cache: KVCache | None = None, *, num_heads: int,
    score_bias: Tensor | None = None, key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None, is_causal: bool = False,
) -> AttentionMask:  # fmt: skip
    """The caller's masks (and a positional ``score_bias`` ``(B or 1, H, L, S)``) for
    queries ``q`` ``(B, ·, L, ·)`` and keys ``k`` ``(B, ·, S, ·)``, in the kernels' form
    (:func:`~.masks.build_attention_mask`). With a static ``kv_cache`` the keys are its
    whole buffers: the positions it hides (:meth:`KVCache.hide_unwritten`) join ``attn_mask``."""
    if kv_cache is not None and kv_cache.static:
        attn_mask, is_causal = kv_cache.hide_unwritten(attn_mask, q.shape[2], is_causal)
    return build_attention_mask(
        key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
        batch_size=q.shape[0], num_heads=num_heads, q_len=q.shape[2], kv_len=k.shape[2],
        dtype=q.dtype, device=q.device, score_bias=score_bias,
    )  # fmt: skip


def kernel_of(layer: AttentionLayer, need_weights: bool, scale: float | None = None) -> Kernel:
    """:func:`~.backends.attend` with the layer's backend, dropout (training mode only) and
    scale (``scale``: a design's own, e.g. MLA's wider scores): ``kernel(q, k, v, mask)``.

    ``kernel(q, k, v, mask, on_logits=..., on_weights=...)``, a design changing the formula
    through the math kernel's hooks, runs on a layer with ``backend="math"`` only: on any
    other it raises, rather than run the math path while the layer reports its backend.
    """
    run = functools.partial(
        attend, backend=layer.backend, dropout_p=layer.dropout if layer.training else 0.0,
        scale=layer.scale if scale is None else scale, need_weights=need_weights,
    )  # fmt: skip

    def kernel(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, **hooks):
        if hooks and layer.backend != "math":
            design = getattr(layer, "design", None)
            name = getattr(design, "name", "") or type(design).__name__
            raise ValueError(
                f"head design {name!r} changes the formula through the math kernel's hooks "
                f"({', '.join(sorted(hooks))}), which backend {layer.backend!r} does not "
                "compute; build the layer with backend='math' (and declare backends = "
                "frozenset({'math'}) on the design, so that other backends are refused when "
                "it is built)"
            )
        return run(q, k, v, mask, **hooks)

    return kernel


def weights_times_values(layer: AttentionLayer, weights: Tensor, source: Tensor) -> Tensor:
    """``weights`` ``(B, H, L, S)`` times the V heads of ``source`` ``(B, S, E)``, each K/V
    head repeated for its group: ``(B, H, L, D)``."""
    _, v = layer.in_proj.kv(source)  # (B, G, S, D)
    return weights @ v.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1)


def merge_heads(heads: Tensor) -> Tensor:
    """Heads ``(B, H, L, D)`` concatenated, ``(B, L, H*D)``, as they enter ``W^O``."""
    B, H, L, D = heads.shape
    return heads.transpose(1, 2).reshape(B, L, H * D)


def scale_heads(heads: Tensor, head_mask: Tensor | None) -> Tensor:
    """``heads`` ``(B, H, L, ·)`` each scaled by its entry of ``head_mask`` ``(H,)``
    (Michel et al., NeurIPS 2019: 0 removes a head; a ones tensor that requires grad gives
    each head's importance as the gradient of the loss with respect to it)."""
    if head_mask is None:
        return heads
    return heads * head_mask.to(heads.dtype).view(1, -1, 1, 1)
