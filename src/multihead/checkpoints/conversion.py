"""K/V conversion of a trained checkpoint (scripts/convert_kv_heads.py): MHA to GQA/MQA/MLA.

Each attention sublayer in scope keeps its query heads and gets either ``num_kv_heads`` K/V
heads, each the mean of a group of the trained K/V projection heads, as in the GQA paper
(Ainslie et al., 2023; :func:`~multihead.attention.convert.with_kv_heads`), or a
K/V latent of ``kv_latent_dim`` numbers per token from a joint truncated SVD of its K/V
weights (TransMLA, MHA2MLA; :func:`~multihead.attention.convert.with_kv_latent`).
The converted checkpoint is then uptrained for a small fraction of the original steps.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from multihead.attention import MultiHeadAttention
from multihead.attention.convert import with_kv_heads, with_kv_latent
from multihead.checkpoints.io import load_trained_model, read_checkpoint, save_new, weights_only
from multihead.model.transformer import ATTENTION_SUBLAYERS, Transformer

# The GQA paper converts the decoder; "all" also converts the encoder self-attention.
SCOPES = {
    "decoder": ("decoder_self_attention", "cross_attention"),
    "all": ATTENTION_SUBLAYERS,
}


def resolve_scope(scope: str | Sequence[str]) -> tuple[str, ...]:
    """The attention kinds that ``scope`` names, in :data:`ATTENTION_SUBLAYERS` order.

    Args:
        scope: ``"decoder"`` (decoder self- and cross-attention), ``"all"``, one kind, or
            a list of kinds, e.g. ``["decoder_self_attention", "cross_attention"]``.
    """
    if isinstance(scope, str):
        if scope in SCOPES:
            return SCOPES[scope]
        names = [scope]
    else:
        names = [str(name) for name in scope] if isinstance(scope, Sequence) else []
    if not names or not set(names) <= set(ATTENTION_SUBLAYERS):
        accepted = f"{', '.join(SCOPES)}, or a list of {', '.join(ATTENTION_SUBLAYERS)}"
        raise ValueError(f"unknown scope {scope!r}; expected {accepted}")
    return tuple(kind for kind in ATTENTION_SUBLAYERS if kind in names)


def _target(num_kv_heads: int | None, kv_latent_dim: int | None) -> dict[str, int]:
    """The one conversion asked for, as ``{name: value}``; bad values raise, naming them."""
    asked = {
        k: v
        for k, v in (("num_kv_heads", num_kv_heads), ("kv_latent_dim", kv_latent_dim))
        if v is not None
    }
    if len(asked) != 1:
        raise ValueError(
            f"set exactly one of num_kv_heads and kv_latent_dim, got num_kv_heads={num_kv_heads}, "
            f"kv_latent_dim={kv_latent_dim}"
        )
    ((name, value),) = asked.items()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return asked


def layer_options(attn: MultiHeadAttention) -> dict[str, Any]:
    """The K/V and rotary options that rebuild a converted layer, as constructor keywords
    (read from what was built, its ``head_config``)."""
    options = {k: v for k, v in attn.head_config.items() if k not in ("kind", "num_heads")}
    if "interleaved" in options:  # the rotary part's name for rope_interleaved
        options["rope_interleaved"] = options.pop("interleaved")
    return options


def convert_model(
    model: Transformer,
    kinds: Sequence[str],
    *,
    num_kv_heads: int | None = None,
    kv_latent_dim: int | Mapping[str, int] | None = None,
    rope_dim: int | None = None,
    selection: str = "high",
) -> Transformer:
    """Replace the attention sublayers of ``kinds`` by their converted copies.

    Changes ``model`` in place and returns it.

    Args:
        kv_latent_dim: ``r`` for every kind, or ``{kind: r}``.
        rope_dim: with ``kv_latent_dim``, the rotated features each K/V group of a rotary
            sublayer keeps (partial RoPE, see
            :func:`~multihead.attention.convert.with_kv_latent`); ``None``: all of them.
        selection: which rotary pairs ``rope_dim`` keeps: ``"high"`` or ``"uniform"``.

    Raises:
        ValueError: ``num_kv_heads`` does not divide a sublayer's current K/V heads, a
            sublayer to give a latent has a head design, or ``kv_latent_dim`` misses a kind.
    """
    per_kind = kv_latent_dim if isinstance(kv_latent_dim, Mapping) else None
    if per_kind is not None and set(per_kind) != set(kinds):
        raise ValueError(
            f"kv_latent_dim names {sorted(per_kind)}; expected the kinds {list(kinds)}"
        )
    for kind in kinds:
        _target(num_kv_heads, kv_latent_dim if per_kind is None else per_kind[kind])
    if rope_dim is not None and kv_latent_dim is None:
        raise ValueError(f"rope_dim={rope_dim} is for kv_latent_dim (MLA), not num_kv_heads")
    layers = [(kind, path, attn) for kind, _, path, attn in model.attention_sublayers()]
    if rope_dim is not None and all(a.positions is None for k, _, a in layers if k in kinds):
        raise ValueError(f"rope_dim={rope_dim} needs rotary positions; none of {list(kinds)} has")
    for kind, path, attn in layers:
        if kind in kinds:
            if num_kv_heads:
                new = with_kv_heads(attn, num_kv_heads)
            else:
                r = kv_latent_dim if per_kind is None else per_kind[kind]
                rope = {} if attn.positions is None else {"rope_dim": rope_dim}
                new = with_kv_latent(attn, r, **rope, selection=selection)
            model.set_submodule(path, new)
            model.attention_config[kind].update(layer_options(new))
    return model


def convert_checkpoint(
    path: str | Path,
    num_kv_heads: int | None = None,
    scope: str | Sequence[str] = "decoder",
    *,
    kv_latent_dim: int | Mapping[str, int] | None = None,
    rope_dim: int | None = None,
    selection: str = "high",
) -> dict[str, Any]:
    """A checkpoint whose attention sublayers in ``scope`` have ``num_kv_heads`` K/V heads
    or a ``kv_latent_dim`` K/V latent.

    The result loads with :func:`~multihead.checkpoints.load_trained_model` and can
    initialise a new run; it keeps no optimiser, scheduler, loop or callback state, so it
    cannot resume one. ``ckpt["multihead"]["converted_from"]`` records the conversion.

    Args:
        path: a ``.ckpt`` written by ``scripts/train.py``.
        num_kv_heads: ``G``; must divide the current K/V heads of every converted sublayer.
        scope: see :func:`resolve_scope`.
        kv_latent_dim, rope_dim, selection: instead of ``num_kv_heads``, see
            :func:`convert_model`.
    """
    kinds = resolve_scope(scope)
    ckpt = read_checkpoint(path)
    model = load_trained_model(path).model
    before = {kind: cfg["num_kv_heads"] for kind, cfg in model.head_config.items()}
    convert_model(
        model, kinds, num_kv_heads=num_kv_heads, kv_latent_dim=kv_latent_dim,
        rope_dim=rope_dim, selection=selection,
    )  # fmt: skip
    target = (
        {"num_kv_heads": num_kv_heads}
        if kv_latent_dim is None
        else {"kv_latent_dim": dict(kv_latent_dim) if isinstance(kv_latent_dim, Mapping)
              else kv_latent_dim, "rope_dim": rope_dim, "selection": selection}
    )  # fmt: skip

    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    old_keys = {k for k in ckpt["state_dict"] if k.startswith("model.")}
    if num_kv_heads is not None and set(state) != old_keys:  # pooling changes shapes only
        raise RuntimeError(f"conversion changed the parameter names: {set(state) ^ old_keys}")
    converted = weights_only(ckpt)
    converted["state_dict"] = {
        **{k: v for k, v in ckpt["state_dict"].items() if not k.startswith("model.")},
        **state,
    }
    extra = dict(ckpt["multihead"])
    # The run config with the K/V settings of kinds, so that it rebuilds the result.
    extra["config"] = config = copy.deepcopy(extra["config"])
    attention = config["attention"]  # the one place heads are set
    built = {kind: layer_options(attn) for kind, _, _, attn in model.attention_sublayers()}
    for kind in kinds:
        attention[kind] = {**(attention.get(kind) or {}), **built[kind]}
    if set(kinds) == set(ATTENTION_SUBLAYERS) and num_kv_heads is not None:
        attention["num_kv_heads"] = num_kv_heads
    extra["converted_from"] = {
        "path": str(path),
        **target,
        "scope": list(kinds),
        "previous_num_kv_heads": {kind: before[kind] for kind in kinds},
        "layer_options": {kind: built[kind] for kind in kinds},
    }
    converted["multihead"] = extra
    return converted


def uptrain_overrides(ckpt_path: str | Path, out: str | Path, converted: dict) -> list[str]:
    """The ``scripts/train.py`` overrides that rebuild ``converted`` and start from ``out``.

    The original run's own overrides (:func:`recorded_overrides`), less the head options
    set here (each converted sublayer's :func:`layer_options`).
    """
    info = converted["multihead"]["converted_from"]
    kinds = info["scope"]
    heads: list[str] = []
    if set(kinds) == set(ATTENTION_SUBLAYERS) and "num_kv_heads" in info:
        heads.append(f"attention.num_kv_heads={info['num_kv_heads']}")
    for kind in kinds:  # "++": the rotary keys are not in the attention configs
        heads += [
            f"++attention.{kind}.{key}={json.dumps(value, separators=(',', ':'))}"
            for key, value in info["layer_options"][kind].items()
        ]
    # Also dropped: resuming (ckpt_path) and the old run directory (paths.output_dir).
    ours = {h.lstrip("+").split("=", 1)[0] for h in heads}
    return [*recorded_overrides(ckpt_path, ours), f"init_from={out}", *heads]


def recorded_overrides(ckpt_path: str | Path, drop: set[str] = frozenset()) -> list[str]:
    """The overrides of the run that wrote ``ckpt_path``, from ``<run dir>/.hydra/
    overrides.yaml`` (the checkpoint in ``<run dir>/checkpoints/`` or, averaged, in
    ``<run dir>/``; none when neither has the file), less ``hydra.*``, ``ckpt_path``,
    ``init_from``, ``paths.output_dir`` and the keys in ``drop``."""
    drop = {*drop, "ckpt_path", "init_from", "paths.output_dir"}
    here = Path(ckpt_path).resolve().parent
    for run_dir in (here.parent, here):
        recorded = run_dir / ".hydra" / "overrides.yaml"
        if recorded.is_file():
            overrides = [str(o) for o in OmegaConf.load(recorded)]
            return [
                o
                for o in overrides
                if o.lstrip("+~").split("=", 1)[0] not in drop
                and not o.lstrip("+~").startswith("hydra.")
            ]
    return []


def convert_kv_heads(
    ckpt: str | Path,
    num_kv_heads: int | None,
    out: str | Path,
    scope: str | Sequence[str] = "decoder",
    *,
    kv_latent_dim: int | Mapping[str, int] | None = None,
    rope_dim: int | None = None,
    selection: str = "high",
) -> tuple[Path, list[str]]:
    """Convert ``ckpt`` and save it to ``out`` (never overwritten).

    Returns:
        ``(out, overrides)``: the path written and the ``scripts/train.py`` overrides
        that uptrain from it (see :func:`uptrain_overrides`).

    Raises:
        FileExistsError: ``out`` exists.
    """
    if Path(out).exists():  # before the work; save_new checks again when writing
        raise FileExistsError(f"{out} already exists; choose a new out= path")
    converted = convert_checkpoint(
        ckpt, num_kv_heads, scope, kv_latent_dim=kv_latent_dim, rope_dim=rope_dim,
        selection=selection,
    )  # fmt: skip
    written = save_new(converted, out)
    return written, uptrain_overrides(ckpt, written, converted)
