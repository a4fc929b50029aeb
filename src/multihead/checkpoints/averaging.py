"""Checkpoint averaging (Vaswani et al. average the last 5 or 20 checkpoints)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from multihead.checkpoints.io import read_checkpoint, weights_only

_STEP = re.compile(r"step(\d+)\.ckpt$")


def recent_checkpoints(ckpt_dir: str | Path, last: int) -> list[Path]:
    """The ``last`` newest files ending in ``step<N>.ckpt`` in ``ckpt_dir``, oldest first.

    That is every checkpoint a run names by its step: the periodic ``step<N>.ckpt`` saves, the
    final step, and the ``minute<M>-step<N>.ckpt`` marks. Each step counts once: a minute mark
    that falls on a periodic save's step holds the same weights, and counting it twice would
    weight that step double and push the oldest one out.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    if last < 1:
        raise ValueError(f"last={last}; expected at least 1 checkpoint to average")
    named = ((_STEP.search(p.name), p) for p in sorted(ckpt_dir.iterdir()))
    by_step = {int(m.group(1)): p for m, p in named if m}
    if not by_step:
        raise FileNotFoundError(f"no step<N>.ckpt checkpoints in {ckpt_dir}")
    return [by_step[step] for step in sorted(by_step)[-last:]]


def checkpoints_to_average(
    ckpt_dir: str | Path | None, last: int, ckpts: list[str | Path] | None
) -> list[Path]:
    """The files to average: the ``last`` newest in ``ckpt_dir``, or exactly ``ckpts``.

    Exactly one of ``ckpt_dir`` and ``ckpts`` is given. Named files are checked when
    ``average_checkpoints`` reads them (``read_checkpoint``), before anything is written.
    """
    if (ckpt_dir is None) == (ckpts is None):
        raise ValueError(
            f"ckpt_dir={ckpt_dir}, ckpts={ckpts}; "
            "expected exactly one: ckpt_dir=DIR (with last=N) or ckpts=[A,B,...]"
        )
    if ckpt_dir is not None:
        return recent_checkpoints(ckpt_dir, last)
    if not ckpts:
        raise ValueError("ckpts=[] is empty; expected at least one checkpoint to average")
    return [Path(p) for p in ckpts]


def average_checkpoints(paths: list[Path]) -> dict:
    """A checkpoint whose weights are the mean of ``paths``' weights.

    The config, tokenizer and step are taken from the last one, so the result loads
    anywhere the last checkpoint does. Optimiser, scheduler and loop states are dropped:
    they belong to the last file's run, not to the averaged weights.
    """
    ckpts = [read_checkpoint(p) for p in paths]
    averaged = weights_only(ckpts[-1])
    keys = averaged["state_dict"].keys()
    for c, p in zip(ckpts, paths, strict=True):
        if c["state_dict"].keys() != keys:
            raise ValueError(f"{p} has different parameters from {paths[-1]}; cannot average")
    for key in keys:
        tensors = [c["state_dict"][key] for c in ckpts]
        if tensors[0].is_floating_point():
            averaged["state_dict"][key] = (
                torch.stack([t.float() for t in tensors]).mean(0).to(tensors[0].dtype)
            )
    averaged["multihead"]["averaged_from"] = [str(p) for p in paths]
    return averaged
