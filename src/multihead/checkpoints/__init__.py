"""A checkpoint's life after training: read it, rebuild its model, write files atomically,
average several, convert its K/V heads.

Checkpoints are self-contained (see :mod:`multihead.checkpoints.io`). Imports no Lightning.
"""

from multihead.checkpoints.io import (
    FORMAT_VERSION,
    Translator,
    build_model,
    load_translator,
    model_state_dict,
    read_checkpoint,
    save_new,
    weights_only,
    write_atomically,
)

__all__ = [
    "FORMAT_VERSION",
    "Translator",
    "build_model",
    "load_translator",
    "model_state_dict",
    "read_checkpoint",
    "save_new",
    "weights_only",
    "write_atomically",
]
