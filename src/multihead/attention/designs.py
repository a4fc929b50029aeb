"""Head designs by name, like backends: the interface (:class:`HeadDesign`), the registry
(:data:`DESIGNS`, :func:`register_design`, :func:`design_class`) and the steps that every
design shares.

A design replaces steps of the layer's forward (:meth:`HeadDesign.attend`,
:meth:`HeadDesign.mix`) or writes the whole of it (:meth:`HeadDesign.attention`) from the
layer's parts (:class:`AttentionLayer`) and the shared steps here, and declares what it works
with, which the layer checks when built. ``docs/reuse.md`` teaches writing one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import ClassVar, Protocol

import torch
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
        """The options of its constructor that build it again (its keyword-only arguments;
        not its name, which the layer's ``head_config`` adds: :func:`design_arguments`)."""
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
# The entry-point group in which an installed package declares its designs, each by name:
# [project.entry-points."multihead.designs"] my_design = "my_pkg.module:MyDesign".
ENTRY_POINT_GROUP = "multihead.designs"
# The designs loaded from outside the registry, and the name that loaded them: an import
# path or an entry point's, which a fresh process resolves again (a name the design's module
# registers it under when imported does not).
_LOADED_AS: dict[type[HeadDesign], str] = {}


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


def check_design(design: HeadDesign) -> None:
    """Refuse a built design that its layer's ``head_config`` would not build again (as
    :func:`~multihead.attention.convert.rebuild` does): one without an ``attribute``, or whose
    ``options`` name what its constructor does not take or leave out what it needs."""
    check_attribute(design)
    cls, options = type(design), design.options
    takes = _options(cls)
    unknown = sorted(set(options) - set(takes))
    missing = [k for k in _required(cls) if k not in options]
    if unknown or missing:
        what = (
            f"names {', '.join(unknown)}, which its constructor does not take"
            if unknown
            else f"leaves out {', '.join(missing)}, which its constructor needs"
        )
        raise ValueError(
            f"head design {cls.name or cls.__name__!r} ({cls.__qualname__}): its options "
            f"property {what}; it returns the keyword-only arguments that build it again "
            f"(its constructor's: {', '.join(takes) or 'none'})"
        )


def _options(cls: type[HeadDesign]) -> dict[str, object]:
    """A design's own options and their defaults (``inspect.Parameter.empty``: required)."""
    params = inspect.signature(cls.__init__).parameters.values()
    skip = ("bias", "device", "dtype")
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name not in skip}


def _required(cls: type[HeadDesign]) -> list[str]:
    return [k for k, v in _options(cls).items() if v is inspect.Parameter.empty]


def design_class(design: str) -> type[HeadDesign]:
    """The design class that ``design`` names: a name in :data:`DESIGNS`, a name that an
    installed package declares in the entry-point group :data:`ENTRY_POINT_GROUP` (loaded and
    registered when first asked for), or an import path, ``"my_pkg.module.MyDesign"``.

    Raises:
        ValueError: nothing of that name, a path that cannot be imported, or one that names
            something other than a :class:`HeadDesign` subclass.
    """
    if not isinstance(design, str):
        raise ValueError(
            f"design must be a name, an import path or a HeadDesign instance, got {design!r}"
        )
    if design in DESIGNS:
        return DESIGNS[design]
    loaded = [cls for cls, name in _LOADED_AS.items() if name == design]
    if loaded:  # a path loaded before (an entry point's is registered): no metadata scan
        return loaded[0]
    found = entry_points(group=ENTRY_POINT_GROUP, name=design)
    if found:
        entry = next(iter(found))
        try:
            cls = entry.load()
        except Exception as err:  # whatever the package raises while imported
            where = f"entry point {entry.value!r} of group {ENTRY_POINT_GROUP!r}"
            raise _import_error(design, where, err) from None
        cls = register_design(design, _design_subclass(design, cls))
        _LOADED_AS.setdefault(cls, design)
        return cls
    if "." in design and all(part.isidentifier() for part in design.split(".")):
        known = list(DESIGNS.values())  # those registered before the import, the package's
        cls = _design_subclass(design, _import_path(design))
        check_attribute(cls)
        if not any(cls is registered for registered in known):  # else its name rebuilds it
            _LOADED_AS.setdefault(cls, design)
        return cls
    raise ValueError(
        f"unknown head design {design!r}; registered: {', '.join(DESIGNS)}; or an import path "
        f"(my_pkg.module.MyDesign), or a name that an installed package declares in "
        f"entry-point group {ENTRY_POINT_GROUP!r}"
    )


