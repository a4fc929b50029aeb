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
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from multihead.attention import MultiHeadAttention
from multihead.attention.convert import rotary_index, with_kv_heads, with_kv_latent
from multihead.checkpoints.io import load_trained_model, read_checkpoint, save_new, weights_only
from multihead.model.transformer import ATTENTION_SUBLAYERS, Transformer, sublayer_config

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


def _target(
    num_kv_heads: int | None, kv_latent_dim: int | None,
    names: tuple[str, str] = ("num_kv_heads", "kv_latent_dim"),
) -> dict[str, int]:  # fmt: skip
    """The one conversion asked for, as ``{name: value}``; bad values raise, naming them."""
    asked = {
        k: v for k, v in zip(names, (num_kv_heads, kv_latent_dim), strict=True) if v is not None
    }
    if len(asked) != 1:
        raise ValueError(
            f"set exactly one of {names[0]} and {names[1]}, got {names[0]}={num_kv_heads}, "
            f"{names[1]}={kv_latent_dim}"
        )
    ((name, value),) = asked.items()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {name}={value}")
    return asked


def convert_attention(
    model: nn.Module, *, kv_heads: int | None = None, kv_latent: int | None = None,
    rope_dim: int | None = None, selection: str = "high", calibration: Any = None,
    scope: str | Sequence[str] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Convert every attention layer of ``model`` in place: to ``kv_heads`` pooled K/V heads
    (:func:`~multihead.attention.convert.with_kv_heads`) or to a ``kv_latent`` K/V latent
    (:func:`~multihead.attention.convert.with_kv_latent`, rotary layers keeping ``rope_dim``
    rotated features per K/V group, chosen by ``selection``).

    ``model``: our :class:`Transformer` (the sublayers of ``scope``, default ``"decoder"``, see
    :func:`resolve_scope`; its ``attention_config`` rewritten so that it rebuilds the result),
    or any model whose layers are :class:`MultiHeadAttention` (swapped by
    ``replace_torch_attention`` or ``replace_hf_attention``: all of them; an HF model keeps
    generating, its cache holding each layer's latent). ``calibration``: the model's inputs,
    called as ``model(*calibration)`` (a tuple), ``model(**calibration)`` (a mapping) or
    ``model(calibration)``; each layer's inputs on it choose ``selection="norm"``'s pairs and
    measure the errors below.

    Returns:
        Per layer: ``layer`` (its path), ``bytes_before`` and ``bytes_after`` (KV cache bytes
        per token, fp32), and with ``calibration``, ``k_error`` and ``v_error``: the relative
        Frobenius error of K and V (per query head, before RoPE and without biases, which
        move exactly) on the layer's calibration inputs.
    """
    return _convert(
        model, kv_heads, kv_latent, rope_dim=rope_dim, selection=selection,
        calibration=calibration, scope=scope, names=("kv_heads", "kv_latent"),
    )  # fmt: skip


def _convert(
    model: nn.Module, kv_heads: int | None, kv_latent: int | None, *, rope_dim: int | None,
    selection: str, calibration: Any, scope: str | Sequence[str] | None, names: tuple[str, str],
) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`convert_attention`, its refusals naming the arguments ``names`` (the public
    function's ``kv_heads``, ``kv_latent``; :func:`convert_checkpoint`'s own)."""
    _target(kv_heads, kv_latent, names)
    asked = f"{names[0]}={kv_heads}" if kv_heads is not None else f"{names[1]}={kv_latent}"
    if isinstance(model, Transformer):
        kinds = resolve_scope("decoder" if scope is None else scope)
        layers = [(p, a, k) for k, _, p, a in model.attention_sublayers() if k in kinds]
    elif scope is not None:  # another model's layers have no kinds to choose from
        raise ValueError(
            f"scope={scope!r} is for our Transformer; in a {type(model).__name__} every "
            "MultiHeadAttention is converted (leave scope unset)"
        )
    else:
        layers = [
            (p, m, None) for p, m in model.named_modules() if isinstance(m, MultiHeadAttention)
        ]
        if not layers:  # an HF or torch model never swapped: returning [] hid it
            raise ValueError(
                f"{type(model).__name__} has no MultiHeadAttention to convert; swap its "
                "attention first (replace_hf_attention for a Hugging Face model, "
                "replace_torch_attention for torch.nn.MultiheadAttention)"
            )
    what = "with_kv_heads" if kv_heads is not None else "with_kv_latent"
    for path, attn, _ in layers:
        if attn.design is not None and what not in attn.design.conversions:
            has = (
                "already has a K/V latent"
                if "expand_latent" in attn.design.conversions
                else "has a head design"
            )
            raise ValueError(
                f"{path} {has} ({attn.head_tag!r}), which {asked} does not convert; "
                "it converts MHA/GQA/MQA layers"
            )
    # The options that choose a latent's rotary features, else dropped without a word
    # (selection's default, "high", cannot be told from one not passed).
    ignored = [f"rope_dim={rope_dim}"] if rope_dim is not None else []
    ignored += [f"selection={selection!r}"] if selection != "high" else []
    if kv_heads is not None:
        why = f"{asked} pools K/V heads, and they choose the rotary features of a K/V latent"
    elif all(attn.positions is None for _, attn, _ in layers):
        why = "they choose rotary features, and no layer in scope has positions"
    else:
        why = ""
    if ignored and why:
        raise ValueError(f"{' and '.join(ignored)} would be ignored: {why}")
    inputs = {} if calibration is None else _layer_inputs(model, layers, calibration)
    converted = {}  # every layer first, so that a refusal leaves the model as it was
    for path, attn, _ in layers:
        if kv_heads is not None:
            converted[path] = with_kv_heads(attn, kv_heads)
        else:
            rope = None if attn.positions is None else rope_dim  # cross-attention has none
            x = inputs.get(path, (None,))[0]
            converted[path] = with_kv_latent(
                attn, kv_latent, rope_dim=rope, selection=selection, calibration=x
            )
    if isinstance(model, Transformer):  # one set of options per sublayer kind in its config
        options = {kind: _shared_options(kind, [converted[p] for p, _, k in layers if k == kind])
                   for kind in kinds}  # fmt: skip
    report = []
    for path, attn, _ in layers:
        new = converted[path]
        model.set_submodule(path, new)
        row = {"layer": path, "bytes_before": attn.kv_cache_bytes_per_token(),
               "bytes_after": new.kv_cache_bytes_per_token()}  # fmt: skip
        if path in inputs:
            row |= _kv_errors(attn, new, inputs[path][1])
        report.append(row)
    if isinstance(model, Transformer):
        for kind in kinds:
            model.attention_config[kind].update(options[kind])
    return report


def _shared_options(kind: str, layers: list[MultiHeadAttention]) -> dict[str, Any]:
    """The attention options of ``kind``'s converted ``layers``, which they must share (a
    config has one set per sublayer kind)."""
    found = [sublayer_config(attn) for attn in layers]
    if any(options != found[0] for options in found):
        raise ValueError(
            f"the {kind} layers would get different options (selection='norm' chose other "
            "pairs in some), which one model config cannot hold; use selection='high' or "
            "'uniform'"
        )
    return found[0]


def _layer_inputs(
    model: nn.Module, layers: list[tuple[str, MultiHeadAttention, Any]], calibration: Any
) -> dict[str, tuple[Tensor, Tensor]]:
    """``{path: (query, K/V source)}`` of each layer's first call on ``calibration``."""
    seen: dict[str, tuple[Tensor, Tensor]] = {}

    def hook(path: str):
        def record(module, args, kwargs):
            query = args[0] if args else kwargs["query"]
            key_value = args[1] if len(args) > 1 else kwargs.get("key_value")
            # Refused here, named, before the layer fails on it with a bare matmul error.
            for x in (query, key_value):
                if x is not None and (x.dim() != 3 or x.shape[-1] != module.embed_dim):
                    raise ValueError(
                        f"calibration gives {path} an input of shape {tuple(x.shape)}, where it "
                        f"reads (B, S, {module.embed_dim}): pass the model's own inputs"
                    )
            seen.setdefault(path, (query, query if key_value is None else key_value))

        return record

    handles = [a.register_forward_pre_hook(hook(p), with_kwargs=True) for p, a, _ in layers]
    try:
        with torch.no_grad():
            if isinstance(calibration, tuple):
                model(*calibration)
            elif isinstance(calibration, Mapping):
                model(**calibration)
            else:
                model(calibration)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _kv_errors(old: MultiHeadAttention, new: MultiHeadAttention, x: Tensor) -> dict[str, float]:
    """The relative Frobenius error of ``new``'s K and V against ``old``'s on ``x``, per query
    head ``(B, H, S, D)``, before RoPE and without biases; an MLA layer's K in ``old``'s
    feature order (its rotary key's features back at theirs)."""
    H, D = old.num_heads, old.head_dim

    def per_head(t: Tensor, heads: int) -> Tensor:  # (B, S, heads*w) -> (B, H, S, w)
        return t.unflatten(-1, (heads, -1)).transpose(1, 2).repeat_interleave(H // heads, 1)

    with torch.no_grad():
        _, w_k, w_v = old.in_proj.blocks()
        k, v = per_head(x @ w_k.T, old.num_kv_heads), per_head(x @ w_v.T, old.num_kv_heads)
        latent = new.design
        if latent is None:  # pooled K/V heads
            _, w_k2, w_v2 = new.in_proj.blocks()
            k2, v2 = per_head(x @ w_k2.T, new.num_kv_heads), per_head(x @ w_v2.T, new.num_kv_heads)
        else:
            k2, v2 = latent.expand(x @ latent.down.weight.T)  # (B, H, S, Dq), (B, H, S, D)
            if latent.rope is not None:
                G = latent.rope_kv_heads
                k_rope = per_head(x @ latent.k_rope.weight.T, G)  # (B, H, S, d_R)
                # The kept pairs, found by their frequencies among the source's (all differ).
                source = old.positions.frequencies(x.device, torch.float64)  # (R/2,)
                kept_freqs = torch.tensor(latent.rope.inv_freq, dtype=source.dtype, device=x.device)
                pairs = (kept_freqs[..., None] == source).int().argmax(-1)  # (G, d_R/2)
                rope_index = rotary_index(old.positions, pairs)  # (G, d_R)
                kept = torch.ones(G, D, dtype=torch.bool, device=x.device)
                kept[torch.arange(G, device=x.device)[:, None], rope_index] = False
                order = torch.cat((kept.nonzero()[:, 1].view(G, -1), rope_index), 1)  # (G, D)
                order = order.repeat_interleave(H // G, 0)[None, :, None].expand_as(k)
                k2 = torch.empty_like(k).scatter_(-1, order, torch.cat((k2, k_rope), -1))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return {"k_error": rel(k2, k), "v_error": rel(v2, v)}


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
        kv_latent_dim: ``r``, instead of ``num_kv_heads``, or ``{kind: r}`` for every kind
            in ``scope`` (e.g. a rotary self-attention's latent beside its rotary keys, and
            a wider one in cross-attention, for the same cache).
        rope_dim, selection: for a rotary model, see :func:`convert_attention`; with
            ``{kind: r}``, for the kinds with rotary layers only.
    """
    kinds = resolve_scope(scope)
    per_kind = dict(kv_latent_dim) if isinstance(kv_latent_dim, Mapping) else None
    if per_kind is None:
        target = _target(num_kv_heads, kv_latent_dim)
    elif num_kv_heads is not None or set(per_kind) != set(kinds):
        raise ValueError(
            f"kv_latent_dim={per_kind} must give one r for each of {list(kinds)}, without "
            f"num_kv_heads (got {num_kv_heads})"
        )
    else:
        target = {"kv_latent_dim": per_kind}
    ckpt = read_checkpoint(path)
    model = load_trained_model(path).model
    before = {kind: cfg["num_kv_heads"] for kind, cfg in model.head_config.items()}
    options = copy.deepcopy(model.attention_config)
    names = ("num_kv_heads", "kv_latent_dim")  # this function's, for the refusals
    if per_kind is None:
        _convert(
            model, num_kv_heads, kv_latent_dim, rope_dim=rope_dim, selection=selection,
            calibration=None, scope=kinds, names=names,
        )  # fmt: skip
    else:  # one call per kind: its own r, rope_dim and selection only where it has rotary layers
        rotary = {kind for kind, _, _, a in model.attention_sublayers() if a.positions is not None}
        for kind, r in per_kind.items():
            turns = kind in rotary
            _convert(
                model, None, r, rope_dim=rope_dim if turns else None,
                selection=selection if turns else "high", calibration=None, scope=[kind],
                names=names,
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
    changed: dict[str, list[str]] = {}
    for kind in kinds:
        now = model.attention_config[kind]  # the keys set, and those a rotary latent changed
        kv = {k: v for k, v in now.items() if k == "num_kv_heads" or v != options[kind][k]}
        attention[kind] = {**(attention.get(kind) or {}), **kv}
        # Beyond the K/V heads or the latent asked for: the rotary key's options.
        was = options[kind]["design_options"] if now["design"] == options[kind]["design"] else {}
        own = {k for k, v in now["design_options"].items() if k not in was or v != was[k]}
        layer = set(kv) - {"num_kv_heads", "design", "design_options"}
        changed[kind] = sorted((layer | own) - set(target))
    if set(kinds) == set(ATTENTION_SUBLAYERS) and num_kv_heads is not None:
        attention["num_kv_heads"] = num_kv_heads
    extra["converted_from"] = {
        "path": str(path),
        **target,
        "scope": list(kinds),
        "previous_num_kv_heads": {kind: before[kind] for kind in kinds},
        **({"rope_dim": rope_dim, "selection": selection} if any(changed.values()) else {}),
        **({"changed_keys": changed} if any(changed.values()) else {}),
    }
    converted["multihead"] = extra
    return converted


def uptrain_overrides(ckpt_path: str | Path, out: str | Path, converted: dict) -> list[str]:
    """The ``scripts/train.py`` overrides that rebuild ``converted`` and start from ``out``.

    The original run's own overrides (:func:`recorded_overrides`), less the head options
    set here.
    """
    info = converted["multihead"]["converted_from"]
    kinds, attention = info["scope"], converted["multihead"]["config"]["attention"]
    heads: list[str] = []
    if set(kinds) == set(ATTENTION_SUBLAYERS) and "num_kv_heads" in info:
        heads.append(f"attention.num_kv_heads={info['num_kv_heads']}")
    for kind in kinds:
        sublayer = attention[kind]
        own = sublayer.get("design_options") or {}
        heads += [
            f"attention.{kind}.{key}={sublayer[key]}"
            for key in ("num_kv_heads", "design")
            if sublayer.get(key) is not None
        ]
        if "kv_latent_dim" in info:  # the sublayer's section lists no design option: ++
            heads.append(f"++attention.{kind}.design_options.kv_latent_dim={own['kv_latent_dim']}")
        # What a rotary latent adds (rotary_dim, frequencies, ...): keys the config may lack.
        for key in info.get("changed_keys", {}).get(kind, ()):
            where, value = ("design_options.", own[key]) if key in own else ("", sublayer[key])
            heads.append(f"++attention.{kind}.{where}{key}={json.dumps(value)}")
    ours = {h.lstrip("+").split("=", 1)[0] for h in heads}
    return [*recorded_overrides(ckpt_path, ours), f"init_from={out}", *heads]


def recorded_overrides(ckpt_path: str | Path, drop: Collection[str] = ()) -> list[str]:
    """The overrides of the run that wrote ``ckpt_path``, from ``<run dir>/.hydra/
    overrides.yaml`` (the checkpoint in ``<run dir>/checkpoints/`` or, averaged, in
    ``<run dir>/``; none when neither has the file), less ``hydra.*``, resuming
    (``ckpt_path``), ``init_from``, the old run directory (``paths.output_dir``) and the
    keys in ``drop``."""
    drop = {*drop, "ckpt_path", "init_from", "paths.output_dir"}
    here = Path(ckpt_path).resolve().parent
    for run_dir in (here.parent, here):
        recorded = run_dir / ".hydra" / "overrides.yaml"
        if recorded.is_file():
            overrides = [str(o) for o in OmegaConf.load(recorded)]
            keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
            return [o for o, k in zip(overrides, keys, strict=True)
                    if k not in drop and not k.startswith("hydra.")]  # fmt: skip
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
