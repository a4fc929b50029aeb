"""Which checkpoints are averaged, and that the average is the mean of their weights.

The script's own cases (named files, bad arguments, refusing to overwrite) are in
tests/scripts/test_average_checkpoints_script.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from multihead.checkpoints import read_checkpoint
from multihead.checkpoints.averaging import average_checkpoints, recent_checkpoints


def test_average_checkpoints_is_the_mean(smoke_run_dir: Path) -> None:
    paths = recent_checkpoints(smoke_run_dir / "checkpoints", last=2)
    assert [p.name for p in paths] == ["step10.ckpt", "step20.ckpt"]
    averaged = average_checkpoints(paths)
    a, b = (read_checkpoint(p)["state_dict"] for p in paths)
    key = "model.decoder_layers.0.self_attn.in_proj.weight"
    torch.testing.assert_close(averaged["state_dict"][key], (a[key] + b[key]) / 2)


def test_recent_checkpoints_orders_every_step_named_file_by_step(tmp_path: Path) -> None:
    """Periodic saves, minute marks and the final step count; last.ckpt and best-* do not."""
    names = [
        "step900.ckpt", "step1000.ckpt", "minute105-step1004.ckpt", "step1100.ckpt",
        "step1123.ckpt", "last.ckpt", "best-step1000-bleu40.10.ckpt",
    ]  # fmt: skip
    for name in names:
        (tmp_path / name).touch()
    picked = [p.name for p in recent_checkpoints(tmp_path, last=4)]
    assert picked == ["step1000.ckpt", "minute105-step1004.ckpt", "step1100.ckpt", "step1123.ckpt"]


def test_recent_checkpoints_counts_a_step_once(tmp_path: Path) -> None:
    """A minute mark on a periodic save's step is the same weights: one of the `last`, not two."""
    for name in ["step1200.ckpt", "step1300.ckpt", "minute105-step1300.ckpt", "step1400.ckpt"]:
        (tmp_path / name).touch()
    picked = [p.name for p in recent_checkpoints(tmp_path, last=3)]
    assert picked == ["step1200.ckpt", "step1300.ckpt", "step1400.ckpt"]
