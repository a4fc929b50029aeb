"""``trainer.precision``: what ``auto`` picks on each kind of machine, and fp16 on the CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

from multihead.training.precision import resolve_precision, trainer_precision
from multihead.training.run import train


def fake_gpu(monkeypatch: pytest.MonkeyPatch, native_bf16: bool) -> None:
    """A CUDA device whose bf16 is native (A100, H100) or only emulated (V100, T4).

    torch's own check says True on both unless emulation is excluded.
    """

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native_bf16 or including_emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)


@pytest.mark.parametrize("accelerator", ["gpu", "cuda", "auto"])
@pytest.mark.parametrize(
    "native_bf16, expected", [(True, "bf16-mixed"), (False, "16-mixed")], ids=["a100", "v100"]
)
def test_auto_picks_bf16_only_where_the_gpu_has_it_natively(
    monkeypatch, accelerator, native_bf16, expected
) -> None:
    fake_gpu(monkeypatch, native_bf16)
    assert resolve_precision("auto", accelerator) == expected
    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("bf16-mixed", accelerator) == "bf16-mixed"  # asked for: kept


def test_an_explicit_precision_is_kept_and_an_unknown_one_named() -> None:
    assert resolve_precision("32-true", "cpu") == "32-true"
    expected = r"trainer\.precision='fp8'; expected one of .*32-true, bf16-mixed, 16-mixed"
    with pytest.raises(ValueError, match=expected):
        resolve_precision("fp8", "cpu")


def test_cpu_fp16_gets_lightnings_mixed_precision_plugin_with_a_cpu_scaler() -> None:
    args = trainer_precision("16-mixed", "cpu")
    assert args["precision"] is None
    (plugin,) = args["plugins"]
    assert isinstance(plugin, MixedPrecision) and plugin.device == "cpu"
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler._device == "cpu"
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        precision=args["precision"],
        plugins=args["plugins"],
    )
    assert trainer.precision == "16-mixed"
    with trainer.precision_plugin.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.float16
    # Lightning's own flag would have run bf16 (the swap this plugin avoids).
    swapped = Trainer(accelerator="cpu", logger=False, precision="16-mixed")
    assert swapped.precision == "bf16-mixed"
    # Everything else goes to Lightning as the flag.
    assert trainer_precision("bf16-mixed", "cpu") == {
        "precision": "bf16-mixed",
        "plugins": [],
        "float32_matmul_precision": None,
    }


def test_fp32_on_a_gpu_uses_tf32_and_the_cpu_never_does(monkeypatch) -> None:
    assert trainer_precision("32-true", "cpu")["float32_matmul_precision"] is None
    fake_gpu(monkeypatch, native_bf16=True)
    assert trainer_precision("32-true", "gpu")["float32_matmul_precision"] == "high"
    assert trainer_precision("bf16-mixed", "gpu")["float32_matmul_precision"] is None
    cpu = {"precision": "32-true", "plugins": [], "float32_matmul_precision": None}
    assert trainer_precision("auto", "cpu") == cpu  # even where a GPU is present


def test_cpu_16_mixed_trains_in_fp16_with_a_loss_scale(smoke_config, tmp_path) -> None:
    probe = tmp_path / "probe.json"
    cfg = smoke_config(
        "trainer.precision=16-mixed",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "test=false",
        "summary.limit=4",
        "+callbacks.probe._target_=helpers.training.PrecisionProbe",
        f"+callbacks.probe.out={probe}",
    )
    summary = train(cfg)
    record = json.loads(probe.read_text())
    assert record["dtypes"] == ["torch.float16"]  # not Lightning's silent bf16
    steps = record["steps"]
    assert len(steps) == 4 and all(math.isfinite(s["loss"]) for s in steps)
    # The scaler scales the loss, and no step found an inf (it would halve the scale and skip
    # Adam's step): Adam stepped once per batch.
    assert [s["scale"] for s in steps] == [2.0**16] * 4
    assert [s["adam_steps"] for s in steps] == [[1], [2], [3], [4]]
    assert summary["train/skipped_batches"] == 0
    # The summary and the logged hyperparameters name the precision that ran.
    assert summary["precision"] == "16-mixed"
    hparams = yaml.safe_load((tmp_path / "csv" / "hparams.yaml").read_text())
    assert hparams["precision"] == "16-mixed"
    assert summary["decode/greedy_sentences_per_s"] > 0  # decoding under fp16 autocast runs
    assert math.isfinite(summary["val/loss"])
