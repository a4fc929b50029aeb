"""A run killed with SIGKILL at several moments resumes each time from the step it had
reached and ends with exactly the weights of an uninterrupted run (``smoke_run_dir``).

Two kills land half-way through a checkpoint write: one of a new step file, and one while
``last.ckpt`` of an earlier launch is overwritten, which is where a torn write loses data.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from multihead.training.run import train

from helpers import REPO_ROOT
from helpers.training import (
    STEP_FILE,
    assert_resumed_from,
    assert_same_training_state,
    compose_config,
    listing,
)

# Several trainings in processes: CI's slow pass (-m slow). Resuming is tested in
# test_train.py and tests/checkpoints/test_resume.py.
pytestmark = pytest.mark.slow

# Loaded by every Python started with this directory on PYTHONPATH. When the file that
# torch.save writes is named KILL_DURING_WRITE (or is the temporary file of a write to that
# name), it writes half of it, notes "<pid> <path>" in WRITING, and waits to be killed.
KILL_DURING_WRITE = """
import io, os, time, torch
_save = torch.save
TARGET = os.environ.get("KILL_DURING_WRITE")
NOTE = os.path.join(os.path.dirname(__file__), "WRITING")
def save(obj, f, *args, **kwargs):
    if TARGET is None or isinstance(f, (str, bytes, os.PathLike)) or not hasattr(f, "fileno"):
        return _save(obj, f, *args, **kwargs)
    path = os.readlink(f"/proc/self/fd/{f.fileno()}")  # os.fdopen's files have no name
    name = os.path.basename(path)
    if name != TARGET and not (name.startswith(f".{TARGET}.") and name.endswith(".tmp")):
        return _save(obj, f, *args, **kwargs)
    buffer = io.BytesIO()
    _save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    with open(NOTE + ".new", "w") as note:
        note.write(f"{os.getpid()} {path}")
    os.replace(NOTE + ".new", NOTE)
    while True:
        time.sleep(1)
torch.save = save
"""

# The smoke run's settings (smoke_run_dir, the uninterrupted run), saving every 2 steps.
ARGS = [
    "experiment=smoke",
    "logger=csv",
    "trainer.val_check_interval=10",
    "callbacks.checkpoint_recent.every_n_train_steps=2",
    "callbacks.checkpoint_recent.save_top_k=-1",
    "test=false",
    "summary.decode_speed=false",
    "ckpt_path=auto",
]


class Launch:
    """One ``scripts/train.py`` process on the run directory, and what it changed there.

    With ``kill_during_write=NAME`` the process stops half-way through writing ``NAME``.
    """

    def __init__(
        self, run: Path, site: Path, max_steps: int, *overrides: str, kill_during_write=None
    ) -> None:
        self.ckpts, self.note = run / "checkpoints", site / "WRITING"
        self.before = listing(self.ckpts)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
        if kill_during_write is not None:
            env["KILL_DURING_WRITE"] = kill_during_write
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO_ROOT / "scripts" / "train.py"),
                *ARGS,
                f"trainer.max_steps={max_steps}",
                *overrides,
                f"hydra.run.dir={run}",
            ],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_for(self, condition, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"ended before the kill: {self.stderr()[-2000:]}"
            assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
            time.sleep(0.005)

    def half_written(self) -> str | None:
        """The path of the file this process has half written, once it has."""
        try:
            pid, path = self.note.read_text().split(" ", 1)
        except FileNotFoundError:
            return None
        return path if int(pid) == self.proc.pid else None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL  # killed, not already ended
        self.proc.stderr.close()
        self.note.unlink(missing_ok=True)

    def stderr(self) -> str:
        text = self.proc.stderr.read()
        self.proc.stderr.close()
        return text

    def resumed_from(self, step: int) -> None:
        """This launch restored ``step`` > 0 and wrote no checkpoint of an earlier step."""
        assert_resumed_from(step, self.before, listing(self.ckpts))


def newest_step(ckpts: Path) -> int:
    return max(int(m[1]) for p in ckpts.glob("step*.ckpt") if (m := STEP_FILE.fullmatch(p.name)))


def assert_every_checkpoint_loads(ckpts: Path) -> None:
    for path in ckpts.glob("*.ckpt"):
        torch.load(path, weights_only=False)


def test_killed_run_resumes_to_the_uninterrupted_weights(
    tmp_path, multi30k_dir, cache_dir, smoke_run_dir
) -> None:
    site, run = tmp_path / "site", tmp_path / "run"
    site.mkdir()
    (site / "sitecustomize.py").write_text(KILL_DURING_WRITE)
    ckpts = run / "checkpoints"
    paths = (f"data.local_dir={multi30k_dir}", f"paths.cache_dir={cache_dir}")

    # 1. Half-way through writing its second step file (step4.ckpt; step2.ckpt is whole).
    first = Launch(run, site, 20, *paths, kill_during_write="step4.ckpt")
    first.wait_for(first.half_written)
    first.kill()
    assert not (ckpts / "step4.ckpt").exists(), "the killed write tore step4.ckpt itself"
    assert_every_checkpoint_loads(ckpts)

    # 2. Relaunched (in this process: the same train() as scripts/train.py, without a second
    # import of torch and Lightning) to the end of a shorter budget, 10 steps: last.ckpt.
    before = listing(ckpts)
    train(
        compose_config("train", [*ARGS, "trainer.max_steps=10", *paths, f"paths.output_dir={run}"])
    )
    assert_resumed_from(2, before, listing(ckpts))

    # 3. Training on from step10.ckpt to 14 steps, half-way through overwriting last.ckpt of
    # step 10. (The checkpoint is named: ckpt_path=auto would take last.ckpt, which is written
    # at the end of fit and makes Lightning count one more epoch; docs/reliability.md.)
    old_last = listing(ckpts)["last.ckpt"]
    third = Launch(
        run, site, 14, *paths, f"ckpt_path={ckpts / 'step10.ckpt'}", kill_during_write="last.ckpt"
    )
    third.wait_for(third.half_written)
    third.kill()
    third.resumed_from(10)
    assert listing(ckpts)["last.ckpt"] == old_last, "the killed write changed last.ckpt"
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 10
    assert_every_checkpoint_loads(ckpts)

    # 4. To the end, 20 steps, from the newest checkpoint that loads (ckpt_path=auto).
    assert newest_step(ckpts) == 14
    before = listing(ckpts)
    train(
        compose_config("train", [*ARGS, "trainer.max_steps=20", *paths, f"paths.output_dir={run}"])
    )
    assert_resumed_from(14, before, listing(ckpts))

    # The uninterrupted run: the session's smoke run, the same 20 steps.
    straight = torch.load(smoke_run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    resumed = torch.load(ckpts / "last.ckpt", weights_only=False)
    assert straight["global_step"] == 20
    assert_same_training_state(straight, resumed)
    # Nothing in the run directory is torn: every checkpoint loads, no temporary file is left,
    # and the metrics CSV parses.
    assert not list(ckpts.glob(".*"))
    assert_every_checkpoint_loads(ckpts)
    with open(run / "csv" / "metrics.csv") as f:
        assert list(csv.DictReader(f))
