"""Which checkpoint a run resumes from: ``ckpt_path=PATH``, ``last`` or ``auto``."""

from __future__ import annotations

import logging
from pathlib import Path

from multihead.checkpoints.io import read_checkpoint

log = logging.getLogger(__name__)

# A checkpoint that can resume training holds the loops' and optimisers' states as well.
_RESUMABLE_KEYS = ("optimizer_states", "loops")


def _resumable(path: Path) -> tuple[bool, str, str | None]:
    """``(ok, why not, wandb id)`` for one file."""
    try:
        ckpt = read_checkpoint(path)
    except (FileNotFoundError, ValueError) as err:
        return False, str(err), None
    missing = [key for key in _RESUMABLE_KEYS if key not in ckpt]
    if missing:
        return False, f"{path} holds weights only (no {', '.join(missing)})", None
    # Lightning stores a DataModule's state_dict under its class name; every one of ours
    # holds the training data's position (multihead.data.resume) once training has begun.
    if not any(key.endswith("DataModule") for key in ckpt):
        log.warning(
            "%s holds no data position (an LM or MQAR checkpoint written before 2026-11-29): "
            "the resumed run starts its training data again from the first batch",
            path,
        )
    return True, "", ckpt["multihead"].get("wandb_id")


def resume_checkpoint(setting: str | None, ckpt_dir: Path) -> tuple[str | None, str | None]:
    """The checkpoint to resume from, and the wandb run id stored in it.

    Args:
        setting: ``None`` (start fresh), a checkpoint path, ``"last"`` (the newest
            checkpoint in ``ckpt_dir`` that loads; an error if there is none) or ``"auto"``
            (the same, but start fresh when there is none). A damaged file is skipped with a
            warning that names it; the newest is the most recently written.
        ckpt_dir: the run's checkpoint directory.

    Returns:
        ``(path or None, wandb run id or None)``.

    Raises:
        FileNotFoundError / ValueError: the named checkpoint cannot resume a run, or
            ``last`` finds none that can (the message lists the files tried).
    """
    if setting is None:
        return None, None
    setting = str(setting)
    if setting not in ("last", "auto"):
        ok, why, wandb_id = _resumable(Path(setting))
        if not ok:
            raise ValueError(f"ckpt_path={setting} cannot resume a run: {why}")
        return setting, wandb_id
    # A write that a kill interrupted leaves its temporary file (never the target): drop it.
    for stale in ckpt_dir.glob(".*.ckpt.*.tmp"):
        log.warning("removing %s, left by an interrupted checkpoint write", stale.name)
        stale.unlink(missing_ok=True)
    found = [p for p in ckpt_dir.glob("*.ckpt") if not p.name.startswith(".")]
    tried = []
    for path in sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True):
        ok, why, wandb_id = _resumable(path)
        if ok:
            log.info("resuming from %s", path)
            return str(path), wandb_id
        log.warning("skipping %s: %s", path.name, why)
        tried.append(path.name)
    if setting == "auto":
        return None, None
    raise FileNotFoundError(
        f"ckpt_path=last: no checkpoint in {ckpt_dir} can resume a run (tried: "
        f"{', '.join(tried) or 'none found'}); point hydra.run.dir at the run directory"
    )
