"""Make wandb safe to use unattended: offline without a key, never a prompt.

Used by training (the run's logger) and by analysis (reading a wandb group); standard
library only, so either can import it.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path

log = logging.getLogger(__name__)


def has_wandb_api_key() -> bool:
    """True when ``WANDB_API_KEY`` is set or ``wandb login`` stored a key in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, PermissionError):
        return False


def configure_wandb_mode(save_dir: str) -> str:
    """Choose online/offline before any wandb run starts, and say how to sync later."""
    os.environ.setdefault("WANDB_CONSOLE", "off")
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if has_wandb_api_key():
        return "online"
    os.environ["WANDB_MODE"] = "offline"
    log.warning(
        "wandb: no API key configured, logging offline under %s/wandb. "
        "Upload later with: wandb sync %s/wandb/offline-run-*",
        save_dir,
        save_dir,
    )
    return "offline"


def finish_wandb() -> None:
    """Close the current wandb run, if any (each multirun job gets its own run)."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()
