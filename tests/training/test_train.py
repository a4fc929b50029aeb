"""End-to-end training through the real composed configs (the smoke experiment)."""

from __future__ import annotations

import json
import math
import shutil
import socket
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from multihead.training import TranslationModule
from multihead.training.run import train

from helpers.scripts import run_script
from helpers.training import (
    assert_resumed_from,
    assert_same_training_state,
    compose_config,
    listing,
    read_metrics,
    smoke_overrides,
)


@pytest.mark.parametrize(
    "attention, logger, positional",
    [
        ("mha", "csv", "sinusoidal"),
        ("mqa", "none", "rope"),
        ("gqa", "none", "alibi"),
        ("diff_h8", "none", "rope"),
    ],
)
def test_fast_dev_run(
    smoke_config, attention: str, logger: str, positional: str, tmp_path: Path
) -> None:
    # GQA trains in test_smoke_run_writes_checkpoints_and_metrics. logger=none: the
    # learning-rate monitor, which only writes to loggers, is left out.
    cfg = smoke_config(
        f"attention={attention}", f"logger={logger}", f"model.positional={positional}",
        "+trainer.fast_dev_run=true",
    )  # fmt: skip
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"])
    assert math.isfinite(metrics["test/bleu"])
    assert (tmp_path / "tokenizer.json").is_file()
    if logger == "none":
        assert not (tmp_path / "csv").exists() and not (tmp_path / "wandb").exists()


def test_smoke_run_writes_checkpoints_and_metrics(smoke_config, tmp_path: Path) -> None:
    cfg = smoke_config("attention=gqa", "attention.num_heads=4", "attention.num_kv_heads=2")
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["test/bleu"])
    assert (tmp_path / "tokenizer.json").is_file()
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
    """25 steps, saved every 10: the run stops between saves, and still leaves its final
    weights on disk as last.ckpt and step25.ckpt.

    Lightning 2.6 only refreshes a ModelCheckpoint's last.ckpt when that callback saves a
    top-k file, so last.ckpt used to be the best-BLEU checkpoint; RecentCheckpoints writes
    the final state under both names.
    """
    cfg = smoke_config(
        "trainer.max_steps=25",
        "trainer.val_check_interval=10",
        f"test_ckpt={setting}",
        "module.test_beam_size=2",
        "summary.decode_speed=false",
    )
    summary = train(cfg)
    ckpt_dir = tmp_path / "checkpoints"
    tested = Path(summary["test/ckpt"])
    assert tested == ckpt_dir / f"{setting}.ckpt" and tested.is_file()
    assert summary["test/beam_size"] == 2
    steps = sorted(int(p.stem[4:]) for p in ckpt_dir.glob("step*.ckpt"))
    assert steps[-2:] == [20, 25], steps
    a, b = (torch.load(ckpt_dir / f"step{n}.ckpt", weights_only=False) for n in (20, 25))
    if setting == "avg2":
        avg = torch.load(tested, weights_only=False)
        key = "model.encoder_layers.0.self_attn.in_proj.weight"
        expected = (a["state_dict"][key] + b["state_dict"][key]) / 2
        torch.testing.assert_close(avg["state_dict"][key], expected)
    else:
        last = torch.load(tested, weights_only=False)
        assert last["global_step"] == b["global_step"] == 25
        for key, value in b["state_dict"].items():
            assert torch.equal(last["state_dict"][key], value), key


