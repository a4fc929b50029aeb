"""Reading the self-contained checkpoints that ``train.py`` writes, and writing them safely.

A checkpoint is a Lightning checkpoint with one extra entry, ``multihead``: the format
version, the resolved run config and the tokenizer. Config plus tokenizer rebuild the
network anywhere, without the data or the Hydra config files. Every file is written with
:func:`write_atomically`; during training Lightning writes through
:class:`AtomicCheckpointIO`, which uses it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from multihead.data import Tokenizer
from multihead.model.factory import build_model

# Bumped whenever what ``multihead`` holds, or how the config describes the model, changes.
# 3: a head design's own options under attention.design_options, the design named by design
# alone; a version 2 checkpoint is read in this form (:func:`upgrade_config`).
FORMAT_VERSION = 3


@dataclass
class TrainedModel:
    """What a checkpoint holds: the network, its tokenizer (``None`` for MQAR, whose tokens
    are their ids) and the run's config."""

    model: nn.Module
    tokenizer: Tokenizer | None
    config: dict[str, Any]


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file written by ``scripts/train.py`` onto the CPU.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a readable multihead checkpoint of format 2 or 3 (2 is
            read in the form of 3: :func:`upgrade_config`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        # Our checkpoints hold the config and tokenizer besides tensors: not weights-only.
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for a corrupt or foreign file
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{path} is not a readable checkpoint ({first})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "multihead" not in ckpt:
        raise ValueError(
            f"{path} is not a multihead checkpoint: expected 'state_dict' and 'multihead' "
            "entries, as written by scripts/train.py"
        )
    version = ckpt["multihead"].get("format_version")
    if version == 2:
        config = upgrade_config(ckpt["multihead"]["config"])
        ckpt["multihead"] = {
            **ckpt["multihead"],
            "format_version": FORMAT_VERSION,
            "config": config,
        }
    elif version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format version {version}; this multihead reads versions 2 "
            f"and {FORMAT_VERSION} (use the multihead release that wrote it)"
        )
    return ckpt


# Format 2's attention config, as its layer read it: the layer's own keys; the keys that chose
# a design without a name (head_mixing=NAME, top_k_heads, kv_latent_dim); the options that
# were off at 0 or False (dropped, whichever design the layer had), with their design.
_V2_LAYER_KEYS = frozenset(
    {"num_heads", "num_kv_heads", "backend", "design", "positions", "rotary_dim", "rope_theta",
     "rope_interleaved"}
)  # fmt: skip
_V2_SELECTED_BY = {"top_k_heads": "moh", "kv_latent_dim": "mla"}
_V2_OFF = {"num_shared_heads": "moh", "kv_latent_norm": "mla"}


def upgrade_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A format-2 run config in format 3's form: under ``attention`` and each sublayer's
    section, the design by name (``design``) and its options under ``design_options``.

    Format 2 listed every design's options beside the layer's keys; ``head_mixing=NAME``, a
    ``top_k_heads`` or a ``kv_latent_dim`` chose a design without ``design``; ``None`` and an
    option off (``num_shared_heads: 0``, ``kv_latent_norm: false``) were left out; a
    sublayer's ``None`` was the top level's value. Each sublayer gets the design and options
    format 2 built for it, where they differ from the top level's.
    """
    config = dict(config)
    attention = dict(config["attention"])
    sections = {k: v for k, v in attention.items() if isinstance(v, Mapping)}
    base = {k: v for k, v in attention.items() if k not in sections}
    design, own = _v2_design(base)
    attention = {**{k: v for k, v in base.items() if k in _V2_LAYER_KEYS}, "design": design}
    attention["design_options"] = own
    for name, section in sections.items():
        given = {k: v for k, v in section.items() if v is not None}
        mine, options = _v2_design({**base, **given})
        if mine == design:  # the top level's design: the options that differ from its
            mine = None
            options = {k: v for k, v in options.items() if k not in own or own[k] != v}
        attention[name] = {k: v for k, v in section.items() if k in _V2_LAYER_KEYS} | {
            "design": mine,
            "design_options": options,
        }
    config["attention"] = attention
    return config


def _v2_design(section: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The design and options that format 2 built from one merged ``section``."""
    own = {k: v for k, v in section.items() if k not in _V2_LAYER_KEYS and v is not None}
    design = own.pop("head_mixing", None) or section.get("design")
    design = design or next((d for k, d in _V2_SELECTED_BY.items() if k in own), None)
    off = [k for k, d in _V2_OFF.items() if own.get(k, True) in (0, False) and d != design]
    return design, {k: v for k, v in own.items() if k not in off}


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The network's weights, without the LightningModule's ``model.`` prefix."""
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}


# What a derived checkpoint (an average, a conversion) keeps: the weights, the rebuild
# recipe, and where it was in training. Optimiser, scheduler, loop and callback states
# describe one file's run, not the derived weights, so such a checkpoint cannot resume one.
_WEIGHTS_ONLY_KEYS = (
    "state_dict",
    "multihead",
    "epoch",
    "global_step",
    "pytorch-lightning_version",
)


def weights_only(ckpt: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``ckpt`` without optimiser, scheduler, loop and callback states."""
    return {key: ckpt[key] for key in _WEIGHTS_ONLY_KEYS if key in ckpt}


def load_trained_model(path: str | Path, backend: str | None = None) -> TrainedModel:
    """Rebuild the trained model (in eval mode) and its tokenizer from a checkpoint.

    Args:
        path: a ``.ckpt`` written by ``scripts/train.py``.
        backend: run every attention layer with this backend instead of the trained one.
    """
    ckpt = read_checkpoint(path)
    extra = ckpt["multihead"]
    config = extra["config"]
    if extra["tokenizer"] is None:  # MQAR: the tokens are their ids
        tokenizer, vocab_size, pad_id = None, config["data"]["vocab_size"], 0
    else:
        tokenizer = Tokenizer.from_str(extra["tokenizer"])
        vocab_size, pad_id = tokenizer.vocab_size, tokenizer.pad_id
    model = build_model(config, vocab_size, pad_id, backend=backend)
    model.load_state_dict(model_state_dict(ckpt))
    return TrainedModel(model.eval(), tokenizer, config)


def search_settings(
    config: Mapping[str, Any],
    *,
    length_penalty: float | None = None,
    max_len_a: float | None = None,
    max_len_b: float | None = None,
) -> dict[str, float]:
    """The search settings a run was trained with (its ``module`` config), each replaced
    where given: the keyword arguments of :func:`multihead.evaluation.translate` besides
    the beam size."""
    given = {"length_penalty": length_penalty, "max_len_a": max_len_a, "max_len_b": max_len_b}
    return {k: config["module"][k] if v is None else v for k, v in given.items()}


def write_atomically(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` so that it is either the old file or the complete new one, never torn.

    ``write`` fills a temporary file *in the same directory* (a rename is atomic only within
    one filesystem; the system temp directory may be another one), which is flushed and
    fsynced, then renamed over ``path``; the directory is fsynced so the rename survives a
    power loss. On any error the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        # A full or read-only disk: torch.save reports the OSError's aftermath as a
        # RuntimeError, so find the OSError and say which file could not be written.
        cause = err if isinstance(err, OSError) else err.__context__
        if isinstance(cause, OSError):
            raise OSError(cause.errno, f"cannot write {path}: {cause.strerror}") from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def save_new(obj: dict, out: str | Path) -> Path:
    """``torch.save`` to ``out`` atomically, refusing to overwrite anything."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new out= path")
    return write_atomically(out, lambda f: torch.save(obj, f))
