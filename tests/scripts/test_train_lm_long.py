"""scripts/train.py experiment=lm_long and experiment=mqar: a tiny run of each of the four
designs writes its summary (loss by position bucket, parameters, cache bytes) and a
checkpoint that rebuilds the model it trained; MQAR runs from the command line and logs to
wandb (offline); a bad objective is one line; a stopped run of either resumes on the batches an
uninterrupted one trains on."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from multihead.checkpoints import load_trained_model
from multihead.data.documents import DocumentLMDataModule
from multihead.training.lm import position_losses

from helpers.corpus import tiny_corpus_wheels
from helpers.scripts import assert_one_error_line, fails_in_one_line, run_script, script_module
from helpers.training import assert_same_training_state, compose_config

ATTENTION = {"mha": "mha_h8", "gqa": "gqa_h8_kv2", "mqa": "mqa_h8", "mla": "mla_h8_r24"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    where = tmp_path_factory.mktemp("wheels")
    pins = [", ".join(f"{k}: '{v}'" for k, v in p.items()) for p in tiny_corpus_wheels(where)]
    packages = "[" + ", ".join("{" + p + "}" for p in pins) + "]"
    return [
        "data.context=64", "data.vocab_size=300", "data.batch_size=2", "data.val_windows=3",
        "data.select_windows=2",
        f"data.packages={packages}", f"data.find_links={where}",
        f"paths.cache_dir={tmp_path_factory.mktemp('cache')}",
        "model.d_model=64", "model.ffn_dim=64", "model.num_layers=1",
        "trainer.max_steps=3", "trainer.val_check_interval=3", "logger=csv",
    ]  # fmt: skip


@pytest.mark.parametrize("design", ATTENTION)
def test_a_tiny_run_of_each_design_writes_what_it_measured(design, tiny, tmp_path):
    from multihead.training.run import train

    # The last validation in fit comes at step 2 of 3: the summary must hold the final
    # weights' figures all the same (the validation after fit).
    overrides = ["experiment=lm_long", f"attention={ATTENTION[design]}", *tiny]
    overrides.append("trainer.val_check_interval=2")
    cfg = compose_config("train", [*overrides, f"paths.output_dir={tmp_path}"])
    summary = train(cfg)
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["steps"] == 3 and summary["kind"] == design
    buckets = ["val/loss@0-63"]  # context 64: one bucket below the first edge
    assert all(b in summary for b in buckets) and "val/loss@64-255" not in summary
    # The final checkpoint rebuilds the trained model: its held-out loss is the one reported.
    trained = load_trained_model(tmp_path / "checkpoints" / "last.ckpt")
    data = DocumentLMDataModule(
        **{k: v for k, v in cfg.data.items() if k not in ("_target_",)}
    )  # fmt: skip
    data.setup()
    with torch.no_grad():
        windows = data.scored_windows()
        loss = position_losses(trained.model(windows), windows).mean().item()
    assert loss == pytest.approx(summary["val/loss"], rel=1e-5)
    assert {"val/loss/halfpkg", "val/loss/tinypkg", "select/loss"} <= set(summary)
    assert summary["kv_cache/bytes_per_token"] == trained.model.kv_cache_bytes_per_token()


@pytest.mark.slow  # 2 script processes, one training
def test_mqar_from_the_command_line_logs_to_wandb_and_a_bad_objective_is_one_line(tmp_path):
    run = tmp_path / "run"
    result = run_script(
        "train.py", "experiment=mqar", "attention=mla_h8_r24", "model.d_model=64",
        "data.train_settings=[[64,4]]", "data.eval_settings=[[64,4],[64,8]]",
        "data.batch_tokens=256", "data.eval_examples=8", "data.vocab_size=128",
        "trainer.max_steps=3", "trainer.val_check_interval=3", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert {"val/acc@64x4", "val/acc@64x8", "val/acc"} <= set(summary)
    assert summary["kind"] == "mla"
    assert list((run / "wandb").glob("offline-run-*"))
    bad = run_script("train.py", "objective=lm", f"hydra.run.dir={tmp_path / 'bad'}")
    assert_one_error_line(bad, "objective='lm'; expected translation or causal_lm")


@pytest.mark.slow  # 2 trainings, timed over 3 rounds
def test_the_long_context_benchmark_times_trained_checkpoints_interleaved(tiny, tmp_path):
    """Two designs trained for 3 steps, timed at two settings over 3 rounds: every row has
    its rounds, its min-max, MHA's speed ratio, and the cache bytes its design holds."""
    from multihead.training.run import train

    paths = {}
    for design in ("mha", "mqa"):
        out = tmp_path / design
        cfg = compose_config(
            "train",
            [
                "experiment=lm_long",
                f"attention={ATTENTION[design]}",
                *tiny,
                f"paths.output_dir={out}",
            ],
        )
        train(cfg)
        paths[design] = out / "checkpoints" / "last.ckpt"
    rows_path = tmp_path / "rows.json"
    script_module("benchmark_long_context.py").main([
        "--checkpoints", *[f"{d}={p}" for d, p in paths.items()], "--settings", "32x2", "96x1",
        "--rounds", "3", "--steps", "2", "--json", str(rows_path),
    ])  # fmt: skip
    rows = json.loads(rows_path.read_text())
    assert len(rows) == 4 and all(len(r["round_ms"]) == 3 and len(r["steps_ms"]) == 6 for r in rows)
    assert all(r["ms_min"] <= r["ms"] <= r["ms_max"] for r in rows)
    assert {r["x_mha"] for r in rows if r["design"] == "mha"} == {1.0}
    # Held: max_len = context + steps + 2 positions; per token, per layer (1 layer, d 64,
    # 8 heads of 8): MHA K and V of 8 heads, MQA of one.
    per_token = {"mha": 2 * 8 * 8 * 4, "mqa": 2 * 1 * 8 * 4}
    for r in rows:
        assert r["cache_bytes"] == per_token[r["design"]] * r["batch"] * (r["context"] + 4)


