"""wandb never prompts: offline without a key, one finished run per job, head settings visible."""

from __future__ import annotations

import logging
import os

import torch
import wandb

from multihead.training.run import train
from multihead.wandb_setup import configure_wandb_mode, has_wandb_api_key


def test_no_api_key_means_offline_with_sync_hint(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert not has_wandb_api_key()
    with caplog.at_level(logging.WARNING):
        assert configure_wandb_mode(str(tmp_path)) == "offline"
    assert "wandb sync" in caplog.text
    assert os.environ["WANDB_MODE"] == "offline"


def test_api_key_in_netrc_means_online(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert configure_wandb_mode(str(tmp_path)) == "online"


def test_wandb_run_is_finished_named_grouped_and_resumed(
    smoke_config, tmp_path, monkeypatch
) -> None:
    started = []
    init = wandb.init

    def recording_init(*args, **kwargs):
        started.append(init(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(wandb, "init", recording_init)
    overrides = [
        "logger=wandb",
        "attention=mqa",
        "wandb_group=G",
        "seed=7",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "summary.decode_speed=false",
        "test=false",
    ]
    summary = train(smoke_config(*overrides))
    assert wandb.run is None  # finished, so the next multirun job starts a new run
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # Named after the built model: every kind of sublayer is MQA with 4 query heads.
    assert summary["run_name"] == "enc-mqa4_dec-mqa4_cross-mqa4_sdpa"
    assert summary["seed"] == 7  # compare.py pairs runs by it
    # What wandb itself holds for the run. Offline, wandb 0.31 writes the group only into
    # its binary log (run-*.wandb, a private format), so ask wandb's Run object.
    (run,) = started
    assert (run.group, run.name) == ("G", summary["run_name"])
    assert run.job_type == "smoke"  # the experiment's task_name: LM and MQAR runs share names
    assert summary["run/wandb_group"] == "G"  # compare.py logs its comparison there
    assert runs[0].name.endswith(f"-{run.id}")

    # A resumed job continues its wandb run: the id is stored in the checkpoint.
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["multihead"]["wandb_id"] == run.id
    train(smoke_config(*overrides, "trainer.max_steps=4", "ckpt_path=auto"))
    assert started[1].id == run.id
