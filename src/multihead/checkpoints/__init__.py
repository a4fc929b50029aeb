"""Checkpoints: read them, write them atomically (Lightning's writes during ``fit`` too,
through :class:`AtomicCheckpointIO`), rebuild a trained model and its search settings from
one, pick the one a run resumes from, average several, convert their K/V heads.

Checkpoints are self-contained (see :mod:`multihead.checkpoints.io`): the config and the
tokenizer inside rebuild the network with :func:`multihead.model.build_model`. Exporting
one for deployment is :mod:`multihead.deploy`.
"""

from multihead.checkpoints.io import (
    FORMAT_VERSION,
    AtomicCheckpointIO,
    TrainedModel,
    load_trained_model,
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
    "TrainedModel",
    "load_trained_model",
    "model_state_dict",
    "read_checkpoint",
    "save_new",
    "search_settings",
    "weights_only",
    "write_atomically",
]
