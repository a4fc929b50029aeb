"""DDP on CPU (gloo, 2 processes): it trains, it matches one process, its BLEU is corpus BLEU,
and a NaN loss on one rank stops both.

One 2-process run and one single-process run with twice the token budget, both without
dropout: the DDP sampler packs global batches of ``max_tokens * 2`` and splits each between
the ranks, so step i sees the same sentences in both runs. The evaluation splits have 63
sentences, so the ranks decode 32 and 31 of them.
"""

from __future__ import annotations

import csv
import gzip
import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from multihead.evaluation import corpus_scores, evaluate_checkpoint
from multihead.model import Transformer
from multihead.training import TranslationModule
from multihead.training.module import NonFiniteLossError
from multihead.training.run import train

from helpers.scripts import run_script
from helpers.training import compose_config

# Each test starts processes (a DDP training of 2 ranks, or 2 ranks of one step): CI's slow
# pass. trainer=ddp_cpu builds its Trainer in test_configs.py.
pytestmark = pytest.mark.slow

COMMON = [
    "experiment=smoke",
    "model.dropout=0.0",
    "trainer.max_steps=12",
    "trainer.val_check_interval=6",
    "module.bleu_every_n_val=1",
    "test_ckpt=last",
    "summary.limit=8",
    "data.val_limit=63",
    "data.test_limit=63",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, multi30k_dir, cache_dir) -> dict[str, Path]:
    """The DDP run (2 ranks, half batches) in a process of its own, as a user starts it; the
    single-process run it is compared with (whole batches) in this one."""
    root = tmp_path_factory.mktemp("ddp")
    out = {"ddp": root / "ddp", "single": root / "single"}
    data = [f"data.local_dir={multi30k_dir}", f"paths.cache_dir={cache_dir}"]
    result = run_script(
        "train.py",
        *COMMON,
        "trainer=ddp_cpu",
        "data.max_tokens=1024",
        "logger=wandb_csv",
        *data,
        f"hydra.run.dir={out['ddp']}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    single = [*COMMON, "data.max_tokens=2048", "logger=csv", *data]
    train(compose_config("train", [*single, f"paths.output_dir={out['single']}"]))
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
    """The DDP run's test BLEU and chrF equal one process scoring the same checkpoint, and
    differ from the score of one rank's share alone (what a rank would log ungathered)."""
    summary = json.loads((runs["ddp"] / "summary.json").read_text())
    alone = evaluate_checkpoint(
        summary["test/ckpt"],
        tmp_path,
        split="test",
        beam_size=1,
        limit=63,  # data.test_limit
        local_dir=str(multi30k_dir),
    )
    assert alone["sentences"] == 63
    assert summary["test/chrf"] > 0
    assert summary["test/chrf"] == pytest.approx(alone["chrf"], abs=1e-4)
    assert summary["test/bleu"] == pytest.approx(alone["bleu"], abs=1e-4)
    # Rank 0 decodes sentences 0, 2, 4, ... (the data module's shard).
    hypotheses = (tmp_path / "hypotheses.test.txt").read_text().split("\n")[:63]
    with gzip.open(multi30k_dir / "test_2016_flickr.de.gz", "rt") as f:
        references = f.read().split("\n")[:63]
    whole = corpus_scores(hypotheses, references)
    assert whole.chrf == pytest.approx(alone["chrf"], abs=1e-4)  # the files are what was scored
    rank0 = corpus_scores(hypotheses[::2], references[::2])
    assert rank0.chrf != pytest.approx(summary["test/chrf"], abs=1e-4)


def one_rank_step(rank: int, init_file: str, results) -> None:
    """Rank ``rank`` of 2 (gloo) takes one training step whose loss is NaN on rank 1 only."""
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),  # a rank left waiting for the other fails, not hangs
    )
    try:
        torch.manual_seed(0)
        model = Transformer(
            src_vocab_size=20,
            tgt_vocab_size=20,
            d_model=16,
            ffn_dim=32,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dropout=0.0,
            max_positions=16,
            pad_id=0,
            attention={"num_heads": 2},
        )
        module = TranslationModule(
            model,
            SimpleNamespace(pad_id=0),
            optimizer=torch.optim.Adam,
            beam_size=1,
            length_penalty=1.0,
            max_len_a=1.0,
            max_len_b=1.0,
        )
        # What training_step reads of the trainer; the reduce is Lightning's own DDP one.
        module.trainer = SimpleNamespace(world_size=2, global_step=2, strategy=DDPStrategy())
        loss = TranslationModule.loss
        if rank == 1:
            module.loss = lambda batch: (loss(module, batch)[0] * float("nan"), 6)
        batch = {"src": torch.randint(3, 20, (2, 5)), "tgt": torch.randint(3, 20, (2, 4))}
        try:
            module.training_step(batch, 0)
            outcome = "went on"
        except NonFiniteLossError as err:
            outcome = str(err)
        except Exception as err:  # went on: to self.log, which needs a real trainer, or to a
            outcome = f"went on: {type(err).__name__}: {err}"  # collective, until gloo's timeout
        results.put((rank, outcome))
    finally:
        torch.distributed.destroy_process_group()


def test_a_nan_on_one_rank_stops_every_rank(tmp_path) -> None:
    """Every rank learns of rank 1's NaN from the step's all-reduce, and stops with the error.
    Without it rank 0 would go on and wait for rank 1 in the next collective."""
    # spawn, not fork: a fork after earlier tests started OpenMP threads can deadlock.
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=one_rank_step, args=(rank, str(tmp_path / "init"), results))
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        # The ranks' imports and step take 15 s of CPU; at load 8 on 2 cores, about a minute.
        outcome = dict(results.get(timeout=300) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
            process.kill()
    assert outcome[1].startswith("non-finite training loss (nan) at step 2;"), outcome
    assert outcome[0].startswith("non-finite training loss (") and "at step 2;" in outcome[0], (
        outcome
    )
