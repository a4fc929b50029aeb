"""scripts/average_checkpoints.py: the last N or the named checkpoints into a new file, never
over an old one; bad arguments and a full disk end it with one line.

The script's ``main`` runs in this process; the full disk (a file-size limit on the process)
runs it as a process. The mean itself is tested in tests/checkpoints/test_averaging.py.
"""

from __future__ import annotations

import resource
import signal
from pathlib import Path

import pytest
import torch

from multihead.checkpoints import load_trained_model, read_checkpoint, save_new
from multihead.checkpoints.averaging import average_checkpoints, checkpoints_to_average

from helpers.scripts import fails_in_one_line, run_script, script_main


def average(*overrides: str) -> None:
    script_main("average_checkpoints.py", "average", *overrides)


def test_average_the_last_two_and_refuse_to_overwrite(smoke_run_dir, tmp_path, capsys) -> None:
    ckpts = smoke_run_dir / "checkpoints"
    out = tmp_path / "avg.ckpt"
    average(f"ckpt_dir={ckpts}", "last=2", f"out={out}")
    assert "averaged 2 checkpoints (step10.ckpt, step20.ckpt)" in capsys.readouterr().out
    assert load_trained_model(out).config == load_trained_model(ckpts / "step20.ckpt").config
    before = out.read_bytes()
    line = fails_in_one_line(average, capsys, f"ckpt_dir={ckpts}", "last=2", f"out={out}")
    assert "already exists" in line, line
    assert out.read_bytes() == before


def test_average_named_checkpoints(smoke_run_dir: Path, tmp_path: Path) -> None:
    ckpts = smoke_run_dir / "checkpoints"
    out = tmp_path / "named.ckpt"
    average(f"ckpts=[{ckpts / 'step10.ckpt'},{ckpts / 'step20.ckpt'}]", f"out={out}")
    a, b = (torch.load(ckpts / f"step{n}.ckpt", weights_only=False) for n in (10, 20))
    named = read_checkpoint(out)
    for key, value in a["state_dict"].items():
        expected = (value + b["state_dict"][key]) / 2 if value.is_floating_point() else value
        torch.testing.assert_close(named["state_dict"][key], expected)
    # Weights only: the optimiser and loop states belonged to step20's run, not to the mean.
    assert "optimizer_states" not in named and "loops" not in named


@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt_dir=CKPTS", "ckpts=[CKPTS/step10.ckpt]"], "expected exactly one"),
        ([], "expected exactly one"),
        (["ckpts=[CKPTS/step10.ckpt,CKPTS/step999.ckpt]"], "checkpoint not found"),
        (["ckpts=[]"], "expected at least one"),
    ],
)
def test_bad_arguments(smoke_run_dir, tmp_path, capsys, args, message) -> None:
    out = tmp_path / "avg.ckpt"
    args = [a.replace("CKPTS", str(smoke_run_dir / "checkpoints")) for a in args]
    line = fails_in_one_line(average, capsys, *args, f"out={out}")
    assert message in line, line
    assert not out.exists()


@pytest.mark.slow  # a process; an in-process full disk: test_io.py
def test_a_full_disk_fails_in_one_line_in_a_process(smoke_run_dir, tmp_path) -> None:
    """With a 64 KiB file-size limit the checkpoint cannot be written. The control, the
    script's steps without the limit, writes it."""

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
