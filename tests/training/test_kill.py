"""A run killed with SIGKILL at several moments, one of them mid checkpoint write, resumes
each time (``ckpt_path=auto``) and ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import csv
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.conftest import REPO_ROOT
from tests.training.test_train import assert_same_training_state

# Loaded by every Python started with this directory on PYTHONPATH: torch.save writes in
# slow chunks, so a checkpoint write lasts long enough to be killed in the middle.
SLOW_SAVE = """
import io, time, torch
_save = torch.save
def slow_save(obj, f, *args, **kwargs):
    if isinstance(f, (str, bytes)) or not hasattr(f, "write"):
        return _save(obj, f, *args, **kwargs)
    buffer = io.BytesIO()
    _save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    step = len(data) // 4 + 1
    for start in range(0, len(data), step):
        f.write(data[start : start + step])
        f.flush()
        time.sleep(0.1)
torch.save = slow_save
"""


def start(run_dir: Path, cache: Path, data: Path, site: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    args = [
        "experiment=smoke",
        "logger=csv",
        "trainer.max_steps=16",
        "trainer.val_check_interval=8",
        "callbacks.checkpoint_recent.every_n_train_steps=2",
        "callbacks.checkpoint_recent.save_top_k=-1",
        "test=false",
        "summary.decode_speed=false",
        "ckpt_path=auto",
        f"data.local_dir={data}",
        f"paths.cache_dir={cache}",
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), *args],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting to kill"
        time.sleep(0.005)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()


def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path, multi30k_dir) -> None:
    site, cache = tmp_path / "site", tmp_path / "cache"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SAVE)

    straight = start(tmp_path / "straight", cache, multi30k_dir, site)
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-3000:]
    straight.stderr.close()

    run = tmp_path / "killed"
    ckpts = run / "checkpoints"
    rng = random.Random(0)

    def writing() -> bool:
        return ckpts.is_dir() and any(ckpts.glob(".*.tmp"))

    def saved(n: int):
        return lambda: ckpts.is_dir() and len(list(ckpts.glob("step*.ckpt"))) >= n

    # 1: in the middle of a checkpoint write; 2 and 3: at random moments after a save.
    for moment in (writing, saved(2), saved(4)):
        proc = start(run, cache, multi30k_dir, site)
        wait_for(moment, proc)
        if moment is not writing:
            time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            kill(proc)
    final = start(run, cache, multi30k_dir, site)
    assert final.wait(timeout=300) == 0, final.stderr.read()[-3000:]
    final.stderr.close()

    a, b = (
        torch.load(d / "checkpoints" / "last.ckpt", weights_only=False)
        for d in (tmp_path / "straight", run)
    )
    assert a["global_step"] == 16
    assert_same_training_state(a, b)
    # Nothing in the run directory is torn: every checkpoint loads, no temporary file is left,
    # and the metrics CSV parses.
    assert not list(ckpts.glob(".*"))
    for path in ckpts.glob("*.ckpt"):
        torch.load(path, weights_only=False)
    with open(run / "csv" / "metrics.csv") as f:
        assert list(csv.DictReader(f))
