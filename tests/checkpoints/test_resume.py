"""Which checkpoint a run resumes from: the newest that loads."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from multihead.checkpoints.resume import resume_checkpoint


def test_resume_skips_a_damaged_newest_checkpoint(smoke_run_dir, tmp_path, caplog) -> None:
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    shutil.copy(smoke_run_dir / "checkpoints" / "step10.ckpt", ckpts / "step10.ckpt")
    good = (smoke_run_dir / "checkpoints" / "step20.ckpt").read_bytes()
    (ckpts / "step20.ckpt").write_bytes(good[: len(good) // 2])  # truncated
    (ckpts / ".step30.ckpt.abc.tmp").write_bytes(b"half a write")
    os.utime(ckpts / "step10.ckpt", (1, 1))  # the older file
    path, _ = resume_checkpoint("last", ckpts)
    assert path == str(ckpts / "step10.ckpt")
    assert "skipping step20.ckpt" in caplog.text
    assert not (ckpts / ".step30.ckpt.abc.tmp").exists()  # an interrupted write's leftover

    (ckpts / "step10.ckpt").unlink()
    assert resume_checkpoint("auto", ckpts) == (None, None)
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint .* can resume a run \(tried: step20"
    ):
        resume_checkpoint("last", ckpts)


def test_a_checkpoint_without_a_data_position_resumes_with_a_warning(
    smoke_run_dir, tmp_path, caplog
) -> None:
    """A checkpoint of an LM written before the LM's data kept its position: it resumes
    (weights, optimiser, loops), and one warning says the data restarts; a checkpoint with
    the position (the smoke run's) gives none."""
    path, _ = resume_checkpoint(str(smoke_run_dir / "checkpoints" / "step10.ckpt"), tmp_path)
    assert "data position" not in caplog.text
    ckpt = torch.load(path, weights_only=False)
    del ckpt["TranslationDataModule"]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    assert resume_checkpoint(str(old), tmp_path)[0] == str(old)
    assert f"{old} holds no data position" in caplog.text
    assert "starts its training data again from the first batch" in caplog.text
