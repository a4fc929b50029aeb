"""Fixtures shared by all tests: where the raw Multi30k lives, and composing real configs.

Only torch is imported here: tests/attention and tests/model also run where only the core
is installed (.ci/run). Hydra, which composing configs needs, is imported when used.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from omegaconf import DictConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(REPO_ROOT / "configs")

# Every test runs offline: the Hugging Face Hub is never contacted.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# CTranslate2 runs int8 GEMMs on Intel MKL on Intel CPUs and on oneDNN on all others, and
# with oneDNN int8 agrees much less with fp32: the int8 export of the toy model in
# tests/deploy/test_export.py agrees with ours on 28/100 outputs on an AMD EPYC with
# oneDNN and on 84/100 there with MKL. Pin MKL (the x86-64 Linux wheel ships it) so int8
# tests expect the same on every host; docs/results.md ("Deployment") measures both.
if sys.platform == "linux" and platform.machine() == "x86_64":
    os.environ.setdefault("CT2_USE_MKL", "1")


def find_multi30k() -> Path | None:
    """``$MULTIHEAD_DATA_DIR`` if set, else ``../shared/data/multi30k`` beside the repository."""
    where = os.environ.get("MULTIHEAD_DATA_DIR")
    candidate = Path(where) if where else REPO_ROOT.parent / "shared/data/multi30k"
    return candidate if (candidate / "train.en.gz").is_file() else None


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


def compose_config(name: str, overrides: list[str]) -> DictConfig:
    """Compose ``configs/<name>.yaml`` with ``overrides``, exactly as the scripts do."""
    from multihead.cli import register_resolvers

    from hydra import compose, initialize_config_dir

    register_resolvers()  # as scripts/train.py does
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


@pytest.fixture
def smoke_config(tmp_path: Path, multi30k_dir: Path, cache_dir: Path):
    """A factory for the smoke experiment's config, writing into ``tmp_path``."""

    def make(*overrides: str) -> DictConfig:
        return compose_config(
            "train",
            [
                "experiment=smoke",
                "logger=csv",
                f"data.local_dir={multi30k_dir}",
                f"paths.output_dir={tmp_path}",
                f"paths.cache_dir={cache_dir}",
                *overrides,
            ],
        )

    return make


@pytest.fixture(scope="session")
def smoke_run_dir(tmp_path_factory, multi30k_dir, cache_dir) -> Path:
    """The smoke experiment trained for 20 steps: checkpoints at steps 10 and 20, and last."""
    return train_smoke_run(tmp_path_factory.mktemp("smoke_run"), multi30k_dir, cache_dir)


def train_smoke_run(out: Path, multi30k_dir: Path, cache_dir: Path) -> Path:
    """Train the smoke experiment for 20 steps into ``out`` (as :func:`smoke_run_dir`).

    The resume and kill tests train their own uninterrupted run with this, next to the runs
    they compare it with: the session's run is trained earlier, among other tests, and a
    bit-exact comparison must not depend on what ran in between.
    """
    from multihead.training.run import train

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


class HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for a GPU, run on the CPU.

    Reading a tensor's value (``.item()``, ``bool(t)``, ``int(t)``), ``nonzero`` (also inside
    ``x[mask]``) and ``equal`` cost nothing on the CPU, but on CUDA tensors each is a
    host-device sync: counted on a CPU step, they are that step's syncs on a GPU, except
    what only CUDA kernels do (tests/fake_cuda counts on fake CUDA tensors instead).
    """

    _READS = ("_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal")
    _INDEX = ("index", "index_put", "index_put_")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self._READS:
            self.count += 1
        elif name in self._INDEX:  # a boolean mask index is a nonzero inside the op
            self.count += sum(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
            )
        return func(*args, **(kwargs or {}))
