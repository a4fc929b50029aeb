"""Reading and writing the self-contained checkpoints that ``train.py`` saves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from multihead.data import Tokenizer


@dataclass
class Translator:
    """What a checkpoint holds: the network, its tokenizer and the run's config."""

    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file written by ``scripts/train.py`` onto the CPU.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a readable multihead checkpoint.
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
    return ckpt


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The network's weights, without the LightningModule's ``model.`` prefix."""
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}


def load_translator(path: str | Path, backend: str | None = None) -> Translator:
    """Rebuild the trained model (in eval mode) and its tokenizer from a checkpoint.

    Args:
        path: a ``.ckpt`` written by ``scripts/train.py``.
        backend: run every attention layer with this backend instead of the trained one.
    """
    from hydra.utils import instantiate

    ckpt = read_checkpoint(path)
    extra = ckpt["multihead"]
    tokenizer = Tokenizer.from_str(extra["tokenizer"])
    config = extra["config"]
    model_cfg = OmegaConf.create(config["model"])
    if backend is not None:
        model_cfg.attention.backend = backend
        for key in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
            if model_cfg.get(key):
                model_cfg[key].pop("backend", None)
    model = instantiate(
        model_cfg,
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        pad_id=tokenizer.pad_id,
    )
    model.load_state_dict(model_state_dict(ckpt))
    return Translator(model.eval(), tokenizer, config)
