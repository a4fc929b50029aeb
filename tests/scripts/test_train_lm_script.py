"""scripts/train_lm.py: a tiny Llama-shaped LM trained for three steps writes its model, and
the perplexity it reports is the saved model's, recomputed here with plain cross-entropy; a
bad model value ends the process with one line."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from multihead.data.lm import LanguageModelDataModule
from multihead.data.tokenizer import Tokenizer

from helpers.scripts import assert_one_error_line, run_script

TINY = (
    "data.vocab_size=300", "data.block_size=32", "data.batch_size=8",
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=64", "trainer.max_steps=3", "trainer.val_check_interval=3",
    "module.scheduler.warmup_steps=1", "module.scheduler.cooldown_steps=1",
)  # fmt: skip


def test_a_tiny_training_writes_a_model_that_scores_its_reported_perplexity(
    tmp_path, multi30k_dir, cache_dir
) -> None:
    run = tmp_path / "run"
    result = run_script(
        "train_lm.py", *TINY, f"data.local_dir={multi30k_dir}", f"paths.cache_dir={cache_dir}",
        f"hydra.run.dir={run}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run / "checkpoints" / "last.ckpt").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    model = LlamaForCausalLM.from_pretrained(run / "hf").eval()
    assert model.config.num_key_value_heads == 2
    data = LanguageModelDataModule(
        local_dir=str(multi30k_dir), vocab_size=300, block_size=32, cache_dir=cache_dir
    )
    data.setup()
    assert Tokenizer.load(run / "tokenizer.json").fingerprint() == data.tokenizer.fingerprint()
    blocks = data.blocks["validation"]  # (N, 32)
    with torch.no_grad():
        logits = model(input_ids=blocks).logits  # (N, 32, V)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), blocks[:, 1:].flatten())
    assert math.isclose(summary["val/ppl"], loss.exp().item(), rel_tol=1e-4)


def test_a_bad_model_value_fails_in_one_line(tmp_path, multi30k_dir, cache_dir) -> None:
    result = run_script(
        "train_lm.py", *TINY, "model.num_kv_heads=3", f"data.local_dir={multi30k_dir}",
        f"paths.cache_dir={cache_dir}", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert_one_error_line(result, "num_kv_heads=3 must divide num_heads=4")
