"""The bad-input sweep: each case gets one ``error: ...`` line, exit status 2, nothing lost.

Cases run in-process through :func:`multihead.cli.exit_on_user_error`, the wrapper every
script's ``main`` has (``tests/training/test_configs.py`` and ``test_scripts.py`` run some
through the real scripts).
"""

from __future__ import annotations

import errno
import importlib.machinery
import os
import resource
import shutil
import signal
import sys
import tempfile
import types
from pathlib import Path

from multihead.cli import exit_on_user_error

import pytest
import torch

from multihead.checkpoints import (
    FORMAT_VERSION,
    load_trained_model,
    read_checkpoint,
    save_new,
    write_atomically,
)
from multihead.checkpoints.averaging import average_checkpoints, checkpoints_to_average
from multihead.evaluation import evaluate_checkpoint
from multihead.training.run import train

from helpers.scripts import run_script


def fails_in_one_line(fn, capsys, *args) -> str:
    """Run ``fn`` as a script's main would; return its one error line."""
    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(fn)(*args)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_tokens=abc", "data.max_tokens must be a positive integer, got 'abc'"),
        ("data.max_tokens=0", "data.max_tokens must be a positive integer, got 0"),
        ("data.lowercase=yes", "data.lowercase must be a bool, got 'yes'"),
        ("model.d_model=0", "d_model must be a positive integer, got 0"),
        ("model.num_encoder_layers=-2", "num_encoder_layers must be a positive integer, got -2"),
        ("model.dropout=1.5", "dropout must be a number in [0, 1), got 1.5"),
        ("attention.num_heads=0", "num_heads must be positive"),
        ("attention.num_kv_heads=3", "must be divisible by num_kv_heads (3)"),
        ("attention.backend=fast", "unknown attention backend 'fast'"),
        ("module.on_non_finite_loss=maybe", "module.on_non_finite_loss='maybe'"),
        ("module.beam_size=0", "module.beam_size must be >= 1, got 0"),
        ("test_ckpt=avg0", "test_ckpt=avg0; expected best, last, avg<N>"),
        ("test_ckpt=/nowhere.ckpt", "test_ckpt=/nowhere.ckpt: no such checkpoint"),
        ("ckpt_path=last", "ckpt_path=last: no checkpoint in"),
    ],
)
def test_bad_config_values(smoke_config, capsys, override, message) -> None:
    cfg = smoke_config(override, "trainer.max_steps=2", "trainer.val_check_interval=2")
    line = fails_in_one_line(train, capsys, cfg)
    assert message in line, line


@pytest.mark.parametrize(
    "installed, why",
    [
        (False, "the flash-attn package is not installed"),
        (True, "flash-attn needs CUDA and fp16/bf16 (got cpu/torch.float32)"),
    ],
)
def test_a_backend_that_cannot_run_here_says_why(
    smoke_config, capsys, monkeypatch, installed, why
) -> None:
    """Whether or not flash-attn is installed here, it cannot run on the CPU in fp32."""
    if installed:  # what importlib finds for an installed package
        module = types.ModuleType("flash_attn")
        module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    else:  # importlib.util.find_spec then answers None, as for a package that is absent
        module = None
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    cfg = smoke_config("attention.backend=flash_attn", "trainer.max_steps=2")
    line = fails_in_one_line(train, capsys, cfg)
    assert "'flash_attn'" in line and why in line and "math" in line, line  # why; which can


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture
def ckpt(smoke_run_dir, tmp_path) -> Path:
    path = tmp_path / "good.ckpt"
    shutil.copy(smoke_run_dir / "checkpoints" / "last.ckpt", path)
    return path


