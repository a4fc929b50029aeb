"""Fixtures and hooks shared by all tests: the raw Multi30k, a cache, the smoke config, the
session's smoke run. The plain helpers are in ``tests/helpers``.

Only torch is imported here: tests/attention and tests/model also run where only the core
is installed (.ci/run). Hydra and Lightning, which composing configs and training need, are
imported when used.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from helpers import REPO_ROOT, find_multi30k

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Every test runs offline: the Hugging Face Hub is never contacted.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# CTranslate2 runs int8 GEMMs on Intel MKL on Intel CPUs and on oneDNN on all others, and
# with oneDNN int8 agrees much less with fp32: the int8 export of the toy model in
# tests/deploy/test_export.py agrees with ours on 28/100 outputs on an AMD EPYC with
# oneDNN and on 84/100 there with MKL. Pin MKL (the x86-64 Linux wheel ships it) so int8
# tests expect the same on every host; docs/results/deployment.md measures both.
if sys.platform == "linux" and platform.machine() == "x86_64":
    os.environ.setdefault("CT2_USE_MKL", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Test models are tiny: intra-op threads only add overhead, and when the two cores are
    # shared with other jobs OpenMP threads wait on each other (tests ran ~50x slower).
    # Set before every test and before its fixtures, module-scoped ones included: making a
    # ctranslate2.Translator sets the process's OpenMP thread count to its own choice, and a
    # run trained after that summed in another order than the 1-thread run it was compared
    # with bit for bit (test_kill and test_resume_is_bit_exact in CI).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seeded() -> None:
    # Each test draws the same random tensors however the suite is selected or ordered, so a
    # failure seen in CI repeats with `pytest path::test` alone.
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    path = find_multi30k()
    if path is not None:
        return path
    where = os.environ.get("MULTIHEAD_DATA_DIR")
    if where:
        # CI sets it: there, missing data must fail every test that needs it, not skip them
        # all and leave the run green.
        pytest.fail(
            f"MULTIHEAD_DATA_DIR={where} holds no raw Multi30k; expected train.en.gz and the "
            "other {train,val,test_2016_flickr}.{en,de}.gz files there",
            pytrace=False,
        )
    pytest.skip(
        "raw Multi30k not found: set MULTIHEAD_DATA_DIR or put it at "
        f"{REPO_ROOT.parent / 'shared/data/multi30k'}"
    )


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data/tokenizer cache for the whole session, so it is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def smoke_config(tmp_path: Path, multi30k_dir: Path, cache_dir: Path):
    """A factory for the smoke experiment's config, writing into ``tmp_path``."""

    from helpers.training import compose_config, smoke_overrides

    def make(*overrides: str) -> DictConfig:
        return compose_config(
            "train", [*smoke_overrides(tmp_path, multi30k_dir, cache_dir), *overrides]
        )

    return make


@pytest.fixture(scope="session")
def smoke_run_dir(tmp_path_factory, multi30k_dir, cache_dir) -> Path:
    """The smoke experiment trained for 20 steps: checkpoints at steps 10 and 20, and last.

    Also the uninterrupted run that the resume and kill tests compare with bit for bit: the
    threads are reset before every test and fixture (above), so what ran before it changes
    nothing.
    """
    from helpers.training import train_smoke_run

    return train_smoke_run(tmp_path_factory.mktemp("smoke_run"), multi30k_dir, cache_dir)
