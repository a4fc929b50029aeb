"""End-to-end training through the real composed configs (the smoke experiment)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from multihead.training.run import train


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("attention", ["mha", "gqa", "mqa"])
def test_fast_dev_run(smoke_config, attention: str, tmp_path: Path) -> None:
    cfg = smoke_config(f"attention={attention}", "+trainer.fast_dev_run=true")
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"])
    assert math.isfinite(metrics["test/bleu"])
    assert (tmp_path / "tokenizer.json").is_file()


def test_smoke_run_writes_checkpoints_and_metrics(smoke_config, tmp_path: Path) -> None:
    cfg = smoke_config("attention=gqa", "attention.num_heads=4", "attention.num_kv_heads=2")
    metrics = train(cfg)
    ckpts = {p.name for p in (tmp_path / "checkpoints").iterdir()}
    assert "last.ckpt" in ckpts and "step20.ckpt" in ckpts and "step40.ckpt" in ckpts
    assert any(name.startswith("best-") for name in ckpts)
    rows = read_metrics(tmp_path)
    logged = {k for row in rows for k, v in row.items() if v}
    for key in (
        "train/loss",
        "val/loss",
        "val/ppl",
        "val/bleu",
        "test/bleu",
        "lr-Adam",
        "train/grad_norm",
        "perf/tgt_tokens_per_s",
        "perf/peak_memory_mb",
    ):
        assert key in logged, key
    # Perplexity is exp of the plain NLL, which label smoothing (0.1) keeps below the loss.
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/nll"]), rel=1e-5)
    assert metrics["val/nll"] < metrics["val/loss"]
    best = [p for p in (tmp_path / "checkpoints").glob("best-*.ckpt")]
    assert metrics["test/ckpt"] == str(best[0]) and metrics["test/beam_size"] == 1


@pytest.mark.parametrize("setting", ["last", "avg2"])
def test_test_ckpt_names_the_tested_checkpoint(smoke_config, tmp_path: Path, setting) -> None:
    cfg = smoke_config(
        "trainer.max_steps=20",
        "trainer.val_check_interval=10",
        f"test_ckpt={setting}",
        "module.test_beam_size=2",
        "summary.decode_speed=false",
    )
    summary = train(cfg)
    tested = Path(summary["test/ckpt"])
    assert tested == tmp_path / "checkpoints" / f"{setting}.ckpt" and tested.is_file()
    assert summary["test/beam_size"] == 2
    if setting == "avg2":
        a, b = (
            torch.load(tmp_path / "checkpoints" / f"step{n}.ckpt", weights_only=False)
            for n in (10, 20)
        )
        avg = torch.load(tested, weights_only=False)
        key = "model.encoder_layers.0.self_attn.in_proj.weight"
        expected = (a["state_dict"][key] + b["state_dict"][key]) / 2
        torch.testing.assert_close(avg["state_dict"][key], expected)


def test_final_weights_are_saved_as_last_and_step(smoke_config, tmp_path: Path) -> None:
    """A run that stops between every-N-steps saves still leaves its final weights on disk.

    Lightning 2.6 only refreshes a ModelCheckpoint's last.ckpt when that callback saves a
    top-k file, so last.ckpt used to be the best-BLEU checkpoint; RecentCheckpoints writes
    the final state under both names.
    """
    cfg = smoke_config(
        "trainer.max_steps=25",
        "trainer.val_check_interval=10",
        "test=false",
        "summary.decode_speed=false",
    )
    train(cfg)
    ckpt_dir = tmp_path / "checkpoints"
    steps = sorted(int(p.stem[4:]) for p in ckpt_dir.glob("step*.ckpt"))
    assert steps[-1] == 25, steps
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    final = torch.load(ckpt_dir / "step25.ckpt", weights_only=False)
    assert last["global_step"] == final["global_step"] == 25
    for key, value in final["state_dict"].items():
        assert torch.equal(last["state_dict"][key], value), key


def assert_same_training_state(a: dict, b: dict) -> None:
    """Every tensor of the model, optimiser and scheduler, the step and the sampler position."""
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        assert opt_a["param_groups"] == opt_b["param_groups"]
        for i, state in opt_a["state"].items():
            for name, value in state.items():
                assert torch.equal(value, opt_b["state"][i][name]), (i, name)
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["TranslationDataModule"] == b["TranslationDataModule"]  # the sampler position


def test_resume_is_bit_exact(smoke_config, tmp_path: Path) -> None:
    """N steps straight == N/2 steps, a stop, a resume from the checkpoint, N/2 more."""
    common = ["trainer.max_steps=20", "trainer.val_check_interval=10", "test=false"]
    common += ["summary.decode_speed=false"]
    train(smoke_config(*common, f"paths.output_dir={tmp_path / 'straight'}"))
    straight_rng = torch.get_rng_state()

    half = tmp_path / "half" / "checkpoints" / "step10.ckpt"
    train(smoke_config(*common, "trainer.max_steps=10", f"paths.output_dir={tmp_path / 'half'}"))
    train(smoke_config(*common, f"ckpt_path={half}", f"paths.output_dir={tmp_path / 'resumed'}"))
    assert torch.equal(torch.get_rng_state(), straight_rng)

    a, b = (
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=False)
        for run in ("straight", "resumed")
    )
    assert a["global_step"] == 20
    assert_same_training_state(a, b)


def test_wall_clock_logs_minutes_and_checkpoints_at_marks(smoke_config, tmp_path: Path) -> None:
    """Marks a few milliseconds apart: every one passed writes a minute checkpoint once."""
    cfg = smoke_config(
        "callbacks.wall_clock.save_at_minutes=[0.0001,0.0002,1000]",
        "trainer.max_steps=10",
        "trainer.val_check_interval=5",
        "test=false",
        "summary.decode_speed=false",
    )
    train(cfg)
    minute_ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("minute*.ckpt"))
    # The first step already passes both early marks; the one that is skipped is not saved.
    assert len(minute_ckpts) == 1 and minute_ckpts[0].startswith("minute0.0001-step"), minute_ckpts
    elapsed = [
        float(r["time/elapsed_min"]) for r in read_metrics(tmp_path) if r["time/elapsed_min"]
    ]
    assert len(elapsed) == 2 and 0 < elapsed[0] < elapsed[1]
    # The checkpoints carry the clock: a resumed run counts on from there.
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]
    (clock,) = [v for k, v in state.items() if k.startswith("WallClock")]
    assert clock["marks"] == [1000] and clock["elapsed_min"] >= elapsed[1]
