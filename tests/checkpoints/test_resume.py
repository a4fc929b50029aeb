"""Which checkpoint a run resumes from: the newest that loads."""

from __future__ import annotations

import os
import shutil

import pytest

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
