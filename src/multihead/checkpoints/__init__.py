"""Checkpoints: read them, write them atomically (Lightning's writes during ``fit`` go through
the same :func:`write_atomically`, in ``multihead.training.checkpoint_io``), rebuild a trained
model and its search settings from one, pick the one a run resumes from, average several,
convert their K/V heads. Nothing here imports Lightning.

Checkpoints are self-contained (see :mod:`multihead.checkpoints.io`): the config and the
tokenizer inside rebuild the network with :func:`multihead.model.build_model`. Exporting
one for deployment is :mod:`multihead.deploy`.
"""

from multihead.checkpoints.io import (
    FORMAT_VERSION,
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
