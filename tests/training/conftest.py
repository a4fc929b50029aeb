"""A small run trained once per session, for the tests that need real checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from multihead.training.run import train
from tests.conftest import compose_config


@pytest.fixture(scope="session")
def smoke_run_dir(tmp_path_factory, multi30k_dir, cache_dir) -> Path:
    """The smoke experiment trained for 20 steps: checkpoints at steps 10 and 20, and last."""
    out = tmp_path_factory.mktemp("smoke_run")
    cfg = compose_config(
        "train",
        [
            "experiment=smoke",
            "logger=csv",
            f"data.local_dir={multi30k_dir}",
            f"paths.output_dir={out}",
            f"paths.cache_dir={cache_dir}",
            "trainer.max_steps=20",
            "trainer.val_check_interval=10",
            "test=false",
            "summary.decode_speed=false",
        ],
    )
    train(cfg)
    return out