def callback_states(ckpt: dict, run_dir: Path) -> dict:
    """The callbacks' states, with the run directory written as ``RUN`` and tensors as lists.

    The wall clock's minutes are left out: they measure this machine, not the training.
    """

    def plain(value):
        if isinstance(value, dict):
            return {plain(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, str):
            return value.replace(str(run_dir), "RUN")
        return value

    states = plain(ckpt["callbacks"])
    for key, state in states.items():
        if key.startswith("WallClock"):
            del state["elapsed_min"]
    return states


@pytest.fixture
def trained_steps(monkeypatch) -> list[int]:
    """The ``global_step`` at the start of every training batch of the runs in this test."""
    steps: list[int] = []
    start = TranslationModule.on_train_batch_start

    def recording(self, batch, batch_idx):
        steps.append(self.global_step)
        return start(self, batch, batch_idx)

    monkeypatch.setattr(TranslationModule, "on_train_batch_start", recording)
    return steps


HALF = ["trainer.max_steps=10", "trainer.val_check_interval=10", "test=false"]
HALF += ["summary.decode_speed=false"]


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory, multi30k_dir, cache_dir) -> tuple[Path, Path]:
    """Two copies of a run stopped after 10 of the smoke run's 20 steps (``smoke_run_dir``
    trains the same 20 steps without a stop): one to resume, one to break resuming on."""
    run = tmp_path_factory.mktemp("stopped")
    train(
        compose_config(
            "train",
            [
                "experiment=smoke",
                "logger=csv",
                f"data.local_dir={multi30k_dir}",
                f"paths.output_dir={run}",
                f"paths.cache_dir={cache_dir}",
                *HALF,
            ],
        )
    )
    copy = tmp_path_factory.mktemp("stopped_copy") / "run"
    shutil.copytree(run, copy)  # with the files' times, which the resume orders them by
    return run, copy


def resume_stopped_run(smoke_config, run: Path, trained_steps: list[int]) -> dict:
    """Relaunch the stopped run in its directory from step10.ckpt to step 20; check that it
    resumed at step 10, and return its last checkpoint.

    (Not from last.ckpt, which ``ckpt_path=auto`` would take: written at the end of ``fit``,
    it makes Lightning count one more epoch and logged step; docs/reliability.md.)
    """
    before = listing(run / "checkpoints")
    trained_steps.clear()
    resume = f"ckpt_path={run / 'checkpoints' / 'step10.ckpt'}"
    train(smoke_config(*HALF, "trainer.max_steps=20", resume, f"paths.output_dir={run}"))
    assert trained_steps == list(range(10, 20)), f"trained steps {trained_steps}, not 10..19"
    assert_resumed_from(10, before, listing(run / "checkpoints"))
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)


