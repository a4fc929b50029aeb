"""The checkpoint writer Lightning uses during ``fit``: atomic, as every file written here;
and the record that makes a checkpoint self-contained (:func:`multihead_record`)."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

from multihead.checkpoints import FORMAT_VERSION, write_atomically


def multihead_record(module, tokenizer) -> dict[str, Any]:
    """A checkpoint's ``multihead`` entry: the format, the run's wandb id, its resolved
    config and the tokenizer (``None`` where the tokens are their ids, MQAR), which rebuild
    the model anywhere (:func:`multihead.checkpoints.load_trained_model`)."""
    wandb_ids = [lg.version for lg in module.loggers if isinstance(lg, WandbLogger)]
    return {
        "format_version": FORMAT_VERSION,
        "wandb_id": wandb_ids[0] if wandb_ids else None,
        "config": module.run_config,
        "tokenizer": None if tokenizer is None else tokenizer.to_str(),
    }


class AtomicCheckpointIO(TorchCheckpointIO):
    """Every checkpoint is the old file or the complete new one, never a torn one.

    Lightning's own writer stages the file through an fsspec transaction whose temporary
    file lives in the system temp directory; when that is another filesystem than the run
    directory (a node-local ``/tmp``, a shared run directory), the final move is a copy that
    a kill can interrupt, and nothing is fsynced. This writer uses :func:`write_atomically`:
    a temporary file in the checkpoint's own directory, flushed and fsynced, then renamed
    over the target.
    """

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        storage_options: Any | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options}")
        write_atomically(os.fspath(path), lambda f: torch.save(checkpoint, f))
