"""The checkpoint writer Lightning uses during ``fit``: atomic, as every file written here."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from multihead.checkpoints import write_atomically


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
