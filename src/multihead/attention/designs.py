"""Head designs by name, like backends: the interface (:class:`HeadDesign`), the registry
(:data:`DESIGNS`, :func:`register_design`, :func:`design_class`) and the steps that designs
share.

The layer runs the same steps for every design (``MultiHeadAttention.forward``): positions,
project, turn Q and K, cache, mask. A design changes what it must through the hooks of
:class:`HeadDesign`, each seeing the call (:class:`Call`): the projection
(:meth:`~HeadDesign.project`), the heads' attention (:meth:`~HeadDesign.attend`, or only the
formula, through the math kernel's hooks), how the heads become the output
(:meth:`~HeadDesign.merge`); and it refuses, when built, a layer it cannot work in
(:meth:`~HeadDesign.check`). ``docs/reuse.md`` teaches writing one.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import ClassVar, NamedTuple, Protocol

from torch import Tensor, nn

from multihead.attention.backends import attend
from multihead.attention.checks import closest_name
from multihead.attention.kv_cache import KVCache
from multihead.attention.masks import AttentionMask
from multihead.attention.positional import PositionalPart, tag_digest
from multihead.attention.projection import QKVProjection


class DesignBackendError(ValueError):
    """A head design's refusal of its layer's backend; ``backends``: those that run it."""

    def __init__(self, message: str, backends: tuple[str, ...]) -> None:
        super().__init__(message)
        self.backends = backends


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
            a design whose formula needs every key of the sentence says so
            (:attr:`HeadDesign.refuses_kv_cache`) and never gets one in self-attention.
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
    # Each head has an output of its own, which forward's head_mask scales; False: the
    # design mixes or pairs the heads after the scale would apply.
    takes_head_mask: ClassVar[bool] = True
    conversions: ClassVar[frozenset[str]] = frozenset()  # those of convert that keep it
    # The math kernel's hooks (backends.math_attention), for a design that changes the
    # formula: on_logits(scores) on the unmasked scores (B, H, L, S); on_weights(weights,
    # masked_scores, mask) on the weights before dropout. Either needs backend math (check).
    on_logits: Callable[[Tensor], Tensor] | None = None
    on_weights: Callable[[Tensor, Tensor, AttentionMask], Tensor] | None = None
    # Its formula needs every key of the sequence at once (e.g. the key length), which the
    # steps of cached decoding do not see: the layer refuses a self-attention KV cache,
    # naming it, and the Transformer's searches recompute the full prefix at each step.
    # An instance may set it from its options (sigmoid attention with n the key length).
    refuses_kv_cache: bool = False

    @property
    def options(self) -> dict[str, object]:
        """The options of its constructor that build it again (its keyword-only arguments;
        not its name, which the layer's ``head_config`` adds: :func:`design_arguments`)."""
        return {}

    @property
    def tag(self) -> str:
        """The part of the layer's ``head_tag`` it adds: ``-name``, and a digest of the
        options that differ from its constructor's defaults (:func:`options_digest`), so that
        runs of two settings get two run names. A design that spells its options in its own
        tag overrides this (``-moh-k2s1``)."""
        return f"-{self.name}{options_digest(self)}" if self.name else ""

    def check(self, layer: AttentionLayer) -> None:
        """Raise, naming the design, if it cannot work in ``layer`` (its backend, K/V heads,
        positions): the layer calls it once built. By default: the formula hooks need the
        ``math`` backend, the one that computes the formula written out."""
        hooks = [name for name in ("on_logits", "on_weights") if getattr(self, name) is not None]
        if hooks and layer.backend != "math":
            raise DesignBackendError(
                f"head design {self.name!r} runs on backend math only; got backend="
                f"{layer.backend!r}: it changes the formula through the math kernel's hooks "
                f"({', '.join(hooks)}), which only math computes",
                ("math",),
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
    check_options_property(cls)
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


def check_options_property(cls: type[HeadDesign]) -> None:
    """Refuse, when registered or loaded, a design whose constructor takes options of its
    own but whose ``options`` property is the interface's, which returns none of them: its
    ``head_config`` (checkpoints, conversions) and its tag would build and name it with
    their defaults, whatever it was built with."""
    own = list(_options(cls))
    if own and cls.options is HeadDesign.options:
        raise ValueError(
            f"head design {cls.name or cls.__name__!r} ({cls.__qualname__}) takes option "
            f"{', '.join(own)} but has no options property of its own; give it one that "
            f"returns them as built (e.g. {{{own[0]!r}: self.{own[0]}}})"
        )


def check_built_options(design: HeadDesign, given: dict[str, object]) -> None:
    """Refuse a design built from ``given`` options whose ``options`` property leaves out
    one of them set to other than its default: the layer's ``head_config`` would build it
    again with the default, and its tag would not tell the two apart. An option whose
    default is ``None`` (worked out from the layer, e.g. MLA's ``qk_head_dim``: ``D``) may
    be left out: the design leaves it out where it equals what ``None`` gives."""
    cls, reported = type(design), design.options
    defaults = _options(cls)
    lost = [
        k
        for k, v in given.items()
        if k not in reported and defaults.get(k) is not None and not _same(v, defaults.get(k))
    ]
    if lost:
        raise ValueError(
            f"head design {cls.name or cls.__name__!r} ({cls.__qualname__}): its options "
            f"property leaves out {', '.join(f'{k}={given[k]!r}' for k in lost)}, which is not "
            f"the default; it must return every option that changes what the layer computes"
        )


def _same(value: object, default: object) -> bool:
    if value is default:
        return True
    if isinstance(value, Tensor) or isinstance(default, Tensor):
        return False
    try:
        return bool(value == default)
    except (TypeError, ValueError):
        return False


def options_digest(design: HeadDesign, spelled: tuple[str, ...] = ()) -> str:
    """``"-"`` and six hex digits of a hash of ``design``'s options that differ from its
    constructor's defaults, leaving out those its tag already spells (``spelled``);
    ``""`` if none (a design at its defaults keeps its bare tag). Its own rotary options
    (MLA's ``rope_theta``, ...) are among them: they change what it computes. Stable across
    processes (:func:`~multihead.attention.positional.tag_digest`)."""
    defaults = _options(type(design))
    differ = {
        k: v
        for k, v in design.options.items()
        if k not in spelled and not _same(v, defaults.get(k, inspect.Parameter.empty))
    }
    return tag_digest(differ)


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
        check_options_property(cls)
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
        near = [(k, closest_name(k, takes)) for k in unknown]
        raise ValueError(
            f"head design {design!r} takes no option "
            + ", ".join(k + (f" (closest: {c})" if c else "") for k, c in near)
            + "; its options: "
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