def test_a_design_and_its_backend_are_checked_before_the_corpus(
    tiny, tmp_path, monkeypatch, capsys
):
    from multihead.training.run import train

    def no_data(self, stage=None) -> None:
        raise AssertionError("the corpus was read before the model's settings were checked")

    monkeypatch.setattr(DocumentLMDataModule, "setup", no_data)
    overrides = ["experiment=lm_long", "attention.design=talking_heads", *tiny]
    cfg = compose_config("train", [*overrides, f"paths.output_dir={tmp_path}"])
    line = fails_in_one_line(train, capsys, cfg)
    assert "runs on backend math only" in line and line.endswith("set attention.backend=math")


MQAR_TINY = [
    "experiment=mqar", "attention=mqa_h8", "model.d_model=64", "data.train_settings=[[64,4]]",
    "data.eval_settings=[[64,4]]", "data.batch_tokens=256", "data.eval_examples=8",
    "data.vocab_size=128", "logger=csv",
]  # fmt: skip


@pytest.mark.parametrize("experiment", ["lm_long", "mqar"])
def test_a_stopped_run_resumes_on_the_batches_an_uninterrupted_run_trains_on(
    experiment, tiny, tmp_path
):
    """6 steps straight == 3 steps, a stop, a resume from step3.ckpt, 3 more: the same
    weights, optimiser state and data position, bit for bit. A resume that started the data
    again from the first batch would train steps 4-6 on batches 1-3 and end elsewhere."""
    from multihead.training.run import train

    overrides = [*tiny, "experiment=lm_long"] if experiment == "lm_long" else MQAR_TINY
    overrides = [*overrides, "trainer.max_steps=6", "trainer.val_check_interval=3"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(compose_config("train", [*overrides, f"paths.output_dir={straight}"]))
    stop = ["+callbacks.stop._target_=helpers.training.StopAfter", "+callbacks.stop.step=3"]
    train(compose_config("train", [*overrides, *stop, f"paths.output_dir={stopped}"]))
    resume = f"ckpt_path={stopped / 'checkpoints' / 'step3.ckpt'}"
    train(compose_config("train", [*overrides, resume, f"paths.output_dir={stopped}"]))
    a, b = (torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
            for run in (straight, stopped))  # fmt: skip
    assert a["global_step"] == 6
    # With several validation loaders (held-out sets, the selection set), Lightning counts
    # the validation a resumed run skips (the one after the step it resumed at) by its largest
    # loader's batches, not all loaders' (EvaluationLoop.increment_progress_to_evaluation_end):
    # its batch counter differs, and nothing else; what the runs logged is the same.
    for ckpt in (a, b):
        ckpt["loops"]["fit_loop"].pop("epoch_loop.val_loop.batch_progress")
    assert_same_training_state(a, b)
    logged = [
        [r for r in csv.DictReader((run / "csv" / "metrics.csv").open()) if r.get("val/loss")]
        for run in (straight, stopped)
    ]
    assert logged[1] and logged[1] == logged[0][-len(logged[1]) :]
