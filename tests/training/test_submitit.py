"""A real multirun through hydra-submitit-launcher's local executor (hydra/launcher=submitit_local).

Each job runs in its own process started by submitit, as on a SLURM node; the SLURM launcher
(hydra/launcher=slurm) differs only in how those processes are started.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from helpers.scripts import run_script

pytest.importorskip(
    "hydra_plugins.hydra_submitit_launcher", reason="needs hydra-submitit-launcher (.[cluster])"
)

# Each test runs train.py in a process (the multirun, its 2 jobs in 2 more): CI's slow pass.
# The SLURM launcher's config composes in test_cluster_configs.py.
pytestmark = pytest.mark.slow


def test_submitit_local_multirun_gives_each_job_its_run_and_one_wandb_group(
    tmp_path: Path, multi30k_dir: Path, cache_dir: Path
) -> None:
    result = run_script(
        "train.py",
        "-m",
        "experiment=smoke",
        "hydra/launcher=submitit_local",
        "attention=mha,mqa",
        "logger=wandb_csv",
        "wandb_group=G",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "summary.limit=4",
        f"data.local_dir={multi30k_dir}",
        f"hydra.sweep.dir={tmp_path}",
        f"paths.cache_dir={cache_dir}",  # the session's smoke data, built once
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # submitit ran each job as a job of its own: one folder of logs and result per job.
    assert len(list((tmp_path / ".submitit").glob("*/*_result.pkl"))) == 2

    jobs = sorted(p for p in tmp_path.iterdir() if p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1"]
    summaries = [json.loads((job / "summary.json").read_text()) for job in jobs]
    assert [s["kind"] for s in summaries] == ["mha", "mqa"]
    # Each job ran its test stage (after 4 steps the score itself means nothing).
    assert all(isinstance(s["test/bleu"], float) for s in summaries)

    run_dirs = [list((job / "wandb").glob("offline-run-*")) for job in jobs]
    assert [len(runs) for runs in run_dirs] == [1, 1]
    assert run_dirs[0][0].name != run_dirs[1][0].name
    # Each job was given the sweep's group. (wandb offline keeps a run's group only in its
    # binary log, a private format; test_wandb.py reads it from wandb's Run object.)
    for job in jobs:
        hparams = yaml.safe_load((job / "csv" / "hparams.yaml").read_text())
        assert hparams["logger"]["wandb"]["group"] == "G"


def test_slurm_launcher_submits_the_sweep_as_one_job_array(tmp_path: Path, monkeypatch) -> None:
    """What `hydra/launcher=slurm` hands to sbatch. No SLURM here: `sbatch` and `srun` are
    stand-ins on PATH that record the submission file and refuse, so the command fails after
    submitting and nothing runs."""
    bin_dir, captured = tmp_path / "bin", tmp_path / "submission.sh"
    bin_dir.mkdir()
    for name, body in [("sbatch", f'cp "$1" {captured}\n'), ("srun", "")]:
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}echo 'no SLURM here' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    result = run_script(
        "train.py",
        "-m",
        "experiment=compare_heads",
        "budget=gpu",
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.gpus_per_node=2",
        "trainer=ddp",
        "ckpt_path=auto",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert result.returncode != 0 and "no SLURM here" in result.stderr
    flags = {
        line.split()[1] for line in captured.read_text().splitlines() if line.startswith("#SBATCH ")
    }
    # The nine head configurations of compare_heads, eight at once, two GPUs and two
    # tasks (ranks) each; SLURM warns 90 s before the time limit so submitit can requeue.
    assert {
        "--array=0-8%8",
        "--partition=gpu",
        "--gpus-per-node=2",
        "--ntasks-per-node=2",
        "--nodes=1",
        "--signal=USR2@90",
        "--time=240",
    } <= flags