def make_bad(kind: str, good: Path, path: Path) -> None:
    if kind == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif kind == "plain state_dict":
        torch.save(load_trained_model(good).model.state_dict(), path)
    elif kind == "another project's Lightning checkpoint":
        torch.save({"state_dict": {}, "epoch": 3, "pytorch-lightning_version": "2.6.0"}, path)
    elif kind == "another format version":
        ckpt = torch.load(good, weights_only=False)
        ckpt["multihead"]["format_version"] = FORMAT_VERSION + 1
        torch.save(ckpt, path)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("truncated", "is not a readable checkpoint"),
        ("random bytes", "is not a readable checkpoint"),
        ("plain state_dict", "is not a multihead checkpoint"),
        ("another project's Lightning checkpoint", "is not a multihead checkpoint"),
        ("another format version", f"format version {FORMAT_VERSION + 1}; this multihead reads"),
    ],
)
def test_bad_checkpoints(ckpt, tmp_path, capsys, kind, message) -> None:
    bad = tmp_path / "bad.ckpt"
    make_bad(kind, ckpt, bad)
    before = bad.read_bytes()
    line = fails_in_one_line(load_trained_model, capsys, bad)
    assert message in line and str(bad) in line, line
    assert bad.read_bytes() == before  # left alone


def test_resume_skips_a_damaged_newest_checkpoint(smoke_run_dir, tmp_path, caplog) -> None:
    from multihead.checkpoints.resume import resume_checkpoint

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    shutil.copy(smoke_run_dir / "checkpoints" / "step10.ckpt", ckpts / "step10.ckpt")
    make_bad("truncated", smoke_run_dir / "checkpoints" / "step20.ckpt", ckpts / "step20.ckpt")
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


# ----------------------------------------------------------------------- output location
def test_unwritable_output_location(ckpt, tmp_path, capsys, multi30k_dir) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("precious")
    line = fails_in_one_line(
        evaluate_checkpoint,
        capsys,
        str(ckpt),
        blocker / "out",
    )
    assert str(blocker) in line, line
    assert blocker.read_text() == "precious"


def test_checkpoints_never_stage_in_the_temp_directory(smoke_config, tmp_path, monkeypatch):
    """With TMPDIR on another filesystem, every checkpoint is still renamed within its own
    directory (a rename across filesystems would be a copy that a kill can tear)."""
    other = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path / "elsewhere"
    elsewhere = other / f"multihead-tmp-{os.getpid()}"
    elsewhere.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    renames: list[tuple[Path, Path]] = []
    replace = os.replace

    def recording_replace(src, dst):
        renames.append((Path(src), Path(dst)))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    cfg = smoke_config(
        "trainer.max_steps=4", "trainer.val_check_interval=2", "summary.decode_speed=false"
    )
    train(cfg)
    ckpts = [(src, dst) for src, dst in renames if dst.suffix == ".ckpt"]
    assert {dst.name for _, dst in ckpts} >= {"step2.ckpt", "step4.ckpt", "last.ckpt"}
    assert all(src.parent == dst.parent for src, dst in ckpts), ckpts
    assert list(elsewhere.iterdir()) == []
    elsewhere.rmdir()


def test_a_full_disk_leaves_the_old_file_and_no_partial_one(tmp_path) -> None:
    target = tmp_path / "scores.json"
    target.write_text("old")

    def write_until_full(f) -> None:
        f.write(b"half of the new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=f"cannot write {target}: No space left"):
        write_atomically(target, write_until_full)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["scores.json"]


def test_script_on_a_full_disk_fails_in_one_line(smoke_run_dir, tmp_path) -> None:
    """average_checkpoints.py with a 64 KiB file-size limit: the checkpoint cannot be written.
    The control, the script's steps without the limit, writes it."""

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failing write, not a killed process

    full, control = tmp_path / "full", tmp_path / "control"
    full.mkdir()
    ckpt_dir = smoke_run_dir / "checkpoints"
    result = run_script(
        "average_checkpoints.py",
        f"ckpt_dir={ckpt_dir}",
        "last=2",
        f"out={full / 'avg.ckpt'}",
        preexec_fn=limit_file_size,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]  # error: [Errno 27] cannot write ...
    assert line.startswith("error: ["), line
    assert line.endswith(f"] cannot write {full / 'avg.ckpt'}: File too large"), line
    assert list(full.iterdir()) == []  # no partial file, no temporary file

    save_new(average_checkpoints(checkpoints_to_average(ckpt_dir, 2, None)), control / "a.ckpt")
    assert (control / "a.ckpt").stat().st_size > 64 * 1024
    read_checkpoint(control / "a.ckpt")
