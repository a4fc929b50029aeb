"""scripts/train.py: a bad config value ends the process with one line; a typo in an option is
Hydra's own message, without a traceback; a key added with ``++`` that no code reads is one
line naming the closest real key; a head design written outside the package trains
by its import path, and its checkpoint evaluates in another process.

The other bad values are tested where they are raised, in this process
(tests/training/test_bad_input.py and the tests of each part); training itself in
tests/training.
"""

from __future__ import annotations

import json
import os

import pytest

from multihead.checkpoints import read_checkpoint

from helpers.designs import write_sigmoid
from helpers.scripts import assert_one_error_line, run_script


def test_a_bad_config_value_fails_in_one_line(tmp_path, multi30k_dir, cache_dir) -> None:
    """The layer's error, raised while the model is built, through the script's wrapper.

    The model is built after the data, so the session's cache spares training a tokenizer."""
    result = run_script(
        "train.py",
        "experiment=smoke",
        "logger=csv",
        f"data.local_dir={multi30k_dir}",
        f"paths.log_dir={tmp_path}",
        f"paths.cache_dir={cache_dir}",
        "attention.num_kv_heads=3",
    )
    assert_one_error_line(result, "num_heads (4) must be divisible by num_kv_heads (3)")


def test_a_config_typo_is_hydras_message_without_a_traceback(tmp_path) -> None:
    """Hydra composes before the script's wrapper runs: its own message, no traceback."""
    result = run_script("train.py", "attention=gqx", f"paths.log_dir={tmp_path}")
    assert result.returncode != 0
    assert "Could not find 'attention/gqx'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow  # 3 processes; in-process: test_bad_input.py
def test_keys_that_no_code_reads_are_refused_in_one_line_before_anything_is_written(
    tmp_path, multi30k_dir, cache_dir
) -> None:
    """``++`` adds a key the config lacks: a misspelt one trained at the seed, test
    checkpoint and decoding it misspelt (exit 0); one that reached a ``_partial_``
    constructor ended in a traceback inside the training loop. Both are refused by name with
    the closest real key, before Hydra writes the run directory's ``.hydra``."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    kept = run / ".hydra" / "config.yaml"
    kept.write_text("seed: 7\n")  # a run directory's kept config, not to be replaced
    fast = [
        "experiment=smoke", "logger=csv", f"data.local_dir={multi30k_dir}",
        f"paths.cache_dir={cache_dir}", f"hydra.run.dir={run}", "trainer.max_steps=1",
        "test=false",
    ]  # fmt: skip
    for typed, said in [
        (
            ["++seedd=2", "++test_ckptt=avg10", "++summary.decod_speed=false"],
            ["++seedd=2 sets seedd, which no code reads (closest: seed)",
             "++test_ckptt=avg10 sets test_ckptt, which no code reads (closest: test_ckpt)",
             "sets summary.decod_speed, which no code reads (closest: summary.decode_speed)"],
        ),
        (
            ["++module.optimizer.lrr=1", "++module.scheduler.warmup_step=1"],
            ["module.optimizer.lrr: torch.optim.Adam takes no argument 'lrr' (closest: 'lr')",
             "module.scheduler.warmup_step: multihead.training.InverseSqrtWarmup takes no "
             "argument 'warmup_step' (closest: 'warmup_steps')"],
        ),
        (  # the heads' keys: the model refuses them, built on the meta device
            ["++attention.num_kv_headz=1"],
            ["unknown key(s) ['num_kv_headz'] in attention (num_kv_headz: closest "
             "num_kv_heads)"],
        ),
    ]:  # fmt: skip
        line = assert_one_error_line(run_script("train.py", *fast, *typed), said[0])
        assert all(part in line for part in said), line
        assert sorted(p.name for p in run.rglob("*")) == [".hydra", "config.yaml"]
        assert kept.read_text() == "seed: 7\n"


@pytest.mark.slow  # a training and an evaluation, each a process
def test_an_outside_design_trains_by_import_path_and_its_checkpoint_evaluates(
    tmp_path, multi30k_dir, cache_dir
) -> None:
    """Its module is known to the two processes by its path alone (PYTHONPATH), its option
    given on the command line; the checkpoint's config names the path. With n the key
    length it refuses the KV cache: validation's BLEU and evaluate.py decode it by the full
    prefix at each step, and each process says so once (training stopped at the first
    validation: the layer refused the cache)."""
    designs = write_sigmoid(tmp_path / "designs")
    path = os.pathsep.join(p for p in (str(designs), os.environ.get("PYTHONPATH")) if p)
    run = tmp_path / "run"
    trained = run_script(
        "train.py", "experiment=smoke", "logger=csv", f"data.local_dir={multi30k_dir}",
        f"paths.cache_dir={cache_dir}", f"hydra.run.dir={run}", "trainer.max_steps=2",
        "trainer.val_check_interval=2", "test=false", "summary.decode_speed=false",
        "attention.design=sigmoid_attention.Sigmoid", "attention.backend=math",
        "++attention.design_options.sigmoid_n=length", env={"PYTHONPATH": path},
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    said = "decoding recomputes the full prefix at each step: head design 'sigmoid'"
    assert (trained.stdout + trained.stderr).count(said) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val/bleu"] >= 0  # validation decoded
    assert summary["run_name"] == "enc-mha4-sigmoid_dec-mha4-sigmoid_cross-mha4-sigmoid_math"
    ckpt = run / "checkpoints" / "last.ckpt"
    attention = read_checkpoint(ckpt)["multihead"]["config"]["attention"]
    assert attention["design"] == "sigmoid_attention.Sigmoid"
    assert attention["design_options"] == {"sigmoid_n": "length"}
    scores = tmp_path / "evaluate"
    evaluated = run_script(
        "evaluate.py", f"ckpt={ckpt}", "limit=4", "beam_size=2", f"data.local_dir={multi30k_dir}",
        f"hydra.run.dir={scores}", env={"PYTHONPATH": path},
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert (evaluated.stdout + evaluated.stderr).count(said) == 1
    result = json.loads((scores / "scores.json").read_text())
    assert result["sentences"] == 4 and "bleu" in result


@pytest.mark.slow  # a process; the message in-process: test_designs.py
def test_an_unimportable_design_fails_in_one_line(tmp_path, multi30k_dir, cache_dir) -> None:
    result = run_script(
        "train.py", "experiment=smoke", "logger=csv", f"data.local_dir={multi30k_dir}",
        f"paths.log_dir={tmp_path}", f"paths.cache_dir={cache_dir}",
        "attention.design=no_such_package_x.Sigmoid",
    )  # fmt: skip
    assert_one_error_line(result, "head design 'no_such_package_x.Sigmoid': no module 'no_such_")
