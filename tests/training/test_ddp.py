"""DDP on CPU (gloo, 2 processes): it trains, it matches one process, its BLEU is corpus BLEU.

One 2-process run and one single-process run with twice the token budget, both without
dropout: the DDP sampler packs global batches of ``max_tokens * 2`` and splits each between
the ranks, so step i sees the same sentences in both runs.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from multihead.evaluation import evaluate_checkpoint
from tests.training.test_configs import run_script

COMMON = [
    "experiment=smoke",
    "model.dropout=0.0",
    "trainer.max_steps=12",
    "trainer.val_check_interval=6",
    "module.bleu_every_n_val=1",
    "test_ckpt=last",
    "summary.limit=8",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, multi30k_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ddp")
    cache = root / "cache"
    out = {}
    for name, extra in (
        ("ddp", ["trainer=ddp_cpu", "data.max_tokens=1024", "logger=wandb_csv"]),
        ("single", ["data.max_tokens=2048", "logger=csv"]),
    ):
        out[name] = root / name
        result = run_script(
            "train.py",
            *COMMON,
            *extra,
            f"data.local_dir={multi30k_dir}",
            f"paths.cache_dir={cache}",
            f"hydra.run.dir={out[name]}",
        )
        assert result.returncode == 0, result.stderr[-3000:]
    return out


def val_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(f) if r["val/loss"]}


def test_ddp_run_writes_one_set_of_outputs(runs) -> None:
    run = runs["ddp"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test/ckpt"] == str(run / "checkpoints" / "last.ckpt")
    assert summary["decode/greedy_sentences_per_s"] > 0
    names = {p.name for p in (run / "checkpoints").iterdir()}
    assert {"step6.ckpt", "step12.ckpt", "last.ckpt"} <= names
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1  # one wandb run per job
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 12


def test_two_half_batches_follow_one_whole_batch(runs) -> None:
    ddp, single = val_losses(runs["ddp"]), val_losses(runs["single"])
    assert sorted(ddp) == sorted(single) == [5, 11]
    for step in ddp:
        assert ddp[step] == pytest.approx(single[step], rel=1e-4), step
    a = torch.load(runs["ddp"] / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(runs["single"] / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for key, value in a.items():
        other = b[key]
        if key.endswith("in_proj.bias"):
            # The K bias adds the same number to every score of a query, so softmax ignores
            # it: its true gradient is 0, and Adam scales rounding noise up to full-size
            # steps. Compare the Q and V biases only (E = 32 in the smoke model).
            value, other = torch.cat([value[:32], value[64:]]), torch.cat([other[:32], other[64:]])
        torch.testing.assert_close(value, other, rtol=1e-3, atol=1e-5, msg=key)


def test_test_scores_are_corpus_scores_of_all_ranks(runs, multi30k_dir, tmp_path) -> None:
    """The DDP run's test BLEU and chrF equal one process scoring the same checkpoint."""
    summary = json.loads((runs["ddp"] / "summary.json").read_text())
    alone = evaluate_checkpoint(
        summary["test/ckpt"],
        tmp_path,
        split="test",
        beam_size=1,
        limit=64,  # the smoke budget's test_limit
        local_dir=str(multi30k_dir),
    )
    assert summary["test/chrf"] == pytest.approx(alone["chrf"], abs=1e-4)
    assert summary["test/bleu"] == pytest.approx(alone["bleu"], abs=1e-4)
