"""A checkpoint's life after training: read it, rebuild its model, write files atomically,
resume from it, average several, convert its K/V heads, export it to CTranslate2.

Checkpoints are self-contained (see :mod:`multihead.checkpoints.io`).
:mod:`multihead.checkpoints.export` writes a CTranslate2 model directory from any of them;
:mod:`multihead.checkpoints.engine` translates with such a directory under the length rules
of our own decoder (``scripts/translate.py engine=ctranslate2``). Imports no Lightning.
"""

from multihead.checkpoints.io import (
    FORMAT_VERSION,
    AtomicCheckpointIO,
    Translator,
    load_translator,
    model_state_dict,
    read_checkpoint,
    save_new,
    search_settings,
    weights_only,
    write_atomically,
)

__all__ = [
    "AtomicCheckpointIO",
    "FORMAT_VERSION",
    "Translator",
    "load_translator",
    "model_state_dict",
    "read_checkpoint",
    "save_new",
    "search_settings",
    "weights_only",
    "write_atomically",
]