def _import_path(path: str) -> object:
    """The object at ``path``: its longest prefix that is a module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is not None and (module == err.name or module.startswith(err.name + ".")):
                continue  # no such module: a shorter prefix may be one
            raise _import_error(path, f"module {module}", err) from None
        except Exception as err:  # whatever the user's module raises while imported
            raise _import_error(path, f"module {module}", err) from None
        for j, part in enumerate(parts[i:], start=i):
            if not hasattr(found, part):
                raise ValueError(
                    f"head design {path!r}: {'.'.join(parts[:j])} has no attribute {part!r}"
                )
            found = getattr(found, part)
        return found
    raise ValueError(
        f"head design {path!r}: no module {parts[0]!r} to import it from (is its directory "
        "on PYTHONPATH, or its package installed?)"
    )


def _import_error(design: str, what: str, err: Exception) -> ValueError:
    first = (str(err).splitlines() or [""])[0]
    return ValueError(
        f"head design {design!r}: importing {what} failed: {type(err).__name__}: {first}"
    )


def _design_subclass(design: str, found: object) -> type[HeadDesign]:
    if not (isinstance(found, type) and issubclass(found, HeadDesign)):
        raise ValueError(f"head design {design!r} is {found!r}, not a HeadDesign subclass")
    return found


def design_reference(cls: type[HeadDesign]) -> str:
    """The string that builds ``cls`` again (:func:`design_class`): the import path or
    entry point's name it was loaded by, else its name in :data:`DESIGNS`, else
    ``"module.QualName"``."""
    if cls in _LOADED_AS:
        return _LOADED_AS[cls]
    names = [name for name, registered in DESIGNS.items() if registered is cls]
    return names[0] if names else f"{cls.__module__}.{cls.__qualname__}"


def design_arguments(design: HeadDesign | None) -> dict[str, object]:
    """The layer's constructor arguments that build ``design`` again: ``design`` (its name,
    or the import path it was loaded by) and its :attr:`~HeadDesign.options`; ``{}`` for
    none."""
    if design is None:
        return {}
    return {"design": design_reference(type(design)), **design.options}


def resolve_design(
    design: str | HeadDesign | None, options: dict[str, object]
) -> tuple[type[HeadDesign] | HeadDesign | None, dict[str, object]]:
    """The design class ``design`` names (:func:`design_class`), or the instance it is, and
    its ``options``: the keyword-only arguments of its constructor, given only with a name;
    one given as ``None`` is left out (its default), as a config's ``null`` means unset.

    Raises:
        ValueError: an unknown name or path, options without a design name, options the
            design does not take, or leaves out.
    """
    options = {k: v for k, v in options.items() if v is not None}
    if design is None or isinstance(design, HeadDesign):
        if options:
            which = "an instance, built with its own" if design is not None else "no design"
            raise ValueError(
                f"options {', '.join(sorted(options))} are a head design's, and design= names "
                f"{which}; give them with the design's name, e.g. design='moh', top_k_heads=2 "
                f"(registered: {', '.join(DESIGNS)})"
            )
        return design, {}
    cls = design_class(design)
    takes = _options(cls)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ValueError(
            f"head design {design!r} takes no option {', '.join(unknown)}; its options: "
            + (", ".join(takes) or "none")
        )
    missing = [k for k in _required(cls) if k not in options]
    if missing:
        raise ValueError(
            f"head design {design!r} needs option {', '.join(missing)}; its options: "
            + ", ".join(takes)
        )
    return cls, options


# --------------------------------------------------------------------------- shared steps
def new_positions(
    kv_cache: KVCache | None, length: int, device: torch.device, position_ids: Tensor | None
) -> Tensor:
    """The positions of ``length`` new tokens: ``position_ids`` ``(L,)`` or ``(B, L)`` if
    given (a left-padded batch), else those after the positions in ``kv_cache``."""
    if position_ids is not None:
        return position_ids
    start = 0 if kv_cache is None else kv_cache.position if kv_cache.static else kv_cache.size
    return start + torch.arange(length, device=device)  # (L,)


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