def test_resume_is_bit_exact(smoke_config, smoke_run_dir, stopped_runs, trained_steps) -> None:
    """20 steps straight (the session's ``smoke_run_dir``) == 10 steps, a stop, a resume, 10
    more.

    Dropout is reseeded from the step at every step and the sampler is deterministic, so a
    relaunch that ignored its checkpoint and trained 20 steps from scratch would end with
    the same weights: the resumed run must also train only steps 10..19 and leave the
    checkpoints of steps <= 10 as they were.
    """
    run = stopped_runs[0]
    resumed = resume_stopped_run(smoke_config, run, trained_steps)
    straight = torch.load(smoke_run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert straight["global_step"] == 20
    assert_same_training_state(straight, resumed)
    # Equal here because BLEU rose from step 10 to 20: step10.ckpt holds checkpoint_best's
    # state from before step 10's validation (docs/reliability.md, "Known gaps").
    assert callback_states(straight, smoke_run_dir) == callback_states(resumed, run)


# The session's smoke run (helpers.training.train_smoke_run).
SAME_COMMAND = [
    "trainer.max_steps=20",
    "trainer.val_check_interval=10",
    "test=false",
    "summary.decode_speed=false",
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.slow  # 1 or 2 trainings, each a process
def test_same_command_seed_and_threads_give_identical_weights(
    threads, smoke_run_dir, multi30k_dir, tmp_path
) -> None:
    """The session's smoke run (20 steps, seed 1234, one thread) again as a fresh
    ``scripts/train.py`` process with its own data and tokenizer cache, or two such runs on
    two threads (the recipe's count), end with the same weights, optimizer state and sampler
    position, bit for bit (docs/usage.md, "Reproducible runs": the thread count and the CPU's
    kernels must match too). The budget is in steps: under ``max_time`` with a clock-read
    cooldown, as the recipe trains, the machine's load decides the steps, and no test can pin
    that."""
    runs = [smoke_run_dir] if threads == 1 else []
    while len(runs) < 2:
        out = tmp_path / f"run{len(runs)}"
        overrides = smoke_overrides(out, multi30k_dir, tmp_path / "cache")
        result = run_script(
            "train.py", *overrides, *SAME_COMMAND, "hydra.mode=RUN", f"hydra.run.dir={out}",
            env={"OMP_NUM_THREADS": str(threads)},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads((out / "summary.json").read_text())["run/threads"] == threads
        runs.append(out)
    first, again = (torch.load(r / "checkpoints" / "last.ckpt", weights_only=False) for r in runs)
    assert_same_training_state(first, again)


def test_same_command_check_fails_when_the_seed_is_not_applied(
    smoke_config, smoke_run_dir, tmp_path, monkeypatch
) -> None:
    """A mutation check: with ``seed_everything`` dropped (the initial weights then come from
    wherever the global generator stands), the check above fails on the same command."""
    monkeypatch.setattr(pl, "seed_everything", lambda *args, **kwargs: None)
    torch.manual_seed(0)  # not the run's 1234
    train(smoke_config(*SAME_COMMAND))
    first = torch.load(smoke_run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    again = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    with pytest.raises(AssertionError, match=r"^model\."):
        assert_same_training_state(first, again)


def test_resume_checks_fail_when_resume_is_dropped(
    smoke_config, stopped_runs, trained_steps, monkeypatch
) -> None:
    """A mutation check: with the checkpoint dropped before ``Trainer.fit`` (a relaunch that
    starts over), the checks of ``test_resume_is_bit_exact`` and of ``test_kill.py`` fail."""
    fit = pl.Trainer.fit

    def fit_from_scratch(self, *args, ckpt_path=None, **kwargs):
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(pl.Trainer, "fit", fit_from_scratch)
    run = stopped_runs[1]
    before = listing(run / "checkpoints")
    with pytest.raises(AssertionError, match=r"trained steps \[0, 1, 2,"):
        resume_stopped_run(smoke_config, run, trained_steps)
    # test_kill.py's check on each relaunch
    with pytest.raises(AssertionError, match="a checkpoint of step 10 was written again"):
        assert_resumed_from(10, before, listing(run / "checkpoints"))


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


def test_run_writes_test_hypotheses_in_order_and_when_where(smoke_config, tmp_path: Path) -> None:
    """hypotheses.test.txt holds the tested checkpoint's outputs in the split's order (the
    test batches decode longest first): the same lines as scripts/evaluate.py's decoding of
    that checkpoint, sentence by sentence. summary.json says when and where the run ran."""
    from datetime import datetime

    from multihead.evaluation.scoring import evaluate_checkpoint

    cfg = smoke_config(
        "trainer.max_steps=10",
        "trainer.val_check_interval=10",
        "test_ckpt=last",
        "module.test_beam_size=2",
        "summary.decode_speed=false",
    )
    summary = train(cfg)
    lines = (tmp_path / "hypotheses.test.txt").read_text().splitlines()
    scores = evaluate_checkpoint(
        summary["test/ckpt"], tmp_path / "eval", beam_size=2, limit=cfg.data.test_limit
    )
    assert lines == (tmp_path / "eval" / "hypotheses.test.txt").read_text().splitlines()
    assert len(lines) == cfg.data.test_limit == scores["sentences"]
    assert len(set(lines)) > 10  # outputs differ (in length at least): the order is tested
    assert summary["test/bleu"] == pytest.approx(scores["bleu"])
    start, end = (datetime.fromisoformat(summary[k]) for k in ("run/start", "run/end"))
    assert start <= end and start.utcoffset().total_seconds() == 0
    assert summary["run/host"] == socket.gethostname() and summary["run/cpu"]
    # the machine compare.py tells overlapping runs apart by: the running kernel's boot id
    assert summary["run/boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    # What makes two runs identical besides the command and seed (docs/usage.md): the
    # conftest runs every test on one thread.
    assert summary["run/threads"] == 1
    assert summary["run/cpu_capability"] == torch.backends.cpu.get_cpu_capability()
