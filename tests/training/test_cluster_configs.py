"""The many-GPU presets (trainer=ddp, trainer=fsdp) and the SLURM sweep launcher compose as
docs/cluster.md says; the Trainers are built only where CUDA is (pytest -m gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from multihead.model import DecoderLayer, EncoderLayer, build_model
from multihead.training.precision import resolve_precision

from helpers import CONFIG_DIR, REPO_ROOT
from helpers.training import compose_config

CUDA = torch.cuda.is_available()


def trainer_config(tmp_path: Path, *overrides: str):
    base = [f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"]
    return compose_config("train", [*base, *overrides])


@pytest.mark.parametrize("preset", ["ddp", "fsdp"])
def test_multi_gpu_presets_shard_batches_themselves(preset, tmp_path) -> None:
    t = trainer_config(tmp_path, f"trainer={preset}").trainer
    assert (t.accelerator, t.devices, t.num_nodes) == ("gpu", "auto", 1)
    # Our batch sampler splits each global batch between ranks; a DistributedSampler on top
    # would shard the data twice.
    assert t.use_distributed_sampler is False
    assert t.precision == "auto" and t.max_steps == 20000  # the rest as trainer=cpu
    expected = "ddp" if preset == "ddp" else "lightning.pytorch.strategies.FSDPStrategy"
    assert (t.strategy if preset == "ddp" else t.strategy._target_) == expected


def test_fsdp_strategy_wraps_each_layer_and_saves_full_checkpoints(tmp_path) -> None:
    from torch.distributed.fsdp import ShardingStrategy

    cfg = trainer_config(tmp_path, "trainer=fsdp", "model=transformer_base")
    strategy = instantiate(cfg.trainer.strategy)  # the strategy alone needs no GPU
    assert strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert strategy._state_dict_type == "full"  # one file that evaluate.py etc. can read
    policy = strategy.kwargs["auto_wrap_policy"]
    model = build_model(OmegaConf.to_container(cfg, resolve=True), vocab_size=100, pad_id=0)
    units = [m for m in model.modules() if policy(module=m, recurse=False, nonwrapped_numel=0)]
    assert all(isinstance(m, (EncoderLayer, DecoderLayer)) for m in units)
    assert len(units) == cfg.model.num_encoder_layers + cfg.model.num_decoder_layers == 12


def test_slurm_launcher_runs_one_task_per_gpu(tmp_path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs .[cluster]")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (4, 4, 1)
    assert launcher.signal_delay_s == 90 and launcher.max_num_timeout > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="trainer=ddp and trainer=fsdp need a CUDA GPU")
@pytest.mark.parametrize("preset", ["ddp", "fsdp"])
def test_multi_gpu_trainers_instantiate(preset, tmp_path) -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    cfg = trainer_config(tmp_path, f"trainer={preset}")
    precision = resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    trainer = instantiate(cfg.trainer, precision=precision, logger=False)
    expected = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}[preset]
    assert isinstance(trainer.strategy, expected)
    assert trainer.num_devices == torch.cuda.device_count()
    native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    assert precision == ("bf16-mixed" if native_bf16 else "16-mixed")


GPU_CHECK = REPO_ROOT / "scripts" / "gpu_check.sh"


def gpu_check_recipe() -> list[str]:
    """The overrides scripts/gpu_check.sh trains with (its `recipe=(...)` line)."""
    (line,) = [x for x in GPU_CHECK.read_text().splitlines() if x.startswith("recipe=(")]
    return line.removeprefix("recipe=(").removesuffix(")").split()


def test_gpu_check_recipe_composes_into_three_minutes_of_the_gpu_recipe(tmp_path) -> None:
    cfg = trainer_config(tmp_path, *gpu_check_recipe(), "data.local_dir=/data/multi30k")
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "auto"
    assert cfg.trainer.max_time == "00:00:03:00"
    # The cooldown ends the budget; longer than the budget, the rate would never peak.
    assert 0 < cfg.module.scheduler.cooldown_minutes < 3
    assert cfg.task_name == "multi30k_en_de" and cfg.model.d_model == 128
    assert list(cfg.logger) == ["csv"]  # the script reads csv/hparams.yaml and summary.json


@pytest.mark.skipif(CUDA, reason="checks the message given where CUDA is missing")
@pytest.mark.slow  # a shell and a Python process
def test_gpu_check_without_cuda_fails_in_one_line(tmp_path) -> None:
    report = tmp_path / "report.md"
    result = subprocess.run(
        ["bash", str(GPU_CHECK), str(report)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("gpu_check: no CUDA device (torch: ")
    assert len(result.stderr.splitlines()) == 1 and not report.exists()
